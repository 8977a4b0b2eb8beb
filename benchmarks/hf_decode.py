"""Decoding speed of this project's generate against transformers' generate, same weights.

Usage:
    python -m benchmarks.hf_decode [--new-tokens 64] [--repeats 3]

Random GPT-2 small weights (124M), batch 1, greedy, an 8-token prompt, with and without a
KV cache in both implementations, timed in one process. transformers is a test-only
dependency (requirements-dev.txt).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import typer
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2 import load_hf_gpt2


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(new_tokens: int = 64, repeats: int = 3) -> None:
    """Print tokens/s of both implementations, cached and uncached, and their ratios."""
    torch.manual_seed(0)
    theirs = GPT2LMHeadModel(GPT2Config()).eval()
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = load_hf_gpt2(folder)
    prompt = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))
    print(f"GPT-2 small shape, random weights, {new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {repeats}")
    for cache in (True, False):
        with torch.inference_mode():
            t_ours = median_seconds(lambda: ours.generate(prompt, new_tokens, temperature=0.0,
                                                          use_kv_cache=cache), repeats)
            t_theirs = median_seconds(lambda: theirs.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                use_cache=cache, pad_token_id=50256), repeats)
        print(f"{'cached' if cache else 'uncached':>9}: ours {new_tokens / t_ours:6.1f} tokens/s, "
              f"transformers {new_tokens / t_theirs:6.1f} tokens/s, ratio {t_theirs / t_ours:.2f}x")


if __name__ == "__main__":
    typer.run(main)
