"""Generate text from a trained checkpoint with the KV-cache sampler.

Usage:
    python sample.py --prompt "ROMEO:"                         # best.pt of the newest run
    python sample.py --run runs/quickstart --num-samples 3 --temperature 0.8 --top-k 40
    python sample.py --benchmark                               # cached vs uncached speed
    python sample.py --benchmark --preset baby_gpt             # random weights, no training
    python sample.py --prompt "ROMEO:" --decode eager          # or compile, c; default auto

The context-window policy past block_size is stated in main's docstring, which is what
`python sample.py --help` prints (one paragraph: typer keeps the line breaks of later ones).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import torch
import typer

from cdecode import BuildError
from checkpoint import load_checkpoint, model_from_checkpoint
from data.sources import decode_text
from generate import DECODE_BACKENDS, check_sampling, decode_step, generate_text
from model import GPT
from precision import DTYPES, resolve_device
from tokenizer import Tokenizer, load_tokenizer


class SampleError(ValueError):
    """Input that sampling cannot use; the message says what to change."""


def resolve_checkpoint(run: str | None, checkpoint: str | None, out_dir: str = "runs") -> Path:
    """--checkpoint as given; else best.pt of --run; else best.pt of the newest run."""
    if checkpoint:
        return Path(checkpoint)
    if run:
        folder = Path(run)
        if not folder.exists() and len(folder.parts) == 1:
            folder = Path(out_dir) / run  # a bare run name, e.g. --run quickstart
        path = folder / "best.pt"
        if not path.is_file():  # most likely a mistyped run name: offer its neighbours
            runs = ", ".join(str(p.parent) for p in sorted(folder.parent.glob("*/best.pt")))
            raise SampleError(f"no checkpoint at {path}; runs in {folder.parent}/ that "
                              f"have one: {runs or 'none'}")
        return path
    candidates = sorted(Path(out_dir).glob("*/best.pt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise SampleError(f"no checkpoint found under {out_dir}/; train first "
                          f"(python train.py --config config/quickstart.toml) or pass --checkpoint")
    return candidates[-1]


def load_model(path: Path, device: str, dtype: str) -> tuple[GPT, Tokenizer]:
    """The checkpoint's model on `device` with weights in `dtype`, and its tokenizer."""
    ckpt = load_checkpoint(path, map_location="cpu")
    model = model_from_checkpoint(ckpt).to(device=device, dtype=DTYPES[dtype])
    return model, load_tokenizer(ckpt["tokenizer"])


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of the prompt; an empty prompt starts from the tokenizer's natural start
    (GPT-2's end-of-text token, or a newline for a character vocabulary)."""
    if prompt:
        try:
            return tokenizer.encode(prompt)
        except ValueError as e:
            raise SampleError(f"prompt: {e}") from None
    if tokenizer.eot_token is not None:
        return [tokenizer.eot_token]
    try:
        return tokenizer.encode("\n")
    except ValueError:  # a character vocabulary without newlines
        return [0]


def write_attention(model: GPT, tokenizer: Tokenizer, ids: list[int], path: Path) -> None:
    """PATH.html and PATH.png for the last block_size tokens of `ids`."""
    from attention import attention_maps, token_labels, write_html, write_png
    ids = ids[-model.config.block_size:]
    maps = attention_maps(model.float(), ids)
    labels = token_labels(tokenizer, ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    html = write_html(maps, labels, path.with_suffix(".html"))
    png = write_png(maps, labels, path.with_suffix(".png"))
    print(f"attention: {html} and {png}", file=sys.stderr)


def main(
    prompt: Annotated[str, typer.Option(help="Text to continue; empty starts from scratch.")] = "",
    prompt_file: Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False, help="Read the prompt from this file instead.")] = None,
    run: Annotated[str | None, typer.Option(
        help="Run folder, or run name under runs/, whose best.pt to load; default: the "
             "newest run.")] = None,
    checkpoint: Annotated[str | None, typer.Option(help="Checkpoint file to load.")] = None,
    init_from: Annotated[str | None, typer.Option(
        help="Sample from a Hugging Face GPT-2 folder (config.json + weights) instead.")] = None,
    num_samples: Annotated[int, typer.Option(min=1, help="Samples to draw.")] = 1,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per sample.")] = 500,
    temperature: Annotated[float, typer.Option(
        help="Softmax temperature; 0 is greedy (always the likeliest token).")] = 0.8,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k likeliest only.")] = None,
    top_p: Annotated[float | None, typer.Option(
        help="Sample among the likeliest tokens whose probability adds up to p, in (0, 1].")] = None,
    stop: Annotated[list[str] | None, typer.Option(
        help="End a sample at this string (repeatable; \\n and \\t mean newline and tab); "
             "found even across tokens.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed gives the same text.")] = 1337,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or mps.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Weights dtype: float32, bfloat16 or float16.")] = "float32",
    kv_cache: Annotated[bool, typer.Option(
        help="Reuse keys/values of past tokens; --no-kv-cache recomputes the window each step.")] = True,
    decode: Annotated[str, typer.Option(
        help="The cached decode step: auto (the C step on a CPU when it builds, else "
             "eager), eager, compile (torch.compile: seconds to tens of seconds to build on a "
             "CPU) or c (cdecode/decode_step.c, built by the system C compiler). With "
             "--benchmark, compile or c adds that row.")] = "auto",
    stream: Annotated[bool, typer.Option(help="Print tokens as they are made.")] = True,
    attention: Annotated[Path | None, typer.Option(
        help="Also write PATH.html (an interactive inspector) and PATH.png (a grid of "
             "heatmaps): the attention of every layer and head over the prompt and the "
             "first sample (its last block_size tokens).")] = None,
    benchmark: Annotated[bool, typer.Option(
        help="Measure cached vs uncached decoding speed instead of sampling.")] = False,
    preset: Annotated[str | None, typer.Option(
        help="With --benchmark: a model shape with random weights (baby_gpt, gpt2, ...).")] = None,
    lengths: Annotated[str, typer.Option(
        help="With --benchmark: new-token counts, comma-separated.")] = "64,248,1024",
    repeats: Annotated[int, typer.Option(min=1, help="With --benchmark: timed runs per case (median).")] = 3,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="With --benchmark: write figures here.")] = None,
    debug: Annotated[bool, typer.Option(help="Show tracebacks for input errors.")] = False,
) -> None:
    """Sample text from a checkpoint, or benchmark the KV cache (--benchmark).
    Context window: the model sees at most block_size tokens. When the next token would not
    fit, the window jumps forward to keep the most recent block_size // 2 tokens, and the
    KV cache is rebuilt from them in one prefill. --no-kv-cache uses the same window, so
    both give the same text.
    """
    try:
        if dtype not in DTYPES:
            raise SampleError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        device = str(resolve_device(device))  # a DeviceError names what to use instead
        check_sampling(temperature, top_k, top_p)
        if decode not in DECODE_BACKENDS:
            raise SampleError(f"--decode must be one of {', '.join(DECODE_BACKENDS)}, "
                              f"got {decode!r}")
        if decode != "auto" and not kv_cache:
            raise SampleError(f"--decode {decode} chooses the cached decode step; drop "
                              f"--no-kv-cache or --decode")
        # a shell passes "\n" as backslash and n; a stop string almost always means a newline
        stops = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in stop or ())
        if any(not s for s in stops):
            raise SampleError("--stop is empty, which would end every sample at once; give "
                              "some text or drop it")
        if benchmark:
            from benchmarks.decode import run_benchmark  # keeps the sampling path light
            run_benchmark(resolve_checkpoint(run, checkpoint) if preset is None else None,
                          preset, device, dtype, [int(n) for n in lengths.split(",")], repeats,
                          json_path, decode)
            return
        if init_from:
            from gpt2 import load_hf_gpt2
            from tokenizer import GPT2Tokenizer
            model = load_hf_gpt2(init_from).to(device=device, dtype=DTYPES[dtype])
            tokenizer = GPT2Tokenizer()
            if model.config.vocab_size < tokenizer.vocab_size:
                raise SampleError(f"{init_from} has a vocabulary of {model.config.vocab_size:,} "
                                  f"tokens, fewer than GPT-2's {tokenizer.vocab_size:,}: "
                                  f"--init-from samples with GPT-2's tokenizer only")
        else:
            model, tokenizer = load_model(resolve_checkpoint(run, checkpoint), device, dtype)
        text = decode_text(prompt_file.read_bytes(), str(prompt_file)) if prompt_file else prompt
        ids = prompt_ids(tokenizer, text)
        step = decode_step(model, decode) if kv_cache else None
    # SampleError, CheckpointError, the model's sampling checks, and a C step that cannot build
    except (ValueError, BuildError) as e:
        if debug:
            raise
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None

    generator = torch.Generator(device=device).manual_seed(seed)
    first_sample = ""
    for i in range(num_samples):
        pieces = generate_text(model, tokenizer, ids, max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, use_kv_cache=kv_cache,
                               generator=generator, stop=stops, decode=step or "eager")
        sys.stdout.write(text)
        generated = []
        for piece in pieces:
            generated.append(piece)
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        if not stream:
            sys.stdout.write("".join(generated))
        sys.stdout.write("\n" if i == num_samples - 1 else "\n---------------\n")
        first_sample = first_sample or "".join(generated)
    sys.stdout.flush()
    if attention is not None:
        write_attention(model, tokenizer, ids + tokenizer.encode(first_sample), attention)


if __name__ == "__main__":
    typer.run(main)
