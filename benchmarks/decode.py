"""Decoding speed with and without the KV cache, on a checkpoint or a random-weight shape.

Usage:
    python sample.py --benchmark --preset baby_gpt --lengths 64,248,1024 --json decode.json
    python -m benchmarks.decode --preset gpt2 --lengths 64

Batch 1, greedy, an 8-token prompt. For every length: one warm-up, then the median of
`repeats` timed runs; the first step (prefill of the prompt) and the rest (one token per
step) are timed apart. Greedy outputs of both paths must be identical token for token.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import torch
import typer

from checkpoint import load_checkpoint, model_from_checkpoint
from model import GPT, GPTConfig
from sample import DTYPES
PROMPT_LEN = 8


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generation(model: GPT, prompt: torch.Tensor, n_new: int,
                     use_kv_cache: bool) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, tokens) of one greedy generation."""
    device = prompt.device
    tokens, stamps = [], []
    sync(device)
    t0 = time.perf_counter()
    for token in model.stream(prompt, n_new, temperature=0.0, use_kv_cache=use_kv_cache):
        tokens.append(token.item())  # .item() waits for the device, so stamps are honest
        stamps.append(time.perf_counter())
    return stamps[0] - t0, stamps[-1] - stamps[0], tokens


def measure(model: GPT, n_new: int, use_kv_cache: bool, repeats: int) -> dict:
    device = model.lm_head.weight.device
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(0)).to(device)
    timed_generation(model, prompt, n_new, use_kv_cache)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = [timed_generation(model, prompt, n_new, use_kv_cache) for _ in range(repeats)]
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    total = statistics.median(r[0] + r[1] for r in runs)
    row = {
        "new_tokens": n_new,
        "kv_cache": use_kv_cache,
        "tokens_per_s": n_new / total,
        "prefill_ms": prefill * 1e3,
        "decode_ms_per_token": decode * 1e3 / max(1, n_new - 1),
        "tokens": runs[0][2],
    }
    if device.type == "cuda":
        row["peak_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return row


def run_benchmark(checkpoint: Path | None, preset: str | None, device: str, dtype: str,
                  lengths: list[int], repeats: int, json_path: Path | None) -> list[dict]:
    """Measure, print a table, and write the figures as JSON if asked."""
    if preset is not None:
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(preset)).eval()
        source = f"preset {preset} (random weights)"
    else:
        model = model_from_checkpoint(load_checkpoint(checkpoint))
        source = str(checkpoint)
    model = model.to(device=device, dtype=DTYPES[dtype])
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    cfg = model.config
    cache_mb = 2 * cfg.n_layer * cfg.block_size * cfg.n_embd * DTYPES[dtype].itemsize / 1e6
    print(f"{source}: {model.num_params() / 1e6:.1f}M parameters, {weights_mb:.1f} MB of "
          f"weights, KV cache {cache_mb:.1f} MB, block_size {cfg.block_size}, {dtype}, "
          f"{device}, {torch.get_num_threads()} threads")
    print(f"{'new tokens':>10} {'path':>9} {'tokens/s':>9} {'prefill ms':>11} "
          f"{'ms/token':>9} {'speed-up':>9} {'identical':>9}")
    rows = []
    for n_new in lengths:
        cached = measure(model, n_new, True, repeats)
        uncached = measure(model, n_new, False, repeats)
        speedup = cached["tokens_per_s"] / uncached["tokens_per_s"]
        identical = cached["tokens"] == uncached["tokens"]
        for row in (cached, uncached):
            row.update(speedup=speedup, identical=identical)
            print(f"{n_new:>10} {'cached' if row['kv_cache'] else 'uncached':>9} "
                  f"{row['tokens_per_s']:>9.1f} {row['prefill_ms']:>11.2f} "
                  f"{row['decode_ms_per_token']:>9.2f} {speedup if row['kv_cache'] else 1:>8.1f}x "
                  f"{str(identical):>9}")
            rows.append({k: v for k, v in row.items() if k != "tokens"})
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak resident memory of the process: {rss_mb:.0f} MB")
    if json_path:
        json_path.write_text(json.dumps({"source": source, "device": device, "dtype": dtype,
                                         "threads": torch.get_num_threads(),
                                         "peak_rss_mb": rss_mb, "rows": rows}, indent=2) + "\n")
    return rows


def main(preset: str = "baby_gpt", device: str = "cpu", dtype: str = "float32",
         lengths: str = "64,248,1024", repeats: int = 3, json: Path | None = None) -> None:
    """Benchmark a random-weight model shape (see model.PRESETS)."""
    run_benchmark(None, preset, device, dtype, [int(n) for n in lengths.split(",")], repeats, json)


if __name__ == "__main__":
    typer.run(main)
