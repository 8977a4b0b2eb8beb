"""Generation: the KV cache changes speed, never results; sampling filters do what they say;
the sample.py command streams, stops and refuses bad input cleanly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import GPT, GPTConfig, filter_top_k, filter_top_p
from sample import SampleError, generate_text, resolve_checkpoint
from tokenizer import CharTokenizer, GPT2Tokenizer, TextStream

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32)).eval()


def step_logits(model: GPT, prompt: torch.Tensor, n: int, use_kv_cache: bool) -> list[torch.Tensor]:
    """Greedy generation, recording the logits the sampler saw at every step."""
    seen, forward = [], model.forward

    def recording_forward(*args, **kwargs):
        logits, loss = forward(*args, **kwargs)
        seen.append(logits[:, -1].clone())
        return logits, loss

    model.forward = recording_forward
    try:
        list(model.stream(prompt, n, temperature=0.0, use_kv_cache=use_kv_cache))
    finally:
        del model.forward
    return seen


def test_cached_logits_equal_uncached_at_every_step_past_block_size(model):
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = step_logits(model, prompt, 40, use_kv_cache=True)  # 45 tokens, block_size 16
    uncached = step_logits(model, prompt, 40, use_kv_cache=False)
    assert len(cached) == len(uncached) == 40
    for step, (a, b) in enumerate(zip(cached, uncached)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_takes_the_autocast_dtype(model, dtype):
    # a bf16 or fp16 training run samples at every evaluation under autocast, where keys and
    # values come out of the projections in the low-precision dtype, not the weights' fp32
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.autocast("cpu", dtype=dtype):
        assert model.new_kv_cache(2, 8).k[0].dtype == dtype
        cached = step_logits(model, prompt, 20, use_kv_cache=True)
        uncached = step_logits(model, prompt, 20, use_kv_cache=False)
    assert model.new_kv_cache(2, 8).k[0].dtype == torch.float32
    for step, (a, b) in enumerate(zip(cached, uncached)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2, msg=f"step {step}")


def test_greedy_cached_and_uncached_tokens_are_identical(model):
    prompt = torch.randint(0, 40, (1, 3), generator=torch.Generator().manual_seed(2))
    cached = model.generate(prompt, 60, temperature=0.0, use_kv_cache=True)
    uncached = model.generate(prompt, 60, temperature=0.0, use_kv_cache=False)
    assert cached.shape == (1, 63) and torch.equal(cached, uncached)


def test_compiled_decode_step_gives_the_same_tokens_and_compiles_once(model):
    prompt = torch.randint(0, 40, (1, 3), generator=torch.Generator().manual_seed(6))
    eager = [model.generate(prompt, 40, temperature=0.0),  # 43 tokens: two re-prefills
             model.generate(prompt[:, :2], 25, temperature=0.0)]
    model.compile_decode()
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every position
        compiled = [model.generate(prompt, 40, temperature=0.0),
                    model.generate(prompt[:, :2], 25, temperature=0.0)]
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_compiled_bf16_decode_step_matches_eager(model):
    # on the CPU the compiled step computes differently (fused loops, attention written
    # out); in bf16 its logits must still agree with eager's to within bf16 rounding
    model = model.to(torch.bfloat16)
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(8))
    cache = model.new_kv_cache(1, 16)
    with torch.inference_mode():
        model(prompt, kv_cache=cache, input_pos=torch.arange(5))  # prefill
        model.compile_decode()
        for pos in (5, 6, 15):  # writing the same key/value twice changes nothing
            token, input_pos = prompt[:, pos % 5:pos % 5 + 1], torch.tensor([pos])
            eager, _ = model(token, kv_cache=cache, input_pos=input_pos)
            compiled, _ = model.compiled_decode(token, kv_cache=cache, input_pos=input_pos)
            torch.testing.assert_close(compiled.float(), eager.float(), rtol=0, atol=2e-2,
                                       msg=f"position {pos}")


def test_a_batch_equals_its_sequences_one_by_one(model):
    prompts = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(3))
    batch = model.generate(prompts, 30, temperature=0.0)
    for row in range(3):
        assert torch.equal(batch[row:row + 1], model.generate(prompts[row:row + 1], 30, temperature=0.0))


def test_top_k_keeps_exactly_k_candidates():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0, 3.0]])
    kept = torch.isfinite(filter_top_k(logits, 2))
    assert kept.sum() == 2 and kept[0, [1, 2, 5]].sum() == 2
    assert torch.isfinite(filter_top_k(logits, 100)).all()  # k clamped to the vocabulary


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    assert torch.isfinite(filter_top_p(logits, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_top_p(logits, 0.8)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(filter_top_p(logits, 0.81)).tolist() == [[True, False, True, True]]
    assert torch.isfinite(filter_top_p(logits, 1.0)).all()


def test_same_seed_same_text_and_temperature_zero_is_deterministic(model):
    prompt = torch.zeros(1, 1, dtype=torch.long)
    def run(seed, temperature):
        return model.generate(prompt, 30, temperature, top_k=10, top_p=0.9,
                              generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run(7, 1.0), run(7, 1.0))
    assert not torch.equal(run(7, 1.0), run(8, 1.0))
    assert torch.equal(run(7, 0.0), run(8, 0.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_k": 0}, "top_k must be at least 1"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
])
def test_impossible_sampling_values_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 5, **kwargs)


def test_stop_string_split_across_tokens_is_found(model):
    tok = CharTokenizer("".join(chr(ord("a") + i) for i in range(26)) + " .,:;!?\n'-()[]")
    assert tok.vocab_size == 40
    full = "".join(generate_text(model, tok, [0], 30, temperature=0.0))
    stop = full[10:13]  # three characters: three separate tokens
    cut = "".join(generate_text(model, tok, [0], 30, temperature=0.0, stop=(stop,)))
    assert cut == full[:full.index(stop)]


def test_text_stream_never_emits_half_a_character():
    tok = GPT2Tokenizer()
    ids = tok.encode("東京 naïve")
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == "東京 naïve"
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len("東京 naïve".split()) + 1  # some characters really span tokens


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, char_data) -> Path:
    out = tmp_path_factory.mktemp("runs")
    subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "config" / "tiny.toml"),
                    "--data-dir", str(char_data), "--out-dir", str(out), "--max-iters", "20"],
                   check=True, capture_output=True, cwd=REPO)
    return out / "tiny"


def run_sample(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "sample.py"), *args], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_cli_streaming_prints_the_same_text_as_non_streaming(trained_run):
    args = ("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "80", "--seed", "3")
    streamed, whole = run_sample(*args), run_sample(*args, "--no-stream")
    uncached = run_sample(*args, "--no-kv-cache", "--temperature", "0")
    greedy = run_sample(*args, "--temperature", "0")
    c_step = run_sample(*args, "--temperature", "0", "--c-decode")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == whole.stdout and streamed.stdout.startswith("ROMEO:")
    assert len(streamed.stdout) > 80
    assert uncached.stdout == greedy.stdout == c_step.stdout


def test_cli_stop_string_understands_backslash_n(trained_run):
    full = run_sample("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "200")
    cut = run_sample("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "200",
                     "--stop", "\\n")
    assert full.stdout.count("\n") > 1  # the model does write newlines
    assert cut.returncode == 0 and cut.stdout == full.stdout[:full.stdout.index("\n")] + "\n"


@pytest.mark.parametrize("args, message", [
    (("--prompt", "ROMEO: ~^"), "error: prompt: 2 character(s) not in this model's vocabulary: '^', '~'"),
    (("--temperature", "-1"), "error: temperature must be >= 0"),
    (("--top-p", "0"), "error: top_p must be in (0, 1]"),
    (("--top-k", "0"), "error: top_k must be at least 1"),
    (("--dtype", "int8"), "error: dtype must be one of float32, bfloat16, float16"),
    (("--compile", "--no-kv-cache"), "error: --compile speeds up the cached decode step"),
    (("--c-decode", "--no-kv-cache"), "error: --c-decode speeds up the cached decode step"),
    (("--c-decode", "--compile"), "error: --compile and --c-decode are two ways"),
])
def test_cli_refuses_bad_sampling_input(trained_run, args, message):
    result = run_sample("--run", str(trained_run), *args)
    assert result.returncode == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_help_states_the_context_window_policy():
    proc = subprocess.run([sys.executable, "sample.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # the help is wrapped to the terminal's width
    assert "keep the most recent block_size // 2 tokens" in text
    assert "--no-kv-cache uses the same window" in text


def test_cli_names_a_missing_or_broken_checkpoint(tmp_path):
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a checkpoint")
    missing = run_sample("--checkpoint", str(tmp_path / "none.pt"))
    bad = run_sample("--checkpoint", str(broken))
    assert missing.returncode == 1 and "not found" in missing.stderr
    assert bad.returncode == 1 and "truncated or not a checkpoint" in bad.stderr


def test_cli_names_the_runs_when_run_has_no_checkpoint(trained_run):
    result = run_sample("--run", str(trained_run.parent / "no-such-run"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert f"no checkpoint at {trained_run.parent / 'no-such-run' / 'best.pt'}" in line
    assert line.endswith(f"runs in {trained_run.parent}/ that have one: {trained_run}")


def test_a_bare_run_name_is_looked_up_in_the_runs_folder(trained_run):
    runs = trained_run.parent
    assert resolve_checkpoint(trained_run.name, None, out_dir=str(runs)) == trained_run / "best.pt"
    with pytest.raises(SampleError, match=f"runs in {runs}/ that have one: {trained_run}$"):
        resolve_checkpoint("no-such-run", None, out_dir=str(runs))


def test_cli_benchmark_writes_figures(tmp_path):
    path = tmp_path / "decode.json"
    result = run_sample("--benchmark", "--preset", "baby_gpt", "--lengths", "8", "--repeats", "1",
                        "--c-decode", "--json", str(path))
    assert result.returncode == 0, result.stderr
    rows = json.loads(path.read_text())["rows"]
    assert [(r["new_tokens"], r["path"]) for r in rows] == [(8, "cached"), (8, "C step"),
                                                           (8, "uncached")]
    assert all(r["identical"] and r["tokens_per_s"] > 0 for r in rows)
