"""The GPU path, tested where a CUDA GPU is available and skipped everywhere else, CI
included: training in bf16 and in fp16 (with the gradient scaler) follows fp32, --compile
follows eager, torchrun trains under NCCL (FSDP too), a checkpoint written on the GPU runs
on the CPU, and cached decoding gives the uncached tokens past block_size."""

import json
import math
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from benchmarks.train import read_scalars
from generate import compiled_step, decode_step, generate
from model import GPT, GPTConfig
from train import TrainResult, train
from training.config import TrainConfig
from weights.checkpoint import load_checkpoint
from weights.loading import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parent.parent


def val_losses(run_dir: Path) -> list[float]:
    return [e.value for e in read_scalars(run_dir)["loss/val"]]


def uniform_guess(data_dir: Path | str) -> float:
    """The loss of a model that gives each of the data's tokens the same probability."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return math.log(meta["tokenizer"]["vocab_size"])


def train_on_gpu(cfg: TrainConfig, **changes) -> TrainResult:
    """The tiny preset on the GPU for 60 iterations (each call writes a new run folder)."""
    return train(cfg.updated(**{"device": "cuda", "max_iters": 60, "eval_interval": 30,
                                **changes}))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_half_precision_training_follows_fp32(tiny_config, optimizer):
    fp32 = val_losses(train_on_gpu(tiny_config, optimizer=optimizer, dtype="float32").run_dir)
    for dtype in ("bfloat16", "float16"):
        result = train_on_gpu(tiny_config, optimizer=optimizer, dtype=dtype)
        half = val_losses(result.run_dir)
        assert half[-1] < min(half[0], uniform_guess(tiny_config.data_dir) - 1.0)  # it learns
        assert abs(half[-1] - fp32[-1]) < 0.1, (dtype, half, fp32)
        ckpt = load_checkpoint(result.run_dir / "last.pt")
        assert ckpt["dtype"] == dtype
        # fp16 needs the gradient scaler, and a resume needs its state; bf16 has fp32's range
        assert ("scale" in ckpt["scaler"]) == (dtype == "float16")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_compiled_training_follows_eager(tiny_config, accumulation, monkeypatch):
    # without accumulation the compiled step replays as CUDA graphs, with it as plain kernels
    short = {"max_iters": 20, "eval_interval": 10, "gradient_accumulation_steps": accumulation}
    eager = val_losses(train_on_gpu(tiny_config, **short).run_dir)
    from torch._dynamo.utils import counters  # the compiler's, imported only where a GPU is
    modes, real_compile = [], torch.compile

    def compile_noting_mode(fn, **options):  # the model's mode (check_compile compiles a function first)
        if isinstance(fn, torch.nn.Module):
            modes.append(options.get("mode"))
        return real_compile(fn, **options)
    monkeypatch.setattr(torch, "compile", compile_noting_mode)
    skips = counters["inductor"]["cudagraph_skips"]
    compiled = val_losses(train_on_gpu(tiny_config, **short, compile=True).run_dir)
    assert compiled == pytest.approx(eager, abs=1e-2)
    assert modes == ["reduce-overhead" if accumulation == 1 else None]
    assert counters["inductor"]["cudagraph_skips"] == skips  # the compiler used the graphs it was asked for


def test_torchrun_trains_one_process_under_nccl(tmp_path, char_data):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         "train.py", "--config", "config/tiny.toml", "--data-dir", str(char_data),
         "--out-dir", str(tmp_path), "--device", "cuda", "--max-iters", "20",
         "--eval-interval", "10"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "device cuda:0 x 1 process," in result.stdout
    assert "done: 20 iters" in result.stdout


@pytest.mark.parametrize("compile", [False, True])
def test_fsdp_trains_under_nccl_in_bf16_compiled_or_not(tmp_path, char_data, compile):
    # FSDP's mixed precision (bf16 weights, fp32 reductions); with --compile, each block is
    # compiled before it is sharded
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
         "train.py", "--config", "config/tiny.toml", "--data-dir", str(char_data),
         "--out-dir", str(tmp_path), "--device", "cuda", "--dtype", "bfloat16",
         "--parallel", "fsdp", "--max-iters", "20", "--eval-interval", "10",
         *(["--compile"] if compile else [])],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: 20 iters" in result.stdout
    losses = val_losses(tmp_path / "tiny")
    assert losses[-1] < min(losses[0], uniform_guess(char_data) - 0.5)  # it learns


@contextmanager
def full_fp32():
    """Run fp32 matmuls in full fp32 rather than TF32, which training turns on for the whole
    process (as nanoGPT does)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_a_checkpoint_written_on_the_gpu_runs_on_the_cpu(tiny_config):
    result = train_on_gpu(tiny_config, max_iters=20, eval_interval=10, dtype="bfloat16")
    checkpoint = str(result.run_dir / "best.pt")
    on_cpu, tokenizer, _ = load_model(checkpoint=checkpoint, device="cpu")
    on_gpu, _, _ = load_model(checkpoint=checkpoint, device="cuda")
    idx = torch.tensor([tokenizer.encode("ROMEO: Juliet loves the moon.")])
    with torch.inference_mode(), full_fp32():
        logits_cpu = on_cpu(idx)[0]
        logits_gpu = on_gpu(idx.cuda())[0].cpu()
    torch.testing.assert_close(logits_gpu, logits_cpu, rtol=1e-4, atol=1e-4)
    sampled = subprocess.run([sys.executable, "sample.py", "--checkpoint", checkpoint,
                              "--device", "cpu", "--prompt", "ROMEO:", "--max-new-tokens", "40"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) > 40


@pytest.mark.parametrize("decode", ["auto", "eager", "compile", "compile without CUDA graphs"])
def test_cached_decoding_gives_the_uncached_tokens_past_block_size(decode):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32))
    model = model.cuda().eval()
    step = (compiled_step(model, cuda_graphs=False) if decode.endswith("graphs")
            else decode_step(model, decode))
    # 3 sequences of 4 + 40 tokens with block_size 16, so the window jumps and is prefilled again
    prompts = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2)).cuda()
    with full_fp32():
        uncached = generate(model, prompts, 40, temperature=0.0, use_kv_cache=False)
        # twice with the same step, because the second generation's new cache makes a CUDA graph
        # record again
        for _ in range(2):
            cached = generate(model, prompts, 40, temperature=0.0, decode=step)
            assert cached.shape == (3, 44) and torch.equal(cached, uncached)
