"""What each weight dtype costs and buys, in one run: weight MB, decoding speed at two model
shapes, and the loss of a trained model on its validation text.

Usage:
    python -m benchmarks.dtypes --run runs/quickstart             # its val split as the text
    python -m benchmarks.dtypes --run runs/quickstart --input input.txt --json dtypes.json

For float32, bfloat16 and int8 (quantize.py), in one process:
- decoding: batch 1, greedy, an 8-token prompt and `new_tokens` new ones, on random weights
  of the baby GPT and GPT-2 small shapes, by the default path (decode="auto": the C step on
  a CPU); the median of `repeats` runs after a warm-up (measure/decoding.py's `measure`);
- quality: evaluate.py's loss and bits per character of the run's best.pt on the text;
- evaluation speed (float32): the tokens per second that evaluation scores, and the
  forward tokens per second behind them (block_size / stride per scored token), against
  training's forward pass at the run's batch and block size.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from benchmarks import check_paths
from data.documents import read_text
from data.loader import load_split
from data.tokenizer import load_tokenizer
from generate import decode_step
from machine.errors import reported, run_command
from machine.files import write_bytes_atomic
from measure.decoding import PROMPT_LEN, measure, ours, preset_config
from measure.scores import evaluate
from model import GPT
from weights.checkpoint import load_checkpoint
from weights.loading import model_from_checkpoint, resolve_checkpoint
from weights.quantize import cast_weights, weight_bytes

COMPARED = ("float32", "bfloat16", "int8")
SHAPES = ("baby_gpt", "gpt2")


def decode_speed(shape: str, dtype: str, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(weight MB, tokens/s) of the default decode path on random weights of `shape`."""
    torch.manual_seed(0)
    model = cast_weights(GPT(preset_config(shape)).eval(), dtype)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN),
                           generator=torch.Generator().manual_seed(0))
    row = measure(ours(model, decode_step(model)), prompt, new_tokens, repeats)
    return weight_bytes(model) / 1e6, row["tokens_per_s"]


def training_forward_speed(model: GPT, batch_size: int, steps: int = 10) -> float:
    """Tokens per second of training's forward pass (train mode, autograd recording) on
    random batches of the model's block size, which evaluation should at least match."""
    model.train()
    block = model.config.block_size
    x = torch.randint(0, model.config.vocab_size, (batch_size, block))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        _, loss = model(x, x)
        times.append(time.perf_counter() - t0)
        del loss
    model.eval()
    return batch_size * block / statistics.median(times[1:])


def main(run: str = "runs/quickstart", input: Path | None = None,
         new_tokens: Annotated[int, typer.Option(min=1)] = 64,
         repeats: Annotated[int, typer.Option(min=1)] = 5,
         json_path: Annotated[Path | None, typer.Option("--json")] = None) -> None:
    """Weight MB, decode tokens/s and loss for each weight dtype (see the module docstring)."""
    with reported():  # a bad path or run, before the work
        check_paths(input, json_path)
        path = resolve_checkpoint(run, None)
        ckpt = load_checkpoint(path)
    measure_dtypes(path, ckpt, input, new_tokens, repeats, json_path)


def measure_dtypes(path: Path, ckpt: dict, input: Path | None, new_tokens: int, repeats: int,
                   json_path: Path | None) -> None:
    tokenizer = load_tokenizer(ckpt["tokenizer"])
    if input is not None:  # read as evaluate.py reads it, so the figures match its own
        text, source = read_text(input), str(input)
    else:  # the run's own validation split, back to text
        data_dir = ckpt["config"]["data_dir"]
        text = tokenizer.decode(load_split(data_dir, "val")[:].tolist())
        source = f"{data_dir} val split"
    print(f"{path} on {source} ({len(text):,} characters); decoding {new_tokens} tokens after "
          f"{PROMPT_LEN}, batch 1, {torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = []
    for dtype in COMPARED:
        row: dict = {"dtype": dtype}
        for shape in SHAPES:
            row[f"{shape}_weight_mb"], row[f"{shape}_tokens_per_s"] = decode_speed(
                shape, dtype, new_tokens, repeats)
        model = cast_weights(model_from_checkpoint(ckpt), dtype)
        scores = evaluate(model, tokenizer, text)
        row.update(loss=scores.loss, bits_per_char=scores.bits_per_char,
                   eval_tokens_per_s=scores.tokens / scores.seconds,
                   eval_forward_tokens_per_s=scores.forward_tokens / scores.seconds)
        if dtype == "float32":
            row["train_forward_tokens_per_s"] = training_forward_speed(
                model, ckpt["config"]["batch_size"])
        rows.append(row)
    fp32 = rows[0]
    print(f"{'dtype':>9} {'baby MB':>8} {'baby tok/s':>10} {'gpt2 MB':>8} {'gpt2 tok/s':>10} "
          f"{'val loss':>9} {'vs fp32':>8} {'bits/char':>9}")
    for row in rows:
        print(f"{row['dtype']:>9} {row['baby_gpt_weight_mb']:>8.1f} "
              f"{row['baby_gpt_tokens_per_s']:>10.1f} {row['gpt2_weight_mb']:>8.1f} "
              f"{row['gpt2_tokens_per_s']:>10.1f} {row['loss']:>9.4f} "
              f"{row['loss'] - fp32['loss']:>+8.4f} {row['bits_per_char']:>9.4f}")
    by = {row["dtype"]: row for row in rows}
    for shape in SHAPES:
        speed = {d: by[d][f"{shape}_tokens_per_s"] for d in COMPARED}
        print(f"{shape}: int8 {speed['int8'] / speed['float32']:.2f}x float32's tokens/s, "
              f"{speed['int8'] / speed['bfloat16']:.2f}x bfloat16's")
    print(f"evaluation (float32): {fp32['eval_tokens_per_s']:,.0f} scored tokens/s, "
          f"{fp32['eval_forward_tokens_per_s']:,.0f} forward tokens/s; training's forward "
          f"pass at batch {ckpt['config']['batch_size']}: "
          f"{fp32['train_forward_tokens_per_s']:,.0f} tokens/s")
    if json_path:
        record = {"checkpoint": str(path), "text": source, "threads": torch.get_num_threads(),
                  "torch": torch.__version__, "rows": rows}
        write_bytes_atomic(json_path, (json.dumps(record, indent=2) + "\n").encode())


if __name__ == "__main__":
    run_command(main)
