"""GPT-2 compatibility, checked against an independent implementation (transformers):
the same logits, the same greedy tokens, and exports that transformers loads."""

import fractions
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data.prepare import prepare_text
from data.tokenizer import load_tokenizer
from generate import generate
from tests.forked import python
from tests.output import error_line
from train import train
from training.config import load_config
from weights.checkpoint import load_checkpoint
from weights.gpt2 import export_hf_gpt2, load_hf_gpt2
from weights.hf import FolderError
from weights.loading import model_from_checkpoint

transformers = pytest.importorskip("transformers")  # test-only dependency
REPO = Path(__file__).resolve().parent.parent

SHAPES = [
    dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=100),
    dict(n_layer=3, n_head=4, n_embd=64, n_positions=128, vocab_size=50257),
]


def saved(obj: object) -> bytes:
    """The bytes that torch.save writes for obj."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def hf_model(tmp_path: Path, safe: bool = True, **shape) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).eval()
    model.save_pretrained(tmp_path)
    if not safe:  # the older pytorch_model.bin, which transformers 5 no longer writes
        torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    return model


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_loaded_gpt2_gives_the_same_logits(tmp_path, shape, safe):
    reference = hf_model(tmp_path, safe, **shape)
    ours = load_hf_gpt2(tmp_path)
    idx = torch.randint(0, shape["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], reference(idx).logits, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_transformers_generate(tmp_path):
    reference = hf_model(tmp_path, **SHAPES[1])
    ours = load_hf_gpt2(tmp_path)
    prompt = torch.randint(0, 50257, (1, 6), generator=torch.Generator().manual_seed(2))
    expected = reference.generate(prompt, max_new_tokens=50, do_sample=False, use_cache=True,
                                  pad_token_id=50256)
    assert torch.equal(generate(ours, prompt, 50, temperature=0.0), expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_exported_folder_loads_in_transformers_with_the_same_logits(tmp_path, shape):
    hf_model(tmp_path / "src", **shape)
    ours = load_hf_gpt2(tmp_path / "src")
    export_hf_gpt2(ours, tmp_path / "out", end_of_text=shape["vocab_size"] - 1)  # GPT-2's is its last
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.bos_token_id == reloaded.config.eos_token_id == shape["vocab_size"] - 1
    # unless told otherwise, GPT-2's vocabulary gets GPT-2's end of text, and another none
    export_hf_gpt2(ours, tmp_path / "default")
    config = json.loads((tmp_path / "default" / "config.json").read_text())
    assert config["eos_token_id"] == (50256 if shape["vocab_size"] == 50257 else None)
    idx = torch.randint(0, shape["vocab_size"], (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, ours(idx)[0], rtol=1e-5, atol=1e-5)


def test_block_size_crops_the_position_table(tmp_path):
    hf_model(tmp_path, **SHAPES[0])
    full, cropped = load_hf_gpt2(tmp_path), load_hf_gpt2(tmp_path, block_size=16)
    assert cropped.config.block_size == 16 and cropped.transformer.wpe.weight.shape == (16, 32)
    idx = torch.randint(0, 100, (1, 16))
    assert torch.equal(full(idx)[0], cropped(idx)[0])


def test_broken_folders_are_named(tmp_path):
    hf_model(tmp_path / "good", **SHAPES[0])
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    with pytest.raises(FolderError, match="has neither model.safetensors nor pytorch_model.bin"):
        load_hf_gpt2(tmp_path / "no_weights")
    with pytest.raises(FolderError, match="has no config.json"):
        load_hf_gpt2(tmp_path)
    config = json.loads((tmp_path / "good" / "config.json").read_text())
    (tmp_path / "good" / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(FolderError, match=r"do not match its config.json: transformer.wte.weight "
                                              r"is \(100, 32\) but config.json implies \(100, 64\)"):
        load_hf_gpt2(tmp_path / "good")


@pytest.mark.parametrize("damage, message", [
    ({"config.json": b"{not json"}, "config.json is not valid JSON"),
    ({"config.json": b'{"n_layer": 2}'}, "config.json lacks vocab_size, n_positions, n_head, n_embd"),
    ({"config.json": b'{"vocab_size": 100, "n_positions": 64, "n_layer": 2, "n_head": 3, '
                     b'"n_embd": 32}'}, "n_embd (32) must be divisible by n_head (3)"),
    ({"model.safetensors": b"\x00" * 40}, "model.safetensors is truncated or not a weights file"),
])
def test_damaged_gpt2_folders_are_one_clear_error(tmp_path, damage, message):
    hf_model(tmp_path, **SHAPES[0])
    for name, data in damage.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(FolderError, match=re.escape(message)):
        load_hf_gpt2(tmp_path)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:200], "pytorch_model.bin is truncated or not a weights file"),
    (lambda data: b"ROMEO:\n", "pytorch_model.bin is truncated or not a weights file (not a file "
                               "that torch.save wrote)"),
    (lambda data: saved({"lr": fractions.Fraction(1, 3)}),
     "(it holds a fractions.Fraction, which a safe load refuses)"),
    (lambda data: saved([torch.zeros(1)]), "pytorch_model.bin does not hold named weight tensors"),
    (lambda data: saved({"h.0.ln_1.weight": torch.zeros(1)}),
     "do not match its config.json: missing lm_head.weight, transformer.h.0.attn.c_attn.bias"),
], ids=["truncated", "text", "another program's pickle", "a list", "a stray tensor"])
def test_a_damaged_pytorch_model_bin_is_one_clear_error(tmp_path, damage, message):
    hf_model(tmp_path, safe=False, **SHAPES[0])
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(FolderError, match=re.escape(message)):
        load_hf_gpt2(tmp_path)


def test_sampling_a_folder_without_gpt2s_vocabulary_is_one_clear_error(tmp_path):
    hf_model(tmp_path, **SHAPES[0])  # 100 tokens
    result = python(["sample.py", "--init-from", str(tmp_path), "--prompt", "Hello"], timeout=120)
    assert result.returncode == 1
    assert error_line(result.stderr) == (f"error: {tmp_path} has a vocabulary of 100 tokens, "
                                         f"fewer than the 50,257 of GPT-2's tokenizer, which "
                                         f"reads a folder without tokenizer.json")


def test_sample_cli_samples_from_a_gpt2_folder(tmp_path):
    hf_model(tmp_path, **SHAPES[1])
    result = python(["sample.py", "--init-from", str(tmp_path), "--prompt", "Hello, my name is",
                     "--max-new-tokens", "20", "--temperature", "0"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Hello, my name is") and len(result.stdout) > 20


def test_benchmark_times_the_gpt2_folder_it_is_given(tmp_path):
    hf_model(tmp_path, **SHAPES[1])
    result = python(["sample.py", "--benchmark", "--init-from", str(tmp_path), "--lengths", "4",
                     "--repeats", "1"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{tmp_path}: ") and "uncached" in result.stdout
    both = python(["sample.py", "--benchmark", "--init-from", str(tmp_path), "--preset",
                   "baby_gpt"], timeout=120)
    assert both.returncode == 1 and error_line(both.stderr) == (
        "error: --preset times random weights of a named shape; drop --run, --checkpoint and "
        "--init-from, or drop --preset")


def test_training_fine_tunes_a_gpt2_folder(tmp_path):
    hf_model(tmp_path / "gpt2", **SHAPES[1])
    prepare_text("To be, or not to be, that is the question.\n" * 200, "gpt2", tmp_path / "data", "test")
    cfg = load_config(REPO / "config" / "tiny.toml", {
        "init_from": str(tmp_path / "gpt2"), "data_dir": str(tmp_path / "data"),
        "out_dir": str(tmp_path / "runs"), "block_size": 32, "max_iters": 12, "eval_interval": 12,
        "learning_rate": 4e-3, "sample_tokens": 0})
    result = train(cfg)
    assert result.best_val_loss < math.log(50257) - 2  # random weights start near ln(vocab)
    assert load_checkpoint(result.run_dir / "best.pt")["model_args"]["n_embd"] == 64


def test_export_cli_turns_our_checkpoint_into_a_transformers_model(tmp_path, trained_run):
    best = trained_run / "best.pt"
    result = python(["export.py", str(best), str(tmp_path / "hf")], timeout=120)
    assert result.returncode == 0, result.stderr
    ours = model_from_checkpoint(load_checkpoint(best))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    # a character vocabulary has no end-of-text token, so none is named (not GPT-2's 50256)
    assert theirs.config.bos_token_id is None and theirs.config.eos_token_id is None
    idx = torch.randint(0, ours.config.vocab_size, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx)[0], rtol=1e-5, atol=1e-5)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # it holds our char table
    text = "ROMEO: Juliet loves the moon.\n\nNURSE:  Tybalt"
    assert auto.encode(text) == load_tokenizer(load_checkpoint(best)["tokenizer"]).encode(text)
    # a second export into the same folder is refused, and the first is left as it was;
    # gpt2.py, the command's old name, runs the same command
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    again = python(["gpt2.py", str(best), str(tmp_path / "hf")], timeout=120)
    assert again.returncode == 1
    assert error_line(again.stderr) == (f"error: {tmp_path / 'hf'} is not empty; choose another "
                                        f"folder, or pass --force to replace its config.json, "
                                        f"model.safetensors, tokenizer.json and "
                                        f"tokenizer_config.json")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    export_hf_gpt2(ours, tmp_path / "hf", force=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    unwritable = python(["export.py", str(best), "/proc/no-such-export"], timeout=120)
    assert unwritable.returncode == 1
    assert error_line(unwritable.stderr).startswith("error: cannot write /proc/no-such-export (")
