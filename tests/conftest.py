"""Shared fixtures: a small real corpus on disk, prepared into char-level bins, a tiny run
trained on it, and that run fine-tuned on conversations."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

# One thread per process, set before torch is imported here and inherited by every command
# the tests start. The xdist workers share the machine's cores, and the OpenMP threads of
# processes that each take every core spin against each other and slow the suite down. The C
# decode step's own threads are tested with torch.set_num_threads (tests/test_decode_step.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from data.prepare import prepare_text
from model import GPT, GPTConfig
from tests.forked import stop_server
from tests.processes import left_behind, mark_session
from tests.shared import built_once, conversation
from training.config import load_config

REPO = Path(__file__).resolve().parent.parent

def make_corpus(n_lines: int = 3000, seed: int = 0) -> str:
    """Text with real structure (a small grammar) so a tiny model's loss can fall fast."""
    rng = random.Random(seed)
    names = ["ROMEO", "JULIET", "NURSE", "TYBALT"]
    verbs = ["loves", "fears", "sees", "calls", "follows"]
    things = ["the moon", "the night", "a rose", "the sword", "her name"]
    lines = [f"{rng.choice(names)}: {rng.choice(names).title()} {rng.choice(verbs)} "
             f"{rng.choice(things)}." for _ in range(n_lines)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Fail the session if a process it started is still running at its end, and end that
    process. The check allows a grace period, because a worker takes up to a second to see
    that its parent has died."""
    mark_session()
    yield
    stop_server()
    left = left_behind(within=15)
    assert not left, f"processes the tests started are still running: {left}"


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder that every xdist worker of this session sees (or the session's own folder,
    without xdist), so that what is built there once serves them all."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def corpus_file(shared_dir) -> Path:
    def build(folder: Path) -> None:
        folder.mkdir()
        (folder / "plays.txt").write_text(make_corpus())
    return built_once(shared_dir / "corpus", build) / "plays.txt"


@pytest.fixture(scope="session")
def char_data(shared_dir, corpus_file) -> Path:
    return built_once(shared_dir / "plays_char", lambda out: prepare_text(
        corpus_file.read_text(), "char", out, source=str(corpus_file), shard_tokens=5000))


@pytest.fixture(scope="session")
def trained_run(shared_dir, char_data) -> Path:
    """A tiny model trained for 20 iterations by the real train.py: runs/tiny with best.pt."""
    def build(out: Path) -> None:
        subprocess.run([sys.executable, str(REPO / "train.py"), "--config",
                        str(REPO / "config" / "tiny.toml"), "--data-dir", str(char_data),
                        "--out-dir", str(out), "--max-iters", "20"],
                       check=True, capture_output=True, cwd=REPO)
    return built_once(shared_dir / "runs", build) / "tiny"


@pytest.fixture
def tiny_config(tmp_path, char_data):
    """The tiny preset pointed at the test corpus, writing into a temporary runs folder."""
    return load_config(REPO / "config" / "tiny.toml",
                       {"data_dir": str(char_data), "out_dir": str(tmp_path / "runs"),
                        "run_name": "tiny"})


@pytest.fixture
def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)).eval()


@pytest.fixture
def one_thread():
    """One thread for bit-for-bit comparisons, because with several threads, math libraries
    may split the work differently when the machine is busy, which changes the order of float
    additions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def chat_data(shared_dir, char_data) -> Path:
    def build(folder: Path) -> None:
        folder.mkdir()
        rng = random.Random(0)
        path = folder / "chats.jsonl"
        path.write_text("".join(json.dumps(conversation(rng)) + "\n" for _ in range(600)))
        result = subprocess.run([sys.executable, "-m", "data.prepare", "--input", str(path),
                                 "--chat", "--tokenizer", str(char_data), "--out",
                                 str(folder / "data")], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert "600 conversations" in result.stdout
    return built_once(shared_dir / "chat", build) / "data"


@pytest.fixture(scope="session")
def sft_run(shared_dir, trained_run, chat_data) -> tuple[Path, str]:
    """The tiny run fine-tuned on the chat data by the real train.py, and what it printed."""
    def build(out: Path) -> None:
        result = subprocess.run(
            [sys.executable, "train.py", "--config", "config/chat_sft.toml", "--init-from",
             str(trained_run), "--data-dir", str(chat_data), "--out-dir", str(out),
             "--max-iters", "150", "--eval-interval", "75", "--batch-size", "16", "--dtype",
             "float32", "--muon-lr", "0.03", "--learning-rate", "3e-3", "--embedding-lr", "0.05"],
            capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, result.stderr
        (out / "output.txt").write_text(result.stdout + result.stderr)
    out = built_once(shared_dir / "sft", build)
    return out / "chat_sft", (out / "output.txt").read_text()


@pytest.fixture(scope="module")
def chain_server(trained_run, tmp_path_factory):
    """serve.py with --api-key on tests/test_serve.py's byte_chain_checkpoint model, and the
    chain's ids; test_serve.py and test_lm_eval.py both ask it about split characters."""
    from tests.test_serve import CHAIN_KEY, CHAIN_NAME, byte_chain_checkpoint, serving

    path = tmp_path_factory.mktemp("chain") / f"{CHAIN_NAME}.pt"
    chain = byte_chain_checkpoint(trained_run, path)
    with serving("--checkpoint", str(path), "--api-key", CHAIN_KEY) as server:
        yield server, chain
