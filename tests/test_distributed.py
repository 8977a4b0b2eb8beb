"""Data-parallel training with torchrun on the CPU (gloo), under DDP and FSDP: it gives the
same run as one process, with one writer, and does not hang when a process dies. FSDP's
sharded checkpoints resume on any number of processes, can be made plain, and stay whole
after a kill; fine-tuning works sharded; and a model that fits under a memory limit only
when FSDP shards it trains."""

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.prepare import prepare_text
from tests.layouts import LAYOUTS, cli_args
from tests.output import error_line
from tests.shared import built_once
from weights.checkpoint import load_checkpoint
from weights.loading import model_from_checkpoint
from weights.sharded import consolidate, read_shards, read_state, tensor_shapes

REPO = Path(__file__).resolve().parent.parent
# One thread per process; a process that aborts in C++ still reports where Python was; and
# glibc's malloc keeps the address space it maps small, as it must under ulimit -v
# (docs/distributed.md): one arena, where each thread would otherwise map 64 MB of its own,
# and every block of a megabyte or more mapped on its own and returned when freed.
ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "MALLOC_ARENA_MAX": "1",
       "MALLOC_MMAP_THRESHOLD_": str(2**20)}


def run(nproc: int | None, *args: str, timeout: int = 240, config: str = "tiny.toml",
        limit_kb: int | None = None) -> subprocess.CompletedProcess:
    """Run train.py on a preset (by default the tiny one) under torchrun with nproc
    processes, or as a plain process when nproc is None. limit_kb caps each process's address
    space, as `ulimit -v` does."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={nproc}"] if nproc else [sys.executable])
    return subprocess.run([*launcher, str(REPO / "train.py"), "--config",
                           str(REPO / "config" / config), "--sample-tokens", "0", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **ENV}, preexec_fn=limit_kb and (
                              lambda: resource.setrlimit(resource.RLIMIT_AS,
                                                         (limit_kb * 1024, limit_kb * 1024))))


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


# FSDP's case takes the harder paths (AdamW is FSDP's plain one): under FSDP, Muon
# orthogonalizes each matrix on one process, and eval_iters 3 does not divide among 2
# processes whose every forward is a collective.
CASES = {"ddp": ("adamw", "gpt2"), "fsdp": ("muon", "modern")}


def common_args(char_data: Path, parallel: str) -> tuple[str, ...]:
    optimizer, layout = CASES[parallel]
    return ("--data-dir", str(char_data), "--optimizer", optimizer, *cli_args(LAYOUTS[layout]),
            "--gradient-accumulation-steps", "4", "--eval-interval", "6", "--eval-iters", "3",
            "--lr-decay-iters", "12", "--log-interval", "3")


def plain_checkpoint(run_dir: Path, tmp_path: Path) -> dict:
    """A run's last checkpoint, made plain as export.py --plain does if it is sharded."""
    if not (run_dir / "last.dcp").exists():
        return load_checkpoint(run_dir / "last.pt")
    out = tmp_path / f"{run_dir.parent.name}.pt"
    consolidate(run_dir / "last.dcp", out)
    return load_checkpoint(out)


def assert_same_run(a: Path, b: Path, tolerance: float, tmp_path: Path) -> None:
    """b logged the losses that a logged, equal to within `tolerance`, and maybe more (a run
    resumed at a point that a passed evaluates there); their final weights agree to 1e-4."""
    for tag in ("train/loss_step", "loss/val"):
        logged_b = dict(losses(b, tag))
        steps, values = zip(*losses(a, tag), strict=True)
        assert set(steps) <= set(logged_b), (tag, steps, sorted(logged_b))
        torch.testing.assert_close(torch.tensor([logged_b[step] for step in steps]),
                                   torch.tensor(values), rtol=tolerance, atol=tolerance, msg=tag)
    wa, wb = plain_checkpoint(a, tmp_path)["model"], plain_checkpoint(b, tmp_path)["model"]
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-5, msg=key)


def straight(shared_dir: Path, char_data: Path, parallel: str) -> dict[str, Path]:
    """12 iterations from scratch as one plain process and as two under `parallel`. Under
    FSDP, the two stop and save at 6 (kept as "half") and resume from that save, so the run
    that must equal one process is also a run resumed on the same number of processes."""
    def build(out: Path) -> None:
        result = run(None, *common_args(char_data, parallel), "--max-iters", "12",
                     "--out-dir", str(out / "one"))
        assert result.returncode == 0, failure(result)
        two = ("--parallel", parallel, "--out-dir", str(out / "two"))
        if parallel == "fsdp":
            result = run(2, *common_args(char_data, parallel), "--max-iters", "6", *two)
            assert result.returncode == 0, failure(result)
            shutil.copytree(out / "two", out / "half", symlinks=True)
            two = (*two, "--resume")
        result = run(2, *common_args(char_data, parallel), "--max-iters", "12", *two)
        assert result.returncode == 0, failure(result)
        assert result.stdout.count("done: 12 iters") == 1  # only rank 0 reports
    out = built_once(shared_dir / f"straight-{parallel}", build)
    return {name: out / name / "tiny" for name in ("one", "two", "half")}


@pytest.fixture(scope="session")
def ddp_runs(shared_dir, char_data) -> dict[str, Path]:
    return straight(shared_dir, char_data, "ddp")


@pytest.fixture(scope="session")
def fsdp_runs(shared_dir, char_data) -> dict[str, Path]:
    return straight(shared_dir, char_data, "fsdp")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, request, parallel):
    runs = request.getfixturevalue(f"{parallel}_runs")
    two = runs["two"]
    # one writer: a single run folder, one set of checkpoints, one events stream; under FSDP
    # the checkpoints are links to one save (best is last), written by both processes
    files = sorted(p.name for p in two.iterdir())
    kind = ".dcp" if parallel == "fsdp" else ".pt"
    assert [name for name in files if name.endswith((".pt", ".dcp"))] == [f"best{kind}",
                                                                          f"last{kind}"]
    # the FSDP run was resumed once, and each launch writes its own events and hparams
    launches = 2 if parallel == "fsdp" else 1
    assert sum(name.startswith("events.out.tfevents") for name in files) == 2 * launches
    if parallel == "fsdp":
        assert (two / "last.dcp").resolve() == (two / "best.dcp").resolve()
        saves = list((two / "shards").iterdir())
        assert saves == [(two / "last.dcp").resolve()]  # older saves are tidied away
        assert sorted(p.name for p in saves[0].iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    # the same losses and weights; in an fp32 run, Muon orthogonalizes in fp32, each matrix
    # on one of the two processes, so it holds to AdamW's tolerance
    assert_same_run(runs["one"], two, 1e-5, tmp_path)


def test_a_sharded_run_resumes_on_any_number_of_processes(tmp_path, char_data, fsdp_runs):
    # (resuming on 2, as it was saved, gives fsdp_runs["two"], which the test above compares
    # with one process)
    common, half = common_args(char_data, "fsdp"), fsdp_runs["half"].parent
    # 6 iterations on 2 processes, then 6 more on 4
    shutil.copytree(half, tmp_path / "on4", symlinks=True)
    result = run(4, *common, "--max-iters", "12", "--out-dir", str(tmp_path / "on4"), "--resume",
                 "--parallel", "fsdp")
    assert result.returncode == 0, failure(result)
    assert_same_run(fsdp_runs["two"], tmp_path / "on4" / "tiny", 1e-4, tmp_path)
    # or 3 more as one plain process, which saves a plain last.pt and removes the sharded one,
    # and then 3 more on 2 processes, each taking its own shards of that plain checkpoint
    shutil.copytree(half, tmp_path / "chain", symlinks=True)
    chain = tmp_path / "chain" / "tiny"
    for nproc, iters in ((None, "9"), (2, "12")):
        result = run(nproc, *common, "--max-iters", iters, "--out-dir", str(tmp_path / "chain"),
                     "--resume", *(["--parallel", "fsdp"] if nproc else []))
        assert result.returncode == 0, failure(result)
        assert (chain / "last.pt").is_file() == (nproc is None)
        assert (chain / "last.dcp").exists() == (nproc is not None)
    assert_same_run(fsdp_runs["two"], chain, 1e-4, tmp_path)
    # given a sharded run, sample.py says which command to run, and that command writes the
    # checkpoints that sample.py reads
    sharded_run = tmp_path / "on4" / "tiny"
    sample = [sys.executable, str(REPO / "sample.py"), "--run", str(sharded_run),
              "--max-new-tokens", "8"]
    refused = subprocess.run(sample, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and error_line(refused.stderr) == (
        f"error: {sharded_run} holds sharded checkpoints (last.dcp, written under FSDP); make "
        f"plain ones beside them with: python export.py {sharded_run} --plain")
    made = subprocess.run(error_line(refused.stderr).split("with: ")[1].split(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"wrote {sharded_run / 'last.pt'}, {sharded_run / 'best.pt'}\n"
    assert (sharded_run / "best.pt").stat().st_ino == (sharded_run / "last.pt").stat().st_ino
    # a whole model, built as sample.py builds it, has the weights of the run resumed on 2
    model = model_from_checkpoint(load_checkpoint(sharded_run / "last.pt"))
    torch.testing.assert_close(model.state_dict(),
                               plain_checkpoint(fsdp_runs["two"], tmp_path)["model"],
                               rtol=1e-4, atol=1e-5)


def test_torchrun_with_one_process_trains_in_a_group_of_one_as_a_plain_run_does(tmp_path,
                                                                              char_data, ddp_runs):
    # under torchrun, even one process joins a process group and trains through DDP, so one
    # GPU runs the same code as eight (and NCCL's path can be tested with one GPU)
    group = run(1, *common_args(char_data, "ddp"), "--max-iters", "12", "--out-dir", str(tmp_path))
    assert group.returncode == 0, failure(group)
    assert "device cpu x 1 process," in group.stdout
    a = load_checkpoint(ddp_runs["one"] / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "tiny" / "last.pt")["model"]
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
        if line.startswith("iter "):  # the first log line, so training has begun
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
        if proc.poll() is None:  # it hung, so clean up before failing
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.time() - started < 90


@pytest.mark.parametrize("signalled", [0, 1])
def test_a_signal_to_one_process_stops_them_all_with_one_save(tmp_path, char_data, signalled):
    # A scheduler or a user may signal one process alone. The others learn of it at the next
    # log point, and every process saves and leaves as the signalled one does: one line, with
    # no traceback from this code, and a checkpoint at the iteration it names.
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(REPO / "train.py"), "--config",
                             str(REPO / "config" / "tiny.toml"), "--data-dir", str(char_data),
                             "--out-dir", str(tmp_path), "--gradient-accumulation-steps", "2",
                             "--max-iters", "1000000", "--eval-interval", "100000",
                             "--sample-tokens", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV}, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("iter "):  # the first log line, so training has begun
            break
    workers = sorted(int(p) for p in subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "train.py"],
                                                    capture_output=True, text=True).stdout.split())
    assert len(workers) == 2, "".join(seen)
    os.kill(workers[signalled], signal.SIGTERM)
    try:
        out = "".join(seen) + proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:  # it hung, so clean up before failing
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = re.search(r"interrupted: stopped by SIGTERM at iter (\d+); saved", out)
    assert stopped, out[-3000:]
    ours = re.compile(rf'File "{re.escape(str(REPO))}/(?!\.venv/)')
    assert not ours.search(out), out[-3000:]
    saved = load_checkpoint(tmp_path / "tiny" / "last.pt", "cpu", resume=True)
    assert saved["iter_num"] == int(stopped.group(1)) > 0


@pytest.mark.parametrize("args, error", [
    (("--learning-rate", "nan"), "error: learning_rate must be a finite number, got nan"),
    # an error that rank 0 meets first, in a step it takes for all processes
    # (distributed.from_main)
    (("--data-dir", "{tmp}/none"), "error: no prepared dataset in {tmp}/none "),
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


def test_init_from_under_fsdp_equals_one_process(tmp_path, trained_run, chat_data):
    # fine-tuning the tiny run on conversations grows the vocabulary by the chat tokens, and
    # each process reads its own rows of the mapped base checkpoint, one tensor at a time
    args = ("--init-from", str(trained_run), "--data-dir", str(chat_data), "--max-iters", "6",
            "--eval-interval", "3", "--eval-iters", "2", "--batch-size", "4", "--dtype",
            "float32", "--gradient-accumulation-steps", "2", "--log-interval", "3")
    one = run(None, *args, "--out-dir", str(tmp_path / "one"), config="chat_sft.toml")
    assert one.returncode == 0, failure(one)
    two = run(2, *args, "--parallel", "fsdp", "--out-dir", str(tmp_path / "two"),
              config="chat_sft.toml")
    assert two.returncode == 0, failure(two)
    assert two.stdout.count("the vocabulary grows") == 1
    assert_same_run(tmp_path / "one" / "chat_sft", tmp_path / "two" / "chat_sft", 1e-5, tmp_path)


def test_init_from_a_hugging_face_folder_under_fsdp_equals_one_process(tmp_path):
    # each process reads the folder's safetensors one tensor at a time and keeps its rows
    import transformers
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=128)).save_pretrained(tmp_path / "gpt2")
    prepare_text("To be, or not to be, that is the question.\n" * 200, "gpt2", tmp_path / "data",
                 "test")
    args = ("--init-from", str(tmp_path / "gpt2"), "--data-dir", str(tmp_path / "data"),
            "--block-size", "32", "--max-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
            "--dtype", "float32", "--gradient-accumulation-steps", "2", "--log-interval", "1")
    one = run(None, *args, "--out-dir", str(tmp_path / "one"))
    assert one.returncode == 0, failure(one)
    two = run(2, *args, "--parallel", "fsdp", "--out-dir", str(tmp_path / "two"))
    assert two.returncode == 0, failure(two)
    assert_same_run(tmp_path / "one" / "tiny", tmp_path / "two" / "tiny", 1e-5, tmp_path)


def test_a_kill_during_a_sharded_save_leaves_the_last_checkpoint_whole(tmp_path, char_data):
    # a save at every step of a 3.2M-parameter model (38 MB with AdamW's moments), written
    # by two processes; each kill waits for a save that has begun and not ended
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            str(REPO / "train.py"), "--config", str(REPO / "config" / "tiny.toml"),
            "--data-dir", str(char_data), "--out-dir", str(tmp_path), "--parallel", "fsdp",
            "--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--eval-interval", "1",
            "--eval-iters", "2", "--sample-tokens", "0", "--gradient-accumulation-steps", "2"]
    run_dir = tmp_path / "tiny"
    caught, reached = 0, []
    for kill in range(3):  # until a kill lands during a save (nearly always the first)
        proc = subprocess.Popen([*args, "--max-iters", "100000", *(["--resume"] if kill else [])],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, **ENV})
        try:
            partial = wait_for_a_save_in_progress(run_dir, seconds=90)
        finally:
            kill_all(proc)
        # last.dcp leads to a whole save, whose state and every tensor read back
        last = run_dir / "last.dcp"
        state, shapes = read_state(last, resume=True), tensor_shapes(last)
        read_shards({key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items()},
                    last, shapes)
        reached.append(state["iter_num"])
        if partial is not None and not (partial / "state.pt").exists():
            caught += 1
            break
    assert caught == 1, "no kill landed during a save"
    # the run goes on from the last whole save, and its next save deletes the cut-short one
    result = subprocess.run([*args, "--max-iters", str(reached[-1] + 1), "--resume"], cwd=REPO,
                            capture_output=True, text=True, timeout=240, env={**os.environ, **ENV})
    assert result.returncode == 0, failure(result)
    assert read_state(run_dir / "last.dcp")["iter_num"] == reached[-1] + 1
    assert set((run_dir / "shards").iterdir()) == {(run_dir / name).resolve()
                                                   for name in ("last.dcp", "best.dcp")}


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its processes (each in a session of its own) at once, as a
    crash would, and wait until all are gone, including the one that holds the run folder's
    lock."""
    members = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                              text=True).stdout.split()] + [proc.pid]
    for pid in members:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in members):
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether a process still runs (a zombie, dead and not yet reaped, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def wait_for_a_save_in_progress(run_dir: Path, seconds: float) -> Path | None:
    """A folder under shards/ that a save is still writing (it has no state.pt yet, because
    rank 0 writes that last), looked for once a whole save exists to fall back on; None if
    none is seen in time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (run_dir / "last.dcp").exists():
            kept = (run_dir / "last.dcp").resolve()
            for folder in (run_dir / "shards").iterdir():
                if folder != kept and not (folder / "state.pt").exists():
                    return folder
        time.sleep(0.001)
    return None


def test_a_model_too_large_for_one_process_trains_saves_and_resumes_sharded(tmp_path, char_data):
    # 76M parameters: 1.2 GB of weights, gradients and AdamW's moments, which each of DDP's
    # processes holds whole and each of FSDP's two holds half of, under a 1.7 GB address
    # space per process; torch and gloo map part of that before the model is built, which
    # leaves room for half of the model but not for all of it
    limit = 1_650_000
    args = ("--data-dir", str(char_data), "--out-dir", str(tmp_path), "--n-layer", "6",
            "--n-embd", "1024", "--n-head", "8", "--batch-size", "2",
            "--gradient-accumulation-steps", "2", "--eval-interval", "1", "--eval-iters", "2")
    refused = run(2, *args, "--max-iters", "1", limit_kb=limit)
    assert refused.returncode != 0
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(
        r"error: this run needs at least 1\.2 GB \(1\.2 for the weights, gradients and optimizer "
        r"state, .*\), but cpu has [\d.]+ GB left under this process's limit of 1\.7 GB \(ulimit "
        r"-v\); .* or shard it across the processes with --parallel fsdp$", errors[0]), errors
    trained = run(2, *args, "--max-iters", "1", "--parallel", "fsdp", limit_kb=limit)
    assert trained.returncode == 0, failure(trained)
    resumed = run(2, *args, "--max-iters", "2", "--parallel", "fsdp", "--resume", limit_kb=limit)
    assert resumed.returncode == 0, failure(resumed)
    assert "iter 2: train loss" in resumed.stdout
    assert read_state(tmp_path / "tiny" / "last.dcp")["iter_num"] == 2


def test_a_disk_that_fills_during_a_sharded_save_is_one_line_and_leaves_no_half_save(tmp_path,
                                                                                      char_data):
    def small_disk() -> None:  # files past 150 KB fail to grow, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "train.py"), "--config", str(REPO / "config" / "tiny.toml"), "--data-dir",
         str(char_data), "--out-dir", str(tmp_path), "--parallel", "fsdp", "--sample-tokens",
         "0", "--gradient-accumulation-steps", "2", "--eval-interval", "5", "--max-iters", "20"],
        cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, **ENV},
        preexec_fn=small_disk)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: could not write a checkpoint in {tmp_path / 'tiny'} (File too "
                      f"large) at iter 5; no checkpoint was written yet; free space and start "
                      f"again"], result.stderr
    assert not (tmp_path / "tiny" / "shards").exists()
