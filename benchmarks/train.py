"""Training speed and quality, read back from the runs' own TensorBoard files.

Usage:
    python -m benchmarks.train --input tinyshakespeare/input.txt     # the quickstart preset, CPU
    python -m benchmarks.train --config config/baby_gpt.toml         # on a GPU: bf16, compiled
    python -m benchmarks.train --config config/gpt2_small.toml --max-iters 200 --no-compile
    python -m benchmarks.train --config config/baby_gpt_adamw.toml --set bias=false --profile
    python -m benchmarks.train --time-to-loss 1.95 --input tinyshakespeare/input.txt
    python -m benchmarks.train --time-to-loss 1.95 --input tinyshakespeare/input.txt --ablate
    python -m benchmarks.train --time-to-loss 1.95 --input input.txt --nanogpt ../nanoGPT
    python -m benchmarks.train --time-to-loss 1.95 --input input.txt --nanogpt ../nanoGPT --avx2
    python -m benchmarks.train --input input.txt --max-iters 100 --neighbours 1   # a busy machine

One preset (by default config/quickstart.toml) is trained in this process into a temporary
folder, on the text of --input (prepared char-level there) or else on the preset's own
data_dir. It prints median ms/iter and tokens/s, median MFU, the wall time of the whole run
(evaluations included), the final val loss and peak memory: allocated tensors on CUDA, the
process's resident size on the CPU. --set KEY=VALUE changes any TrainConfig setting (the
value in TOML: --set bias=false, --set sample_prompt='"ROMEO:"').

--profile runs the same training under torch's profiler and prints where the time went: on
a GPU, the kernels that took the most device time, the device's busy time per iteration
(to set beside the median ms/iter of a run without --profile: well below it, the GPU waits
on Python, so fewer or fused launches pay; near it, the kernels themselves are the cost),
and every place that made the process wait for the GPU, with how often. The profiler's own
cost makes that run slower, so its ms/iter are not the figures to report.

--time-to-loss races training recipes instead (benchmarks/race.py): the classic recipe
(nanoGPT's settings), the quickstart as shipped and in fp32, or with --ablate what each
switch of the model's layout buys; with --nanogpt, nanoGPT itself first, as the baseline.
On a GPU, the baby GPT presets race, and nanoGPT runs its own baby GPT. --avx2 races the
float32 recipes as a CPU without AVX-512 runs them (benchmarks/race.py's AVX2_ONLY).
--neighbours N runs N CPU-bound processes beside every run, nanoGPT's too, as on a
machine that is not idle.
Each runs as its own process, timed from its start to its first evaluation at or below the
target val loss; the table gives the medians of --repeats alternating rounds.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import tomllib
import warnings
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.autograd import DeviceType

from benchmarks import check_paths, neighbours
from benchmarks.race import (
    AVX2_ONLY,
    GPU_RECIPES,
    RECIPES,
    ablation_recipes,
    build_c_kernels,
    check_nanogpt,
    machine_line,
    print_rows,
    time_to_loss,
)
from data.documents import read_text
from data.prepare import prepare_text
from machine.device import resolve_device
from machine.errors import UserError, reported, run_command
from machine.files import write_bytes_atomic
from measure.memory import memory_mb, reset_peak_memory
from train import train
from training.config import load_config
from weights.checkpoint import load_checkpoint

QUICKSTART = Path("config/quickstart.toml")


def read_scalars(run_dir: Path) -> dict[str, list[Any]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def race(input: Path, recipes: list, target: float, repeats: int, json_path: Path | None,
         avx2: bool = False, busy: int = 0) -> None:
    """--time-to-loss: race the recipes to a val loss on a char-level copy of `input`, with
    avx2, each held to AVX2 (AVX2_ONLY), beside `busy` CPU-bound processes."""
    print(machine_line() + ("; held to AVX2" if avx2 else "")
          + (f"; beside {busy} CPU-bound process{'es' * (busy > 1)}" if busy else ""))
    env = AVX2_ONLY if avx2 else None
    if not torch.cuda.is_available():
        build_c_kernels(env)
    with tempfile.TemporaryDirectory() as tmp:
        prepare_text(read_text(input), "char", tmp, source=str(input))
        with neighbours(busy):
            rows = time_to_loss(recipes, Path(tmp), target, repeats, env)
    print_rows(rows, target)
    if json_path:
        write_bytes_atomic(json_path, (json.dumps(rows, indent=2) + "\n").encode())


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
    nanogpt: Annotated[Path | None, typer.Option(
        help="With --time-to-loss: race nanoGPT too, from this checkout, as the baseline (its "
             "README's CPU recipe, or on a GPU its baby GPT).")] = None,
    settings: Annotated[list[str] | None, typer.Option(
        "--set", help="KEY=VALUE: any other setting, the value in TOML (bias=false).")] = None,
    avx2: Annotated[bool, typer.Option(
        help="With --time-to-loss: hold every trainer to AVX2 (torch, MKL, oneDNN, the C "
             "kernels), as a CPU without AVX-512 runs them; only the float32 recipes race.")] = False,
    profile: Annotated[bool, typer.Option(
        help="Under torch's profiler: print where the time went (see the module's doc).")] = False,
    busy: Annotated[int, typer.Option(
        "--neighbours", min=0, max=64,
        help="Run this many CPU-bound processes beside every run, as on a busy machine.")] = 0,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write figures here.")] = None,
) -> None:
    """Train a preset and print its speed, MFU, memory and final loss; or race the recipes."""
    with reported():  # a bad path or setting, before the work
        check_paths(input, json_path)
        if time_to_loss_target is not None:
            if input is None:
                raise UserError("--time-to-loss races on a text: add --input FILE")
            gpu = torch.cuda.is_available()  # on a GPU, the baby GPT presets race instead
            if gpu and (ablate or avx2):
                raise UserError(f"--{'ablate' if ablate else 'avx2'} races the quickstart as a CPU "
                                f"runs it; hide the GPU with CUDA_VISIBLE_DEVICES=\"\"")
            if ablate and avx2:
                raise UserError("--avx2 races the float32 recipes, and the layout switches' rows "
                                "take dtype auto; give one of --ablate and --avx2")
            if avx2 and platform.machine() not in ("x86_64", "AMD64"):
                raise UserError(f"--avx2 holds an x86 CPU to AVX2, and this one is "
                                f"{platform.machine()}; race without it")
            recipes = ablation_recipes() if ablate else GPU_RECIPES if gpu else RECIPES
            if avx2:  # dtype auto would choose bf16 by this CPU's flags, so only float32 races
                recipes = [r for r in recipes if r.overrides.get("dtype") == "float32"]
            if nanogpt is not None:
                recipes = [check_nanogpt(nanogpt, gpu), *recipes]
            return race(input, recipes, time_to_loss_target, repeats, json_path, avx2, busy)
        overrides = {"max_iters": max_iters, "eval_interval": eval_interval,
                     "eval_iters": eval_iters, "dtype": dtype, "device": device,
                     "compile": compile}
        overrides = {**parse_settings(settings or []),
                     **{k: v for k, v in overrides.items() if v is not None}}
        if busy:
            print(f"{machine_line()}; beside {busy} CPU-bound process{'es' * (busy > 1)}")
        with neighbours(busy):
            figures = train_figures(config, input, overrides, profile)
        for key, value in figures.items():
            print(f"{key:>20}: {value:.4g}" if isinstance(value, float) else f"{key:>20}: {value}")
        if json_path:
            write_bytes_atomic(json_path, (json.dumps(figures, indent=2) + "\n").encode())


if __name__ == "__main__":
    run_command(main)
