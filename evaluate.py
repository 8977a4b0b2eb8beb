"""Score a model: its loss on any text, its accuracy on a multiple-choice task, or a chat
model's right answers.

Usage:
    python evaluate.py --input play.txt                          # best.pt of the newest run
    python evaluate.py --input texts/ --run quickstart --dtype int8 --json scores.json
    python evaluate.py --input play.txt --init-from path/to/gpt2 --stride 512
    python evaluate.py --task hellaswag.jsonl --init-from path/to/gpt2 --json hs.json
    python evaluate.py --run runs/chat_sft --answers demo        # a chat model's right answers

measure/ defines each score: a text's loss in scores.py (a sliding window over long texts,
in nats per token and in bits per character, which compare across tokenizers), a task's
accuracy in choices.py (as lm-eval scores it), and a chat model's answers in answers.py.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import torch
import typer

from cli.options import (
    CheckpointOption,
    DebugOption,
    DeviceOption,
    DtypeOption,
    InitFromOption,
    RunOption,
    check_output_file,
)
from data.documents import read_text
from machine.device import resolve_device
from machine.errors import InputError, UserError, reported, run_command
from machine.files import write_bytes_atomic
from machine.perf import out_of_memory
from measure.answers import answer_score, demo_conversations, read_conversations
from measure.choices import read_items, score_items
from measure.scores import check_stride, evaluate
from weights.loading import load_model


def main(
    input: Annotated[Path | None, typer.Option(
        "--input", help="A UTF-8 text file, scored exactly as it is, or a folder of .txt "
                        "files (path order, a blank line between two files).")] = None,
    task: Annotated[Path | None, typer.Option(
        help="Instead: a multiple-choice task, JSON Lines of HellaSwag's fields (ctx, endings, "
             "label) or of context, choices and answer, scored as lm-eval scores it (acc, "
             "acc_norm).")] = None,
    answers: Annotated[str | None, typer.Option(
        help="Instead: count the conversations whose last reply the model gives exactly "
             "(greedy), from a JSON Lines file of {\"messages\": [...]}, or 'demo' for the "
             "built-in held-out set (docs/chat.md).")] = None,
    run: RunOption = None,
    checkpoint: CheckpointOption = None,
    init_from: InitFromOption = None,
    dtype: DtypeOption = "float32",
    stride: Annotated[int | None, typer.Option(
        help="Tokens between window starts; default block_size // 2.")] = None,
    batch_size: Annotated[int | None, typer.Option(
        min=1, help="Windows (or a task's choices) per forward pass; default: as many as keep "
                    "the logits under 256 MB, at most 16 windows or 64 choices.")] = None,
    device: DeviceOption = "cpu",
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Also write the scores to this JSON file.")] = None,
    debug: DebugOption = False,
) -> None:
    """Score a model on a text (loss per token, perplexity and bits per character), on a
    multiple-choice task (accuracy), or on a chat model's answers."""
    with reported(debug=debug):
        if sum(x is not None for x in (input, task, answers)) != 1:
            raise UserError("give one of --input TEXT to score a text, --task FILE to score a "
                            "multiple-choice task, or --answers (a file or demo) to score a "
                            "chat model's replies")
        if json_path is not None:  # check it before the evaluation, not after
            check_output_file(json_path, "--json")
        device = str(resolve_device(device))
        if answers is not None:
            return score_answers(answers, run, checkpoint, init_from, device, dtype, json_path,
                                 text_options=stride is not None or batch_size is not None)
        if task is not None:
            if stride is not None:
                raise UserError("--stride is for scoring a text; drop it with --task")
            return score_task(task, run, checkpoint, init_from, device, dtype, json_path,
                              batch_size or 64)
        text = read_text(input)
        loaded: list[str] = []
        model, tokenizer, source = load_model(run, checkpoint, init_from, device, dtype,
                                              say=loaded.append)
        stride = check_stride(stride, model.config.block_size)
        # measure.scores checks a batch's logits, but its activations may still not fit
        with out_of_memory("scoring", torch.device(device), "lower --batch-size", InputError):
            try:
                scores = evaluate(model, tokenizer, text, stride, batch_size, progress=True)
            except InputError as e:  # text outside a character vocabulary, or too short
                raise InputError(f"{input}: {e}") from None
        if json_path is not None:
            write_json(json_path, {**asdict(scores), "input": str(input), "model": source,
                                   "dtype": dtype, "block_size": model.config.block_size,
                                   "stride": stride})
    say(loaded)
    print(f"{source} ({dtype}) on {input}: {scores.tokens:,} tokens, {scores.chars:,} characters, "
          f"{scores.windows:,} windows")
    print(f"loss {scores.loss:.4f} nats/token   perplexity {scores.perplexity:.3f}   "
          f"{scores.bits_per_char:.4f} bits/char   "
          f"({scores.tokens / scores.seconds:,.0f} tokens/s)")
    if json_path is not None:
        print(f"wrote {json_path}")


def say(lines: list[str]) -> None:
    """Print what load_model said it loaded to stderr once the scores are in, so that stdout
    holds only the scores and a failure before them prints only its own error line."""
    for line in lines:
        print(line, file=sys.stderr)


def write_json(path: Path, record: dict) -> None:
    """Write the record as JSON. A figure that does not exist, such as the standard error of
    a single item, is NaN here and null in the file, because JSON has no NaN and strict
    readers refuse the file that Python's json module would write."""
    record = {key: None if isinstance(value, float) and not math.isfinite(value) else value
              for key, value in record.items()}
    try:
        write_bytes_atomic(path, (json.dumps(record, indent=2, allow_nan=False) + "\n").encode())
    except OSError as e:
        raise UserError(f"cannot write --json {path} ({e.strerror}); choose another "
                         f"path") from None


def score_task(task: Path, run: str | None, checkpoint: str | None, init_from: str | None,
               device: str, dtype: str, json_path: Path | None, batch_size: int) -> None:
    """--task: a multiple-choice task's accuracy (measure/choices.py)."""
    items = read_items(task)
    loaded: list[str] = []
    model, tokenizer, source = load_model(run, checkpoint, init_from, device, dtype,
                                          say=loaded.append)
    scores = score_items(model, tokenizer, items, batch_size, progress=True)
    if json_path is not None:
        write_json(json_path, {**asdict(scores), "task": str(task), "model": source,
                               "dtype": dtype})
    say(loaded)
    print(f"{source} ({dtype}) on {task}: {scores.items:,} items")
    print(f"acc {scores.acc:.4f} ± {figure(scores.acc_stderr)}   acc_norm {scores.acc_norm:.4f} "
          f"± {figure(scores.acc_norm_stderr)}   centered {scores.centered:.4f}")
    if json_path is not None:
        print(f"wrote {json_path}")


def figure(value: float) -> str:
    """A score as printed: n/a where it does not exist, as lm-eval prints a standard error
    of one item."""
    return f"{value:.4f}" if math.isfinite(value) else "n/a"


def score_answers(answers: str, run: str | None, checkpoint: str | None, init_from: str | None,
                  device: str, dtype: str, json_path: Path | None, text_options: bool) -> None:
    """--answers: count the conversations whose last reply a chat model gets right
    (measure/answers.py)."""
    if text_options:
        raise UserError("--stride and --batch-size are for scoring a text; drop them with "
                         "--answers")
    records = demo_conversations() if answers == "demo" else read_conversations(Path(answers))
    loaded: list[str] = []
    model, tokenizer, source = load_model(run, checkpoint, init_from, device, dtype,
                                          say=loaded.append)
    right, total = answer_score(model, tokenizer, records)
    if json_path is not None:
        write_json(json_path, {"right": right, "total": total, "answers": answers,
                               "model": source, "dtype": dtype})
    say(loaded)
    print(f"{source} ({dtype}): {right} of {total} last replies right "
          f"({100 * right / max(total, 1):.1f}%) on {answers}")


if __name__ == "__main__":
    run_command(main)
