"""Decoding speed with and without the KV cache, on a checkpoint or a random-weight shape.

Usage:
    python sample.py --benchmark --preset baby_gpt --lengths 64,248,1024 --json decode.json
    python sample.py --benchmark --preset baby_gpt --compile     # adds the compiled decode step
    python sample.py --benchmark --preset baby_gpt --c-decode    # adds the C decode step
    python -m benchmarks.decode --preset gpt2 --lengths 64

Batch 1, greedy, an 8-token prompt. For every length and path: one warm-up, then the median
of `repeats` timed runs; the first step (prefill of the prompt) and the rest (one token per
step) are timed apart. Greedy outputs of all paths must be identical token for token.
Memory is the peak while a path runs: allocated tensors on CUDA, the resident size of the
whole process on the CPU (weights included), with its growth during that path.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from checkpoint import load_checkpoint, model_from_checkpoint
from model import GPT, GPTConfig
from perf import memory_mb, reset_peak_memory, sync
from sample import DTYPES

PROMPT_LEN = 8


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


def measure(model: GPT, prompt: torch.Tensor, n_new: int, use_kv_cache: bool,
            repeats: int) -> dict:
    device = prompt.device
    timed_generation(model, prompt, n_new, use_kv_cache)  # warm-up
    reset_peak_memory(device)
    before = memory_mb(device)
    runs = [timed_generation(model, prompt, n_new, use_kv_cache) for _ in range(repeats)]
    after = memory_mb(device)
    total = statistics.median(r[0] + r[1] for r in runs)
    row = {
        "new_tokens": n_new,
        "tokens_per_s": n_new / total,
        "prefill_ms": statistics.median(r[0] for r in runs) * 1e3,
        "decode_ms_per_token": statistics.median(r[1] for r in runs) * 1e3 / max(1, n_new - 1),
        "tokens": runs[0][2],
    }
    if before is not None and after is not None:
        row.update(peak_memory_mb=after[1], memory_growth_mb=after[1] - before[0])
    return row


def run_benchmark(checkpoint: Path | None, preset: str | None, device: str, dtype: str,
                  lengths: list[int], repeats: int, json_path: Path | None,
                  compile_decode: bool = False, c_decode: bool = False) -> list[dict]:
    """Measure every path at every length, print a table, and write JSON if asked."""
    if preset is not None:
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(preset)).eval()
        source = f"preset {preset} (random weights)"
    else:
        model = model_from_checkpoint(load_checkpoint(checkpoint))
        source = str(checkpoint)
    model = model.to(device=device, dtype=DTYPES[dtype])
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(0)).to(device)
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    cfg = model.config
    cache_mb = 2 * cfg.n_layer * cfg.block_size * cfg.n_embd * DTYPES[dtype].itemsize / 1e6
    # a generation's cache holds the power of two above its length, at most block_size slots
    print(f"{source}: {model.num_params() / 1e6:.1f}M parameters, {weights_mb:.1f} MB of "
          f"weights, KV cache at most {cache_mb:.1f} MB, block_size {cfg.block_size}, {dtype}, "
          f"{device}, {torch.get_num_threads()} threads")

    # (path, use_kv_cache, compiled decode step or None)
    paths = [("cached", True, None)]
    compile_s = None
    if compile_decode:
        model.compile_decode()
        # the step is built for one cache size, and a generation's cache size follows its
        # length: compile for the first length measured (other sizes compile in their warm-up)
        t0 = time.perf_counter()
        timed_generation(model, prompt, lengths[0], use_kv_cache=True)
        compile_s = time.perf_counter() - t0
        print(f"compiled the decode step in {compile_s:.1f} s (the first generation of "
              f"{lengths[0]} tokens, compile included)")
        paths.append(("compiled", True, model.compiled_decode))
    if c_decode:
        model.compile_decode(backend="c")
        paths.append(("C step", True, model.compiled_decode))
    paths.append(("uncached", False, None))

    print(f"{'new tokens':>10} {'path':>9} {'tokens/s':>9} {'prefill ms':>11} {'ms/token':>9} "
          f"{'speed-up':>9} {'peak MB':>8} {'growth MB':>10} {'identical':>9}")
    rows = []
    for n_new in lengths:
        group = []
        for path, use_kv_cache, decode in paths:
            model.compiled_decode = decode
            group.append({"path": path, **measure(model, prompt, n_new, use_kv_cache, repeats)})
        uncached = group[-1]
        identical = all(row["tokens"] == uncached["tokens"] for row in group)
        for row in group:
            row.update(speedup=row["tokens_per_s"] / uncached["tokens_per_s"], identical=identical)
            memory = (f"{row['peak_memory_mb']:>8.0f} {row['memory_growth_mb']:>10.1f}"
                      if "peak_memory_mb" in row else f"{'-':>8} {'-':>10}")
            print(f"{n_new:>10} {row['path']:>9} {row['tokens_per_s']:>9.1f} "
                  f"{row['prefill_ms']:>11.2f} {row['decode_ms_per_token']:>9.2f} "
                  f"{row['speedup']:>8.1f}x {memory} {str(identical):>9}")
            rows.append({k: v for k, v in row.items() if k != "tokens"})
    if json_path:
        json_path.write_text(json.dumps({
            "source": source, "device": device, "dtype": dtype,
            "threads": torch.get_num_threads(), "compile_s": compile_s, "rows": rows,
        }, indent=2) + "\n")
    return rows


def main(preset: str = "baby_gpt", device: str = "cpu", dtype: str = "float32",
         lengths: str = "64,248,1024", repeats: int = 3, json: Path | None = None,
         compile_decode: Annotated[bool, typer.Option("--compile")] = False,
         c_decode: Annotated[bool, typer.Option("--c-decode")] = False) -> None:
    """Benchmark a random-weight model shape (see model.PRESETS)."""
    run_benchmark(None, preset, device, dtype, [int(n) for n in lengths.split(",")], repeats,
                  json, compile_decode, c_decode)


if __name__ == "__main__":
    typer.run(main)
