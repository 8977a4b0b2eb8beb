"""Published numbers: evaluate.py's multiple-choice tasks score as EleutherAI's
lm-evaluation-harness scores (its hf backend, run here for real on the exported folder), and
lm-eval pointed at serve.py, with its defaults, scores as its hf backend does; on small local
tasks that nothing downloads. And models from the Hugging Face Hub, read from its cache."""

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from data.prepare import prepare_text
from tests.forked import python
from tests.output import error_line
from tests.shared import built_once
from tests.test_serve import CHAIN_KEY, CHAIN_NAME, Server, serving
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


def write_tasks(folder: Path, n_items: int = 24) -> tuple[Path, Path]:
    """Two tasks of the corpus's grammar (conftest.make_corpus). mc_local: multiple choice,
    the right ending a phrase the corpus has, the others its words in the wrong order, in
    HellaSwag's fields. gen_local: the ending generated, greedily, to the first full stop.
    Their items, and the folder of lm-eval's YAML for them."""
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
        lines.append(json.dumps({"ctx": ctx, "endings": endings, "label": label,
                                 "target": " " + right}))
    items = folder / "items.jsonl"
    items.write_text("\n".join(lines) + "\n")
    tasks = folder / "tasks"
    tasks.mkdir()
    head = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
doc_to_text: "{{{{ctx}}}}"
"""
    (tasks / "mc_local.yaml").write_text(f"""task: mc_local
{head}output_type: multiple_choice
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (tasks / "gen_local.yaml").write_text(f"""task: gen_local
{head}output_type: generate_until
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return items, tasks


def lm_eval(folder: Path, tasks: Path, *model: str) -> tuple[dict, list[str]]:
    """The real lm_eval command's results, and the generations of gen_local, run where this
    repository's evaluate.py does not shadow the `evaluate` package it imports."""
    out = folder / "lm_eval_out"
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", *model, "--tasks", "mc_local,gen_local",
         "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
        cwd=tasks.parent, capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = out.rglob("results_*.json")
    (samples,) = out.rglob("samples_gen_local_*.jsonl")
    generated = [json.loads(line)["filtered_resps"][0] for line in samples.read_text().splitlines()]
    return json.loads(path.read_text())["results"], generated


@pytest.fixture(scope="module")
def bpe_server(bpe_model) -> Iterator[Server]:
    with serving("--run", str(bpe_model / "run"), "--parallel", "4") as server:
        yield server


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory, bpe_model) -> tuple[Path, dict, list[str]]:
    """lm-eval's hf backend on the exported folder: the yardstick of the tests below."""
    folder = tmp_path_factory.mktemp("lm_eval_hf")
    items, tasks = write_tasks(folder)
    results, generated = lm_eval(folder, tasks, "--model", "hf", "--model_args",
                                 f"pretrained={bpe_model / 'hf'},dtype=float32", "--device", "cpu",
                                 "--batch_size", "8")
    return items, results, generated


def test_evaluate_task_scores_as_lm_eval_does(tmp_path, bpe_model, hf_results):
    items, theirs, _ = hf_results
    for source in (["--init-from", str(bpe_model / "hf")], ["--run", str(bpe_model / "run")]):
        out = tmp_path / "ours.json"
        result = python(["evaluate.py", "--task", str(items), *source, "--json", str(out)])
        assert result.returncode == 0, result.stderr
        ours = json.loads(out.read_text())
        assert ours["items"] == 24
        assert ours["acc"] == pytest.approx(theirs["mc_local"]["acc,none"], abs=1e-9)
        assert ours["acc_norm"] == pytest.approx(theirs["mc_local"]["acc_norm,none"], abs=1e-9)
        assert ours["acc_stderr"] == pytest.approx(theirs["mc_local"]["acc_stderr,none"], abs=1e-9)
    assert ours["acc"] > 0.5  # the grammar's phrase beats its words reversed, mostly
    assert ours["centered"] == pytest.approx((ours["acc"] - 0.25) / 0.75)


def test_lm_eval_through_serve_scores_as_its_hf_backend(tmp_path, bpe_server, hf_results):
    # lm-eval's defaults: prompts as token ids from the server's own /tokenize, 4 a request
    _, theirs, their_text = hf_results
    _, tasks = write_tasks(tmp_path)
    ours, our_text = lm_eval(tmp_path, tasks, "--model", "local-completions", "--model_args",
                             f"base_url={bpe_server.url}/v1/completions,model=run,max_length=32",
                             "--batch_size", "4")
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["mc_local"][metric] == pytest.approx(theirs["mc_local"][metric], abs=1e-9)
    assert our_text == their_text and any(our_text)
    assert ours["gen_local"]["exact_match,none"] == theirs["gen_local"]["exact_match,none"]


def test_prompt_logprobs_equal_evaluate_and_transformers_whatever_the_batch(bpe_model,
                                                                           bpe_server):
    import transformers
    from transformers import AutoModelForCausalLM

    from measure.logprobs import token_logprobs
    from weights.loading import load_model
    prompts = ["ROMEO: Nurse loves the moon.", "JULIET: Tybalt",
               "NURSE: Romeo sees a rose. JULIET: Nurse fears"]
    client = bpe_server.client()
    together = client.completions.create(model="run", prompt=prompts, echo=True, logprobs=2,
                                         max_tokens=0).choices
    alone = client.completions.create(model="run", prompt=prompts[1], echo=True, logprobs=2,
                                      max_tokens=0).choices[0]
    model, tokenizer, _ = load_model(run=str(bpe_model / "run"))
    transformers.logging.set_verbosity_error()
    theirs = AutoModelForCausalLM.from_pretrained(bpe_model / "hf").eval()
    for prompt, choice in zip(prompts, together, strict=True):
        ids = tokenizer.encode(prompt)
        assert choice.text == prompt and choice.logprobs.token_logprobs[0] is None
        ours = token_logprobs(model, [ids])[0].logprobs[1:]
        with torch.no_grad():
            logp = torch.log_softmax(theirs(torch.tensor([ids])).logits[0].float(), dim=-1)
        hf = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        served = choice.logprobs.token_logprobs[1:]
        assert served == pytest.approx(ours, abs=1e-4) and served == pytest.approx(hf, abs=1e-4)
        # two alternatives and the token's own, as OpenAI's legacy shape (fewer: one text)
        assert len(choice.logprobs.top_logprobs[1]) <= 3
        assert choice.logprobs.text_offset[:2] == [0, len(choice.logprobs.tokens[0])]
    assert alone.logprobs.token_logprobs == pytest.approx(together[1].logprobs.token_logprobs,
                                                          abs=1e-5)


@pytest.mark.parametrize("alternatives", [1, 5])
def test_lm_eval_reads_a_greedy_continuation_of_split_characters_as_greedy(chain_server,
                                                                           alternatives):
    """lm-eval's local-completions calls a continuation greedy where each token's logprob is
    the largest of its top_logprobs. The bytes of a Chinese character are tokens that all
    read U+FFFD, one key of that dict, which must hold the likeliest's logprob. Its own
    parser reads the server's answer to its own request (echo, one token, logprobs)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    server, chain = chain_server
    client = server.client(CHAIN_KEY)
    swapped = [chain[0], chain[2], chain[1], *chain[3:]]  # the chain's bytes out of order
    for continuation, greedy in ((chain, True), (swapped, False)):
        answer = client.completions.create(model=CHAIN_NAME, prompt=continuation, echo=True,
                                           max_tokens=1, temperature=0, logprobs=alternatives)
        (logprob, is_greedy), = LocalCompletionsAPI.parse_logprobs(
            answer.model_dump(), tokens=[continuation], ctxlens=[1])
        assert is_greedy == greedy
        assert (logprob > -1e-2) == greedy  # the chain is all but certain, the swap is not


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
    assert missing.returncode == 1 and error_line(missing.stderr) == (
        "error: someone/missing is not a folder here, and it is not in the Hugging Face cache "
        "while the Hub cannot be reached (offline, or HF_HUB_OFFLINE=1); download it where "
        "there is a connection, or give a folder")
