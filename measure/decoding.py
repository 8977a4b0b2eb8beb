"""Decoding speed of every path, on a checkpoint or a random-weight shape.

Usage:
    python sample.py --benchmark --preset baby_gpt --lengths 64,248,1024 --json decode.json
    python sample.py --benchmark --preset baby_gpt --decode compile   # adds the compiled step
    python sample.py --benchmark --preset gpt2 --device cuda --decode compile --batch 8
    python -m benchmarks.decode --preset gpt2 --lengths 64

Decoding is greedy from an 8-token prompt, at batch 1 unless --batch says otherwise;
tokens/s counts the tokens of every sequence. With a longer prompt (--prompt-len, in
`python -m benchmarks.decode`), tokens/s is that of decoding alone from a context that long:
each timed run is the time of n_new tokens minus that of one token, which includes the prefill.

The rows: the default path (decode="auto", labelled with what it chose), the eager cached
step, the compiled or C step when --decode names it (on a GPU, compiled with and without
CUDA graphs), the uncached path, and transformers' generate on the same weights when
transformers is installed (up to block_size tokens, where its position table ends; not for
int8, which it cannot load). For every length and path: one warm-up, then the median of
`repeats` timed runs. Every row says whether its greedy tokens are identical to the
uncached path's. Memory is the peak while a path runs (allocated tensors on CUDA; on the
CPU, the resident size of the whole process, weights included), and how much it grew during
that path.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cdecode import CDecodeStep
from generate import DecodeStep, cache_length, compiled_step, decode_step, stream
from machine.errors import InputError
from machine.files import write_bytes_atomic
from machine.perf import check_room, out_of_memory, sync
from measure.memory import cache_bytes_per_token, decode_needs, memory_mb, reset_peak_memory
from model import GPT, GPTConfig
from weights.checkpoint import load_checkpoint
from weights.loading import load_folder, model_from_checkpoint
from weights.quantize import cast_weights, weight_bytes

PROMPT_LEN = 8
Tokens = Callable[[torch.Tensor, int], list[list[int]]]  # (prompt, n_new) -> (B, n_new) ids


def parse_lengths(text: str) -> list[int]:
    """--lengths: counts of new tokens, comma-separated, each at least 1."""
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise InputError(f"--lengths takes counts of new tokens separated by commas, each at "
                         f"least 1, like 64,248,1024; got {text!r}")
    return lengths


def ours(model: GPT, step: DecodeStep | None) -> Tokens:
    """Greedy generation through `stream` with this decode step, or uncached if it is None."""
    def run(prompt: torch.Tensor, n_new: int) -> list[list[int]]:
        tokens = stream(model, prompt, n_new, temperature=0.0, use_kv_cache=step is not None,
                        decode=step or "eager")
        # each step's copy to the CPU waits for the device, as streaming text does
        return torch.cat([t.cpu() for t in tokens], dim=1).tolist()
    return run


def transformers_generate(model: GPT) -> Tokens | None:
    """transformers' greedy generate on the same weights (exported to GPT-2's format or
    NanoChat's, as the layout allows), or None if it is not installed or neither format fits."""
    try:
        import transformers
    except ImportError:
        return None
    from weights.gpt2 import export_hf_gpt2, gpt2_problem
    from weights.nanochat import export_hf_nanochat, nanochat_problem
    gpt2 = gpt2_problem(model.config) is None
    if not gpt2 and nanochat_problem(model.config):
        return None
    export = export_hf_gpt2 if gpt2 else export_hf_nanochat
    # silence its progress bars and its notes
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        export(copy.deepcopy(model).float(), folder, force=True)  # .float() casts in place
        # the modeling file that a NanoChat export with a bigram table carries runs only with
        # trust_remote_code; without one it is transformers' own class either way
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True).eval()
    p = model.lm_head.weight
    theirs = theirs.to(device=p.device, dtype=p.dtype)

    @torch.inference_mode()
    def run(prompt: torch.Tensor, n_new: int) -> list[list[int]]:
        out = theirs.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, use_cache=True, pad_token_id=0)
        return out[:, prompt.size(1):].tolist()
    return run


def timed(run: Tokens, prompt: torch.Tensor, n_new: int) -> tuple[float, list[list[int]]]:
    sync(prompt.device)
    t0 = time.perf_counter()
    tokens = run(prompt, n_new)
    sync(prompt.device)
    return time.perf_counter() - t0, tokens


def measure(run: Tokens, prompt: torch.Tensor, n_new: int, repeats: int) -> dict:
    """The median speed of `repeats` runs after one warm-up, and the memory they took. After
    a prompt longer than PROMPT_LEN, time decoding alone by subtracting from each run the time
    of a one-token run (the prefill and the first token)."""
    device = prompt.device
    decode_only = prompt.size(1) > PROMPT_LEN
    run(prompt, n_new)  # warm-up
    reset_peak_memory(device)
    before = memory_mb(device)
    times, tokens = [], []
    for _ in range(repeats):
        seconds, tokens = timed(run, prompt, n_new)
        times.append(seconds - timed(run, prompt, 1)[0] if decode_only else seconds)
    after = memory_mb(device)
    counted = n_new - 1 if decode_only else n_new
    row = {"new_tokens": n_new,
           "tokens_per_s": prompt.size(0) * counted / statistics.median(times),
           "tokens": tokens}
    if before is not None and after is not None:
        row.update(peak_memory_mb=after[1], memory_growth_mb=after[1] - before[0])
    return row


# the named shapes that a benchmark builds with random weights, and the layouts it gives
# them: GPT-2's; the modern one (RoPE, RMSNorm, QK norm, relu^2, an untied head); nanochat's
PRESETS = {
    "baby_gpt": dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
    "nanochat-d12": dict(vocab_size=65536, block_size=2048, n_layer=12, n_head=6, n_embd=768),
}
MODERN = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2", tie_embeddings=False)
LAYOUTS = {"gpt2": {}, "modern": MODERN, "nanochat": {
    **MODERN, "bias": False, "embed_norm": True, "logit_softcap": 15.0, "norm_eps": 1e-6}}


def preset_config(name: str, **switches: Any) -> GPTConfig:
    """A named shape from PRESETS, e.g. preset_config("gpt2"), with the switches given."""
    if name not in PRESETS:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **switches})


def benchmark_model(checkpoint: Path | None, preset: str | None, layout: str,
                    n_kv_head: int, init_from: str | None = None) -> tuple[GPT, str]:
    """The model to time and a line saying what it is: a Hugging Face folder's model, a
    checkpoint's, or a preset's shape with random weights, in `layout` (LAYOUTS) and
    with n_kv_head key/value heads (0 means n_head)."""
    if init_from:
        return load_folder(init_from)[0], init_from
    if preset is None:
        return model_from_checkpoint(load_checkpoint(checkpoint)), str(checkpoint)
    torch.manual_seed(0)
    try:
        config = preset_config(preset, **LAYOUTS[layout], n_kv_head=n_kv_head)
    except ValueError as e:  # an unknown preset, or an n_kv_head that does not divide n_head
        raise InputError(f"--preset {preset}: {e}") from None
    model = GPT(config).eval()
    return model, (f"preset {preset}, {layout} layout, n_kv_head {model.config.n_kv_head} "
                   f"(random weights)")


def check_cache_memory(model: GPT, batch: int, prompt_len: int, lengths: list[int],
                       device: str, steps: list[DecodeStep]) -> None:
    """Refuse a batch whose KV cache, logits and C step's scratch cannot fit, before any is
    allocated, because it would swap a CPU to a standstill. steps are the decode steps that
    will be timed; a C step among them takes scratch."""
    cfg = model.config
    c_steps = [step for step in steps if isinstance(step, CDecodeStep)]
    longest = max((step.max_prefill for step in c_steps), default=0)
    c_step = bool(c_steps)
    # the C step prefills the whole batch's prompts in one call when they are short enough
    prefill = prompt_len if c_step and prompt_len <= longest else 1
    needs = decode_needs(model, batch, cache_length(prompt_len, max(lengths), cfg.block_size),
                         c_step_tokens=batch * prefill if c_step else 0)
    needs[f"the prompts of {prompt_len:,} ids"] = batch * prompt_len * 8
    fix = "lower --batch" + (" or --prompt-len" if prompt_len > PROMPT_LEN else "")
    check_room(f"--batch {batch}", needs, torch.device(device), fix, InputError)


def decoding_paths(model: GPT, default: DecodeStep, device: str, decode: str, baselines: bool,
                   prompt: torch.Tensor, first_length: int) -> tuple[dict[str, Tokens], float | None]:
    """The paths to time, by row name, and the seconds the compiled step took to build; default
    is the step that a user gets without choosing."""
    paths: dict[str, Tokens] = {f"default ({default.name})": ours(model, default)}
    if baselines:
        paths["eager"] = ours(model, decode_step(model, "eager"))
    compile_s = None
    if decode == "compile":
        step = decode_step(model, "compile")
        # the step is built for one cache size, and a generation's cache size follows its
        # length, so compile for the first length measured (others compile in their warm-up)
        t0 = time.perf_counter()
        ours(model, step)(prompt, first_length)
        compile_s = time.perf_counter() - t0
        print(f"compiled the decode step in {compile_s:.1f} s (the first generation of "
              f"{first_length} tokens, compile included)")
        paths["compiled"] = ours(model, step)
        if torch.device(device).type == "cuda":  # to show what the CUDA graphs add
            paths["compiled, no graphs"] = ours(model, compiled_step(model, cuda_graphs=False))
    if decode == "c" and default.name != "C step":
        paths["C step"] = ours(model, decode_step(model, "c"))
    if baselines:
        paths["uncached"] = ours(model, None)
    return paths, compile_s


def measure_rows(paths: dict[str, Tokens], theirs: Tokens | None, prompt: torch.Tensor,
                 lengths: list[int], repeats: int, block_size: int) -> list[dict]:
    """Time every path at every length and print the table as it goes, comparing each row's
    speed and tokens with the uncached path's where that path ran."""
    print(f"{'new tokens':>10} {'path':>18} {'tokens/s':>9} {'vs uncached':>11} "
          f"{'peak MB':>8} {'growth MB':>10} {'identical':>9}")
    rows = []
    for n_new in lengths:
        group = [{"path": name, **measure(run, prompt, n_new, repeats)}
                 for name, run in paths.items()]
        if theirs is not None and prompt.size(1) + n_new <= block_size:
            group.append({"path": "transformers", **measure(theirs, prompt, n_new, repeats)})
        uncached = next((row for row in group if row["path"] == "uncached"), None)
        for row in group:
            if uncached is not None:
                row.update(speedup=row["tokens_per_s"] / uncached["tokens_per_s"],
                           identical=row["tokens"] == uncached["tokens"])
            else:
                row.update(speedup=float("nan"), identical=None)
            memory = (f"{row['peak_memory_mb']:>8.0f} {row['memory_growth_mb']:>10.1f}"
                      if "peak_memory_mb" in row else f"{'-':>8} {'-':>10}")
            speedup = f"{row['speedup']:>10.1f}x" if uncached is not None else f"{'-':>11}"
            print(f"{n_new:>10} {row['path']:>18} {row['tokens_per_s']:>9.1f} "
                  f"{speedup} {memory} {str(row['identical'] if uncached else '-'):>9}")
            rows.append({k: v for k, v in row.items() if k != "tokens"})
    return rows


def run_benchmark(checkpoint: Path | None, preset: str | None, device: str, dtype: str,
                  lengths: list[int], repeats: int, json_path: Path | None,
                  decode: str = "auto", batch: int = 1, layout: str = "gpt2",
                  n_kv_head: int = 0, baselines: bool = True,
                  prompt_len: int = PROMPT_LEN, init_from: str | None = None) -> list[dict]:
    """Measure every path at every length, print a table, and write JSON if asked. Without
    baselines, only the default path runs, with no eager, uncached or transformers rows,
    which are slow at GPT-2's shape."""
    model, source = benchmark_model(checkpoint, preset, layout, n_kv_head, init_from)
    n_params = model.num_params()  # before int8 turns the matrices into buffers
    model = cast_weights(model.to(device), dtype)
    cfg, kv_bytes = model.config, cache_bytes_per_token(model)
    default = decode_step(model)  # built before the check, which counts a C step's scratch
    c_too = decode == "c" and not isinstance(default, CDecodeStep)  # a "C step" row as well
    check_cache_memory(model, batch, prompt_len, lengths, device,
                       [default, *([decode_step(model, "c")] if c_too else [])])
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)
    # a generation's cache holds the power of two above its length, at most block_size slots
    print(f"{source}: {n_params / 1e6:.1f}M parameters, {weight_bytes(model) / 1e6:.1f} MB of "
          f"weights, KV cache {kv_bytes:,} bytes per token, at most "
          f"{batch * cfg.block_size * kv_bytes / 1e6:.1f} MB, block_size {cfg.block_size}, "
          f"{dtype}, {device}, batch {batch}, {torch.get_num_threads()} threads, a "
          f"{prompt_len}-token prompt"
          f"{' (tokens/s: decoding alone)' if prompt_len > PROMPT_LEN else ''}")
    # the check counts the buffers a cached decode allocates, and the baselines take more
    with out_of_memory(f"--batch {batch}", torch.device(device), "lower --batch", InputError):
        paths, compile_s = decoding_paths(model, default, device, decode, baselines, prompt,
                                          lengths[0])
        theirs = transformers_generate(model) if dtype != "int8" and baselines else None
        rows = measure_rows(paths, theirs, prompt, lengths, repeats, cfg.block_size)
    if json_path:
        write_bytes_atomic(json_path, (json.dumps({
            "source": source, "device": device, "dtype": dtype, "batch": batch,
            "prompt_len": prompt_len, "kv_cache_bytes_per_token": kv_bytes,
            "threads": torch.get_num_threads(), "compile_s": compile_s, "rows": rows,
        }, indent=2) + "\n").encode())
    return rows
