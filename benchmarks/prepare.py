"""Preparation at scale: throughput, peak memory, kills, and a training start on the result.

Usage:
    python -m benchmarks.prepare --gb 2                      # the 2 GB JSON Lines benchmark
    python -m benchmarks.prepare --gb 10 --repeats 1 --train # 10 GB, then 100 training iters
    python -m benchmarks.prepare --gb 0.2 --kills 5          # SIGKILLs, each then a rerun

A corpus of --gb gigabytes of JSON Lines is generated in --workdir (the built-in Shakespeare's
paragraphs, shuffled into documents of 2 to 40 paragraphs, seeded) and deleted at the end
unless --keep. It prints, each the median of --repeats runs of `python -m data.prepare
--tokenizer gpt2` as a user runs it:
- its wall time and MB/s of input, and tiktoken's single-process MB/s (the call that the
  workers make, results dropped) on the corpus's first --baseline-mb megabytes, measured in
  the same run, and the ratio of the two;
- peak RSS, the sum over the process and its workers, sampled from /proc every 50 ms;
- for comparison, the peak RSS of the whole-corpus approach (read the text, encode it into
  one list) on the first --baseline-mb megabytes.
--kills N kills the preparation N times at random moments, reruns it after each, and checks
every shard against an uninterrupted run's by sha256. --train runs 100 iterations of the
tiny preset on the prepared corpus and on the built-in Shakespeare prepared with the same
tokenizer, and prints the time to the first step, the wall time and the peak RSS of each.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.train import read_scalars
from data.assets import shakespeare_text
from machine.device import cpu_name
from machine.threads import usable_cpus

REPO = Path(__file__).resolve().parent.parent


def make_corpus(path: Path, gigabytes: float, seed: int = 0) -> int:
    """JSON Lines of shuffled Shakespeare paragraphs; its size in bytes."""
    paragraphs = [p for p in shakespeare_text().split("\n\n") if p.strip()]
    rng, target, size = random.Random(seed), int(gigabytes * 1e9), 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            doc = "\n\n".join(rng.choices(paragraphs, k=rng.randint(2, 40)))
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
    return size


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, in MB."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines()
                              if line.startswith("VmRSS:")))
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024


def run_measured(cmd: list[str], kill_after: float | None = None) -> tuple[float, float, int]:
    """(wall seconds, peak tree RSS in MB, exit code) of a command; SIGKILL it after
    kill_after seconds if given."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, stop = [0.0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    stop.set()
    sampler.join()
    if proc.returncode not in (0, -9):
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr.read().decode()[-2000:]}")
    return time.perf_counter() - t0, peak[0], proc.returncode


def shard_hashes(out: Path) -> dict[str, str]:
    meta = json.loads((out / "meta.json").read_text())
    return {s["file"]: s["sha256"] for s in meta["shards"]}


def baseline(corpus: Path, megabytes: float) -> dict:
    """tiktoken on one core, and the whole-corpus approach's memory, on the corpus's head."""
    code = f"""
import json, resource, time, numpy as np
from data.bpe_tokenizers import GPT2Tokenizer
enc = GPT2Tokenizer().enc
texts, size = [], 0
with open({str(corpus)!r}, 'rb') as f:
    for line in f:
        if size >= {megabytes * 1e6}: break
        texts.append(json.loads(line)['text']); size += len(line)
t0 = time.perf_counter()
for t in texts:
    enc.encode_to_numpy(t, disallowed_special=())  # what data.prepare's workers call
seconds = time.perf_counter() - t0
text = '<|endoftext|>'.join(texts); del texts
ids = np.array(enc.encode_ordinary(text), dtype=np.uint16)  # the whole-corpus approach
print(json.dumps({{"mb": size / 1e6, "seconds": seconds,
                   "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def prepare_cmd(corpus: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "data.prepare", "--input", str(corpus), "--tokenizer", "gpt2",
            "--out", str(out)]


def train_start(data_dir: str, runs: Path, name: str) -> tuple[float, float, float]:
    """(seconds from process start to the first training step, wall seconds, peak RSS MB)
    of 100 iterations of the tiny preset on a dataset. The model is small so that what the
    data costs shows."""
    cmd = [sys.executable, "train.py", "--config", "config/tiny.toml", "--data-dir", data_dir,
           "--out-dir", str(runs), "--run-name", name, "--max-iters", "100",
           "--eval-interval", "100", "--sample-tokens", "0"]
    t0 = time.time()
    seconds, peak, _ = run_measured(cmd)
    first = read_scalars(runs / name)["train/loss_step"][0].wall_time - t0
    return first, seconds, peak


def main(gb: Annotated[float, typer.Option(help="Corpus size in GB.")] = 2.0,
         repeats: Annotated[int, typer.Option(min=1, help="Preparation runs; medians.")] = 2,
         kills: Annotated[int, typer.Option(min=0, help="SIGKILL-and-rerun rounds.")] = 0,
         train: Annotated[bool, typer.Option(help="100 training iterations on the result.")] = False,
         baseline_mb: Annotated[float, typer.Option(help="Text for the baselines.")] = 200.0,
         workdir: Annotated[str, typer.Option(help="Where the corpus goes.")] = "",
         keep: Annotated[bool, typer.Option(help="Keep the corpus and dataset.")] = False) -> None:
    """Generate a corpus, prepare it, and print throughput and peak memory."""
    work = Path(workdir or tempfile.mkdtemp(prefix="gptlab-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus, out = work / "corpus.jsonl", work / "dataset"
    try:
        print(f"cpu: {cpu_name()}, {usable_cpus()[1]}")
        size = make_corpus(corpus, gb)
        print(f"corpus: {size / 1e9:.2f} GB of JSON Lines in {corpus}")
        base = baseline(corpus, baseline_mb)
        single = base["mb"] / base["seconds"]
        print(f"tiktoken, one process: {single:.2f} MB/s on the first {base['mb']:.0f} MB; "
              f"whole-corpus approach: peak RSS {base['peak_mb']:.0f} MB for {base['mb']:.0f} MB "
              f"({base['peak_mb'] / base['mb']:.1f} bytes of RAM per byte of text)")
        walls, peaks = [], []
        for _ in range(repeats):
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak, _ = run_measured(prepare_cmd(corpus, out))
            walls.append(seconds)
            peaks.append(peak)
            print(f"  run: {seconds:.1f} s, {size / 1e6 / seconds:.2f} MB/s, peak RSS {peak:.0f} MB")
        wall, rate = statistics.median(walls), size / 1e6 / statistics.median(walls)
        meta = json.loads((out / "meta.json").read_text())
        tokens = meta["train_tokens"] + meta["val_tokens"]
        print(f"data.prepare: median {wall:.1f} s, {rate:.2f} MB/s ({rate * 3600 / 1000:.1f} GB "
              f"an hour), {rate / single:.2f}x tiktoken's one process; peak RSS median "
              f"{statistics.median(peaks):.0f} MB; {tokens:,} tokens, {meta['documents']:,} "
              f"documents, {len(meta['shards'])} shards")
        if kills:
            check_kills(corpus, out, kills, wall)
        if train:
            runs = work / "runs"
            # the same tokenizer on both sides gives the same model, so only the data differs
            subprocess.run([sys.executable, "-m", "data.prepare", "--tokenizer", "gpt2"],
                           cwd=REPO, check=True, capture_output=True)
            for name, data_dir in (("the built-in Shakespeare (GPT-2 BPE, 1.7M tokens)",
                                    "data/shakespeare_bpe"), (f"the {gb:g} GB corpus", str(out))):
                first, seconds, peak = train_start(data_dir, runs, name.split()[1])
                print(f"100 iterations of the tiny preset on {name}: first step {first:.1f} s "
                      f"after the start, {seconds:.1f} s in all, peak RSS {peak:.0f} MB")
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def check_kills(corpus: Path, whole: Path, kills: int, wall: float) -> None:
    """Kill a fresh preparation `kills` times at random moments, rerunning after each."""
    expected, out = shard_hashes(whole), whole.with_name("killed")
    shutil.rmtree(out, ignore_errors=True)
    rng = random.Random(1)
    for k in range(kills):
        moment = rng.uniform(0.05, 0.9) * wall
        _, _, code = run_measured(prepare_cmd(corpus, out), kill_after=moment)
        shards = len(list(out.glob("tokens_*.bin")))
        run_measured(prepare_cmd(corpus, out))
        same = shard_hashes(out) == expected
        print(f"  kill {k + 1} at {moment:.1f} s ({'killed' if code == -9 else 'had finished'}, "
              f"{shards} whole shards): rerun's shards identical by sha256: {same}")
        shutil.rmtree(out)


if __name__ == "__main__":
    typer.run(main)
