"""How fast EleutherAI's lm-eval scores a multiple-choice task through serve.py, against its
own hf backend on the same model: the loglikelihood requests per second of each, and their
accuracies, which must agree.

Usage:
    python -m benchmarks.lm_eval                      # 200 items, 4 choices each
    python -m benchmarks.lm_eval --items 50 --batch-size 4

The model is benchmarks/serve.py's: GPT-2 small (124M) with random weights and GPT-2's
tokenizer, served by serve.py (float32, its defaults) and exported for the hf backend. The
task is local (dataset_path: json) and made of the same words as the serving benchmark's
prompts. Each backend's time is the lm_eval command's wall time, its start included (the
same few seconds for both), so the rate is a little below the backend's own.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.serve import REPO, WORDS, run, server_command, started, write_model
from machine.device import cpu_name
from machine.errors import run_command


def write_task(folder: Path, items: int) -> Path:
    """A task of `items` items, each a context of words and four endings, in lm-eval's YAML."""
    rng = random.Random(0)
    lines = []
    for _ in range(items):
        endings = [" ".join(rng.choices(WORDS, k=4)) for _ in range(4)]
        lines.append(json.dumps({"ctx": " ".join(rng.choices(WORDS, k=12)), "endings": endings,
                                 "label": rng.randrange(4)}))
    (folder / "items.jsonl").write_text("\n".join(lines) + "\n")
    tasks = folder / "tasks"
    tasks.mkdir()
    (tasks / "mc_bench.yaml").write_text(f"""task: mc_bench
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "items.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return tasks


def lm_eval(tasks: Path, *model: str) -> tuple[float, dict]:
    """The lm_eval command's wall seconds and results, run outside this repository (whose
    evaluate.py would shadow the `evaluate` package it imports)."""
    out = tasks.parent / f"out-{time.monotonic_ns()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "lm_eval", *model, "--tasks", "mc_bench",
                             "--include_path", str(tasks), "--output_path", str(out)],
                            cwd=tasks.parent, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"lm_eval failed: {result.stderr.strip()[-2000:]}")
    (path,) = out.rglob("results_*.json")
    return seconds, json.loads(path.read_text())["results"]["mc_bench"]


def main(items: Annotated[int, typer.Option(min=1)] = 200,
         batch_size: Annotated[int, typer.Option(min=1)] = 8, port: int = 8432) -> None:
    """Print each backend's requests per second and accuracy on the same task."""
    requests = 4 * items
    print(f"# lm-eval, {items} items x 4 choices = {requests} loglikelihood requests, batch "
          f"{batch_size}, GPT-2 small (random weights), float32, {cpu_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoint = write_model(folder)
        run([sys.executable, str(REPO / "export.py"), str(checkpoint), str(folder / "hf")])
        tasks = write_task(folder, items)
        rows = {"lm-eval hf": lm_eval(tasks, "--model", "hf", "--model_args",
                                      f"pretrained={folder / 'hf'},dtype=float32", "--device",
                                      "cpu", "--batch_size", str(batch_size))}
        command = server_command("ours-fp32", checkpoint, None, port, 16, 1024, "cpu", "auto")
        with started(command, port) as address:
            rows["lm-eval through serve.py"] = lm_eval(
                tasks, "--model", "local-completions", "--model_args",
                f"base_url=http://{address}/v1/completions,model=gpt2,max_length=1024",
                "--batch_size", str(batch_size))
    print("| backend | seconds | requests/s | acc | acc_norm |\n| --- | --- | --- | --- | --- |")
    for name, (seconds, results) in rows.items():
        print(f"| {name} | {seconds:.1f} | {requests / seconds:.1f} | {results['acc,none']:.4f} "
              f"| {results['acc_norm,none']:.4f} |")


if __name__ == "__main__":
    run_command(main)
