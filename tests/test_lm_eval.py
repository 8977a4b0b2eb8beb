"""Published numbers: evaluate.py's multiple-choice tasks score as EleutherAI's
lm-evaluation-harness scores (its hf backend, run here for real on the exported folder), on
small local tasks that nothing downloads."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from data.prepare import prepare_text
from tests.forked import python
from tests.shared import built_once
from train import train
from training.config import load_config

REPO = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def bpe_model(shared_dir, corpus_file) -> Path:
    """A tiny model trained on the test corpus in a BPE of its own (300 tokens), and its
    export: a BPE has the end-of-text token that lm-eval starts an empty context with."""
    def build(out: Path) -> None:
        prepare_text(corpus_file.read_text(), "bpe", out / "data", source=str(corpus_file),
                     vocab_size=300)
        cfg = load_config(REPO / "config" / "tiny.toml", {
            "data_dir": str(out / "data"), "out_dir": str(out), "run_name": "run",
            "max_iters": 100, "learning_rate": 1e-2, "sample_tokens": 0})
        train(cfg)
        result = python(["export.py", str(out / "run"), str(out / "hf")])
        assert result.returncode == 0, result.stderr
    return built_once(shared_dir / "bpe_model", build)


def write_task(folder: Path, n_items: int = 24) -> tuple[Path, Path]:
    """A multiple-choice task of the corpus's grammar (data/conftest.make_corpus): the right
    ending is a phrase the corpus has, the others its words in the wrong order. Its items in
    HellaSwag's fields, and lm-eval's YAML for them."""
    rng = random.Random(0)
    things = ["the moon", "the night", "a rose", "the sword", "her name"]
    lines = []
    for _ in range(n_items):
        right = rng.choice(things)
        wrong = [" ".join(reversed(t.split())) for t in rng.sample(things, 3)]
        endings = [w + "." for w in wrong]
        label = rng.randrange(4)
        endings.insert(label, right + ".")
        ctx = f"{rng.choice(['ROMEO', 'JULIET'])}: {rng.choice(['Nurse', 'Tybalt'])} " \
              f"{rng.choice(['loves', 'fears', 'sees'])}"
        lines.append(json.dumps({"ctx": ctx, "endings": endings, "label": label}))
    items = folder / "items.jsonl"
    items.write_text("\n".join(lines) + "\n")
    task = folder / "tasks" / "mc_local.yaml"
    task.parent.mkdir()
    task.write_text(f"""task: mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return items, task.parent


def lm_eval(folder: Path, tasks: Path, *model: str) -> dict:
    """The real lm_eval command's results, run where this repository's evaluate.py does not
    shadow the `evaluate` package it imports."""
    out = folder / "lm_eval_out"
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", *model, "--tasks", "mc_local", "--include_path",
         str(tasks), "--output_path", str(out), "--device", "cpu"],
        cwd=folder, capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())["results"]["mc_local"]


def test_evaluate_task_scores_as_lm_eval_does(tmp_path, bpe_model):
    items, tasks = write_task(tmp_path)
    hf = bpe_model / "hf"
    theirs = lm_eval(tmp_path, tasks, "--model", "hf", "--model_args",
                     f"pretrained={hf},dtype=float32", "--batch_size", "8")
    for source in (["--init-from", str(hf)], ["--run", str(bpe_model / "run")]):
        out = tmp_path / "ours.json"
        result = python(["evaluate.py", "--task", str(items), *source, "--json", str(out)])
        assert result.returncode == 0, result.stderr
        ours = json.loads(out.read_text())
        assert ours["items"] == 24
        assert ours["acc"] == pytest.approx(theirs["acc,none"], abs=1e-9)
        assert ours["acc_norm"] == pytest.approx(theirs["acc_norm,none"], abs=1e-9)
        assert ours["acc_stderr"] == pytest.approx(theirs["acc_stderr,none"], abs=1e-9)
    assert ours["acc"] > 0.5  # the grammar's phrase beats its words reversed, mostly
    assert ours["centered"] == pytest.approx((ours["acc"] - 0.25) / 0.75)


def hub_cache(root: Path, repo: str, folder: Path) -> Path:
    """A Hugging Face Hub cache holding `folder` as the snapshot of `repo`, laid out as
    huggingface_hub lays out what it downloads (models--ORG--NAME/refs, snapshots)."""
    commit = "0" * 40
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return root


def test_init_from_takes_a_hub_id_read_from_the_hub_cache(tmp_path, bpe_model):
    cache = hub_cache(tmp_path / "hub", "someone/tiny-gpt2", bpe_model / "hf")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    sampled = [python(["sample.py", "--init-from", source, "--prompt", "ROMEO:", "--temperature",
                       "0", "--max-new-tokens", "12"], env=env)
               for source in ("someone/tiny-gpt2", str(bpe_model / "hf"))]
    assert sampled[0].returncode == 0, sampled[0].stderr
    assert sampled[0].stdout == sampled[1].stdout and sampled[0].stdout.startswith("ROMEO:")
    missing = python(["evaluate.py", "--input", str(REPO / "README.md"), "--init-from",
                      "someone/missing"], env=env)
    assert missing.returncode == 1 and missing.stderr == (
        "error: someone/missing is not a folder here, and it is not in the Hugging Face cache "
        "while the Hub cannot be reached (offline, or HF_HUB_OFFLINE=1); download it where "
        "there is a connection, or give a folder\n")
