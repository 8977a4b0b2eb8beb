"""Data-parallel training with torchrun on the CPU (gloo), DDP and FSDP: the same run as one
process, one writer, resumable exactly, and no hang when a process dies."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.layouts import LAYOUTS, cli_args
from weights.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parent.parent


def run(nproc: int | None, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """train.py on the tiny preset under torchrun with nproc processes, or plain (None)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"] if nproc else [sys.executable])
    return subprocess.run([*launcher, str(REPO / "train.py"), "--config",
                           str(REPO / "config" / "tiny.toml"), "--sample-tokens", "0", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          # a process that aborts in C++ still says where Python was
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})


def failure(result: subprocess.CompletedProcess) -> str:
    """What a failed run said: every line that names an error (a rank's own cause comes
    before torchrun's summary of it), then the end of stderr."""
    lines = result.stderr.splitlines()
    causes = [line for line in lines
              if re.search(r"Error|error:|terminate|Abort|Signal|Fatal|File \"", line)]
    return "\n".join([*causes[:60], "...", *lines[-15:]])


def losses(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.parametrize("optimizer, layout, parallel", [("adamw", "gpt2", "ddp"),
                                                          ("muon", "modern", "fsdp")])
def test_two_processes_equal_one_and_resume_exactly(tmp_path, char_data, optimizer, layout,
                                                   parallel):
    # under FSDP Muon gathers each matrix's update whole, and eval_iters 3 does not divide
    # among 2 processes whose every forward is a collective (AdamW is FSDP's plain path)
    common = ("--data-dir", str(char_data), "--optimizer", optimizer, *cli_args(LAYOUTS[layout]),
              "--gradient-accumulation-steps", "4", "--eval-interval", "6", "--eval-iters", "3",
              "--lr-decay-iters", "12", "--log-interval", "3")
    one = run(None, *common, "--max-iters", "12", "--out-dir", str(tmp_path / "one"))
    assert one.returncode == 0, failure(one)
    a = load_checkpoint(tmp_path / "one" / "tiny" / "last.pt")["model"]
    two = run(2, *common, "--max-iters", "12", "--parallel", parallel,
              "--out-dir", str(tmp_path / "two"))
    assert two.returncode == 0, failure(two)
    assert two.stdout.count("done: 12 iters") == 1  # only rank 0 reports
    b = load_checkpoint(tmp_path / "two" / "tiny" / "last.pt")["model"]
    # an fp32 run's Muon orthogonalizes in fp32 too, so it holds to AdamW's tolerance
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
    for tag in ("train/loss_step", "loss/val"):
        steps_one, values_one = zip(*losses(tmp_path / "one" / "tiny", tag), strict=True)
        steps_two, values_two = zip(*losses(tmp_path / "two" / "tiny", tag), strict=True)
        assert steps_one == steps_two
        torch.testing.assert_close(torch.tensor(values_one), torch.tensor(values_two),
                                   rtol=1e-5, atol=1e-5)
    # one writer: a single run folder, one set of checkpoints, one events stream
    assert [p.name for p in (tmp_path / "two").iterdir()] == ["tiny"]
    files = sorted(p.name for p in (tmp_path / "two" / "tiny").iterdir())
    assert [name for name in files if name.endswith(".pt")] == ["best.pt", "last.pt"]
    assert sum(name.startswith("events.out.tfevents") for name in files) == 2  # + hparams
    assert len(files) == 5 and ".lock" in files
    if parallel == "ddp":  # DDP resumes as a plain run does (test_train.py); FSDP's state is sharded
        return
    # 6 iterations, then 6 more resumed, equal the 12 straight, bit for bit
    resumed = tmp_path / "resumed"
    for more in ("6", "12"):
        result = run(2, *common, "--max-iters", more, "--parallel", parallel,
                     "--out-dir", str(resumed), *(["--resume"] if more == "12" else []))
        assert result.returncode == 0, failure(result)
    b = load_checkpoint(resumed / "tiny" / "last.pt")["model"]
    straight = load_checkpoint(tmp_path / "two" / "tiny" / "last.pt")["model"]
    assert all(torch.equal(straight[k], b[k]) for k in straight)
    assert losses(tmp_path / "two" / "tiny", "loss/val") == losses(resumed / "tiny", "loss/val")
    # a sharded run's checkpoint is today's file: a plain process samples from it
    sampled = subprocess.run([sys.executable, str(REPO / "sample.py"), "--run",
                              str(resumed / "tiny"), "--max-new-tokens", "8"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0 and len(sampled.stdout) > 8, sampled.stderr


def test_torchrun_with_one_process_trains_in_a_group_of_one_as_a_plain_run_does(tmp_path,
                                                                              char_data):
    # under torchrun even one process joins a process group and trains through DDP, so one
    # GPU runs the code of eight (and NCCL's path is tested with one)
    common = ("--data-dir", str(char_data), "--max-iters", "10", "--eval-interval", "10",
              "--eval-iters", "2")
    plain = run(None, *common, "--out-dir", str(tmp_path / "plain"))
    group = run(1, *common, "--out-dir", str(tmp_path / "group"))
    assert plain.returncode == 0 and group.returncode == 0, group.stderr[-2000:]
    assert "device cpu x 1 process," in group.stdout and "device cpu," in plain.stdout
    a = load_checkpoint(tmp_path / "plain" / "tiny" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "group" / "tiny" / "last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_dead_process_ends_the_run_instead_of_hanging(tmp_path, char_data):
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(REPO / "train.py"), "--config",
                             str(REPO / "config" / "tiny.toml"), "--data-dir", str(char_data),
                             "--out-dir", str(tmp_path), "--gradient-accumulation-steps", "2",
                             "--max-iters", "1000000", "--eval-interval", "100000"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    for line in proc.stdout:
        if "iter 0:" in line:
            break
    time.sleep(1.0)
    workers = [int(p) for p in subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train.py"],
                                              capture_output=True, text=True).stdout.split()]
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    started = time.time()
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:  # hung: clean up before failing
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.time() - started < 90


@pytest.mark.parametrize("args, error", [
    (("--learning-rate", "nan"), "error: learning_rate must be a finite number, got nan"),
    # an error that rank 0 alone meets, in a step it takes for all (distributed.from_main)
    (("--resume",), "error: nothing to resume: "),
])
def test_a_bad_config_is_reported_once_not_once_per_process(tmp_path, char_data, args, error):
    result = run(2, "--data-dir", str(char_data), "--out-dir", str(tmp_path / "runs"),
                 "--gradient-accumulation-steps", "2", *(a.format(tmp=tmp_path) for a in args),
                 timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(error.format(tmp=tmp_path)), result.stderr
    # torchrun prints its own traceback when a process fails; none comes from this code
    ours = re.compile(rf'File "{re.escape(str(REPO))}/(?!\.venv/)')
    assert "gloo" not in result.stderr and not ours.search(result.stderr), result.stderr
    assert not (tmp_path / "runs").exists()
