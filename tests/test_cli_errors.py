"""Every kind of bad input, through the real command lines: one line on stderr naming the
problem and the fix, exit code 1 (2 for a command line the parser cannot read, as click and
argparse do), no traceback, and nothing written."""

import json
import math
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from data.prepare import prepare_text
from model import GPT, GPTConfig
from tests.forked import python
from tests.layouts import MODERN
from tests.output import error_line
from weights.gpt2 import export_hf_gpt2

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "config" / "tiny.toml")


def damaged_data(change: Callable[[Path], None]) -> Callable[[Path, dict], None]:
    """A copy of the prepared test data at {tmp}/data, then `change` applied to it."""
    def make(tmp: Path, ctx: dict) -> None:
        shutil.copytree(ctx["data"], tmp / "data")
        change(tmp / "data")
    return make


def edit_meta(**changes) -> Callable[[Path], None]:
    def change(data: Path) -> None:
        meta = json.loads((data / "meta.json").read_text())
        (data / "meta.json").write_text(json.dumps({**meta, **changes}))
    return change


def edit_tokenizer(**changes) -> Callable[[Path], None]:
    """Change meta.json's tokenizer record (a value of None drops the key)."""
    def change(data: Path) -> None:
        meta = json.loads((data / "meta.json").read_text())
        record = {**meta["tokenizer"], **changes}
        meta["tokenizer"] = {k: v for k, v in record.items() if v is not None}
        (data / "meta.json").write_text(json.dumps(meta))
    return change


def shorter_chars(data: Path) -> None:
    meta = json.loads((data / "meta.json").read_text())
    meta["tokenizer"]["chars"] = meta["tokenizer"]["chars"][:-1]
    (data / "meta.json").write_text(json.dumps(meta))


def drop_meta_key(data: Path) -> None:
    meta = json.loads((data / "meta.json").read_text())
    del meta["vocab_size"]
    (data / "meta.json").write_text(json.dumps(meta))


def edited_checkpoint(**model_args) -> Callable[[Path, dict], None]:
    """The trained checkpoint at {tmp}/c.pt with model_args changed, so its weights no longer fit."""
    def make(tmp: Path, ctx: dict) -> None:
        ckpt = torch.load(ctx["ckpt"], weights_only=True)
        ckpt["model_args"].update(model_args)
        torch.save(ckpt, tmp / "c.pt")
    return make


def modern_checkpoint(tmp: Path, ctx: dict) -> None:
    """{tmp}/c.pt: the trained checkpoint's shape in the modern layout, with fresh weights."""
    ckpt = torch.load(ctx["ckpt"], weights_only=True)
    ckpt["model_args"].update(MODERN)
    ckpt["model"] = GPT(GPTConfig(**ckpt["model_args"])).state_dict()
    torch.save(ckpt, tmp / "c.pt")


def nan_checkpoint(tmp: Path, ctx: dict) -> None:
    """{tmp}/c.pt: the trained checkpoint with one NaN weight, as a diverged run's would have."""
    ckpt = torch.load(ctx["ckpt"], weights_only=True)
    ckpt["model"]["transformer.h.1.ln_1.weight"][0] = float("nan")
    torch.save(ckpt, tmp / "c.pt")


def trained_copy(tmp: Path, ctx: dict) -> None:
    """{tmp}/runs/tiny: a copy of the trained run, to resume."""
    shutil.copytree(ctx["ckpt"].parent, tmp / "runs" / "tiny")


def checkpoint_without(key: str, where: str) -> Callable[[Path, dict], None]:
    """The trained checkpoint without `key` (at the top, or in its rng or tokenizer record),
    as {tmp}/c.pt and as the last.pt of a run at {tmp}/runs/tiny."""
    def make(tmp: Path, ctx: dict) -> None:
        ckpt = torch.load(ctx["ckpt"], weights_only=True)
        del (ckpt if where == "top" else ckpt[where])[key]
        (tmp / "runs" / "tiny").mkdir(parents=True)
        for path in (tmp / "c.pt", tmp / "runs" / "tiny" / "last.pt"):
            torch.save(ckpt, path)
    return make


def resumable_with(change: Callable[[dict], None]) -> Callable[[Path, dict], None]:
    """A run at {tmp}/runs/tiny whose last.pt is the trained checkpoint with `change` made."""
    def make(tmp: Path, ctx: dict) -> None:
        ckpt = torch.load(ctx["ckpt"], weights_only=True)
        change(ckpt)
        (tmp / "runs" / "tiny").mkdir(parents=True)
        torch.save(ckpt, tmp / "runs" / "tiny" / "last.pt")
    return make


def damaged_run(tmp: Path, ctx: dict) -> None:
    """{tmp}/runs/tiny, whose last.pt lacks one weight."""
    ckpt = torch.load(ctx["ckpt"], weights_only=True)
    del ckpt["model"]["transformer.h.1.ln_1.weight"]
    (tmp / "runs" / "tiny").mkdir(parents=True)
    torch.save(ckpt, tmp / "runs" / "tiny" / "last.pt")


def hf_folder(damage: dict[str, bytes] | None = None, vocab_size: int = 50257,
              bin_weights: bool = False) -> Callable[[Path, dict], None]:
    """A small GPT-2 folder at {tmp}/hf, written by our own exporter, then damaged."""
    def make(tmp: Path, ctx: dict) -> None:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16))
        export_hf_gpt2(model, tmp / "hf")
        if bin_weights:
            from safetensors.torch import load_file
            torch.save(load_file(tmp / "hf" / "model.safetensors"), tmp / "hf" / "pytorch_model.bin")
            (tmp / "hf" / "model.safetensors").unlink()
        for name, data in (damage or {}).items():
            (tmp / "hf" / name).write_bytes(data)
    return make


def hf_config(**changes) -> Callable[[Path, dict], None]:
    """A small GPT-2 folder at {tmp}/hf whose config.json has `changes`."""
    def make(tmp: Path, ctx: dict) -> None:
        hf_folder()(tmp, ctx)
        config = json.loads((tmp / "hf" / "config.json").read_text())
        (tmp / "hf" / "config.json").write_text(json.dumps({**config, **changes}))
    return make


def hf_weight(tensor: str, value: float | torch.dtype) -> Callable[[Path, dict], None]:
    """A small GPT-2 folder at {tmp}/hf whose `tensor` holds `value` in one place (or, if
    `value` is a dtype, is of that dtype), as a diverged run's export or a damaged copy would,
    and a task and a text to score at {tmp}/task.jsonl and {tmp}/text.txt."""
    def make(tmp: Path, ctx: dict) -> None:
        from safetensors.torch import load_file, save_file
        hf_folder()(tmp, ctx)
        weights = load_file(tmp / "hf" / "model.safetensors")
        if isinstance(value, torch.dtype):
            weights[tensor] = weights[tensor].to(value)
        else:
            weights[tensor].view(-1)[3] = value
        save_file(weights, tmp / "hf" / "model.safetensors", metadata={"format": "pt"})
        TEXT(tmp, ctx)
        (tmp / "task.jsonl").write_text(json.dumps({"context": "The capital of France is",
                                                    "choices": ["Paris", "Rome"], "answer": 0}))
    return make


def write(name: str, data: bytes) -> Callable[[Path, dict], None]:
    def make(tmp: Path, ctx: dict) -> None:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    return make


def nothing(tmp: Path, ctx: dict) -> None:
    pass


TRAIN = ["train.py", "--config", TINY, "--data-dir", "{data}", "--out-dir", "{tmp}/runs"]
BPE_TRAIN = ["train.py", "--config", TINY, "--data-dir", "{bpe}", "--out-dir", "{tmp}/runs"]
SAMPLE = ["sample.py", "--checkpoint", "{ckpt}", "--max-new-tokens", "5"]
EVALUATE = ["evaluate.py", "--checkpoint", "{ckpt}", "--input", "{tmp}/text.txt"]
TEXT = write("text.txt", b"ROMEO: Juliet sees the moon.\n")
LONG = "x" * 300  # a path component longer than file systems allow (255 bytes)
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a GPU")

# (command, files to make first, exit code, what the one line must contain)
CASES = {
    # configuration
    "config is a folder": (["train.py", "--config", "{tmp}"], nothing, 1,
                           "error: config {tmp} is a folder"),
    "config is /dev/null": (["train.py", "--config", "/dev/null"], nothing, 1,
                            "error: config /dev/null is not a regular file"),
    "learning rate nan": ([*TRAIN, "--learning-rate", "nan"], nothing, 1,
                          "error: learning_rate must be a finite number, got nan"),
    "grad clip nan": ([*TRAIN, "--grad-clip", "nan"], nothing, 1,
                      "error: grad_clip must be a finite number, got nan"),
    "min lr inf": ([*TRAIN, "--min-lr", "inf"], nothing, 1,
                   "error: min_lr must be a finite number, got inf"),
    "a micro-batch larger than any memory": (
        [*TRAIN, "--batch-size", "100000000"], nothing, 1,
        "error: this run needs at least 3,520.0 GB (0.0 for the weights, gradients and optimizer "
        "state, 3,520.0 for the activations of batch_size 100000000 x block_size 32), but cpu "
        "has "),
    "a model larger than any memory": (
        [*TRAIN, "--n-embd", "65536"], nothing, 1,
        "error: this run needs at least 1,649.9 GB (1,649.4 for the weights, gradients and "
        "optimizer state, "),
    "unknown dtype": ([*TRAIN, "--dtype", "half"], nothing, 1,
                      "error: dtype must be one of auto, float32, bfloat16, float16, got 'half'"),
    "device with a bad index": ([*TRAIN, "--device", "cuda:abc"], nothing, 1,
                                "error: device 'cuda:abc' is not a device; use auto, cpu, cuda, cuda:N"),
    "sample prompt outside the vocabulary": ([*TRAIN, "--sample-prompt", "\u00e9t\u00e9"], nothing, 1,
                                             "sample_prompt"),
    "run name is a file": ([*TRAIN, "--run-name", "taken"], write("runs/taken", b"x"), 1,
                           "error: {tmp}/runs/taken is a file"),
    "nothing to resume": ([*TRAIN, "--resume"], nothing, 1, "error: nothing to resume"),
    "resume from damaged weights": ([*TRAIN, "--resume"], damaged_run, 1,
                                    "error: cannot resume: the weights in {tmp}/runs/tiny/last.pt do "
                                    "not match its model_args (missing transformer.h.1.ln_1.weight)"),
    "resume with another seed": ([*TRAIN, "--resume", "--max-iters", "30", "--seed", "7"],
                                 trained_copy, 1, "error: cannot resume: seed is 7 in the config "
                                 "but 1337 in {tmp}/runs/tiny/last.pt, and a resumed run "
                                 "continues the random streams saved with it"),
    "resume without the optimizer state": (
        [*TRAIN, "--resume", "--max-iters", "30"], checkpoint_without("optimizer", "top"), 1,
        "error: cannot resume from {tmp}/runs/tiny/last.pt: it lacks optimizer; it can be "
        "sampled, not continued"),
    "resume from an unknown dtype": (
        [*TRAIN, "--resume", "--max-iters", "30"],
        resumable_with(lambda c: c.update(dtype="float8")), 1,
        "error: cannot resume from {tmp}/runs/tiny/last.pt: its dtype is 'float8', not one of "
        "float32, bfloat16, float16; it can be sampled, not continued"),
    "resume from a negative iteration": (
        [*TRAIN, "--resume", "--max-iters", "30"],
        resumable_with(lambda c: c.update(iter_num=-5)), 1,
        "error: cannot resume from {tmp}/runs/tiny/last.pt: its iter_num is -5, below 0"),
    "resume from a best val loss of NaN": (
        [*TRAIN, "--resume", "--max-iters", "30"],
        resumable_with(lambda c: c.update(best_val_loss=math.nan)), 1,
        "error: cannot resume from {tmp}/runs/tiny/last.pt: its best_val_loss is NaN"),
    "resume from a damaged random state": (
        [*TRAIN, "--resume", "--max-iters", "30"],
        resumable_with(lambda c: c["rng"].update(batches=torch.zeros(10, dtype=torch.uint8))),
        1, "error: cannot resume from {tmp}/runs/tiny/last.pt: its rng.batches is a uint8 "
           "tensor of shape (10,), not a random generator's state"),
    "resume from a damaged optimizer state": (
        [*TRAIN, "--resume", "--max-iters", "30"],
        resumable_with(lambda c: c.update(optimizer=[{"state": {}, "param_groups": []}])), 1,
        "error: cannot resume from {tmp}/runs/tiny/last.pt: its optimizer state 0 is damaged: "
        "it has no groups of parameters"),
    "resume with another number of optimizers' states": (
        [*TRAIN, "--resume", "--max-iters", "30"],
        resumable_with(lambda c: c.update(optimizer=[c["optimizer"][0]] * 2)), 1,
        "error: cannot resume: {tmp}/runs/tiny/last.pt holds the state of 2 optimizers, and "
        "this run has 1; the file is damaged: start a new run without --resume"),
    "seed past 64 bits": ([*TRAIN, "--seed", str(2**64)], nothing, 1,
                          "error: seed must be in [0, 2^63), got 18446744073709551616"),
    "seed past 64 bits in TOML": (["train.py", "--config", "{tmp}/c.toml"],
                                  write("c.toml", b"seed = 18446744073709551617\n"), 1,
                                  "error: seed must be in [0, 2^63), got 18446744073709551617"),
    "run name longer than a file name can be": (
        [*TRAIN, "--run-name", LONG], nothing, 1,
        f"error: cannot write to {{tmp}}/runs/{LONG} (File name too long)"),
    "prepare into a path too long": (
        ["-m", "data.prepare", "--input", "{tmp}/c.txt", "--out", "{tmp}/" + LONG],
        write("c.txt", b"some text\n" * 100), 1,
        f"error: cannot use {{tmp}}/{LONG}: a name in it is longer than the file system allows"),
    "fsdp outside torchrun": ([*TRAIN, "--parallel", "fsdp"], nothing, 1,
                              "error: parallel = fsdp shards the model across torchrun's "
                              "processes; launch with torchrun --nproc_per_node=N"),
    "an unknown parallel": ([*TRAIN, "--parallel", "zero3"], nothing, 1,
                            "error: parallel must be ddp or fsdp, got 'zero3'"),
    "not a number (usage)": ([*TRAIN, "--max-iters", "many"], nothing, 2,
                             "error: Invalid value for '--max-iters': 'many' is not a valid "
                             "integer. (see train.py --help)"),
    "two configs (usage)": ([*TRAIN, "config/quickstart.toml"], nothing, 2,
                            f"error: two configs, config/quickstart.toml and --config {TINY}; "
                            f"give one (see train.py --help)"),
    "an extra argument (usage)": (["train.py", TINY, "config/quickstart.toml"], nothing, 2,
                                  "error: Got unexpected extra argument (config/quickstart.toml)"),
    # prepared data
    "meta.json not JSON": ([*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
                           damaged_data(lambda d: (d / "meta.json").write_text("{oops")), 1,
                           "meta.json"),
    "meta.json nested too deep": (
        [*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
        damaged_data(lambda d: (d / "meta.json").write_text("[" * 100_000 + "]" * 100_000)), 1,
        "meta.json is not valid JSON"),
    "meta.json lacks a key": ([*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
                              damaged_data(drop_meta_key), 1, "vocab_size"),
    "unknown tokenizer": ([*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
                          damaged_data(edit_meta(tokenizer={"kind": "sentencepiece"})), 1,
                          "sentencepiece"),
    "tokenizer record lacks its table": (
        [*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
        damaged_data(edit_tokenizer(chars=None)), 1,
        "meta.json is damaged: the tokenizer's description: it lacks chars"),
    "tokenizer record of the wrong type": (
        [*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
        damaged_data(edit_tokenizer(vocab_size="38")), 1,
        "meta.json is damaged: the tokenizer's description: its vocab_size is '38', not of type int"),
    "character table shorter than the vocabulary": (
        [*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
        damaged_data(shorter_chars), 1, "the tokenizer's description: its vocab_size is "),
    "unknown token dtype": ([*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
                            damaged_data(edit_meta(dtype="int3")), 1, "int3"),
    "token ids outside the vocabulary": (
        [*TRAIN[:3], "--data-dir", "{tmp}/data", "--out-dir", "{tmp}/runs"],
        damaged_data(lambda d: [shard.write_bytes(b"\xff\xff" * (shard.stat().st_size // 2))
                                for shard in d.glob("tokens_*.bin")]), 1,
        "a shard is damaged: prepare the dataset again"),
    "corpus is not UTF-8": (["-m", "data.prepare", "--input", "{tmp}/c.txt", "--out", "{tmp}/out"],
                            write("c.txt", b"caf\xe9\n"), 1,
                            "error: {tmp}/c.txt is not valid UTF-8 (byte offset 3, line 1)"),
    "prepare into a file": (["-m", "data.prepare", "--input", "{tmp}/c.txt", "--out", "{tmp}/f/out"],
                            lambda t, c: (write("c.txt", b"some text\n" * 100)(t, c),
                                          write("f", b"x")(t, c)),
                            1, "{tmp}/f"),
    # Hugging Face folders, in training and in sampling
    "init_from config.json not JSON": (
        [*BPE_TRAIN, "--init-from", "{tmp}/hf"], hf_folder({"config.json": b"{not json"}), 1,
        "config.json is not valid JSON"),
    "init_from truncated safetensors": (
        [*BPE_TRAIN, "--init-from", "{tmp}/hf"], hf_folder({"model.safetensors": b"\0" * 40}), 1,
        "model.safetensors is truncated or not a weights file"),
    "--init-from config.json lacks keys": (
        ["sample.py", "--init-from", "{tmp}/hf"], hf_folder({"config.json": b'{"n_layer": 1}'}), 1,
        "config.json lacks vocab_size"),
    "--init-from truncated pytorch_model.bin": (
        ["sample.py", "--init-from", "{tmp}/hf"],
        hf_folder({"pytorch_model.bin": b"PK\x03\x04" + b"\0" * 60}, bin_weights=True), 1,
        "pytorch_model.bin is truncated or not a weights file"),
    "--init-from config.json with a count that is not an integer": (
        ["sample.py", "--init-from", "{tmp}/hf"], hf_config(n_layer=1.0), 1,
        "config.json: n_layer must be an integer, got 1.0"),
    "--init-from weights that hold NaN, sampled": (
        ["sample.py", "--init-from", "{tmp}/hf", "--max-new-tokens", "5"],
        hf_weight("transformer.h.0.mlp.c_fc.weight", math.nan), 1,
        "error: {tmp}/hf's transformer.h.0.mlp.c_fc.weight holds NaN or inf: the weights are "
        "damaged, or the model they were saved from had diverged; use another copy"),
    "--init-from weights that hold NaN, scored on a task": (
        ["evaluate.py", "--init-from", "{tmp}/hf", "--task", "{tmp}/task.jsonl", "--json",
         "{tmp}/scores.json"], hf_weight("transformer.h.0.mlp.c_fc.weight", math.nan), 1,
        "error: {tmp}/hf's transformer.h.0.mlp.c_fc.weight holds NaN or inf"),
    "--init-from weights that hold inf, scored on a text": (
        ["evaluate.py", "--init-from", "{tmp}/hf", "--input", "{tmp}/text.txt"],
        hf_weight("transformer.wpe.weight", -math.inf), 1,
        "error: {tmp}/hf's transformer.wpe.weight holds NaN or inf"),
    "--init-from weights that hold NaN, served": (
        ["serve.py", "--init-from", "{tmp}/hf", "--port", "0"],
        hf_weight("transformer.ln_f.bias", math.nan), 1,
        "error: {tmp}/hf's transformer.ln_f.bias holds NaN or inf"),
    "--init-from weights that hold NaN, fine-tuned": (
        [*BPE_TRAIN, "--init-from", "{tmp}/hf"], hf_weight("transformer.wte.weight", math.nan), 1,
        "error: {tmp}/hf's transformer.wte.weight holds NaN or inf"),
    "--init-from weights of integers": (
        ["sample.py", "--init-from", "{tmp}/hf"], hf_weight("transformer.ln_f.weight", torch.int32),
        1, "error: {tmp}/hf's transformer.ln_f.weight holds int32 values, where weights are "
           "floating point; the file is damaged, use another copy"),
    "--init-from config.json nested too deep to read": (
        ["sample.py", "--init-from", "{tmp}/hf"],
        hf_folder({"config.json": b"[" * 100_000 + b"]" * 100_000}), 1,
        "config.json is not valid JSON (maximum recursion depth exceeded"),
    "--init-from config.json of a width no machine holds": (
        ["sample.py", "--init-from", "{tmp}/hf"], hf_config(n_embd=10**9), 1,
        "config.json: a model of this shape has a tensor too large for any machine"),
    "--init-from without GPT-2's vocabulary": (
        ["sample.py", "--init-from", "{tmp}/hf"], hf_folder(vocab_size=100), 1,
        "has a vocabulary of 100 tokens, fewer than the 50,257 of GPT-2's tokenizer"),
    # sampling
    "temperature nan": ([*SAMPLE, "--temperature", "nan"], nothing, 1,
                        "error: temperature must be >= 0 (0 means greedy) and finite, got nan"),
    "temperature below zero": ([*SAMPLE, "--temperature", "-1"], nothing, 1,
                               "error: temperature must be >= 0"),
    "temperature inf": ([*SAMPLE, "--temperature", "inf"], nothing, 1,
                        "error: temperature must be >= 0 (0 means greedy) and finite, got inf"),
    "sampling seed past 64 bits": ([*SAMPLE, "--seed", str(2**64 + 5)], nothing, 1,
                                   "error: seed must be in [0, 2^63)"),
    "a device type this build cannot run": ([*SAMPLE, "--device", "xpu"], nothing, 1,
                                            "error: device 'xpu' is not one this project runs on"),
    "checkpoint path too long": (["sample.py", "--checkpoint", f"{{tmp}}/{LONG}.pt"], nothing, 1,
                                 "a name in it is longer than the file system allows"),
    "top-p zero": ([*SAMPLE, "--top-p", "0"], nothing, 1, "error: top_p must be in (0, 1]"),
    "top-k zero": ([*SAMPLE, "--top-k", "0"], nothing, 1, "error: top_k must be at least 1"),
    "empty stop string": ([*SAMPLE, "--stop", ""], nothing, 1,
                          "error: --stop is empty, which would end every sample at once"),
    "prompt outside the vocabulary": (
        [*SAMPLE, "--prompt", "ROMEO: ~^"], nothing, 1,
        "error: prompt: 2 character(s) not in this model's vocabulary: '^', '~'"),
    "prompt file not UTF-8": ([*SAMPLE, "--prompt-file", "{tmp}/p.txt"], write("p.txt", b"ROMEO \xe9\n"),
                              1, "error: {tmp}/p.txt is not valid UTF-8 (byte offset 6, line 1); "
                                 "convert it to UTF-8 first"),
    "int4 weights": ([*SAMPLE, "--dtype", "int4"], nothing, 1,
                     "error: dtype must be one of float32, bfloat16, float16, int8, got 'int4'"),
    "unknown decode step": ([*SAMPLE, "--decode", "fast"], nothing, 1,
                            "error: --decode must be one of auto, eager, compile, c, got 'fast'"),
    "a decode step without the cache": ([*SAMPLE, "--decode", "c", "--no-kv-cache"], nothing, 1,
                                        "error: --decode c chooses the cached decode step"),
    "no such run": (["sample.py", "--run", "{tmp}/runs/nope"], nothing, 1,
                    "error: no checkpoint (best.pt or last.pt) in {tmp}/runs/nope"),
    "serve: a negative temperature": (["serve.py", "--checkpoint", "{ckpt}", "--temperature",
                                       "-1"], nothing, 1, "error: temperature must be >= 0"),
    "serve: no such run": (["serve.py", "--run", "{tmp}/runs/nope", "--port", "0"], nothing, 1,
                           "error: no checkpoint (best.pt or last.pt) in {tmp}/runs/nope"),
    "serve: an address not of this machine": (
        ["serve.py", "--checkpoint", "{ckpt}", "--host", "192.0.2.1"], nothing, 1,
        "error: cannot listen on 192.0.2.1:8000"),
    "serve: an unknown decode step": (["serve.py", "--checkpoint", "{ckpt}", "--decode", "fast"],
                                      nothing, 1, "error: --decode must be one of auto"),
    "no such checkpoint": (["sample.py", "--checkpoint", "{tmp}/none.pt"], nothing, 1,
                           "error: checkpoint {tmp}/none.pt not found"),
    "truncated checkpoint": (["sample.py", "--checkpoint", "{tmp}/c.pt"], write("c.pt", b"PK\x03\x04"),
                             1, "error: checkpoint {tmp}/c.pt is truncated or not a checkpoint"),
    "text for a checkpoint": (["sample.py", "--checkpoint", "{tmp}/c.pt"], write("c.pt", b"ROMEO:\n"), 1,
                              "error: checkpoint {tmp}/c.pt is truncated or not a checkpoint (not a "
                              "file that torch.save wrote)"),
    "checkpoint weights that do not fit": (
        ["sample.py", "--checkpoint", "{tmp}/c.pt"], edited_checkpoint(n_layer=3), 1,
        "error: the checkpoint's weights do not match its model_args: missing transformer.h.2."),
    "checkpoint with a damaged tokenizer": (
        ["sample.py", "--checkpoint", "{tmp}/c.pt"], checkpoint_without("chars", "tokenizer"), 1,
        "error: {tmp}/c.pt is damaged: the tokenizer's description: it lacks chars; use "
        "another checkpoint"),
    "checkpoint of a run that diverged": (
        ["sample.py", "--checkpoint", "{tmp}/c.pt"], nan_checkpoint, 1,
        "error: the checkpoint's transformer.h.1.ln_1.weight holds NaN or inf: its run diverged"),
    "checkpoint with a foreign model_args key": (
        ["export.py", "{tmp}/c.pt", "{tmp}/hf"], edited_checkpoint(rope=True), 1,
        "error: {tmp}/c.pt is damaged: its model_args are not a model shape "
        "(GPTConfig.__init__() got an unexpected keyword argument 'rope'); use another "
        "checkpoint"),
    "attention picture unwritable": ([*SAMPLE, "--attention", "/proc/gptlab/attention"], nothing, 1,
                                     "error: --attention cannot write to /proc/gptlab"),
    "a GPU this torch cannot use": pytest.param(
        [*SAMPLE, "--device", "cuda"], nothing, 1,
        "error: device is cuda but no CUDA GPU is available to this torch; use --device cpu",
        marks=NO_GPU),
    "benchmark figures into a missing folder": (
        ["sample.py", "--benchmark", "--preset", "baby_gpt", "--json", "{tmp}/no/b.json"], nothing, 1,
        "error: --json {tmp}/no/b.json: {tmp}/no is not a folder"),
    "benchmark of zero new tokens": (
        ["sample.py", "--benchmark", "--preset", "baby_gpt", "--lengths", "64,0"], nothing, 1,
        "error: --lengths takes counts of new tokens separated by commas, each at least 1"),
    "benchmark of a batch larger than any memory": (
        ["sample.py", "--benchmark", "--preset", "baby_gpt", "--lengths", "8", "--batch",
         "100000000"], nothing, 1,
        "error: --batch 100000000 needs at least 40,902.8 GB (29,504.0 for the KV cache of "
        "100,000,000 rows x 16 positions, 26.0 for the logits of 100,000,000 rows, 11,366.4 for "
        "the C step's scratch, 6.4 for the prompts of 8 ids), but cpu has "),
    "unknown option (usage)": ([*SAMPLE, "--tempreature", "1"], nothing, 2,
                               "error: No such option: --tempreature (Possible options: "
                               "--temperature) (see sample.py --help)"),
    "out of its range (usage)": ([*SAMPLE, "--max-new-tokens", "0"], nothing, 2,
                                 "error: Invalid value for '--max-new-tokens': Input should be "
                                 "greater than or equal to 1 (see sample.py --help)"),
    # evaluation and export
    "no text to score": ([*EVALUATE], write("text.txt", b"\n\n"), 1,
                         "error: input {tmp}/text.txt holds no text"),
    "evaluate int4": ([*EVALUATE, "--dtype", "int4"], TEXT, 1,
                      "error: dtype must be one of float32, bfloat16, float16, int8, got 'int4'"),
    "text outside the vocabulary": ([*EVALUATE], write("text.txt", "ROMEO: \u00e9\n".encode()), 1,
                                    "error: {tmp}/text.txt: 1 character(s) not in this model's "
                                    "vocabulary"),
    "stride as long as the window": ([*EVALUATE, "--stride", "32"], TEXT, 1,
                                     "error: stride must be at least 1 and below block_size (32)"),
    "stride of zero": ([*EVALUATE, "--stride", "0"], TEXT, 1,
                       "error: stride must be at least 1 and below block_size (32), so that "
                       "windows overlap and no token goes unscored; got 0"),
    "negative stride": ([*EVALUATE, "--stride", "-4"], TEXT, 1,
                        "error: stride must be at least 1 and below block_size (32)"),
    "json into a missing folder": ([*EVALUATE, "--json", "{tmp}/no/x.json"], TEXT, 1,
                                   "error: --json {tmp}/no/x.json: {tmp}/no is not a folder"),
    "export into /proc": (["export.py", "{ckpt}", "/proc/gptlab"], nothing, 1, "/proc/gptlab"),
    "export of a run that does not exist": (["export.py", "{tmp}/runs/nosuch", "{tmp}/hf-out"], nothing, 1,
                                            "error: no checkpoint (best.pt or last.pt) in {tmp}/runs/nosuch; "
                                            "runs in {tmp}/runs/ that have one: none"),
    "export over a folder": (["export.py", "{ckpt}", "{tmp}/keep"], write("keep/notes.txt", b"mine"),
                             1, "--force"),
    # layouts that cannot be built
    "n_head not divisible by n_kv_head": ([*TRAIN, "--n-kv-head", "3"], nothing, 1,
                                          "error: n_head (2) must be divisible by n_kv_head (3)"),
    "rope with an odd head size": ([*TRAIN, "--pos-embedding", "rope", "--n-embd", "36",
                                    "--n-head", "12"], nothing, 1,
                                   "error: with rope, the head size n_embd / n_head (3) must "
                                   "be even"),
    "an unknown norm": ([*TRAIN, "--norm", "batchnorm"], nothing, 1,
                        "error: norm must be one of layernorm, rmsnorm, got 'batchnorm'"),
    "a modern layout exported to GPT-2": (["export.py", "{tmp}/c.pt", "{tmp}/hf-out", "--format",
                                           "gpt2"], modern_checkpoint, 1,
                                          "error: a GPT-2 folder holds pos_embedding = 'learned', "
                                          "and this model has 'rope'; neither NanoChat's "
                                          "format nor GPT-2's holds this layout: keep its "
                                          "checkpoint, or train it with --no-bias --embed-norm "
                                          "(NanoChat's), or with --pos-embedding learned --norm "
                                          "layernorm --no-qk-norm --mlp gelu --tie-embeddings "
                                          "(GPT-2's)"),
    "a layout neither format holds": (["export.py", "{tmp}/c.pt", "{tmp}/hf-out"],
                                      modern_checkpoint, 1,
                                      "error: a NanoChat folder holds bias = False, and this "
                                      "model has True; neither NanoChat's format nor GPT-2's "
                                      "holds this layout: keep its checkpoint, or train it with "
                                      "--no-bias --embed-norm (NanoChat's)"),
    "an unknown export format": (["export.py", "{ckpt}", "{tmp}/hf-out", "--format", "gguf"],
                                 nothing, 1, "error: --format must be one of auto, gpt2, "
                                             "nanochat, got 'gguf'"),
    "a layout override on init_from": ([*BPE_TRAIN, "--init-from", "{tmp}/hf", "--mlp", "relu2"],
                                       hf_folder(), 1, "error: init_from loads GPT-2's layout"),
}


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory, corpus_file) -> Path:
    """The test corpus prepared with GPT-2's tokenizer, which init_from needs."""
    out = tmp_path_factory.mktemp("bpe") / "plays_gpt2"
    prepare_text(corpus_file.read_text(), "gpt2", out, source=str(corpus_file))
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def cases() -> list:
    """CASES as pytest parameters named by their keys (a case may carry marks)."""
    params = []
    for name, case in CASES.items():
        values, marks = (case.values, case.marks) if hasattr(case, "marks") else (case, ())
        params.append(pytest.param(*values, marks=marks, id=name))
    return params


@pytest.mark.parametrize("argv, make, code, message", cases())
def test_bad_input_is_one_line_and_nothing_written(argv, make, code, message, tmp_path,
                                                   trained_run, char_data, bpe_data):
    ctx = {"data": char_data, "ckpt": trained_run / "best.pt", "bpe": bpe_data}
    make(tmp_path, ctx)
    before = snapshot(tmp_path)
    fill = {"tmp": tmp_path, **ctx}
    result = python([a.format(**fill) for a in argv], env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    # exit code 2 is a usage error (the parser's), 1 any other; each is one line
    assert message.format(**fill) in error_line(result.stderr), result.stderr
    assert snapshot(tmp_path) == before  # nothing half-written, nothing overwritten


@pytest.mark.parametrize("argv, instead", [
    ([*TRAIN, "--compile", "--max-iters", "2"], "drop --compile"),
    ([*SAMPLE, "--decode", "compile"], "choose another --decode"),
])
def test_torch_compile_without_a_working_compiler_is_one_line(argv, instead, tmp_path,
                                                             trained_run, char_data):
    fill = {"tmp": tmp_path, "data": char_data, "ckpt": trained_run / "best.pt"}
    result = python([a.format(**fill) for a in argv],
                    env={**os.environ, "CXX": "/bin/false"})  # a compiler that fails
    assert result.returncode == 1
    report = error_line(result.stderr)
    assert report.startswith("error: torch.compile does not work on cpu here "), report
    assert report.endswith(f"; {instead}, or install a C++ compiler (g++, or set CXX)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, code, error", [
    (["benchmarks.train", "--input", "{tmp}/missing.txt"], 1,
     "error: input {tmp}/missing.txt does not exist"),
    (["benchmarks.train", "--time-to-loss", "1.9"], 1,
     "error: --time-to-loss races on a text: add --input FILE"),
    (["benchmarks.train", "--json", "{tmp}/no/such/folder/figures.json"], 1,
     "error: --json {tmp}/no/such/folder/figures.json: {tmp}/no/such/folder is not a folder"),
    (["benchmarks.decode", "--json", "{tmp}/no/figures.json", "--lengths", "8"], 1,
     "error: --json {tmp}/no/figures.json: {tmp}/no is not a folder"),
    (["benchmarks.decode", "--lengths", "0"], 1, "error: "),
    (["benchmarks.decode", "--repeats", "0"], 2, "error: Invalid value for '--repeats'"),
    (["benchmarks.dtypes", "--run", "{tmp}"], 1, "error: no checkpoint (best.pt or last.pt) in {tmp}"),
    (["benchmarks.dtypes", "--repeats", "0"], 2, "error: Invalid value for '--repeats'"),
])
def test_the_benchmarks_check_their_input_before_the_work(tmp_path, args, code, error):
    result = python(["-m", *[a.format(tmp=tmp_path) for a in args]])
    assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
    # 2 is the parser's report of a value out of its range, which names the option
    assert error_line(result.stderr).startswith(error.format(tmp=tmp_path)), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


NO_HOME_UID = 54321  # a user with no passwd entry, as `docker run --user 54321` makes one


def without_a_home(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """A command run as a user with no passwd entry and no HOME: uid 54321 inside a user
    namespace of its own (the files it reads and writes are still this user's outside), with
    its temporary folder in `tmp`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "GPTLAB_CACHE")}
    as_nobody = ["unshare", "--user", f"--map-user={NO_HOME_UID}", f"--map-group={NO_HOME_UID}"]
    return subprocess.run([*as_nobody, sys.executable, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**env, "TMPDIR": str(tmp)})


def test_a_user_without_a_home_gets_a_private_cache_folder(tmp_path, trained_run, char_data):
    """For a user with no home, train.py and sample.py keep their cache in a folder of the
    user's own in the temporary folder, and refuse one that others could write into, because
    the cache holds libraries that are loaded."""
    try:
        pwd.getpwuid(NO_HOME_UID)
        pytest.skip(f"uid {NO_HOME_UID} has a passwd entry here")
    except KeyError:
        pass
    probe = without_a_home(["-c", "import pathlib; pathlib.Path.home()"], tmp_path)
    if "Could not determine home directory" not in probe.stderr:
        pytest.skip(f"cannot run as a user without a home here: {probe.stderr[-300:]}")
    train = without_a_home(["train.py", "--config", "config/tiny.toml", "--data-dir",
                            str(char_data), "--out-dir", str(tmp_path / "runs"), "--max-iters",
                            "2", "--eval-interval", "2", "--sample-tokens", "0"], tmp_path)
    assert train.returncode == 0, train.stderr
    sample = ["sample.py", "--checkpoint", str(trained_run / "best.pt"), "--max-new-tokens", "5",
              "--decode", "c"]
    result = without_a_home(sample, tmp_path)
    assert result.returncode == 0 and result.stdout, result.stderr
    cache = tmp_path / f"gptlab-cache-{NO_HOME_UID}"
    assert (cache.stat().st_mode & 0o777) == 0o700 and list((cache / "decode_step").glob("*.so"))
    cache.chmod(0o777)  # as if another user had made it first, for everyone to write
    result = without_a_home(sample, tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert error_line(result.stderr) == (
        f"error: this user has no home folder for the cache, and {cache} is not a private "
        f"folder of its own; set GPTLAB_CACHE to a folder you can write")
