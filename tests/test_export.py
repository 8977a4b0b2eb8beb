"""export.py and --init-from end to end: a model trained here in nanochat's layout is
exported as a Hugging Face folder with the same loss and tokens in transformers, and the
folder read back in samples and evaluates as the checkpoint does, with a bigram table too;
each of our tokenizers gives AutoTokenizer's ids."""

import math
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import make_corpus
from torch.nn import functional as F

from data.bpe import train_bpe
from data.bpe_tokenizers import GPT2Tokenizer
from data.tokenizer import CharTokenizer
from data.tokenizer_json import tokenizer_files
from tests.forked import python
from tests.layouts import LAYOUTS
from tests.output import error_line
from train import train
from training.config import ConfigError, load_config
from weights.checkpoint import load_checkpoint
from weights.gpt2 import gpt2_problem
from weights.loading import load_model
from weights.nanochat import nanochat_problem

transformers = pytest.importorskip("transformers")  # test-only dependency
REPO = Path(__file__).resolve().parent.parent
TEXTS = ["Hello, world!  Runs   of spaces\n\n\nand newlines\tand tabs",
         "unicode: é ß Ωμέγα 中文, emoji 🙂👍🏽 and 'll 've 're",
         "  leading and trailing spaces   ", "numbers 1234567 and 3.14159\r\n"]


def nanochat_layout_run(tmp_path_factory, char_data, name: str, **settings) -> Path:
    """A tiny model in nanochat's layout (no biases), trained for 20 steps into runs/<name>."""
    layout = {k: v for k, v in LAYOUTS["nanochat"].items() if k != "n_inner"}
    cfg = load_config(REPO / "config" / "tiny.toml", {
        "data_dir": str(char_data), "out_dir": str(tmp_path_factory.mktemp("runs")),
        "run_name": name, "max_iters": 20, "eval_interval": 20, "sample_tokens": 0,
        "bias": False, "n_kv_head": 1, **layout, **settings})
    return train(cfg).run_dir


def assert_greedy_sample_is(expected: str, prompt: str, *sources: list[str]) -> None:
    """sample.py at temperature 0 prints `expected` for the prompt, from each source."""
    for source in sources:
        sampled = run("sample.py", *source, "--prompt", prompt, "--max-new-tokens", "20",
                      "--temperature", "0")
        assert sampled.returncode == 0, sampled.stderr
        assert sampled.stdout == expected + "\n"


@pytest.fixture(scope="module")
def nanochat_run(tmp_path_factory, char_data) -> Path:
    return nanochat_layout_run(tmp_path_factory, char_data, "nano")


@pytest.fixture(scope="module")
def bigram_run(tmp_path_factory, char_data) -> Path:
    """The same model with the quickstart's bigram table."""
    return nanochat_layout_run(tmp_path_factory, char_data, "bigram", bigram_embedding=True)


def run(*args: str) -> subprocess.CompletedProcess:
    return python(list(args))


def test_a_run_exported_has_its_loss_and_tokens_in_transformers(tmp_path, nanochat_run):
    result = run("export.py", str(nanochat_run), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'hf'}/ from ")
    assert "in nanochat's format" in result.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = make_corpus(20, seed=5)
    ids = torch.tensor([tokenizer.encode(text)[:32]])
    with torch.no_grad():
        logits = model(ids).logits
    theirs = F.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    (tmp_path / "text.txt").write_text(text[:32])  # the 32 characters transformers scored
    scored = run("evaluate.py", "--input", str(tmp_path / "text.txt"), "--run", str(nanochat_run))
    assert scored.returncode == 0, scored.stderr
    ours = float(scored.stdout.split("loss ")[1].split()[0])
    assert math.isclose(ours, theirs, abs_tol=1e-4)
    # the folder read back scores the text's own tokens, with no special token added
    folder = run("evaluate.py", "--input", str(tmp_path / "text.txt"), "--init-from",
                 str(tmp_path / "hf"))
    assert folder.returncode == 0, folder.stderr
    assert float(folder.stdout.split("loss ")[1].split()[0]) == ours
    # transformers' greedy tokens equal sample.py's, both from the checkpoint and from the
    # exported folder read back
    prompt = "ROMEO: "
    greedy = model.generate(torch.tensor([tokenizer.encode(prompt)]), max_new_tokens=20,
                            do_sample=False)
    expected = tokenizer.decode(greedy[0])
    assert_greedy_sample_is(expected, prompt, ["--run", str(nanochat_run)],
                            ["--init-from", str(tmp_path / "hf")])


def test_a_run_with_a_bigram_table_exported_has_its_logits_and_tokens_in_transformers(tmp_path,
                                                                                     bigram_run):
    folder = tmp_path / "hf"
    result = run("export.py", str(bigram_run), str(folder))
    assert result.returncode == 0, result.stderr
    assert "in nanochat's format" in result.stdout and "nanochat_bigram.py" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        f'load it with AutoModelForCausalLM.from_pretrained("{folder}", trust_remote_code=True), '
        f"because the folder's nanochat_bigram.py adds its bigram table")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours, _, _ = load_model(str(bigram_run))
    assert torch.count_nonzero(ours.transformer.wtb.weight) > 0  # trained away from zero
    text = make_corpus(20, seed=5)
    ids = torch.tensor([tokenizer.encode(text[i * 32:(i + 1) * 32]) for i in range(3)])
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(ids).logits, ours(ids)[0], rtol=1e-5, atol=1e-5)
        # read back by --init-from, the folder is the checkpoint's model, table included
        back, _, _ = load_model(init_from=str(folder))
        torch.testing.assert_close(back(ids)[0], ours(ids)[0], rtol=0, atol=0)
    prompt = "ROMEO: "
    greedy = theirs.generate(torch.tensor([tokenizer.encode(prompt)]), max_new_tokens=20,
                             do_sample=False)
    expected = tokenizer.decode(greedy[0])
    assert_greedy_sample_is(expected, prompt, ["--run", str(bigram_run)], ["--init-from", str(folder)])


@pytest.mark.parametrize("kind", ["char", "gpt2", "bpe"])
def test_every_tokenizer_of_ours_gives_autotokenizers_ids(tmp_path, kind):
    if kind == "char":
        ours = CharTokenizer.from_text("".join(TEXTS))
    elif kind == "gpt2":
        ours = GPT2Tokenizer()
    else:
        ours = train_bpe(iter([make_corpus(2000) + "".join(TEXTS)]), 400)
    for name, data in tokenizer_files(ours).items():
        (tmp_path / name).write_bytes(data)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert auto.encode(text, add_special_tokens=False) == ids
        assert auto.decode(ids) == text


def test_a_folder_that_cannot_be_read_is_one_line_and_nothing_written(tmp_path, nanochat_run):
    folder = tmp_path / "hf"
    assert run("export.py", str(nanochat_run), str(folder)).returncode == 0
    cases = {
        "no tokenizer.json": ("tokenizer.json", None, "has no tokenizer.json"),
        "another model type": ("config.json", '{"model_type": "llama"}',
                               "holds a 'llama' model; --init-from reads GPT-2 and NanoChat"),
        "a WordPiece tokenizer": ("tokenizer.json",
                                  '{"version": "1.0", "model": {"type": "WordPiece", '
                                  '"vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}',
                                  "tokenizer.json: it holds a WordPiece model; only byte-level BPE"),
    }
    for name, (file, contents, message) in cases.items():
        broken = tmp_path / name.replace(" ", "-")
        broken.mkdir()
        for f in folder.iterdir():
            (broken / f.name).write_bytes(f.read_bytes())
        if contents is None:
            (broken / file).unlink()
        else:
            (broken / file).write_text(contents)
        before = sorted(p.name for p in tmp_path.rglob("*"))
        result = run("sample.py", "--init-from", str(broken), "--prompt", "ROMEO:")
        assert result.returncode == 1, name
        assert message in error_line(result.stderr), name
        assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert load_checkpoint(nanochat_run / "best.pt")["iter_num"] == 20


def test_a_nanochat_folder_is_fine_tuned_on_data_prepared_with_its_tokenizer(tmp_path, nanochat_run,
                                                                            corpus_file, char_data):
    folder = tmp_path / "hf"
    assert run("export.py", str(nanochat_run), str(folder)).returncode == 0
    prepared = run("-m", "data.prepare", "--input", str(corpus_file), "--tokenizer", str(folder),
                   "--out", str(tmp_path / "data"))
    assert prepared.returncode == 0, prepared.stderr
    cfg = load_config(REPO / "config" / "tiny.toml", {
        "init_from": str(folder), "data_dir": str(tmp_path / "data"),
        "out_dir": str(tmp_path / "runs"), "max_iters": 10, "eval_interval": 10,
        "sample_tokens": 0, "learning_rate": 1e-3, "block_size": 16})
    result = train(cfg)
    ckpt = load_checkpoint(result.run_dir / "best.pt")
    base = load_checkpoint(nanochat_run / "best.pt")
    assert ckpt["model_args"]["block_size"] == 16 and ckpt["model_args"]["embed_norm"]
    # the same text as the base model's data gives the same ids, so ten more steps keep
    # lowering the loss
    assert ckpt["tokenizer"]["kind"] == "hf" and ckpt["val_loss"] < base["val_loss"]
    sampled = run("sample.py", "--run", str(result.run_dir), "--prompt", "ROMEO:",
                  "--max-new-tokens", "10")
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr
    # data tokenized another way (by the char dataset's own table) is refused, and nothing is
    # written
    with pytest.raises(ConfigError, match=f"init_from needs data tokenized by {folder}'s "
                                          f"tokenizer, but {char_data} was prepared with another"):
        train(cfg.updated(data_dir=str(char_data), run_name="other"))
    assert not (tmp_path / "runs" / "other").exists()


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "config").glob("*.toml")))
def test_every_presets_model_leaves_the_project(preset, tmp_path):
    # a small model in each preset's layout exports to one of the two formats; a bigram table
    # (the quickstart's) goes to NanoChat's, with the modeling file that holds it
    cfg = load_config(REPO / "config" / preset, {"n_layer": 1, "n_embd": 32, "n_head": 2,
                                                 "block_size": 16, "init_from": ""})
    config = cfg.model_config(vocab_size=50)
    if config.bigram_embedding:
        assert nanochat_problem(config) is None, preset
    problems = [gpt2_problem(config), nanochat_problem(config)]
    assert None in problems, (preset, problems)
