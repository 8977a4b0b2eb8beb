"""The race to a loss: training recipes, each run as its own process the way a user runs it,
timed from the process's start to its first evaluation at or below a target val loss.

Usage:
    python -m benchmarks.train --time-to-loss 1.95 --input tinyshakespeare/input.txt
    python -m benchmarks.train --time-to-loss 1.95 --input input.txt --nanogpt ../nanoGPT
    python -m benchmarks.train --time-to-loss 1.48 --input input.txt --nanogpt ../nanoGPT  # a GPU

    from benchmarks.race import Recipe, time_to_loss
    rows = time_to_loss([Recipe("tiny", Path("config/tiny.toml"), {})], data_dir, 2.6, 1)

Every trainer is timed by one clock: the moment each line of its output arrives. An
evaluation is a line "iter N: train loss X, val loss Y" (train.py) or "step N: train loss
X, val loss Y" (nanoGPT), and the time to the target is when the first such line at or
below it arrives. The pace (ms/iter) is the median time between consecutive log lines
(benchmarks/wallclock.py), leaving the evaluations out; an evaluation's cost is the time
between the log lines on either side of it, less its steps' at that pace; and the start is
the time to the first log line.

The recipes take turns, `repeats` rounds of them, so that a slow minute of a shared machine
falls on all of them alike. The baselines (nanoGPT's recipe, and ours of the same settings)
stop once they reach the target, since only their time to it is compared; the other recipes
run to their end, so that their final val loss is known too. On a GPU the baby GPT presets
race nanoGPT's own baby GPT instead (GPU_RECIPES), all stopped at the target. The first
recipe is the one the others' speed-ups are measured against.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.wallclock import LOG_POINT, log_point_times
from machine.device import cpu_flags, cpu_name
from machine.errors import UserError

QUICKSTART = Path("config/quickstart.toml")
CLASSIC = Path("config/quickstart_adamw.toml")
BABY, BABY_ADAMW = Path("config/baby_gpt.toml"), Path("config/baby_gpt_adamw.toml")
EVALUATION = re.compile(r"^(?:iter|step) (\d+): train loss [\d.]+, val loss ([\d.]+|nan|inf)")
DTYPE_LINE = re.compile(r"^dtype (\w+) \(")

# nanoGPT's README runs character-level Shakespeare on a CPU with these settings; the race
# evaluates it every 100 iterations on 50 batches of 12, the same 600 sequences a side that
# the classic recipe below is evaluated on
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
               "--eval_iters=50", "--eval_interval=100", "--log_interval=10", "--block_size=64",
               "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
               "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
# On a GPU, nanoGPT runs its baby GPT as its config file gives it (compiled, in bf16, evaluated
# every 250 iterations on 200 batches of 64), as config/baby_gpt.toml and baby_gpt_adamw.toml are.
NANOGPT_GPU = ["config/train_shakespeare_char.py", "--log_interval=10"]


@dataclass(frozen=True)
class Recipe:
    """A run of train.py: a preset and the settings that change it."""
    name: str
    config: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    stop_at_target: bool = False  # a baseline stops there, because only its time to it is compared

    def command(self, data_dir: Path, out_dir: Path, run_name: str) -> tuple[list[str], Path]:
        """The command line and the folder it runs in."""
        settings = {**self.overrides, "data_dir": str(data_dir), "out_dir": str(out_dir),
                    "run_name": run_name}
        args = [sys.executable, "train.py", "--config", str(self.config)]
        for key, value in settings.items():
            flag = key.replace("_", "-")
            if isinstance(value, bool):
                args.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                args.append(f"--{flag}={value}")
        return args, Path.cwd()


@dataclass(frozen=True)
class NanoGPT:
    """nanoGPT's own train.py in its checkout: its README's CPU settings, or on a GPU its baby GPT."""
    path: Path
    gpu: bool = False
    stop_at_target: bool = True

    @property
    def name(self) -> str:
        return "nanoGPT, its baby GPT" if self.gpu else "nanoGPT, its README's CPU recipe"

    @property
    def dtype(self) -> str:
        """What nanoGPT computes in, by its train.py's rule."""
        if not self.gpu:
            return "float32"
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"

    def command(self, data_dir: Path, out_dir: Path, run_name: str) -> tuple[list[str], Path]:
        settings = NANOGPT_GPU if self.gpu else NANOGPT_CPU
        return [sys.executable, "train.py", *settings, f"--out_dir={out_dir / run_name}"], self.path


def check_nanogpt(path: Path, gpu: bool = False) -> NanoGPT:
    """A nanoGPT checkout with its character-level Shakespeare prepared, or one line saying
    what is missing."""
    if not (path / "train.py").is_file() or not (path / "model.py").is_file():
        raise UserError(f"--nanogpt {path}: no nanoGPT checkout there (train.py and model.py)")
    data = path / "data" / "shakespeare_char"
    if not (data / "train.bin").is_file() or not (data / "val.bin").is_file():
        raise UserError(f"--nanogpt {path}: its data is not prepared; put the same text in "
                        f"{data}/input.txt and run python {data}/prepare.py")
    return NanoGPT(path, gpu)


# The classic recipe is nanoGPT's settings run by train.py, in fp32 as nanoGPT runs on a CPU,
# evaluated as the race evaluates nanoGPT. The quickstart runs as shipped (dtype auto, which
# is bf16 where the CPU multiplies it natively) and in fp32, as every CPU without native
# bf16 runs it, each evaluated at its own interval.
RECIPES = [
    Recipe("adamw classic fp32", CLASSIC, {"dtype": "float32", "eval_interval": 100,
                                           "eval_iters": 50}, stop_at_target=True),
    Recipe("the quickstart as shipped (dtype auto)", QUICKSTART),
    Recipe("the quickstart in fp32", QUICKSTART, {"dtype": "float32"}),
]
# On a GPU, the baby GPT presets race in bf16 and stop at the target: nanoGPT's model and recipe
# (without biases, because nanoGPT's has none), the baseline where nanoGPT itself does not race;
# then the modern layout with Muon, compiled as the preset ships, and not compiled, because the
# compiler's cold start can decide a short race.
GPU_RECIPES = [
    Recipe("baby_gpt_adamw, no biases", BABY_ADAMW, {"bias": False}, stop_at_target=True),
    Recipe("baby_gpt (modern layout, muon)", BABY, stop_at_target=True),
    Recipe("baby_gpt, not compiled", BABY, {"compile": False}, stop_at_target=True),
]


# These settings make an x86 CPU with AVX-512 run as one without it: they hold torch's own
# kernels, MKL's matrix products, oneDNN and this project's C kernels (machine/cbuild.py) to
# AVX2, and replace any such settings of the caller's. dtype auto reads the CPU's bf16 flags,
# not these limits, so a race under them leaves out dtype auto's row.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "GPTLAB_CFLAGS": "-march=x86-64-v3"}


# the layout switches: (the quickstart's value, GPT-2's value); the last three are nanochat's
SWITCHES = {"pos_embedding": ("rope", "learned"), "norm": ("rmsnorm", "layernorm"),
            "qk_norm": (True, False), "mlp": ("relu2", "gelu"), "tie_embeddings": (False, True),
            "bigram_embedding": (True, False), "bias": (False, True), "embed_norm": (True, False),
            "logit_softcap": (15.0, 0.0)}
GPT2_LAYOUT = {name: gpt2 for name, (_, gpt2) in SWITCHES.items()}


def ablation_recipes() -> list[Recipe]:
    """The classic recipe; the quickstart (modern layout, Muon) with each switch turned back
    to GPT-2's, and GPT-2's layout with each turned on, Muon throughout; the quickstart with
    embedding_lr equal to learning_rate, with no positions, and with grouped-query attention
    at n_kv_head n_head / 2 and 1 (multi-query). Each Muon row runs in the dtype that auto
    chooses for it, as a user would run it."""
    rows = [RECIPES[0], Recipe("quickstart: modern layout, muon", QUICKSTART, {}),
            Recipe("GPT-2 layout, muon", QUICKSTART, GPT2_LAYOUT)]
    rows += [Recipe(f"modern, {name} = {gpt2}", QUICKSTART, {name: gpt2})
             for name, (_, gpt2) in SWITCHES.items()]
    rows += [Recipe(f"GPT-2 layout, {name} = {modern}", QUICKSTART, {**GPT2_LAYOUT, name: modern})
             for name, (modern, _) in SWITCHES.items()]
    rows += [Recipe("modern, embedding_lr = learning_rate", QUICKSTART, {"embedding_lr": 0})]
    rows += [Recipe("modern, pos_embedding = none", QUICKSTART, {"pos_embedding": "none"})]
    rows += [Recipe(f"modern, n_kv_head = {n}", QUICKSTART, {"n_kv_head": n}) for n in (2, 1)]
    return rows


def run_recipe(recipe: Recipe | NanoGPT, data_dir: Path, out_dir: Path, run_name: str,
               target: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one recipe in a fresh process, with `env` added to its environment, and return its
    figures, timed from the process's start."""
    args, cwd = recipe.command(data_dir, out_dir, run_name)
    # each line arrives when it is printed
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    lines, hit = [], None
    t0 = time.perf_counter()
    with subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        for line in proc.stdout:
            lines.append((time.perf_counter(), line.strip()))
            match = EVALUATION.match(line)
            if match and hit is None and float(match.group(2)) <= target:
                hit = (int(match.group(1)), lines[-1][0] - t0)
                if recipe.stop_at_target:
                    proc.terminate()
    if proc.returncode != 0 and not (recipe.stop_at_target and hit):
        tail = "\n".join(text for _, text in lines[-5:])
        raise RuntimeError(f"recipe {recipe.name!r} failed with exit code {proc.returncode}:\n{tail}")
    evaluations = [EVALUATION.match(text) for _, text in lines]
    vals = [float(m.group(2)) for m in evaluations if m]
    dtype = next((m.group(1) for m in map(DTYPE_LINE.match, (t for _, t in lines)) if m), None)
    spans = log_point_times(lines)[1:]  # the first holds the first steps' warm-up
    first_step = next((t - t0 for t, text in lines
                       if LOG_POINT.match(text) and not EVALUATION.match(text)), None)
    pace = statistics.median(spans) if spans else None
    return {
        "ms_per_iter": 1000 * pace if pace else None,
        "iters_to_target": hit[0] if hit else None,
        "seconds_to_target": hit[1] if hit else None,
        # a run stopped at the target has no final loss of its own
        "final_val_loss": vals[-1] if vals and not (recipe.stop_at_target and hit) else None,
        "wall_s": time.perf_counter() - t0,
        # the start, to the first log point: importing, reading the data, building, compiling,
        # the first steps, and nanoGPT's evaluation at iteration 0
        "first_log_s": round(first_step, 2) if first_step is not None else None,
        "evaluation_s": evaluation_seconds(lines, pace) if pace else None,
        # train.py prints the dtype it chose; nanoGPT does not, so its own rule gives it
        "dtype": dtype or (recipe.dtype if isinstance(recipe, NanoGPT) else "unknown"),
        # every evaluation as (iteration, seconds from the start, val loss), for other targets
        "evaluations": [(int(m.group(1)), round(t - t0, 2), float(m.group(2)))
                        for t, m in zip((t for t, _ in lines), evaluations, strict=True) if m],
    }


def evaluation_seconds(lines: list[tuple[float, str]], pace: float) -> float | None:
    """The median time an evaluation adds to a run: the time between the log points on either
    side of its line, less that of the steps between them at `pace` seconds an iteration. It
    holds whatever the trainer does there (the losses, and ours the sample, the pictures and
    the checkpoint). Only evaluations with a log point on both sides count, so not nanoGPT's
    at iteration 0, nor the last of a run or the one at the target."""
    costs, last, before = [], None, None  # the last log point, and the one before an evaluation
    for t, text in lines:
        if EVALUATION.match(text):
            before = last
        elif match := LOG_POINT.match(text):
            point = (t, int(match.group(1)))
            if before is not None:
                costs.append(point[0] - before[0] - (point[1] - before[1]) * pace)
                before = None
            last = point
    return round(statistics.median(costs), 2) if costs else None


def build_c_kernels(env: dict[str, str] | None = None) -> None:
    """Build the C kernels and the C decode step as a CPU's runs will load them, in a process
    with `env`, so that no run's time holds a build, and a build that fails (no compiler, or
    flags it refuses) stops the race rather than leaving the runs to PyTorch's slower operations."""
    script = ("import torch\nfrom cdecode import build\nfrom machine.errors import UserError\n"
              "from machine.cpu_kernels import kernels\n"
              "try:\n    build(torch.float32)\n    ok = kernels() is not None\n"
              "except UserError as e:\n    raise SystemExit(str(e))\n"
              "raise SystemExit(not ok)")  # kernels() says why on stderr
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, **(env or {})},
                            capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"the C kernels could not be built for the race: {last}")


def median_or_none(values: list[float | None]) -> float | None:
    """The median, or None if any run lacks the figure (a median of the rest would flatter)."""
    return None if any(v is None for v in values) else statistics.median(values)


def time_to_loss(recipes: list[Recipe | NanoGPT], data_dir: Path, target: float,
                 repeats: int, env: dict[str, str] | None = None) -> list[dict]:
    """Each recipe's median figures over `repeats` alternating rounds, and its speed-up in
    time to the target over the first recipe's; every run has `env` in its environment."""
    runs: dict[str, list[dict]] = {r.name: [] for r in recipes}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(repeats):
            for i, recipe in enumerate(recipes):
                figures = run_recipe(recipe, data_dir, Path(tmp), f"r{round_}-{i}", target, env)
                runs[recipe.name].append(figures)
                print(f"  round {round_ + 1}, {recipe.name}: {json.dumps(figures)}",
                      file=sys.stderr)
    rows = []
    for recipe in recipes:
        done = runs[recipe.name]
        rows.append({"recipe": recipe.name,
                     **{key: median_or_none([d[key] for d in done]) for key in done[0]
                        if key not in ("dtype", "evaluations")},
                     "dtype": "/".join(sorted({d["dtype"] for d in done})),
                     "rounds": [d["seconds_to_target"] for d in done],
                     "evaluations": [d["evaluations"] for d in done]})
    base = rows[0]["seconds_to_target"]
    for row in rows:
        mine = row["seconds_to_target"]
        row["speedup"] = base / mine if base and mine else None
    return rows


def machine_line() -> str:
    """The CPU, the flags that decide its speed here, the threads, the GPU if any, and torch,
    for a figure's label."""
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
             if f in cpu_flags()]
    gpu = f"GPU: {torch.cuda.get_device_name()}; " if torch.cuda.is_available() else ""
    return (f"CPU: {cpu_name()}; flags: {' '.join(flags) or 'none of avx2, avx512'}; "
            f"{torch.get_num_threads()} threads; {gpu}torch {torch.__version__}")


def print_rows(rows: list[dict], target: float) -> None:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"| recipe | dtype | first log point (s) | ms/iter | s per evaluation | "
          f"iters to val <= {target} | seconds to it | final val | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['recipe']} | {row['dtype']} | {fmt(row['first_log_s'], '.1f')} | "
              f"{fmt(row['ms_per_iter'], '.1f')} | {fmt(row['evaluation_s'], '.2f')} | "
              f"{fmt(row['iters_to_target'], '.0f')} | {fmt(row['seconds_to_target'], '.1f')} | "
              f"{fmt(row['final_val_loss'], '.3f')} | "
              f"{'-' if row['speedup'] is None else format(row['speedup'], '.2f') + 'x'} |")
