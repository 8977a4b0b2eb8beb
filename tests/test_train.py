"""Training end to end: loss falls, TensorBoard and checkpoints are real, resume is exact,
bad configs get the promised one-line messages, and the CLI works as a subprocess."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.batches import batch_sampler
from data.loader import load_meta, load_split
from data.sources import DataError
from machine.datasheets import datasheet_peak_flops
from machine.device import resolve_device
from machine.errors import UserError
from machine.perf import peak_flops
from model import GPT, GPTConfig
from tests.forked import python
from tests.layouts import LAYOUTS
from train import estimate_loss, train
from training.config import ConfigError, load_config
from training.distributed import Dist
from weights.checkpoint import (
    CheckpointError,
    link_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from weights.gpt2 import layout_problem
from weights.loading import model_from_checkpoint

REPO = Path(__file__).resolve().parent.parent


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """Every value of `tag`, file by file in the order the files were written. TensorBoard
    reads a folder's files in name order, and within one process and one second, writer 10's
    file sorts before writer 9's, so a run resumed in the same test process would otherwise
    be read out of order."""
    def written(f: Path) -> tuple[int, int]:  # events.out.tfevents.<seconds>.<host>.<pid>.<n>
        return int(f.name.split(".")[3]), int(f.name.rsplit(".", 1)[1])

    values = []
    for f in sorted(run_dir.glob("events.out.tfevents.*"), key=written):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [(e.step, e.value) for e in acc.Scalars(tag)]
    return values


def test_tiny_model_loss_falls_and_lands_in_tensorboard(tiny_config):
    cfg = dataclasses.replace(tiny_config, max_iters=150, eval_interval=50)
    result = train(cfg)
    val = scalars(result.run_dir, "loss/val")
    assert [step for step, _ in val] == [50, 100, 150]  # no evaluation before training
    assert val[-1][1] < 1.4 and result.best_val_loss == pytest.approx(val[-1][1])
    train_loss = scalars(result.run_dir, "train/loss_step")
    assert [step for step, _ in train_loss] == list(range(5, 151, 5))
    vocab_size = load_meta(cfg.data_dir)["vocab_size"]
    # the mean of the first 5 steps, in which an untrained model guesses about uniformly and
    # learns fast
    assert math.log(vocab_size) - 1 < train_loss[0][1] < math.log(vocab_size) + 0.1
    for tag in ("train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu"):
        assert len(scalars(result.run_dir, tag)) == 30, tag
    acc = EventAccumulator(str(result.run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert "sample/text_summary" in acc.Tags()["tensors"]


def test_bf16_autocast_run_trains_and_samples(tiny_config):
    # bf16 is the default on a GPU that has it, and on the CPU the same autocast path runs,
    # sampling included; only ten steps, because a CPU without native bf16 emulates it, which
    # is much slower than fp32
    cfg = dataclasses.replace(tiny_config, dtype="bfloat16", max_iters=10, eval_interval=5,
                              sample_tokens=8)
    result = train(cfg)
    val = scalars(result.run_dir, "loss/val")
    assert [step for step, _ in val] == [5, 10] and val[1][1] < val[0][1]
    acc = EventAccumulator(str(result.run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert len(acc.Tensors("sample/text_summary")) == 2
    assert load_checkpoint(result.run_dir / "last.pt")["model"]["lm_head.weight"].dtype == torch.float32


def test_float16_keeps_a_loss_scale_that_resumes_and_a_run_may_turn_to_float16(tiny_config):
    # float16 alone scales its loss, and a checkpoint keeps the scale for the resumed run; a
    # run saved in bf16 that resumes in float16 starts from a fresh scale
    cfg = tiny_config.updated(max_iters=10, eval_interval=5, sample_tokens=0)
    train(cfg.updated(dtype="bfloat16"))
    assert load_checkpoint(Path(cfg.out_dir) / "tiny" / "last.pt")["scaler"] == {}
    turned = train(cfg.updated(dtype="float16", max_iters=20), resume=True)
    first = load_checkpoint(turned.run_dir / "last.pt")["scaler"]
    assert first["scale"] > 1 and turned.iter_num == 20 and math.isfinite(turned.best_val_loss)
    train(cfg.updated(dtype="float16", max_iters=25), resume=True)
    then = load_checkpoint(turned.run_dir / "last.pt")["scaler"]
    # five more steps on the saved scale: it grew towards its next doubling, or it changed
    assert then["_growth_tracker"] == first["_growth_tracker"] + 5 or then["scale"] != first["scale"]


def test_checkpoint_holds_the_model_that_was_evaluated(tiny_config):
    result = train(tiny_config)
    ckpt = load_checkpoint(result.run_dir / "last.pt")
    assert ckpt["iter_num"] == 50 and ckpt["config"]["n_embd"] == 32
    assert ckpt["tokenizer"]["kind"] == "char"
    model = model_from_checkpoint(ckpt)
    meta = load_meta(tiny_config.data_dir)
    splits = {s: batch_sampler(load_split(tiny_config.data_dir, s), meta,
                               tiny_config.model.block_size, tiny_config.batch_size)
              for s in ("train", "val")}
    # evaluated again on the device and in the precision that the run used (on a GPU machine
    # the preset's device auto is the GPU, whose sums differ from the CPU's in the last bits)
    device, dtype = resolve_device(tiny_config.device), getattr(torch, ckpt["dtype"])
    losses = estimate_loss(model.to(device), splits, tiny_config, device,
                           torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32),
                           Dist())
    assert losses["val"] == ckpt["val_loss"] == result.final_losses["val"]
    assert (result.run_dir / "best.pt").is_file()


def test_checkpoint_round_trips_to_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=8, n_layer=2, n_head=2, n_embd=16)).eval()
    state = {"model_args": dataclasses.asdict(model.config), "model": model.state_dict(),
             "iter_num": 3, "config": {}, "tokenizer": {"kind": "char", "vocab_size": 2, "chars": "ab"}}
    save_checkpoint(state, tmp_path / "ckpt.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt"))
    idx = torch.randint(0, 30, (2, 8))
    assert torch.equal(model(idx)[0], loaded(idx)[0])


def test_best_is_linked_not_rewritten_and_survives_the_next_save(tmp_path):
    def state(it):
        return {"model_args": {}, "model": {"w": torch.full((4,), float(it))}, "iter_num": it,
                "config": {}, "tokenizer": {"kind": "char", "vocab_size": 2, "chars": "ab"}}
    save_checkpoint(state(1), tmp_path / "last.pt")
    link_checkpoint(tmp_path / "last.pt", tmp_path / "best.pt")
    save_checkpoint(state(2), tmp_path / "last.pt")  # a rename, so best.pt keeps the old file
    assert load_checkpoint(tmp_path / "best.pt")["iter_num"] == 1
    assert load_checkpoint(tmp_path / "last.pt")["iter_num"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]


def test_broken_checkpoints_are_named(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint({"model_args": {}, "model": {}, "iter_num": 0, "config": {},
                     "tokenizer": {"kind": "char", "vocab_size": 2, "chars": "ab"}}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match="truncated or not a checkpoint"):
        load_checkpoint(truncated)
    with pytest.raises(CheckpointError, match="not a checkpoint written by this project"):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize("optimizer, layout", [("adamw", "gpt2"), ("muon", "gpt2"),
                                               ("muon", "modern"), ("muon", "bigram")])
def test_resumed_run_equals_uninterrupted_run_bit_for_bit(tiny_config, one_thread, optimizer,
                                                          layout):
    # the schedule is pinned by lr_decay_iters, so stopping at 20 does not change it
    cfg = tiny_config.updated(max_iters=40, eval_interval=20, lr_decay_iters=40, dropout=0.1,
                              optimizer=optimizer, **LAYOUTS[layout])
    straight = train(dataclasses.replace(cfg, run_name="straight"))
    train(dataclasses.replace(cfg, run_name="halves", max_iters=20))
    resumed = train(dataclasses.replace(cfg, run_name="halves"), resume=True)
    assert resumed.run_dir.name == "halves" and resumed.iter_num == 40
    a = load_checkpoint(straight.run_dir / "last.pt")["model"]
    b = load_checkpoint(resumed.run_dir / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    for tag in ("train/loss_step", "loss/val"):
        assert scalars(straight.run_dir, tag) == scalars(resumed.run_dir, tag)


# last.pt of a run made by the code before the packages (commit ed2947f, when train.py held the
# loop and checkpoint.py sat at the root): 10 Muon steps of the modern layout, one layer of
# width 16, on conftest's corpus, with these settings (and the schedule pinned to 20 steps,
# so that stopping at 15 does not change it)
OLD_CHECKPOINT = REPO / "tests" / "fixtures" / "last_before_packages.pt"
OLD_SETTINGS = dict(n_layer=1, n_embd=16, block_size=16, optimizer="muon", eval_interval=10,
                    lr_decay_iters=20,
                    sample_tokens=0, **{**LAYOUTS["modern"], "n_kv_head": 1})


def test_a_checkpoint_from_before_the_packages_samples_and_resumes_exactly(tiny_config,
                                                                           one_thread):
    old = load_checkpoint(OLD_CHECKPOINT)
    model = model_from_checkpoint(old)
    assert old["iter_num"] == 10 and model.config.n_kv_head == 1
    finals = {}
    for run_name, stops in (("straight", [20]), ("in-two", [15, 20])):
        folder = Path(tiny_config.out_dir) / run_name
        folder.mkdir(parents=True)
        shutil.copyfile(OLD_CHECKPOINT, folder / "last.pt")
        for max_iters in stops:
            result = train(tiny_config.updated(run_name=run_name, max_iters=max_iters,
                                               **OLD_SETTINGS), resume=True)
        assert result.iter_num == 20
        finals[run_name] = load_checkpoint(folder / "last.pt")
    a, b = finals["straight"], finals["in-two"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["val_loss"] == b["val_loss"] < old["val_loss"]  # and it kept learning


def test_a_new_run_never_overwrites_an_old_one(tiny_config):
    cfg = dataclasses.replace(tiny_config, max_iters=5, eval_interval=5, sample_tokens=0)
    first, second = train(cfg), train(cfg)
    assert (first.run_dir.name, second.run_dir.name) == ("tiny", "tiny-2")


def test_mfu_yardstick_is_the_datasheet_peak_on_known_gpus_else_measured():
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12  # not the SXM figure
    assert datasheet_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert datasheet_peak_flops("NVIDIA L40S") == 362e12 and datasheet_peak_flops("NVIDIA L4") == 121e12
    assert datasheet_peak_flops("Tesla T4") is None
    flops, source = peak_flops(torch.device("cpu"), torch.float32)
    assert source.startswith("this machine's best float32 matmul") and 1e9 < flops < 1e14


def test_the_cpu_peak_is_measured_once_and_reused(tmp_path, monkeypatch):
    # a busy moment at a run's start must not move MFU's yardstick, so later runs reuse it
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    first, source = peak_flops(torch.device("cpu"), torch.float32)
    assert str(tmp_path / "peak_flops.json") in source
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    (key,) = cached
    assert "float32" in key and f"{torch.get_num_threads()} threads" in key
    cached[key] = 1.5e9  # as if measured while the machine was busy; it still stays the yardstick
    (tmp_path / "peak_flops.json").write_text(json.dumps(cached))
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == 1.5e9


@pytest.mark.parametrize("damage", [
    lambda key: [1.5e9], lambda key: "1.5e9", lambda key: 0, lambda key: None,
    lambda key: {key: 0.0}, lambda key: {key: -2e9}, lambda key: {key: math.nan},
    lambda key: {key: math.inf}, lambda key: {key: "1.5e9"}, lambda key: {key: True},
    lambda key: {key: 5e-324}, lambda key: {key: [1.5e9]},
], ids=["a list", "a string", "zero", "null", "a zero peak", "a negative peak", "a NaN peak",
        "an infinite peak", "a peak as text", "a peak of true", "a peak too small to be one",
        "a peak in a list"])
def test_a_damaged_peak_in_the_cache_is_measured_again_and_rewritten(tmp_path, monkeypatch,
                                                                     damage):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path))
    path = tmp_path / "peak_flops.json"
    measured, _ = peak_flops(torch.device("cpu"), torch.float32)
    (key,) = json.loads(path.read_text())
    # NaN and infinity as Python's json writes them, which its reader takes back
    path.write_text(json.dumps(damage(key)))
    again, _ = peak_flops(torch.device("cpu"), torch.float32)
    assert 1e6 <= again <= 1e18 and json.loads(path.read_text()) == {key: again}
    # a figure for another machine, or another dtype, is kept beside it
    path.write_text(json.dumps({key: again, "another machine, float32, 1 threads": 7e9}))
    assert peak_flops(torch.device("cpu"), torch.float32)[0] == again
    assert json.loads(path.read_text())["another machine, float32, 1 threads"] == 7e9


def test_mfu_is_a_percentage_after_a_damaged_peak_in_the_cache(char_data, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "peak_flops.json").write_text("[1.5e9]")  # the wrong shape: a list
    args = ["train.py", "--config", "config/tiny.toml", "--data-dir", str(char_data),
            "--max-iters", "10", "--sample-tokens", "0"]
    env = {**os.environ, "GPTLAB_CACHE": str(cache)}
    first = python([*args, "--out-dir", str(tmp_path / "a")], env=env)
    assert first.returncode == 0, first.stderr
    peaks = json.loads((cache / "peak_flops.json").read_text())
    (key,) = peaks
    peaks[key] = 5e-324  # a figure a billion billion times too small
    (cache / "peak_flops.json").write_text(json.dumps(peaks))
    second = python([*args, "--out-dir", str(tmp_path / "b")], env=env)
    assert second.returncode == 0, second.stderr
    assert 1e6 <= json.loads((cache / "peak_flops.json").read_text())[key] <= 1e18
    for result in (first, second):
        mfu = [float(m) for m in re.findall(r"MFU (-?[\d.e+]+)%", result.stdout)]
        assert mfu and all(0 <= m < 100 for m in mfu), result.stdout


HEAP_PAGES = """
import torch
from machine.device import reuse_freed_memory
reuse_freed_memory()
tensors = [torch.ones(2 << 20) for _ in range(16)]  # 8 MB each, under the mmap threshold: on the heap
print(next(line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")))
"""


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="this kernel gives no transparent huge pages")
def test_a_training_process_allocates_its_tensors_in_huge_pages():
    # a fresh interpreter, because the forked commands share their server's heap
    result = subprocess.run([sys.executable, "-c", HEAP_PAGES], capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[1]) >= 64 << 10, result.stdout  # kB: most of the 128 MB


def test_a_config_path_that_is_no_toml_file_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=f"config {tmp_path} is a folder; give a TOML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="config /dev/null is not a regular file"):
        load_config("/dev/null")
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbfn_layer = 3\n")  # a byte-order mark, as some editors write
    assert load_config(bom).model.n_layer == 3


@pytest.mark.parametrize("toml, overrides, message", [
    ("n_layers = 2", {}, "unknown config key 'n_layers'; did you mean 'n_layer'?"),
    ("n_layer = '2'", {}, "n_layer must be int, got str '2'"),
    ("learning_rate = true", {}, "learning_rate must be float, got bool True"),
    ("", {"n_embd": 30, "n_head": 4}, "n_embd (30) must be divisible by n_head (4)"),
    ("", {"dtype": "fp8"}, "dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
    ("", {"max_iters": 0}, "max_iters must be at least 1, got 0"),
    ("n_layer = ", {}, "is not valid TOML"),
    ("grad_clip = inf", {}, "grad_clip must be a finite number, got inf"),
    ("", {"min_lr": float("nan")}, "min_lr must be a finite number, got nan"),
])
def test_bad_configs_are_rejected_with_the_key_named(tmp_path, toml, overrides, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert message in str(info.value)


def test_block_size_larger_than_the_data_is_rejected(tiny_config):
    cfg = tiny_config.updated(block_size=10**6)
    with pytest.raises(DataError, match=r"block_size \(1000000\) must be smaller than the train split"):
        train(cfg)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}  # so that help lines are not wrapped
    return python(["train.py", *args], env=env)


def test_every_preset_is_a_valid_config():
    presets = sorted((REPO / "config").glob("*.toml"))
    assert len(presets) >= 6
    for path in presets:
        cfg = load_config(path)
        assert cfg.model_config(vocab_size=65).n_embd == cfg.model.n_embd, path.name


def test_training_benchmark_reads_its_figures_back(tmp_path, corpus_file):
    out = tmp_path / "figures.json"
    proc = python(["-m", "benchmarks.train", "--config", "config/tiny.toml", "--input",
                   str(corpus_file), "--max-iters", "20", "--json", str(out),
                   "--set", "bias=false", "--set", 'optimizer="muon"', "--profile"])
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())
    assert figures["iters"] == 20 and figures["val_loss_step"] == 20
    assert figures["dtype"] == "float32" and figures["device"] == "cpu"
    assert figures["median_tokens_per_s"] > 0 and 0 < figures["median_mfu"] < 1
    uniform_guess = math.log(len(set(corpus_file.read_text())))
    assert figures["val_loss"] < uniform_guess and figures["peak_memory_mb"] > 0
    assert "median_ms_per_iter" in proc.stdout
    assert figures["optimizer"] == "muon"  # --set's TOML string overrides the config's "adamw"
    # the profile's table, sorted by CPU time, lists the matmuls, run at least 20 x 3 x 2 x 2
    # times
    calls = re.search(r"^ +aten::mm +.* (\d+) *$", proc.stdout, re.MULTILINE)
    assert calls and int(calls.group(1)) >= 240, proc.stdout


def test_wallclock_times_a_trainer_between_its_log_lines(char_data, tmp_path):
    proc = python(["-m", "benchmarks.wallclock", "--tokens-per-iter", "256", "--",
                   sys.executable, "train.py", "--config", "config/tiny.toml", "--data-dir",
                   str(char_data), "--out-dir", str(tmp_path), "--max-iters", "40",
                   "--eval-interval", "20"])
    assert proc.returncode == 0, proc.stderr
    # log points at 5, 10, ..., 40 and evaluations at 20 and 40 give the spans 5-10, 10-15,
    # 15-20, 20-25, ..., 35-40, and the first is left out as warm-up
    [summary] = [line for line in proc.stdout.splitlines() if line.startswith("wall clock:")]
    assert re.fullmatch(r"wall clock: median [\d.]+ ms/iter over 6 spans between log "
                        r"points, [\d,]+ tokens/s", summary), proc.stdout


def test_cli_help_documents_every_config_field():
    result = run_cli("--help")
    assert result.returncode == 0
    for option in ("--config", "--resume", "--n-layer", "--learning-rate", "--data-dir",
                   "--gradient-accumulation-steps", "--compile", "--seed"):
        assert option in result.stdout


def test_cli_trains_and_resumes(tmp_path, char_data):
    common = ("--config", str(REPO / "config" / "tiny.toml"), "--data-dir", str(char_data),
              "--out-dir", str(tmp_path), "--max-iters", "10", "--eval-interval", "5")
    first = run_cli(*common, "--dtype", "auto")
    assert first.returncode == 0, first.stderr
    assert re.search(r"^dtype (float32|bfloat16) \(auto: ", first.stdout, re.MULTILINE)
    assert "best val loss" in first.stdout and (tmp_path / "tiny" / "best.pt").is_file()
    resumed = run_cli(*common[:-4], "--max-iters", "15", "--eval-interval", "5", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(tmp_path / "tiny" / "last.pt")["iter_num"] == 15


@pytest.mark.parametrize("args, message", [
    (("--n-layers", "2"), "No such option '--n-layers'"),
    (("--config", "nope.toml"), "error: config file nope.toml not found; presets are in config/"),
    (("--data-dir", "no/such/dir"), "error: no prepared dataset in no/such/dir"),
    (("--resume", "--run-name", "never"), "error: nothing to resume"),
])
def test_cli_bad_input_gives_one_line_and_exit_code(tmp_path, args, message):
    result = run_cli("--out-dir", str(tmp_path), *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_time_to_loss_race_times_each_recipe_from_process_start(char_data):
    from benchmarks.race import Recipe, time_to_loss
    tiny = REPO / "config" / "tiny.toml"
    short = {"eval_interval": 10, "max_iters": 40}
    recipes = [Recipe("slow", tiny, {**short, "learning_rate": 3e-4, "min_lr": 3e-5}),
               Recipe("fast", tiny, {**short, "optimizer": "muon"}),
               Recipe("stopped", tiny, {**short, "optimizer": "muon"}, stop_at_target=True)]
    rows = time_to_loss(recipes, char_data, target=2.6, repeats=1)
    assert [row["recipe"] for row in rows] == ["slow", "fast", "stopped"]
    slow, fast, stopped = rows
    assert slow["iters_to_target"] is None and slow["speedup"] is None  # it never reached the target
    assert fast["iters_to_target"] in (10, 20, 30, 40)
    assert 1 < fast["seconds_to_target"] < fast["wall_s"]  # the process start counts
    assert fast["final_val_loss"] < 2.6 < slow["final_val_loss"]
    assert slow["ms_per_iter"] > 0 and fast["ms_per_iter"] > 0
    assert slow["dtype"] == fast["dtype"] == "float32"  # the dtype each run computed in (tiny's)
    # a run stopped at the target takes the same iterations to reach it and has no
    # final loss of its own
    assert stopped["iters_to_target"] == fast["iters_to_target"]
    assert stopped["final_val_loss"] is None
    # every evaluation of every round, as (iteration, seconds from the start, val loss)
    (evaluations,) = fast["evaluations"]
    assert [it for it, _, _ in evaluations] == [10, 20, 30, 40]
    assert [loss for _, _, loss in evaluations][-1] == fast["final_val_loss"]
    assert (fast["iters_to_target"], fast["seconds_to_target"]) in [
        (it, pytest.approx(seconds, abs=0.01)) for it, seconds, _ in evaluations]
    assert [it for it, _, _ in stopped["evaluations"][0]][-1] == stopped["iters_to_target"]
    # the start: the first log point (iteration 5) is printed before the first evaluation
    assert 0 < fast["first_log_s"] < evaluations[0][1]


def test_an_evaluations_cost_is_the_time_around_it_less_the_steps():
    from benchmarks.race import evaluation_seconds
    # train.py: log point N, then the evaluation at N, then the next log point 5 steps later;
    # at 0.1 s an iteration, the evaluations at 10 and 20 take 1 s and 2 s, and the one at 30
    # (the last) has no log point after it
    ours = [(0.5, "iter 5/30: loss 3.0"), (1.0, "iter 10/30: loss 2.9"),
            (1.8, "iter 10: train loss 2.9, val loss 2.8"), (2.5, "iter 15/30: loss 2.8"),
            (3.0, "iter 20/30: loss 2.7"), (4.4, "iter 20: train loss 2.7, val loss 2.6"),
            (5.5, "iter 25/30: loss 2.6"), (6.0, "iter 30/30: loss 2.5"),
            (6.5, "iter 30: train loss 2.5, val loss 2.4")]
    assert evaluation_seconds(ours, 0.1) == 1.5  # the median of 1 and 2
    # nanoGPT: its evaluation at N comes before step N, so after the log point N - 10; the one
    # at iteration 0 has no log point before it
    nanogpt = [(0.0, "step 0: train loss 4.2, val loss 4.2"), (3.0, "iter 0: loss 4.1"),
               (4.0, "iter 10: loss 3.5"), (5.5, "step 20: train loss 3.2, val loss 3.2"),
               (5.5, "iter 20: loss 3.1"), (6.5, "iter 30: loss 2.9")]
    assert evaluation_seconds(nanogpt, 0.1) == 0.5
    assert evaluation_seconds(ours[-1:], 0.1) is None  # no evaluation between log points


def test_the_race_runs_nanogpt_on_its_own_settings_for_the_device(tmp_path, monkeypatch):
    from benchmarks.race import AVX2_ONLY, NANOGPT_CPU, check_nanogpt, run_recipe
    with pytest.raises(UserError, match="no nanoGPT checkout there"):
        check_nanogpt(tmp_path)
    for name in ("train.py", "model.py"):
        (tmp_path / name).write_text("")
    with pytest.raises(UserError, match="its data is not prepared"):
        check_nanogpt(tmp_path)
    data = tmp_path / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        (data / name).write_bytes(b"")
    cpu, gpu = check_nanogpt(tmp_path), check_nanogpt(tmp_path, gpu=True)
    (cpu_args, cwd), (gpu_args, _) = (n.command(tmp_path, Path("/out"), "r") for n in (cpu, gpu))
    assert cwd == tmp_path and cpu_args[-1] == gpu_args[-1] == "--out_dir=/out/r"
    assert cpu_args[2:-1] == NANOGPT_CPU and "--device=cpu" in cpu_args
    # on a GPU, its baby GPT as its config file gives it
    assert gpu_args[2:-1] == ["config/train_shakespeare_char.py", "--log_interval=10"]
    # the race reads nanoGPT's log as it prints it (a stand-in here, since CI has no nanoGPT):
    # evaluations are "step N" lines, and it is stopped at the target; --avx2's limits reach it
    (tmp_path / "train.py").write_text(
        "import os, sys, time\n"
        f"if any(os.environ.get(k) != v for k, v in {AVX2_ONLY!r}.items()): sys.exit('not AVX2')\n"
        "for it in range(0, 1000, 10):\n"
        "    if it % 20 == 0:\n"
        "        print(f'step {it}: train loss {4.2 - it / 20:.4f}, val loss {4.2 - it / 20:.4f}')\n"
        "        time.sleep(0.3)\n"
        "    print(f'iter {it}: loss 3.0, time 10.00ms, mfu 1.00%', flush=True)\n"
        "    time.sleep(0.2)\n")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")  # the race's limits replace the caller's
    figures = run_recipe(cpu, tmp_path, tmp_path / "out", "r", target=2.6, env=AVX2_ONLY)
    assert figures["iters_to_target"] == 40 and figures["final_val_loss"] is None
    assert [(it, loss) for it, _, loss in figures["evaluations"]] == [(0, 4.2), (20, 3.2), (40, 2.2)]
    assert figures["dtype"] == "float32"  # nanoGPT's own choice on a CPU, as it prints none
    assert figures["wall_s"] < 10  # stopped at the target, long before its 1000 iterations
    # nanoGPT's first log point comes after its evaluation at iteration 0 and before the next
    assert figures["evaluations"][0][1] <= figures["first_log_s"] < figures["evaluations"][1][1]
    # the stand-in's evaluation at 20 adds 0.3 s to its steps' 0.02 s an iteration (the bounds
    # leave room for a busy machine's delays in reading its lines)
    assert 0.15 < figures["evaluation_s"] < 0.8


def test_the_race_refuses_what_it_cannot_race_in_one_line(tmp_path):
    from benchmarks.race import build_c_kernels
    text = tmp_path / "input.txt"
    text.write_text("to be or not to be\n" * 50)
    result = python(["-m", "benchmarks.train", "--time-to-loss", "2", "--input", str(text),
                     "--ablate", "--avx2"])
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: --avx2 races the float32 recipes, and the layout "
                                     "switches' rows take dtype auto; give one of --ablate and --avx2")
    # a build of the C kernels that fails stops the race before any run
    with pytest.raises(UserError, match="the C kernels could not be built for the race: .*GPTLAB_CFLAGS"):
        build_c_kernels({"GPTLAB_CFLAGS": "-mno-such-flag", "GPTLAB_CACHE": str(tmp_path / "cache")})


def test_a_checkpoint_from_before_the_layout_switches_loads_as_gpt2(trained_run, tmp_path):
    ckpt = torch.load(trained_run / "best.pt", weights_only=True)
    switches = ("pos_embedding", "norm", "qk_norm", "mlp", "tie_embeddings", "n_kv_head")
    old = {**ckpt, "model_args": {k: v for k, v in ckpt["model_args"].items() if k not in switches}}
    assert len(old["model_args"]) == len(ckpt["model_args"]) - len(switches)
    torch.save(old, tmp_path / "old.pt")
    then, now = (model_from_checkpoint(load_checkpoint(p)) for p in (tmp_path / "old.pt",
                                                                      trained_run / "best.pt"))
    assert layout_problem(then.config) is None and then.config.n_kv_head == then.config.n_head
    idx = torch.randint(0, then.config.vocab_size, (2, 16))
    assert torch.equal(then(idx)[0], now(idx)[0])


def test_the_same_run_on_a_busy_machine_computes_the_same_numbers(tmp_path, char_data):
    # dtype auto is decided by the hardware, never by a race at start, and MFU's CPU
    # yardstick is measured once, so another process spinning on a core changes neither
    common = ("--config", str(REPO / "config" / "tiny.toml"), "--data-dir", str(char_data),
              "--max-iters", "10", "--eval-interval", "5", "--log-interval", "2",
              "--dtype", "auto", "--sample-tokens", "16")
    quiet = run_cli(*common, "--out-dir", str(tmp_path / "quiet"))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = run_cli(*common, "--out-dir", str(tmp_path / "busy"))
    finally:
        hog.kill()
        hog.wait()
    assert quiet.returncode == 0 and busy.returncode == 0, busy.stderr
    dtype_line = [line for line in quiet.stdout.splitlines() if line.startswith("dtype ")]
    assert dtype_line and dtype_line == [line for line in busy.stdout.splitlines()
                                         if line.startswith("dtype ")]
    runs = [load_checkpoint(tmp_path / name / "tiny" / "last.pt") for name in ("quiet", "busy")]
    assert runs[0]["dtype"] == runs[1]["dtype"] and runs[0]["val_loss"] == runs[1]["val_loss"]
    assert all(torch.equal(runs[0]["model"][k], runs[1]["model"][k]) for k in runs[0]["model"])
    scalars = [EventAccumulator(str(tmp_path / name / "tiny")).Reload() for name in ("quiet", "busy")]
    samples = [[e.tensor_proto.string_val[0] for e in acc.Tensors("sample/text_summary")]
               for acc in scalars]
    assert samples[0] == samples[1] and len(samples[0]) == 2  # at iters 5 and 10
    assert all(0 < e.value < 1 for acc in scalars for e in acc.Scalars("perf/mfu"))
