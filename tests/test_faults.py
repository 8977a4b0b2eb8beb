"""Nothing lost: kills, interrupts, NaNs and failed writes never cost more than the work
since the last checkpoint, and never leave a checkpoint that does not load."""

import dataclasses
import json
import os
import pickle
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import model as model_module
from model import GPT, GPTConfig
from tests.forked import python
from tests.output import error_line
from train import train
from training.config import ConfigError, load_config
from training.runs import TrainingError
from weights.checkpoint import load_checkpoint, save_checkpoint
from weights.loading import model_from_checkpoint

REPO = Path(__file__).resolve().parent.parent
TWO_CHARS = {"kind": "char", "vocab_size": 2, "chars": "ab"}  # a tokenizer to put in checkpoints
TRAIN = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "config" / "tiny.toml")]


def start_training(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for_line(proc: subprocess.Popen, text: str) -> None:
    for line in proc.stdout:
        if text in line:
            return
    raise AssertionError(f"training ended before printing {text!r}: {proc.stderr.read()}")


# SIGHUP comes when the terminal or the SSH session that started the run is closed
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_saves_a_checkpoint_and_resume_continues(tmp_path, char_data, signum):
    args = ("--data-dir", str(char_data), "--out-dir", str(tmp_path), "--eval-interval", "100000",
            "--sample-tokens", "0")
    proc = start_training(*args, "--max-iters", "100000")
    wait_for_line(proc, "iter ")  # the first log line, so training has begun
    time.sleep(1.0)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert f"interrupted: stopped by {signum.name} at iter" in stderr and "--resume" in stderr
    assert "Traceback" not in stderr
    stopped_at = load_checkpoint(tmp_path / "tiny" / "last.pt")["iter_num"]
    assert stopped_at > 0
    resumed = python([*TRAIN[1:], *args, "--max-iters", str(stopped_at + 10), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(tmp_path / "tiny" / "last.pt")["iter_num"] == stopped_at + 10


def test_a_second_ctrl_c_is_one_line_and_exit_130(tmp_path, char_data):
    # The first Ctrl-C asks the loop to save and stop; a second one raises KeyboardInterrupt
    # wherever the run is, which two real signals cannot time reliably, so the loop's first
    # step raises it here, and the run's own handling answers it.
    code = ("import sys, train; from machine.errors import run_command; "
            "from training.config import command_line\n"
            "def interrupted(it, cfg): raise KeyboardInterrupt\n"
            "train.get_lr_scale = interrupted\n"
            "sys.argv[0] = 'train.py'\n"
            "run_command(command_line(train.main))")
    result = subprocess.run([sys.executable, "-c", code, *TRAIN[2:], "--data-dir", str(char_data),
                             "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 128 + signal.SIGINT
    assert error_line(result.stderr, "interrupted") == ("interrupted: stopped at once by a second "
                                                        "Ctrl-C; the last checkpoint, if any, is "
                                                        "intact")


def test_an_interrupted_second_run_resumes_itself_and_leaves_the_first_untouched(tmp_path,
                                                                                 char_data):
    # the second run of a run name becomes NAME-2; the command that the interrupt message
    # gives must resume NAME-2, not overwrite NAME
    args = ("--data-dir", str(char_data), "--out-dir", str(tmp_path), "--run-name", "dup",
            "--eval-interval", "20", "--sample-tokens", "0")
    cfg = load_config(REPO / "config" / "tiny.toml",
                      {"data_dir": str(char_data), "out_dir": str(tmp_path), "run_name": "dup",
                       "eval_interval": 20, "sample_tokens": 0, "max_iters": 20})
    train(cfg)
    before = {p.name: p.read_bytes() for p in (tmp_path / "dup").iterdir()}
    proc = start_training(*args, "--max-iters", "100000")
    wait_for_line(proc, "iter ")  # the first log line, so training has begun
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert "continue with the same command and --run-name dup-2 --resume" in stderr
    stopped_at = load_checkpoint(tmp_path / "dup-2" / "last.pt")["iter_num"]
    resumed = train(dataclasses.replace(cfg, run_name="dup-2", max_iters=stopped_at + 5),
                    resume=True)
    assert resumed.run_dir.name == "dup-2" and resumed.iter_num == stopped_at + 5
    assert {p.name: p.read_bytes() for p in (tmp_path / "dup").iterdir()} == before


def test_sigkill_at_random_moments_never_leaves_an_unreadable_checkpoint(tmp_path, char_data):
    # a checkpoint at every step of a 13 MB model, so much of the time goes to writing them
    args = ["--data-dir", str(char_data), "--out-dir", str(tmp_path), "--n-layer", "4",
            "--n-embd", "128", "--n-head", "4", "--eval-interval", "1", "--eval-iters", "1",
            "--sample-tokens", "0", "--max-iters", "100000"]
    rng = random.Random(0)
    last = tmp_path / "tiny" / "last.pt"
    kills, unreadable, mid_write, iters = 3, 0, 0, []
    for kill in range(kills):
        resume = last.exists()
        proc = start_training(*args, *(["--resume"] if resume else []))
        # Each kill comes at a random time after a line: for the first run, after its first
        # checkpoint (iter 1's is saved before "iter 2:"), so that every kill has one to
        # check; for a resumed run, just before its loop starts; but for the last run, after
        # its first new checkpoint (a run resumed at iter n saves n again, and n + 1 before it
        # prints "iter n + 2:"), so that the runs are seen to make progress however busy the
        # machine is.
        resumed_at = load_checkpoint(last)["iter_num"] if resume else 0
        wait_for_line(proc, "iter 2:" if not resume else
                      f"iter {resumed_at + 2}:" if kill == kills - 1 else " tokens/iter, ")
        time.sleep(rng.uniform(0.2, 2.0))
        proc.kill()
        proc.communicate()
        mid_write += (tmp_path / "tiny" / f".last.pt.{proc.pid}.tmp").exists()
        if last.exists():
            try:
                iters.append(load_checkpoint(last)["iter_num"])
            except Exception:
                unreadable += 1
    print(f"\n{kills} SIGKILLs, {mid_write} during a checkpoint write, {unreadable} unreadable "
          f"checkpoints, iterations reached: {iters}")
    assert unreadable == 0
    assert len(iters) == kills and iters == sorted(iters) and iters[-1] > iters[0]


# One process imports torch once and, for each line on stdin, forks a writer: a process that
# does nothing but write 40 MB checkpoints, and prints its pid once the first is written. The
# writer makes its tensor after the fork, so that no torch work has run in the parent.
WRITERS = """
import os, sys, torch
from weights.checkpoint import save_checkpoint
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        state = {"model_args": {}, "config": {}, "model": {"w": torch.randn(10_000_000)},
                 "tokenizer": {"kind": "char", "vocab_size": 2, "chars": "ab"}}
        for i in range(10**6):
            save_checkpoint({**state, "iter_num": i}, sys.argv[1])
            if i == 0:
                print(os.getpid(), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


def test_sigkill_during_checkpoint_writes_leaves_old_or_new_whole(tmp_path):
    path, rng = tmp_path / "last.pt", random.Random(1)
    mid_write, seen = 0, []
    with subprocess.Popen([sys.executable, "-c", WRITERS, str(path)], cwd=REPO, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as writers:
        for _ in range(8):
            writers.stdin.write("write\n")
            writers.stdin.flush()
            pid = int(writers.stdout.readline())  # its first save is done, and from here on it only writes
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(pid, signal.SIGKILL)
            while Path(f"/proc/{pid}").exists():  # until its parent has reaped it
                time.sleep(0.01)
            mid_write += (tmp_path / f".last.pt.{pid}.tmp").exists()
            seen.append(load_checkpoint(path)["iter_num"])  # raises if not whole
        writers.stdin.close()
    print(f"\n8 SIGKILLs of a checkpoint writer, {mid_write} during a write, all loaded: {seen}")
    # many kills land mid-write; at least one must, or the test proves nothing
    assert mid_write >= 1 and len(seen) == 8
    # each writer's first save removes what the killed ones left, so only the last kill's may
    # stay
    assert len(list(tmp_path.glob(".last.pt.*.tmp"))) <= 1


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_config, monkeypatch):
    forward, calls = GPT.forward, {"train": 0}

    def poisoned_forward(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        if self.training and targets is not None:
            calls["train"] += 1
            if calls["train"] > 12:  # from step 13 on, a NaN, as an overflow would make
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(model_module.GPT, "forward", poisoned_forward)
    cfg = dataclasses.replace(tiny_config, max_iters=40, eval_interval=10, log_interval=5)
    with pytest.raises(TrainingError, match="training loss became nan at iter 15; "
                                            "the last good checkpoint is kept"):
        train(cfg)
    ckpt = load_checkpoint(Path(cfg.out_dir) / "tiny" / "last.pt")
    assert ckpt["iter_num"] == 10
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"model_args": {}, "model": {}, "iter_num": 1, "config": {},
                     "tokenizer": TWO_CHARS}, path)
    before = path.read_bytes()
    with pytest.raises((pickle.PicklingError, AttributeError)):  # a lambda cannot be pickled
        save_checkpoint({"model_args": {}, "model": {}, "iter_num": 2, "config": {},
                         "tokenizer": TWO_CHARS, "unsaveable": lambda: None}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_an_unwritable_out_dir_is_reported_before_training(tmp_path, char_data):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = python([*TRAIN[1:], "--data-dir", str(char_data), "--out-dir", str(not_a_dir)])
    assert result.returncode == 1
    assert (f"error: cannot write to {not_a_dir / 'tiny'} (Not a directory); "
            f"choose another --out-dir or --run-name") in result.stderr


def test_resume_with_a_changed_model_shape_is_refused(tmp_path, char_data, trained_run):
    shutil.copytree(trained_run, tmp_path / "tiny", ignore=shutil.ignore_patterns(".lock"))
    result = python([*TRAIN[1:], "--data-dir", str(char_data), "--out-dir", str(tmp_path),
                     "--max-iters", "30", "--n-embd", "64", "--resume"])
    assert result.returncode == 1
    assert "error: cannot resume: n_embd is 64 in the config but 32 in" in result.stderr


def test_checkpoint_of_a_compiled_model_loads_into_a_plain_one(tmp_path):
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
    compiled_state = torch.compile(plain).state_dict()
    assert all(k.startswith("_orig_mod.") for k in compiled_state)
    save_checkpoint({"model_args": dataclasses.asdict(plain.config), "model": compiled_state,
                     "iter_num": 0, "config": {}, "tokenizer": TWO_CHARS}, tmp_path / "c.pt")
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "c.pt"))
    idx = torch.randint(0, 20, (1, 8))
    assert torch.equal(plain(idx)[0], loaded(idx)[0])


@pytest.mark.parametrize("content, message", [
    (None, "error: input {path} does not exist"),
    (b"", "error: input {path} holds no text"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "error: {path} is not text (NUL byte at offset 8)"),
    (b"caf\xe9\n", "error: {path} is not valid UTF-8 (byte offset 3, line 1)"),
])
def test_prepare_refuses_unusable_corpora(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    result = python(["-m", "data.prepare", "--input", str(path), "--out", str(tmp_path / "out")])
    assert result.returncode == 1
    assert message.format(path=path) in result.stderr
    assert not (tmp_path / "out").exists()


def test_resume_with_data_of_another_vocabulary_is_refused(tiny_config, tmp_path):
    from data.prepare import prepare_text
    train(dataclasses.replace(tiny_config, max_iters=5, eval_interval=5, sample_tokens=0))
    other = tmp_path / "other_data"
    prepare_text("completely different text, with digits 0123456789!\n" * 50, "char", other, "other")
    with pytest.raises(ConfigError,
                       match="cannot resume: .* was trained with another tokenizer or vocabulary"):
        train(dataclasses.replace(tiny_config, data_dir=str(other), max_iters=10,
                                  sample_tokens=0, log_attention=False), resume=True)


def test_resuming_below_the_checkpoints_iteration_says_so(tiny_config):
    cfg = dataclasses.replace(tiny_config, max_iters=10, eval_interval=10, sample_tokens=0)
    train(cfg)
    with pytest.raises(ConfigError, match=r"last.pt is at iter 10, past max_iters \(5\), so "
                                          r"there is nothing to train; raise --max-iters"):
        train(dataclasses.replace(cfg, max_iters=5), resume=True)


def test_a_signal_while_the_run_starts_still_saves_a_resumable_checkpoint(tmp_path, char_data):
    # The handlers are set before the data is read, so a SIGTERM during setup is answered after
    # the first step, with a checkpoint and the resume hint. The dataset's meta.json is a FIFO,
    # which holds the run inside its setup until the test has sent the signal, on a machine of
    # any speed.
    data = tmp_path / "data"
    shutil.copytree(char_data, data)
    meta = (data / "meta.json").read_bytes()
    (data / "meta.json").unlink()
    os.mkfifo(data / "meta.json")
    proc = start_training("--data-dir", str(data), "--out-dir", str(tmp_path),
                          "--max-iters", "100000", "--sample-tokens", "0")
    deadline = time.monotonic() + 120
    while True:  # opening the FIFO to write succeeds once the run has it open to read
        try:
            fifo = os.open(data / "meta.json", os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:  # ENXIO: no reader yet
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert os.write(fifo, meta) == len(meta)
    os.close(fifo)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM at iter 1; saved" in stderr and "--resume" in stderr
    assert load_checkpoint(tmp_path / "tiny" / "last.pt")["iter_num"] == 1


def test_a_folder_where_a_run_saved_nothing_is_taken_over(tiny_config, tmp_path):
    # a run killed before its first checkpoint leaves only TensorBoard events; the next run
    # takes that folder over, removing the stale events, instead of becoming NAME-2
    from torch.utils.tensorboard import SummaryWriter
    dead = Path(tiny_config.out_dir) / "tiny"
    writer = SummaryWriter(dead)
    writer.add_scalar("val/loss", 4.2, 0)
    writer.close()
    stale = {p.name for p in dead.iterdir()}
    result = train(dataclasses.replace(tiny_config, max_iters=5, eval_interval=5, sample_tokens=0))
    assert result.run_dir == dead and not (dead.parent / "tiny-2").exists()
    assert stale.isdisjoint(p.name for p in dead.iterdir())
    assert (dead / "last.pt").is_file()


def test_two_runs_of_one_name_started_together_never_share_a_folder(tmp_path, char_data):
    # a checkpoint at every step, so that two runs sharing a folder would write each other's
    # .last.pt.tmp, events and checkpoints
    args = ("--data-dir", str(char_data), "--out-dir", str(tmp_path), "--max-iters", "15",
            "--eval-interval", "1", "--eval-iters", "1", "--sample-tokens", "0")
    procs = [start_training(*args) for _ in range(2)]
    outputs = [proc.communicate(timeout=180) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    folders = sorted(line.split("writing to ")[1].rstrip("/\n") for out, _ in outputs
                     for line in out.splitlines() if "writing to " in line)
    assert folders == [str(tmp_path / "tiny"), str(tmp_path / "tiny-2")]
    for folder in map(Path, folders):
        assert load_checkpoint(folder / "last.pt")["iter_num"] == 15
        events = [p for p in folder.iterdir() if p.name.startswith("events.out.tfevents.")]
        assert len(events) == 2  # the run's scalars and its hparams, from one run, not two


def test_resume_is_refused_while_the_run_is_still_going(tmp_path, char_data):
    args = ("--data-dir", str(char_data), "--out-dir", str(tmp_path), "--eval-interval", "1",
            "--eval-iters", "1", "--sample-tokens", "0")
    proc = start_training(*args, "--max-iters", "100000")
    try:
        wait_for_line(proc, "iter 1:")
        second = subprocess.run([*TRAIN, *args, "--max-iters", "100000", "--resume"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert second.returncode == 1
    assert error_line(second.stderr) == (
        f"error: {tmp_path / 'tiny'} is in use by a run that is still going; wait for it to "
        f"end, or start a new run without --resume")


def test_ctrl_c_after_the_loss_turned_nan_writes_no_checkpoint(tmp_path, char_data):
    # the loss turns NaN between log points, so only the interrupt's save could notice
    args = ("--data-dir", str(char_data), "--out-dir", str(tmp_path), "--learning-rate", "1e30",
            "--grad-clip", "0", "--log-interval", "100000", "--eval-interval", "100000",
            "--max-iters", "100000", "--sample-tokens", "0")
    proc = start_training(*args)
    wait_for_line(proc, "MFU is measured")  # the last line before the first step
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "holds NaN or inf at iter" in error_line(stderr)
    assert "no checkpoint was written" in error_line(stderr)
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()
                  if not p.name.startswith("events.")) == [".lock"]


def test_a_resumed_run_takes_the_new_learning_rate(tiny_config):
    # the optimizer state comes from the run but its settings from the config, so lr 0 moves
    # nothing
    first = train(dataclasses.replace(tiny_config, max_iters=10, eval_interval=10))
    before = load_checkpoint(first.run_dir / "last.pt")["model"]
    train(dataclasses.replace(tiny_config, max_iters=15, eval_interval=5, learning_rate=0.0,
                              min_lr=0.0), resume=True)
    after = load_checkpoint(first.run_dir / "last.pt")
    assert after["iter_num"] == 15 and after["config"]["learning_rate"] == 0.0
    assert all(torch.equal(before[k], after["model"][k]) for k in before)


def small_disk(limit: int) -> Callable[[], None]:
    """A preexec_fn under which files fail to grow past `limit` bytes, as on a full disk
    (with EFBIG, not a signal)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("what, limit, model, message", [
    # a 0.4 MB checkpoint, cut at 100 KB inside torch's zip writer
    ("checkpoint", 100_000, (), "could not write a checkpoint in {run} (File too large) at "
                                "iter 5; no checkpoint was written yet; free space and start again"),
    # 53 KB checkpoints fit, and the events file reaches 60 KB near iter 200, in TensorBoard's
    # thread
    ("events", 60_000, ("--n-layer", "1", "--n-embd", "8", "--n-head", "1"),
     "could not write to {run} (File too large) at iter "),
])
def test_a_disk_that_fills_mid_write_is_one_line_and_keeps_the_last_checkpoint(
        tmp_path, char_data, what, limit, model, message):
    result = subprocess.run([*TRAIN, "--data-dir", str(char_data), "--out-dir", str(tmp_path),
                             "--max-iters", "100000", "--eval-interval", "5" if what ==
                             "checkpoint" else "20", "--log-interval", "1", *model],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            preexec_fn=small_disk(limit))
    run = tmp_path / "tiny"
    assert result.returncode == 1, result.stderr
    assert error_line(result.stderr).startswith("error: " + message.format(run=run))
    assert not list(run.glob(".*.tmp"))
    if what == "events":  # the last checkpoint is whole, and the hint resumes it
        saved = load_checkpoint(run / "last.pt")["iter_num"]
        assert saved % 20 == 0 and saved > 0
        assert error_line(result.stderr).endswith(
            f"{run / 'last.pt'} (iter {saved}) is intact; continue with the same command and "
            f"--resume")


def test_attention_pictures_that_fill_the_disk_leave_no_half_file(tmp_path, trained_run):
    # the page (written first) holds its 4.5 KB template and every weight in base64, so it
    # passes the limit, while the small file that --attention writes to test the folder fits
    result = subprocess.run([sys.executable, "sample.py", "--checkpoint", str(trained_run / "best.pt"),
                             "--max-new-tokens", "20", "--attention", str(tmp_path / "a")],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            preexec_fn=small_disk(4_000))
    assert result.returncode == 1
    assert result.stderr == (f"loaded {trained_run / 'best.pt'}\n"
                             f"error: --attention could not write {tmp_path / 'a'} (File too large)\n")
    assert list(tmp_path.iterdir()) == []


def run_with_cache(cache: str, *argv: str) -> subprocess.CompletedProcess:
    return python(list(argv), env={**os.environ, "GPTLAB_CACHE": cache})


def test_an_unusable_cache_folder_is_a_fallback_or_one_line(tmp_path, trained_run):
    (tmp_path / "file").write_text("not a folder")
    cache = str(tmp_path / "file")  # a folder this process cannot write fails the same way
    problem = (f"the cache folder {cache} cannot be used (it is a file); set GPTLAB_CACHE to a "
               f"folder you can write")
    sample = ["sample.py", "--checkpoint", str(trained_run / "best.pt"), "--max-new-tokens", "5"]
    # the default decode step falls back to eager, as it does without a compiler
    auto = run_with_cache(cache, *sample)
    assert auto.returncode == 0
    assert auto.stderr == (f"note: decoding with the slower eager step: {problem}\n"
                           f"loaded {trained_run / 'best.pt'}\n")
    # asking for the C step, or for an asset the cache must hold, is one line
    for argv in ([*sample, "--decode", "c"],
                 ["-m", "data.prepare", "--tokenizer", "gpt2", "--out", str(tmp_path / "bpe")]):
        result = run_with_cache(cache, *argv)
        assert result.returncode == 1 and error_line(result.stderr) == f"error: {problem}", argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_damaged_decode_step_in_the_cache_is_built_again(tmp_path, trained_run):
    sample = ["sample.py", "--checkpoint", str(trained_run / "best.pt"), "--max-new-tokens", "5",
              "--decode", "c"]
    first = run_with_cache(str(tmp_path), *sample)
    assert first.returncode == 0, first.stderr
    [library] = (tmp_path / "decode_step").glob("*.so")
    library.write_bytes(library.read_bytes()[:1000])  # a copy cut short
    again = run_with_cache(str(tmp_path), *sample)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert library.read_bytes()[:4] == b"\x7fELF" and library.stat().st_size > 1000


def test_output_to_a_full_disk_is_one_line_and_what_was_written_is_kept(tmp_path, trained_run,
                                                                      corpus_file):
    """With stdout on a full disk (`> /dev/full`), every command prints one line on stderr and
    exits with 1, and the files it wrote (evaluate's --json, prepare's dataset) stay."""
    best = str(trained_run / "best.pt")
    commands = {
        "sample": ["sample.py", "--checkpoint", best, "--prompt", "ROMEO:",
                   "--max-new-tokens", "5"],
        "evaluate": ["evaluate.py", "--checkpoint", best, "--input", str(corpus_file),
                     "--json", str(tmp_path / "scores.json")],
        "prepare": ["-m", "data.prepare", "--input", str(corpus_file), "--out",
                    str(tmp_path / "data")],
        "help": ["train.py", "--help"],
    }
    for name, argv in commands.items():
        with open("/dev/full", "w") as full:
            result = subprocess.run([sys.executable, *argv], cwd=REPO, stdout=full,
                                    stderr=subprocess.PIPE, text=True, timeout=120)
        assert result.returncode == 1, (name, result.stderr)
        assert error_line(result.stderr) == (
            "error: cannot write the output (No space left on device); send it to a file or "
            "a disk with space"), name
    assert json.loads((tmp_path / "scores.json").read_text())["tokens"] > 0
    assert (tmp_path / "data" / "meta.json").is_file()


@pytest.mark.parametrize("batch_size, message", [
    # the check sees the limit, not only the machine's free memory
    (60_000, r"error: this run needs at least [\d.]+ GB \(.* batch_size 60000 x block_size 32\), "
             r"but cpu has [\d.]+ GB left under this process's limit of 2\.0 GB \(ulimit -v\)"),
    # the check's lower bound passes, and the allocator fails in the step
    (12_000, r"error: training with batch_size 12000 x block_size 32 ran out of memory on cpu, "
             r"with [\d.]+ GB left under this process's limit of 2\.0 GB \(ulimit -v\); "
             r"lower batch_size"),
])
def test_a_process_memory_limit_is_one_line_naming_the_batch_and_the_limit(tmp_path, char_data,
                                                                          batch_size, message):
    def limited():  # ulimit -v 2000000, as a shared login node sets it
        resource.setrlimit(resource.RLIMIT_AS, (2_000_000 * 1024, 2_000_000 * 1024))
    result = subprocess.run([*TRAIN, "--data-dir", str(char_data), "--out-dir", str(tmp_path),
                             "--batch-size", str(batch_size), "--max-iters", "2",
                             "--eval-interval", "100", "--eval-iters", "1", "--sample-tokens", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=300,
                            preexec_fn=limited)
    assert result.returncode == 1, result.stderr[-2000:]
    assert re.match(message, error_line(result.stderr)), result.stderr


def under_6_gb() -> None:  # as `ulimit -v 6291456` limits a shell's commands
    resource.setrlimit(resource.RLIMIT_AS, (6_291_456 * 1024, 6_291_456 * 1024))


LIMIT_6_GB = r"but cpu has [\d.]+ GB left under this process's limit of 6\.4 GB \(ulimit -v\)"


def test_a_server_whose_slots_cannot_fit_is_one_line_before_it_allocates(trained_run):
    """The server checks its slots' KV cache against memory before it allocates it, so that
    --parallel 1000000 is one line, not the allocator's traceback."""
    result = subprocess.run([sys.executable, "serve.py", "--checkpoint", str(trained_run / "best.pt"),
                             "--port", "0", "--parallel", "1000000"], cwd=REPO,
                            capture_output=True, text=True, timeout=300, preexec_fn=under_6_gb)
    assert result.returncode == 1
    assert re.fullmatch(r"error: --parallel 1000000 needs at least [\d.,]+ GB \([\d.,]+ for the "
                        r"KV cache of 1,000,000 rows x \d+ positions, .*, [\d.,]+ for the C step's "
                        r"scratch\), " + LIMIT_6_GB + "; lower --parallel",
                        error_line(result.stderr)), result.stderr


def test_a_benchmark_batch_counts_the_c_steps_scratch(trained_run, tmp_path):
    """A shape whose KV cache fits at batch 1,000,000 and whose C step's scratch does not is
    refused by the check, because the check counts the scratch as well as the cache."""
    ckpt = load_checkpoint(trained_run / "best.pt")
    shape = {**ckpt["model_args"], "n_layer": 1, "n_head": 8, "n_embd": 16, "block_size": 64}
    torch.manual_seed(0)
    ckpt["model_args"], ckpt["model"] = shape, GPT(GPTConfig(**shape)).state_dict()
    save_checkpoint(ckpt, tmp_path / "wide.pt")
    result = subprocess.run([sys.executable, "sample.py", "--checkpoint", str(tmp_path / "wide.pt"),
                             "--benchmark", "--batch", "1000000", "--lengths", "8", "--repeats",
                             "1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                            preexec_fn=under_6_gb)
    assert result.returncode == 1
    found = re.fullmatch(r"error: --batch 1000000 needs at least [\d.,]+ GB \(([\d.]+) for the KV "
                         r"cache of 1,000,000 rows x 16 positions, [\d.]+ for the logits of "
                         r"1,000,000 rows, [\d.,]+ for the C step's scratch, .*\), " + LIMIT_6_GB
                         + "; lower --batch", error_line(result.stderr))
    assert found and float(found.group(1)) < 5, result.stderr  # the cache alone would fit


def test_processes_that_write_one_file_at_once_leave_it_whole(tmp_path):
    # the cache is shared, and xdist's workers and torchrun's processes fetch into it at once;
    # if every writer used the same temporary name, a rename could find the file gone or put
    # another writer's half in place
    code = ("import sys\nfrom machine.files import write_bytes_atomic\n"
            "for _ in range(40):\n    write_bytes_atomic(sys.argv[1], sys.argv[2].encode() * 200_000)")
    writers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "file"), str(n)],
                                cwd=REPO, stderr=subprocess.PIPE, text=True) for n in range(4)]
    for writer in writers:
        assert writer.wait(timeout=120) == 0, writer.stderr.read()
    data = (tmp_path / "file").read_bytes()
    assert len(data) == 200_000 and len(set(data)) == 1  # one writer's bytes, all of them
    assert [p.name for p in tmp_path.iterdir()] == ["file"]
