"""Tokenizers side by side: compression, training cost, encoding speed, and what each gives
the quickstart model in the same wall time.

Usage:
    python -m benchmarks.tokenizer --input tinyshakespeare/input.txt              # all but --scale
    python -m benchmarks.tokenizer --input tinyshakespeare/input.txt --scale 0.1 --scale 1

--input is split as training splits it: the first 90% of characters train (the BPEs learn
from them alone), and the last 10% are held out. It prints:
- bytes per token on the held-out text: BPEs of 512 to 4,096 tokens against GPT-2's, and the
  seconds to train each with rustbpe and with Hugging Face tokenizers;
- tiktoken's encoding MB/s with the 4,096-token BPE and with GPT-2's, on the same text in the
  same run (median of 5);
- --scale GB: the seconds and peak RSS to train a 4,096-token BPE on a generated JSON Lines
  corpus of that size, through data.prepare's sample (capped at --tokenizer-train-chars);
- the quality race (unless --no-race): config/quickstart.toml trained on each tokenizer's
  dataset for the wall time that the char model's 600 iterations take (each run's
  max_iters set from a 30-iteration calibration), then bits per character of its best.pt on
  the held-out text, through evaluate.py.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.prepare import make_corpus
from benchmarks.train import read_scalars
from data.bpe import train_bpe
from data.bpe_tokenizers import GPT2Tokenizer
from data.documents import list_inputs
from data.prepare import prepare, prepare_text
from measure.scores import evaluate
from training.config import load_config
from weights.loading import load_model

REPO = Path(__file__).resolve().parent.parent
VOCABS = (512, 1024, 2048, 4096)
RACE = ("char", "bpe512", "bpe2048", "gpt2")


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - t0, result


def hf_train_seconds(texts: list[str], vocab_size: int) -> float:
    """Hugging Face tokenizers' byte-level BPE trainer on the same texts (the alternative to rustbpe)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return timed(hf.train_from_iterator, texts, trainer)[0]


def compression(train_text: str, held_out: str) -> None:
    paragraphs = train_text.split("\n\n")
    gpt2 = GPT2Tokenizer()
    held = len(held_out.encode("utf-8"))
    print("| tokenizer | rustbpe training s | HF tokenizers training s | bytes per token |")
    print("| --- | --- | --- | --- |")
    for vocab in VOCABS:
        seconds, bpe = timed(train_bpe, paragraphs, vocab)
        print(f"| bpe-{vocab} | {seconds:.2f} | {hf_train_seconds(paragraphs, vocab):.2f} | "
              f"{held / len(bpe.encode(held_out)):.2f} |")
    print(f"| GPT-2 (50,257) | - | - | {held / len(gpt2.encode(held_out)):.2f} |")
    text = (train_text + held_out) * 8
    rates = {}
    for name, tok in (("bpe-4096", bpe), ("GPT-2", gpt2)):
        rates[name] = len(text.encode()) / 1e6 / statistics.median(
            timed(tok.encode_array, text)[0] for _ in range(5))
    print(f"tiktoken encoding, one thread, {len(text) / 1e6:.0f} MB: bpe-4096 "
          f"{rates['bpe-4096']:.2f} MB/s, GPT-2 {rates['GPT-2']:.2f} MB/s "
          f"({rates['bpe-4096'] / rates['GPT-2']:.2f}x)")


def scale(gigabytes: float, train_chars: int, work: Path) -> None:
    """Train a 4,096-token BPE on a generated corpus in a fresh process; print its time and peak RSS."""
    corpus = work / f"corpus_{gigabytes:g}.jsonl"
    make_corpus(corpus, gigabytes)
    code = f"""
import json, resource, time
from data.bpe import train_bpe
from data.documents import list_inputs
from data.prepare import sample_texts
t0 = time.perf_counter()
train_bpe(sample_texts(list_inputs([{str(corpus)!r}]), "text", {train_chars}), 4096)
print(json.dumps({{"seconds": time.perf_counter() - t0,
                   "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout)
    print(f"bpe-4096 on {gigabytes:g} GB of JSON Lines (sample cap {train_chars:,} chars): "
          f"{out['seconds']:.1f} s, peak RSS {out['peak_mb']:.0f} MB")
    corpus.unlink()


def train_run(data_dir: Path, runs: Path, name: str, max_iters: int) -> tuple[float, float]:
    """Train the quickstart preset on a dataset; return (wall seconds, median ms/iter)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "train.py", "--config", "config/quickstart.toml",
                    "--data-dir", str(data_dir), "--out-dir", str(runs), "--run-name", name,
                    "--max-iters", str(max_iters), "--eval-interval", str(max(max_iters // 6, 1)),
                    "--sample-tokens", "0", "--no-log-attention"],
                   cwd=REPO, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    tokens_per_s = statistics.median(e.value for e in read_scalars(runs / name)["perf/tokens_per_sec"])
    cfg = load_config("config/quickstart.toml")
    return wall, 1000 * cfg.batch_size * cfg.model.block_size / tokens_per_s


def race(text: str, train_text: str, held_out: str, work: Path) -> None:
    """Train on each tokenizer's dataset for the char model's wall time, and score each model
    on the held-out text in bits per character."""
    (work / "train.txt").write_text(train_text, encoding="utf-8")
    datasets = {}
    for name in RACE:
        out = work / name
        if name.startswith("bpe"):
            vocab = int(name[3:])
            prepare(list_inputs([work / "train.txt"]), "bpe", work / f"{name}_tok", "train part",
                    vocab_size=vocab)  # the BPE learns from the training part only
            prepare_text(text, str(work / f"{name}_tok"), out, "input")
        else:
            prepare_text(text, name, out, "input")
        datasets[name] = out
    runs = work / "runs"
    calibration = {name: train_run(d, runs, f"cal-{name}", 30)[1] for name, d in datasets.items()}
    budget = 600 * calibration["char"]
    print(f"iterations: 600 for char, the same time for the others by the ms/iter of "
          f"30-iteration calibrations: {json.dumps({k: round(v, 1) for k, v in calibration.items()})}")
    print("| tokenizer | ms/iter | iterations in the budget | wall s | held-out bits per char |")
    print("| --- | --- | --- | --- | --- |")
    for name, data_dir in datasets.items():
        iters = int(budget / calibration[name])
        wall, ms = train_run(data_dir, runs, name, iters)
        model, tokenizer, _ = load_model(checkpoint=str(runs / name / "best.pt"))
        scores = evaluate(model, tokenizer, held_out)
        print(f"| {name} | {ms:.1f} | {iters} | {wall:.0f} | {scores.bits_per_char:.3f} |")


def main(input: Annotated[Path, typer.Option(exists=True, dir_okay=False,
                                             help="A text file, e.g. tiny Shakespeare.")],
         scale_gb: Annotated[list[float] | None, typer.Option(
             "--scale", help="Also train on a generated corpus of this many GB.")] = None,
         tokenizer_train_chars: Annotated[int, typer.Option(
             help="The sample cap for --scale.")] = 1_000_000_000,
         no_race: Annotated[bool, typer.Option("--no-race", help="Skip the training race.")] = False
         ) -> None:
    """Compression, training cost, encoding speed and the quality race of the tokenizers."""
    text = input.read_text(encoding="utf-8")
    cut = len(text) - len(text) // 10
    train_text, held_out = text[:cut], text[cut:]
    with tempfile.TemporaryDirectory() as tmp:
        compression(train_text, held_out)
        for gigabytes in scale_gb or []:
            scale(gigabytes, tokenizer_train_chars, Path(tmp))
        if not no_race:
            race(text, train_text, held_out, Path(tmp))


if __name__ == "__main__":
    typer.run(main)
