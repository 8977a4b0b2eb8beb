"""Training speed and quality, read back from the runs' own TensorBoard files.

Usage:
    python -m benchmarks.train --input tinyshakespeare/input.txt     # the quickstart preset, CPU
    python -m benchmarks.train --config config/baby_gpt.toml         # on a GPU: bf16, compiled
    python -m benchmarks.train --config config/gpt2_small.toml --max-iters 200 --no-compile
    python -m benchmarks.train --config config/baby_gpt_adamw.toml --set bias=false --profile
    python -m benchmarks.train --time-to-loss 1.95 --input tinyshakespeare/input.txt
    python -m benchmarks.train --time-to-loss 1.95 --input tinyshakespeare/input.txt --ablate

One preset (by default config/quickstart.toml) is trained in this process into a temporary
folder, on the text of --input (prepared char-level there) or else on the preset's own
data_dir. It prints median ms/iter and tokens/s, median MFU, the wall time of the whole run
(evaluations included), the final val loss and peak memory: allocated tensors on CUDA, the
process's resident size on the CPU. --set KEY=VALUE changes any TrainConfig setting (the
value in TOML: --set bias=false, --set sample_prompt='"ROMEO:"').

--profile runs the same training under torch's profiler and prints where the time went: on
a GPU, the kernels that took the most device time, the device's busy time per iteration
(to set beside the median ms/iter of a run without --profile: busy well below it, the GPU
waits on Python, so fewer or fused launches pay; near it, the kernels themselves), and
every place that made the process wait for the GPU, with how often. The profiler's own
cost makes that run slower: its ms/iter are not the figures.

--time-to-loss races the training recipes of RECIPES instead (with --ablate, those of
ablation_recipes: what each switch of the model's layout buys), each as its own `train.py`
process, as a user runs it, evaluating every 100 iterations. The recipes take turns,
--repeats rounds of them, so that a machine's slow minute falls on all of them alike. One row
per recipe: the medians of ms/iter, of the iterations and wall seconds (from process start)
to the first evaluation at or below the target val loss, and of the final val loss, and the
speed-up in wall time over the classic recipe.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import warnings
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.autograd import DeviceType

from benchmarks import check_paths
from data.documents import read_text
from data.prepare import prepare_text
from machine.device import cpu_flags, native_bf16, resolve_device
from machine.errors import UserError, reported, run_command
from machine.files import write_bytes_atomic
from measure.memory import memory_mb, reset_peak_memory
from train import train
from training.config import load_config
from weights.checkpoint import load_checkpoint

QUICKSTART = Path("config/quickstart.toml")
CLASSIC = Path("config/quickstart_adamw.toml")


@dataclass(frozen=True)
class Recipe:
    name: str
    config: Path
    overrides: dict[str, Any]


# the layout switches: (the quickstart's value, GPT-2's value); the last three are nanochat's
SWITCHES = {"pos_embedding": ("rope", "learned"), "norm": ("rmsnorm", "layernorm"),
            "qk_norm": (True, False), "mlp": ("relu2", "gelu"), "tie_embeddings": (False, True),
            "bias": (False, True), "embed_norm": (True, False), "logit_softcap": (15.0, 0.0)}
GPT2_LAYOUT = {name: gpt2 for name, (_, gpt2) in SWITCHES.items()}

# The classic recipe is nanoGPT's reference settings, in fp32 as nanoGPT runs on a CPU. The
# Muon rows are config/quickstart.toml as shipped (dtype auto), in GPT-2's layout, and in
# fp32 (auto's choice on a CPU without native bf16).
RECIPES = [
    Recipe("adamw classic fp32", CLASSIC, {"dtype": "float32"}),
    Recipe("the quickstart as shipped", QUICKSTART, {}),
    Recipe("the quickstart in GPT-2's layout", QUICKSTART, GPT2_LAYOUT),
    Recipe("the quickstart in fp32", QUICKSTART, {"dtype": "float32"}),
]


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


def read_scalars(run_dir: Path) -> dict[str, list[Any]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def run_recipe(recipe: Recipe, data_dir: Path, out_dir: Path, run_name: str, target: float,
               eval_interval: int, max_iters: int | None) -> dict[str, Any]:
    """Train one recipe in a fresh process; its figures, timed from the process's start."""
    overrides = {**recipe.overrides, "data_dir": str(data_dir), "out_dir": str(out_dir),
                 "run_name": run_name, "eval_interval": eval_interval}
    if max_iters is not None:
        overrides["max_iters"] = max_iters
    args = [sys.executable, "train.py", "--config", str(recipe.config)]
    for key, value in overrides.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args.append(f"--{flag}={value}")
    t0 = time.time()
    proc = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"recipe {recipe.name!r} failed: {proc.stderr.strip()[-500:]}")
    scalars = read_scalars(out_dir / run_name)
    cfg = load_config(recipe.config, overrides)
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.model.block_size
    hit = next((e for e in scalars["loss/val"] if e.value <= target), None)
    return {
        "ms_per_iter": 1000 * tokens_per_iter / statistics.median(
            e.value for e in scalars["perf/tokens_per_sec"]),
        "iters_to_target": hit.step if hit else None,
        "seconds_to_target": hit.wall_time - t0 if hit else None,
        "final_val_loss": scalars["loss/val"][-1].value,
        "wall_s": wall,
        "dtype": load_checkpoint(out_dir / run_name / "last.pt")["dtype"],  # auto's choice
    }


def median_or_none(values: list[float | None]) -> float | None:
    """The median, or None if any run missed the target (its median would flatter it)."""
    return None if any(v is None for v in values) else statistics.median(values)


def time_to_loss(recipes: list[Recipe], data_dir: Path, target: float, repeats: int,
                 eval_interval: int = 100, max_iters: int | None = None) -> list[dict]:
    """Each recipe's median figures over `repeats` alternating rounds."""
    runs: dict[str, list[dict]] = {r.name: [] for r in recipes}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(repeats):
            for i, recipe in enumerate(recipes):
                figures = run_recipe(recipe, data_dir, Path(tmp), f"r{round_}-{i}", target,
                                     eval_interval, max_iters)
                runs[recipe.name].append(figures)
                print(f"  round {round_ + 1}, {recipe.name}: {json.dumps(figures)}",
                      file=sys.stderr)
    rows = []
    for recipe in recipes:
        done = runs[recipe.name]
        rows.append({"recipe": recipe.name,
                     **{key: median_or_none([d[key] for d in done]) for key in done[0]
                        if key != "dtype"},
                     "dtype": "/".join(sorted({d["dtype"] for d in done}))})
    base = rows[0]["seconds_to_target"]
    for row in rows:
        mine = row["seconds_to_target"]
        row["speedup"] = base / mine if base and mine else None
    return rows


def print_rows(rows: list[dict], target: float) -> None:
    print(f"| recipe | dtype | ms/iter | iters to val <= {target} | seconds to it | final val | "
          f"speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    def fmt(value: float | None, spec: str) -> str:
        return "missed" if value is None else format(value, spec)

    for row in rows:
        print(f"| {row['recipe']} | {row['dtype']} | {fmt(row['ms_per_iter'], '.1f')} | "
              f"{fmt(row['iters_to_target'], '.0f')} | {fmt(row['seconds_to_target'], '.1f')} | "
              f"{fmt(row['final_val_loss'], '.3f')} | "
              f"{'missed' if row['speedup'] is None else format(row['speedup'], '.2f') + 'x'} |")


def race(input: Path, recipes: list[Recipe], target: float, repeats: int,
         max_iters: int | None, json_path: Path | None) -> None:
    """--time-to-loss: race the recipes to a val loss on a char-level copy of `input`."""
    flag = native_bf16(cpu_flags())
    print(f"CPU: {'native bf16 (' + flag + ')' if flag else 'no native bf16'}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        prepare_text(read_text(input), "char", tmp, source=str(input))
        rows = time_to_loss(recipes, Path(tmp), target, repeats, max_iters=max_iters)
    print_rows(rows, target)
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """--set KEY=VALUE options as config overrides, each value read as TOML's."""
    overrides = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        try:
            if not sep:
                raise ValueError
            overrides[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except ValueError:  # TOML's errors are ValueErrors
            raise UserError(f"--set {setting}: give KEY=VALUE with a TOML value, e.g. "
                            f"--set bias=false or --set sample_prompt='\"ROMEO:\"'") from None
    return overrides


def train_figures(config: Path, input: Path | None, overrides: dict,
                  profile: bool = False) -> dict:
    """Train the preset once (on `input`, char-level, if given) and read its figures back
    from its TensorBoard events and checkpoint; with profile, print where the time went."""
    with tempfile.TemporaryDirectory() as tmp:
        if input is not None:
            overrides["data_dir"] = str(Path(tmp) / "data")
            prepare_text(read_text(input), "char", overrides["data_dir"], source=str(input))
        cfg = load_config(config, {**overrides, "out_dir": tmp, "run_name": "bench",
                                   "sample_tokens": 0})
        run_device = resolve_device(cfg.device)
        reset_peak_memory(run_device)
        profiler = Profile(run_device) if profile else nullcontext()
        with profiler:
            result = train(cfg)
        memory = memory_mb(run_device)
        if profile:
            profiler.report(result.iter_num)
        scalars = read_scalars(result.run_dir)
        chosen_dtype = load_checkpoint(result.run_dir / "last.pt")["dtype"]  # what auto chose
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.model.block_size
    tok_s = statistics.median(e.value for e in scalars["perf/tokens_per_sec"])
    val = scalars["loss/val"][-1]
    return {
        "config": config.name, "device": str(run_device), "dtype": chosen_dtype,
        "optimizer": cfg.optimizer, "compile": cfg.compile, "iters": result.iter_num,
        "median_ms_per_iter": 1000 * tokens_per_iter / tok_s, "median_tokens_per_s": tok_s,
        "median_mfu": statistics.median(e.value for e in scalars["perf/mfu"]),
        "wall_time_s": result.wall_time, "val_loss": val.value, "val_loss_step": val.step,
        "peak_memory_mb": memory[1] if memory else None,
    }


class Profile:
    """torch's profiler over a whole run and, on a GPU, torch's warning at every wait for the
    device (set_sync_debug_mode), counted by the line of code that waited."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.waits: Counter[str] = Counter()

    def __enter__(self) -> Profile:
        if self.cuda:
            self.caught = warnings.catch_warnings(record=True)
            self.warned = self.caught.__enter__()
            warnings.simplefilter("always")  # every wait, not the first from each line
            torch.cuda.set_sync_debug_mode("warn")
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profiler.__exit__(*exc)
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self.caught.__exit__(*exc)
            self.waits = Counter(f"{w.filename}:{w.lineno}" for w in self.warned
                                 if "synchroniz" in str(w.message))

    def report(self, iters: int) -> None:
        events = self.profiler.key_averages()
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=20))
        if self.cuda:
            # the kernels' own rows, as the table's total counts them (an op's row repeats
            # its kernels' time); the run's few evaluation batches are in it too
            busy = sum(e.self_device_time_total for e in events
                       if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1000
            print(f"device busy {busy / iters:.2f} ms/iter over {iters} iterations")
            for where, count in self.waits.most_common(15):
                print(f"{count:>8} waits for the GPU at {where} ({count / iters:.2f} per iter)")


def main(
    config: Annotated[Path, typer.Option(help="Preset to train.")] = QUICKSTART,
    input: Annotated[Path | None, typer.Option(
        help="Train on this text (char-level) instead of the preset's data_dir.")] = None,
    max_iters: Annotated[int | None, typer.Option(help="Override the preset's.")] = None,
    eval_interval: Annotated[int | None, typer.Option(help="Override the preset's.")] = None,
    eval_iters: Annotated[int | None, typer.Option(help="Override the preset's.")] = None,
    dtype: Annotated[str | None, typer.Option(help="Override the preset's.")] = None,
    device: Annotated[str | None, typer.Option(help="Override the preset's.")] = None,
    compile: Annotated[bool | None, typer.Option(
        "--compile/--no-compile", help="Override the preset's.")] = None,
    time_to_loss_target: Annotated[float | None, typer.Option(
        "--time-to-loss", help="Race the recipes to this val loss instead (needs --input).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Rounds of the race.")] = 2,
    ablate: Annotated[bool, typer.Option(
        help="With --time-to-loss: race the layout switches (ablation_recipes) instead.")] = False,
    settings: Annotated[list[str] | None, typer.Option(
        "--set", help="KEY=VALUE: any other setting, the value in TOML (bias=false).")] = None,
    profile: Annotated[bool, typer.Option(
        help="Under torch's profiler: print where the time went (see the module's doc).")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write figures here.")] = None,
) -> None:
    """Train a preset and print its speed, MFU, memory and final loss; or race the recipes."""
    with reported():  # a bad path or setting, before the work
        check_paths(input, json_path)
        if time_to_loss_target is not None:
            if input is None:
                raise UserError("--time-to-loss races on a text: add --input FILE")
            return race(input, ablation_recipes() if ablate else RECIPES, time_to_loss_target,
                        repeats, max_iters, json_path)
        overrides = {"max_iters": max_iters, "eval_interval": eval_interval,
                     "eval_iters": eval_iters, "dtype": dtype, "device": device,
                     "compile": compile}
        overrides = {**parse_settings(settings or []),
                     **{k: v for k, v in overrides.items() if v is not None}}
        figures = train_figures(config, input, overrides, profile)
        for key, value in figures.items():
            print(f"{key:>20}: {value:.4g}" if isinstance(value, float) else f"{key:>20}: {value}")
        if json_path:
            write_bytes_atomic(json_path, (json.dumps(figures, indent=2) + "\n").encode())


if __name__ == "__main__":
    run_command(lambda: typer.run(main))
