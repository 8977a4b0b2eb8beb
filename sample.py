"""Generate text from a trained checkpoint with the KV-cache sampler.

Usage:
    python sample.py --prompt "ROMEO:"                         # best.pt of the newest run
    python sample.py --run runs/quickstart --num-samples 3 --temperature 0.8 --top-k 40
    python sample.py --benchmark                               # cached vs uncached speed
    python sample.py --benchmark --preset baby_gpt             # random weights, no training
    python sample.py --prompt "ROMEO:" --decode eager          # or compile, c; default auto
    python sample.py --run runs/chat_sft --chat                # talk to a fine-tuned model

The context-window policy past block_size is stated in main's docstring, which is what
`python sample.py --help` prints. It is one paragraph because typer keeps the line breaks of
any later ones.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, BinaryIO

import torch
import typer

from cli.options import (
    CheckpointOption,
    DebugOption,
    DecodeOption,
    DeviceOption,
    DtypeOption,
    InitFromOption,
    RunOption,
    TemperatureOption,
    TopKOption,
    TopPOption,
    check_output_file,
)
from data.documents import decode_text
from data.sources import DataError
from data.tokenizer import Tokenizer
from generate import Chat, check_decode, check_sampling, decode_step, generate_text, prompt_ids
from machine.device import resolve_device
from machine.errors import InputError, UserError, reported, run_command
from machine.files import probe_writable
from model import GPT
from training.config import check_seed
from weights.loading import load_model, resolve_checkpoint
from weights.quantize import check_weight_dtype


def prompt_text(prompt: str, prompt_file: Path | None) -> str:
    """--prompt-file's text, else --prompt's. The shell's bytes are decoded as the file's
    are, so text that is not UTF-8 is refused from both (Python would otherwise pass it on
    as the surrogates U+DC80-U+DCFF)."""
    if prompt_file:
        return decode_text(prompt_file.read_bytes(), str(prompt_file))
    return decode_text(os.fsencode(prompt), "--prompt")


def check_settings(dtype: str, temperature: float, top_k: int | None, top_p: float | None,
                   seed: int, decode: str, kv_cache: bool) -> None:
    """The options that need no model, checked before one is loaded."""
    check_weight_dtype(dtype)  # here, not only in load_model, because --benchmark loads none
    check_sampling(temperature, top_k, top_p)
    check_seed(seed)
    check_decode(decode, "--decode")
    if decode != "auto" and not kv_cache:  # a decode step steps through the cache
        raise UserError(f"--decode {decode} chooses the cached decode step; drop "
                        f"--no-kv-cache or --decode")


def stop_strings(stop: list[str]) -> tuple[str, ...]:
    """--stop's strings, with \\n and \\t read as a newline and a tab, because a shell passes
    "\\n" as a backslash and an n, and a stop string almost always means a newline. The shell's
    bytes are decoded as --prompt's are (prompt_text)."""
    stops = tuple(decode_text(os.fsencode(s), "--stop").replace("\\n", "\n").replace("\\t", "\t")
                  for s in stop)
    if any(not s for s in stops):
        raise UserError("--stop is empty, which would end every sample at once; give "
                        "some text or drop it")
    return stops


def print_samples(draw: Callable[[], Iterator[str]], prompt: str, num_samples: int,
                  stream: bool) -> str:
    """Print num_samples continuations of the prompt, each drawn by `draw` (pieces of text)
    after the prompt, with a rule between them; return the first continuation."""
    samples = []
    for i in range(num_samples):
        sys.stdout.write(prompt)
        pieces = []
        for piece in draw():
            pieces.append(piece)
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        if not stream:
            sys.stdout.write("".join(pieces))
        sys.stdout.write("\n" if i == num_samples - 1 else "\n---------------\n")
        samples.append("".join(pieces))
    sys.stdout.flush()
    return samples[0]


def attention_target(path: str) -> Path:
    """Where --attention PATH writes PATH.html and PATH.png: inside PATH when it is a folder
    or ends with a slash (as attention.html and .png), beside it otherwise. The folder is
    made and tested now, so a path that cannot be written fails before sampling, not after."""
    target = Path(path)
    if path.endswith(("/", "\\")) or target.is_dir():
        target = target / "attention"
    try:
        probe_writable(target.parent)
    except OSError as e:
        raise UserError(f"--attention cannot write to {target.parent} ({e.strerror}); "
                        f"choose another path") from None
    return target


def write_attention(model: GPT, tokenizer: Tokenizer, ids: list[int], path: Path) -> None:
    """PATH.html and PATH.png for the last block_size tokens of `ids`."""
    from viz.attention_maps import attention_maps, token_labels, write_html, write_png
    ids = ids[-model.config.block_size:]
    maps = attention_maps(model.float(), ids)
    labels = token_labels(tokenizer, ids)
    try:
        html = write_html(maps, labels, path.with_suffix(".html"))
        png = write_png(maps, labels, path.with_suffix(".png"))
    except OSError as e:  # a disk that filled since the check; no file is left half-written
        raise UserError(f"--attention could not write {path} ({e.strerror})") from None
    print(f"attention: {html} and {png}", file=sys.stderr)


def benchmark_decoding(run: str | None, checkpoint: str | None, init_from: str | None,
                       preset: str | None, device: str, dtype: str, lengths: str, repeats: int,
                       json_path: Path | None, decode: str, batch: int, layout: str,
                       n_kv_head: int) -> None:
    """--benchmark: time every decoding path on the model sample.py would load (a run, a
    checkpoint, a Hugging Face folder), or on a preset's shape."""
    if preset is not None and (run or checkpoint or init_from):
        raise UserError("--preset times random weights of a named shape; drop --run, "
                        "--checkpoint and --init-from, or drop --preset")
    # imported here to keep the sampling path light
    from measure.decoding import LAYOUTS, parse_lengths, run_benchmark
    if layout not in LAYOUTS:
        raise UserError(f"--layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if json_path is not None:  # checked now, not after the benchmark
        check_output_file(json_path, "--json")
    from_run = preset is None and not init_from
    run_benchmark(resolve_checkpoint(run, checkpoint) if from_run else None, preset, device,
                  dtype, parse_lengths(lengths), repeats, json_path, decode, batch, layout,
                  n_kv_head, init_from=init_from)


def open_chat(run: str | None, checkpoint: str | None, init_from: str | None, device: str,
              dtype: str, prompted: bool, **settings: Any) -> Chat:
    """--chat's conversation with the model that sample.py would load."""
    if prompted:
        raise UserError("--chat reads its turns from stdin; drop --prompt, --prompt-file, "
                        "--stop, --attention and --num-samples")
    loaded: list[str] = []
    model, tokenizer, _ = load_model(run, checkpoint, init_from, device, dtype, prefer="chat",
                                     say=loaded.append)
    chat = Chat(model, tokenizer, **settings)
    say(loaded)
    return chat


def say(lines: list[str]) -> None:
    """Print notes (what was loaded) on stderr once the command's checks have passed, so
    that stdout holds the samples alone and a refusal is its one line alone."""
    for line in lines:
        print(line, file=sys.stderr)


def chat_loop(chat: Chat, lines: BinaryIO | None = None) -> None:
    """--chat: each line is a user turn, and each reply is streamed to stdout on a line of
    its own. Notes and errors go to stderr, so a pipe's output holds the replies alone. A
    line that cannot be a turn (not UTF-8, unknown characters, too long) gets one line on
    stderr, and the conversation goes on."""
    if sys.stdin.isatty():
        print("chat: a line is a turn; /reset starts over, /system TEXT starts over with a "
              "system message, /quit or Ctrl-D ends", file=sys.stderr)
    for line in lines or sys.stdin.buffer:
        try:
            text = decode_text(line, "stdin").rstrip("\r\n")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        command, _, argument = text.partition(" ")
        if command == "/quit":
            return
        if command in ("/reset", "/system"):
            chat.reset(argument.strip() or None if command == "/system" else chat.system)
            print(f"({'system message set; ' if command == '/system' else ''}"
                  f"a new conversation)", file=sys.stderr)
            continue
        if not text.strip():
            continue
        try:
            dropped = chat.add_user(text)
        except InputError as e:  # characters the vocabulary lacks, a turn too long
            print(f"error: {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"(the context is full: the {dropped} oldest turn{'s' * (dropped > 1)} "
                  f"dropped)", file=sys.stderr)
        for piece in chat.reply():
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()


# The options, one per line; each one's help is its documentation (python sample.py --help).
# Those that serve.py and evaluate.py take too are declared in cli/options.py.
PromptOption = Annotated[str, typer.Option(help="Text to continue; empty starts from scratch.")]
PromptFileOption = Annotated[Path | None, typer.Option(
        exists=True, dir_okay=False, help="Read the prompt from this file instead.")]
NumSamplesOption = Annotated[int, typer.Option(min=1, help="Samples to draw.")]
MaxNewTokensOption = Annotated[int, typer.Option(min=1, help="Tokens per sample.")]
StopOption = Annotated[list[str] | None, typer.Option(
        help="End a sample at this string (repeatable; \\n and \\t mean newline and tab); "
             "found even across tokens.")]
SeedOption = Annotated[int, typer.Option(help="Random seed: the same seed gives the same text.")]
KvCacheOption = Annotated[bool, typer.Option(
        help="Reuse keys/values of past tokens; --no-kv-cache recomputes the window each step.")]
StreamOption = Annotated[bool, typer.Option(help="Print tokens as they are made.")]
SkipSpecialTokensOption = Annotated[bool, typer.Option(
        help="Leave special tokens (<|assistant_end|>, <|bos|>) out of the text, as vLLM and "
             "llama.cpp do; --no-skip-special-tokens writes them.")]
AttentionOption = Annotated[str | None, typer.Option(
        help="Also write PATH.html (an interactive inspector) and PATH.png (a grid of "
             "heatmaps): the attention of every layer and head over the prompt and the "
             "first sample (its last block_size tokens). A folder gets attention.html and "
             ".png inside it.")]
ChatOption = Annotated[bool, typer.Option(
        help="Talk to a chat model (fine-tuned on conversations): one user turn a line from "
             "stdin, a terminal or a pipe; /reset, /system TEXT, /quit, Ctrl-D to end.")]
BenchmarkOption = Annotated[bool, typer.Option(
        help="Measure cached vs uncached decoding speed instead of sampling; --decode compile "
             "or c adds that step's row.")]
PresetOption = Annotated[str | None, typer.Option(
        help="With --benchmark: a model shape with random weights (baby_gpt, gpt2, ...).")]
LengthsOption = Annotated[str, typer.Option(
        help="With --benchmark: new-token counts, comma-separated.")]
RepeatsOption = Annotated[int, typer.Option(min=1, help="With --benchmark: timed runs per case (median).")]
BatchOption = Annotated[int, typer.Option(
        min=1, help="With --benchmark: sequences decoded together.")]
LayoutOption = Annotated[str, typer.Option(
        help="With --benchmark --preset: gpt2, modern or nanochat (measure/decoding.py's LAYOUTS).")]
NKvHeadOption = Annotated[int, typer.Option(
        min=0, help="With --benchmark --preset: key/value heads (GQA); 0: n_head.")]
JsonPathOption = Annotated[Path | None, typer.Option(
        "--json", help="With --benchmark: write figures here.")]


def main(
    prompt: PromptOption = "",
    prompt_file: PromptFileOption = None,
    run: RunOption = None,
    checkpoint: CheckpointOption = None,
    init_from: InitFromOption = None,
    num_samples: NumSamplesOption = 1,
    max_new_tokens: MaxNewTokensOption = 500,
    temperature: TemperatureOption = 0.8,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    stop: StopOption = None,
    seed: SeedOption = 1337,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    kv_cache: KvCacheOption = True,
    decode: DecodeOption = "auto",
    stream: StreamOption = True,
    skip_special_tokens: SkipSpecialTokensOption = True,
    attention: AttentionOption = None,
    chat: ChatOption = False,
    benchmark: BenchmarkOption = False,
    preset: PresetOption = None,
    lengths: LengthsOption = "64,248,1024",
    repeats: RepeatsOption = 3,
    batch: BatchOption = 1,
    layout: LayoutOption = "gpt2",
    n_kv_head: NKvHeadOption = 0,
    json_path: JsonPathOption = None,
    debug: DebugOption = False,
) -> None:
    """Sample text from a checkpoint, talk to a chat model (--chat), or benchmark the KV cache
    (--benchmark). Context window: when the next token would not fit in block_size, the window
    jumps forward to keep the most recent block_size // 2 tokens, rebuilding the KV cache in
    one prefill; --no-kv-cache uses the same window, so both give the same text."""
    # each of these is reported in one line: bad options, a model that cannot load, a C step
    # that cannot build, a refused path
    with reported(debug=debug):
        check_settings(dtype, temperature, top_k, top_p, seed, decode, kv_cache)
        device = str(resolve_device(device))  # a DeviceError names what to use instead
        stops = stop_strings(stop or [])
        if benchmark:
            return benchmark_decoding(run, checkpoint, init_from, preset, device, dtype, lengths,
                                      repeats, json_path, decode, batch, layout, n_kv_head)
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, generator=torch.Generator(device=device).manual_seed(seed))
        if chat:  # turns come from stdin, so a prompt's options are refused, not ignored
            prompted = bool(prompt or prompt_file or stop or attention or num_samples > 1)
            return chat_loop(open_chat(run, checkpoint, init_from, device, dtype, prompted,
                                       decode=decode if kv_cache else "eager",
                                       skip_special_tokens=skip_special_tokens, **sampling))
        # to continue a text, prefer the newest base model over a newer chat model
        loaded: list[str] = []
        model, tokenizer, _ = load_model(run, checkpoint, init_from, device, dtype,
                                         prefer="base", say=loaded.append)
        # checked after loading, so a failed load leaves no folder behind, but before sampling
        attention_path = attention_target(attention) if attention is not None else None
        text = prompt_text(prompt, prompt_file)
        ids = prompt_ids(tokenizer, text)
        step = decode_step(model, decode) if kv_cache else None
        say(loaded)
    first_sample = print_samples(
        lambda: generate_text(model, tokenizer, ids, use_kv_cache=kv_cache, stop=stops,
                              decode=step or "eager",  # unused without the cache
                              skip_special_tokens=skip_special_tokens,
                              **sampling), text, num_samples, stream)
    if attention_path is not None:
        with reported():
            write_attention(model, tokenizer, ids + tokenizer.encode(first_sample), attention_path)


if __name__ == "__main__":
    run_command(main)
