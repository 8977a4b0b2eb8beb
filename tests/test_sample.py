"""Generation: the KV cache changes speed, never results; sampling filters do what they say;
the sample.py command streams, stops and refuses bad input cleanly."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.bpe_tokenizers import GPT2Tokenizer
from data.chat import with_specials
from data.specials import CHAT_SPECIALS
from data.text import TextStream
from data.tokenizer import CharTokenizer, load_tokenizer
from generate import (
    DECODE_BACKENDS,
    cache_length,
    decode_step,
    filter_top_k,
    filter_top_p,
    generate,
    generate_text,
    new_kv_cache,
    sample_next,
    stream,
)
from machine.errors import InputError
from model import GPT, GPTConfig
from sample import attention_target, print_samples
from tests.forked import python
from tests.layouts import LAYOUTS, with_bigrams
from tests.output import error_line
from weights.loading import LoadError, resolve_checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32)).eval()


def step_logits(model: GPT, prompt: torch.Tensor, n: int, use_kv_cache: bool) -> list[torch.Tensor]:
    """Greedy generation with the eager decode step, recording the logits the sampler saw
    at every step."""
    seen, forward = [], model.forward

    def recording_forward(*args, **kwargs):
        logits, loss = forward(*args, **kwargs)
        seen.append(logits[:, -1].clone())
        return logits, loss

    model.forward = recording_forward
    try:
        list(stream(model, prompt, n, temperature=0.0, use_kv_cache=use_kv_cache,
                    decode="eager"))
    finally:
        del model.forward
    return seen


def test_cached_logits_equal_uncached_at_every_step_past_block_size(model):
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = step_logits(model, prompt, 40, use_kv_cache=True)  # 45 tokens, block_size 16
    uncached = step_logits(model, prompt, 40, use_kv_cache=False)
    assert len(cached) == len(uncached) == 40
    for step, (a, b) in enumerate(zip(cached, uncached, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cache_takes_the_autocast_dtype(model, dtype):
    # a bf16 or fp16 training run samples at every evaluation under autocast, where keys and
    # values come out of the projections in the low-precision dtype, not the weights' fp32
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.autocast("cpu", dtype=dtype):
        assert new_kv_cache(model, 2, 8).k[0].dtype == dtype
        cached = step_logits(model, prompt, 20, use_kv_cache=True)
        uncached = step_logits(model, prompt, 20, use_kv_cache=False)
    assert new_kv_cache(model, 2, 8).k[0].dtype == torch.float32
    for step, (a, b) in enumerate(zip(cached, uncached, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2, msg=f"step {step}")


def test_the_window_keeps_the_newest_half_block_when_the_next_token_would_not_fit(model):
    # the policy restated over the whole sequence: the model first sees the prompt's last
    # block_size tokens; when a token would not fit, the newest block_size // 2 stay
    prompt = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(3))
    out = generate(model, prompt, 30, temperature=0.0, use_kv_cache=False)
    block_size = model.config.block_size
    start, jumps = 20 - block_size, 0
    for n in range(20, 50):
        if n - start > block_size:
            start, jumps = n - block_size // 2, jumps + 1
        logits, _ = model(out[:, start:n])
        assert torch.equal(logits[:, -1].argmax(-1), out[:, n]), n
    assert jumps == 4  # at 21, 30, 39 and 48 tokens


@pytest.mark.parametrize("new_tokens, slots", [(5, 8), (6, 16)])
def test_the_cache_is_as_long_as_the_generation_fills(model, new_tokens, slots):
    # the prompt's 4 tokens and every new token but the last, which is never fed back: 8 or 9
    # positions, rounded up to a power of two; the cached tokens still equal the uncached ones
    assert cache_length(4, new_tokens, 1024) == slots
    prompt = torch.randint(0, 40, (1, 4), generator=torch.Generator().manual_seed(5))
    cached = generate(model, prompt, new_tokens, temperature=0.0, decode="eager")
    assert torch.equal(cached, generate(model, prompt, new_tokens, temperature=0.0,
                                        use_kv_cache=False))


def test_a_negative_number_of_new_tokens_is_refused(model):
    with pytest.raises(InputError, match="max_new_tokens must be at least 0, got -3"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), -3)


def test_a_bigram_model_with_block_size_1_generates_past_its_window():
    # the window keeps block_size // 2 tokens when it jumps, which for block_size 1 would be
    # none unless it keeps at least one
    torch.manual_seed(0)
    bigram = GPT(GPTConfig(vocab_size=10, block_size=1, n_layer=1, n_head=1, n_embd=8)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    uncached = generate(bigram, prompt, 6, temperature=0.0, use_kv_cache=False)
    assert torch.equal(generate(bigram, prompt, 6, temperature=0.0), uncached)
    for n in range(3, 9):  # each token follows from the one before it alone
        logits, _ = bigram(uncached[:, n - 1:n])
        assert uncached[0, n] == logits[0, -1].argmax()


# torch.compile runs only on gpt2's layout, nanochat's and the bigram table's, which hold
# every switch between them, because a cold compile is slow and the switches' own code is
# the eager model's
@pytest.mark.parametrize("decode, layout", [
    pytest.param(decode, layout, id=f"{decode}-{layout}") for decode in DECODE_BACKENDS
    for layout in LAYOUTS if decode != "compile" or layout in ("gpt2", "nanochat", "bigram")])
def test_every_decode_backend_gives_the_uncached_tokens_past_block_size(decode, layout):
    torch.manual_seed(0)
    model = with_bigrams(GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32,
                                       **LAYOUTS[layout])).eval())
    # 3 sequences of 4 + 40 tokens with block_size 16, so the window jumps and is prefilled
    # again
    prompts = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2))
    uncached = generate(model, prompts, 40, temperature=0.0, use_kv_cache=False)
    torch._dynamo.reset()  # graphs of the other layouts' models are not recompiles of this one
    with torch._dynamo.config.patch(error_on_recompile=True):  # one graph for every position
        cached = generate(model, prompts, 40, temperature=0.0, decode=decode)
    assert cached.shape == (3, 44) and torch.equal(cached, uncached)


def test_the_python_api_decodes_with_the_c_step_on_a_cpu_by_default(model):
    import inspect
    for fn in (generate, stream, generate_text):
        assert inspect.signature(fn).parameters["decode"].default == "auto"
    assert decode_step(model).name == "C step"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # only eager honours autocast
        assert decode_step(model).name == "eager"


def test_auto_decoding_without_a_compiler_falls_back_to_eager_and_says_why(tmp_path):
    # a real missing compiler, in a fresh process with an empty build cache
    script = ("import torch; from generate import generate; from model import GPT, GPTConfig; "
              "torch.manual_seed(0); m = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, "
              "n_head=4, n_embd=32)).eval(); p = torch.zeros(2, 3, dtype=torch.long); "
              "a = generate(m, p, 20, temperature=0.0); b = generate(m, p, 20, temperature=0.0); "
              "c = generate(m, p, 20, temperature=0.0, use_kv_cache=False); "
              "print(torch.equal(a, c) and torch.equal(b, c))")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "GPTLAB_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    assert result.stderr.strip().splitlines() == [  # one line, however many generations
        f"note: decoding with the slower eager step: the C decode step needs a C compiler, "
        f"and '{tmp_path / 'no-such-cc'}' was not found; install gcc or clang (or set CC), "
        f"or choose --decode eager"]


def test_compiled_bf16_decode_step_matches_eager(model):
    # on the CPU the compiled step computes differently (fused loops, attention written
    # out); in bf16 its logits must still agree with eager's to within bf16 rounding
    model = model.to(torch.bfloat16)
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(8))
    cache = new_kv_cache(model, 1, 16)
    step = decode_step(model, "compile")
    with torch.inference_mode():
        model(prompt, kv_cache=cache, input_pos=torch.arange(5))  # prefill
        for pos in (5, 6, 15):  # writing the same key/value twice changes nothing
            token, input_pos = prompt[:, pos % 5:pos % 5 + 1], torch.tensor([pos])
            eager, _ = model(token, kv_cache=cache, input_pos=input_pos)
            compiled = step(token, cache, input_pos)
            torch.testing.assert_close(compiled.float(), eager.float(), rtol=0, atol=2e-2,
                                       msg=f"position {pos}")


def test_a_batch_equals_its_sequences_one_by_one(model):
    prompts = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(3))
    batch = generate(model, prompts, 30, temperature=0.0)
    for row in range(3):
        assert torch.equal(batch[row:row + 1], generate(model, prompts[row:row + 1], 30, temperature=0.0))


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


@pytest.mark.parametrize("p", [1e-300, 5e-324, 1e-46, 1e-45, 1e-8, 0.5])
def test_top_p_keeps_the_likeliest_token_however_small_p(p):
    # a p below float32's smallest number is 0 in float32, where "mass before >= 0" would
    # hold for every token
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 9.0, 0.0]])
    kept = torch.isfinite(filter_top_p(logits, p))
    assert kept.tolist() == [[False, True, False, False], [False, False, True, False]]


# every filter at the narrow edge of its range still keeps the likeliest token
@pytest.mark.parametrize("settings", [
    {"top_p": 1e-300}, {"top_p": 5e-324}, {"top_p": 1e-46}, {"top_k": 1},
    {"temperature": 5e-324}, {"temperature": 1e-38}, {"temperature": 1e-300, "top_k": 1,
                                                      "top_p": 5e-324},
    {"temperature": 0.0, "top_p": 5e-324}, {"temperature": 2.0, "top_k": 10**18, "top_p": 1e-300},
])
def test_every_filter_at_its_narrowest_samples_the_likeliest_token(settings):
    logits = torch.tensor([[3.0, 9.5, -2.0, 9.25], [100.0, -100.0, 0.0, 50.0]])
    picked = sample_next(logits, **{"temperature": 1.0, **settings},
                         generator=torch.Generator().manual_seed(0))
    assert picked.flatten().tolist() == [1, 0]


@pytest.mark.parametrize("settings", [
    {"temperature": 1e30}, {"temperature": 1.7e308}, {"temperature": 1e300, "top_k": 10**18},
    {"temperature": 1e30, "top_k": 4, "top_p": 1.0}, {"temperature": 1e30, "top_p": 1 - 1e-16},
])
def test_every_filter_at_its_widest_samples_every_token(settings):
    # a temperature past float32's largest number divides as inf would, and -inf / inf is nan
    logits = torch.tensor([[3.0, 9.5, -2.0, -float("inf")]]).expand(4000, 4)
    picked = sample_next(logits, **settings, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(picked.flatten(), minlength=4).tolist()
    assert all(1100 < n < 1550 for n in counts[:3]) and counts[3] == 0, counts


def test_special_tokens_stay_out_of_text_unless_asked():
    tok = load_tokenizer(with_specials(GPT2Tokenizer().to_meta(), CHAT_SPECIALS))
    ids = [*tok.encode("Hi"), tok.specials["<|assistant_end|>"], *tok.encode(" there"),
           tok.eot_token]
    assert "".join(TextStream(tok).push([i]) for i in ids) == "Hi there"
    assert "".join(TextStream(tok, skip_special_tokens=False).push([i]) for i in ids) == \
        "Hi<|assistant_end|> there<|endoftext|>"


def test_same_seed_same_text_and_temperature_zero_is_deterministic(model):
    prompt = torch.zeros(1, 1, dtype=torch.long)
    def run(seed, temperature):
        return generate(model, prompt, 30, temperature, top_k=10, top_p=0.9,
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
        generate(model, torch.zeros(1, 1, dtype=torch.long), 5, **kwargs)


def test_stop_string_split_across_tokens_is_found(model):
    tok = CharTokenizer("".join(chr(ord("a") + i) for i in range(26)) + " .,:;!?\n'-()[]")
    assert tok.vocab_size == 40
    full = "".join(generate_text(model, tok, [0], 30, temperature=0.0))
    stop = full[10:13]  # three characters, so three separate tokens
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


def run_sample(*args: str) -> subprocess.CompletedProcess:
    return python(["sample.py", *args], env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_cli_streaming_prints_the_same_text_as_non_streaming(trained_run):
    args = ("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "80", "--seed", "3")
    streamed, whole = run_sample(*args), run_sample(*args, "--no-stream")
    uncached = run_sample(*args, "--no-kv-cache", "--temperature", "0")
    greedy = run_sample(*args, "--temperature", "0")
    eager = run_sample(*args, "--temperature", "0", "--decode", "eager")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == whole.stdout and streamed.stdout.startswith("ROMEO:")
    assert len(streamed.stdout) > 80
    assert uncached.stdout == greedy.stdout == eager.stdout


@pytest.mark.parametrize("streamed", [True, False])
def test_each_sample_follows_the_prompt_with_a_rule_between_them(streamed, capsys):
    draws = iter([["RO", "MEO"], [], ["!"]])
    first = print_samples(lambda: iter(next(draws)), "P:", 3, streamed)
    assert first == "ROMEO"
    assert capsys.readouterr().out == "P:ROMEO\n---------------\nP:\n---------------\nP:!\n"


def test_cli_samples_differ_and_a_seed_repeats_them(trained_run):
    args = ("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "40",
            "--num-samples", "2", "--seed", "5")
    once, again = run_sample(*args), run_sample(*args)
    assert once.returncode == 0, once.stderr
    first, second = once.stdout.split("\n---------------\n")
    assert first.startswith("ROMEO:") and second.startswith("ROMEO:")
    assert first != second  # the second sample continues the random stream, not starting over
    assert again.stdout == once.stdout


def test_cli_stop_string_understands_backslash_n(trained_run):
    full = run_sample("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "200")
    cut = run_sample("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "200",
                     "--stop", "\\n")
    assert full.stdout.count("\n") > 1  # the model does write newlines
    assert cut.returncode == 0 and cut.stdout == full.stdout[:full.stdout.index("\n")] + "\n"


def test_cli_sampling_filters_at_their_edges_print_the_greedy_text(trained_run):
    """Every filter at its narrowest keeps the likeliest token (rather than failing with
    "probability tensor contains inf/nan"), so each prints what --temperature 0 prints."""
    args = ("--run", str(trained_run), "--prompt", "ROMEO:", "--max-new-tokens", "30")
    greedy = run_sample(*args, "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr
    for edge in (["--top-p", "1e-300"], ["--top-p", "5e-324"], ["--top-p", "1e-46"],
                 ["--top-k", "1"], ["--temperature", "5e-324"]):
        result = run_sample(*args, *edge)
        assert result.returncode == 0 and result.stdout == greedy.stdout, (edge, result.stderr)
    wide = run_sample(*args, "--temperature", "1e300", "--top-k", "1000000000000")
    assert wide.returncode == 0 and wide.stdout.startswith("ROMEO:"), wide.stderr


def test_cli_leaves_special_tokens_out_of_text_unless_asked(sft_run):
    """A chat model continuing a plain prompt ends its replies with <|assistant_end|>. The
    text leaves it out by default (as vLLM and llama.cpp do) and keeps it with
    --no-skip-special-tokens."""
    args = ("--run", str(sft_run[0]), "--prompt", "Romeo loves.", "--temperature", "0",
            "--max-new-tokens", "20")
    kept, left_out = run_sample(*args, "--no-skip-special-tokens"), run_sample(*args)
    assert kept.returncode == left_out.returncode == 0, kept.stderr + left_out.stderr
    assert "<|assistant_end|>" in kept.stdout
    assert left_out.stdout == kept.stdout.replace("<|assistant_end|>", "")


def test_cli_help_states_the_context_window_policy():
    proc = python(["sample.py", "--help"], env={**os.environ, "COLUMNS": "200"}, timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # the help is wrapped to the terminal's width
    assert "keep the most recent block_size // 2 tokens" in text
    assert "--no-kv-cache uses the same window" in text


def test_cli_names_the_runs_when_run_has_no_checkpoint(trained_run):
    result = run_sample("--run", str(trained_run.parent / "no-such-run"))
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert f"no checkpoint (best.pt or last.pt) in {trained_run.parent / 'no-such-run'}" in line
    assert line.endswith(f"runs in {trained_run.parent}/ that have one: {trained_run}")


def test_a_bare_run_name_is_looked_up_in_the_runs_folder(trained_run):
    runs = trained_run.parent
    assert resolve_checkpoint(trained_run.name, None, out_dir=str(runs)) == trained_run / "best.pt"
    with pytest.raises(LoadError, match=f"runs in {runs}/ that have one: {trained_run}$"):
        resolve_checkpoint("no-such-run", None, out_dir=str(runs))
    with pytest.raises(LoadError, match=r"in /no-such-run; runs in / that have one"):
        resolve_checkpoint("/no-such-run", None)  # a folder at the root, and no "//"


def test_a_run_stopped_before_its_first_evaluation_samples_from_last_pt(trained_run, tmp_path,
                                                                        capsys):
    # such a run has last.pt and no best.pt; it is also the newest run, so the default takes it
    runs = tmp_path / "runs"
    shutil.copytree(trained_run, runs / "older")
    (runs / "early").mkdir()
    shutil.copy(trained_run / "best.pt", runs / "early" / "last.pt")
    note = f"note: {runs / 'early'} has no best.pt yet (it stopped before its first evaluation)"
    for run in ("early", None):
        assert resolve_checkpoint(run, None, out_dir=str(runs)) == runs / "early" / "last.pt"
        assert capsys.readouterr().err.startswith(note)
    result = run_sample("--run", str(runs / "early"), "--max-new-tokens", "5")
    assert result.returncode == 0 and result.stderr.startswith(note)


def test_cli_benchmark_writes_figures(tmp_path):
    path = tmp_path / "decode.json"
    result = run_sample("--benchmark", "--preset", "baby_gpt", "--lengths", "8", "--repeats", "1",
                        "--batch", "2", "--json", str(path))
    assert result.returncode == 0, result.stderr
    figures = json.loads(path.read_text())
    assert figures["batch"] == 2
    rows = figures["rows"]
    assert [(r["new_tokens"], r["path"]) for r in rows] == [
        (8, "default (C step)"), (8, "eager"), (8, "uncached"), (8, "transformers")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["identical"] for r in rows[:3])  # transformers' kernels may break ties differently


def test_attention_pictures_go_inside_a_folder_and_beside_a_name(tmp_path):
    (tmp_path / "pics").mkdir()
    assert attention_target(str(tmp_path / "pics")) == tmp_path / "pics" / "attention"
    assert attention_target(f"{tmp_path}/new/") == tmp_path / "new" / "attention"
    assert (tmp_path / "new").is_dir() and list((tmp_path / "new").iterdir()) == []
    assert attention_target(str(tmp_path / "out" / "romeo")) == tmp_path / "out" / "romeo"


@pytest.mark.parametrize("temperature", [1e-30, 1e-300, 5e-324])
def test_a_temperature_however_small_samples_the_likeliest_token(temperature):
    # logits / 1e-300 would overflow to inf, and inf - inf is nan in the softmax
    logits = torch.tensor([[3.0, 9.5, -2.0, 9.25], [100.0, -100.0, 0.0, 50.0]])
    picked = sample_next(logits, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert picked.flatten().tolist() == [1, 0]


def test_a_stop_string_that_is_not_utf8_is_refused_as_a_prompt_is(trained_run):
    result = subprocess.run([sys.executable.encode(), b"sample.py", b"--run", bytes(trained_run),
                             b"--stop", b"\n", b"--stop", b"RO\xffMEO"], cwd=REPO,
                            capture_output=True, timeout=120)
    assert result.returncode == 1 and result.stdout == b""
    assert error_line(result.stderr) == (
        "error: --stop is not valid UTF-8 (byte offset 2, line 1); convert it to UTF-8 first")


def test_a_prompt_that_is_not_utf8_is_refused_from_the_command_line_as_from_a_file(tmp_path,
                                                                                trained_run):
    bad = b"ROMEO\xff:"
    (tmp_path / "prompt.txt").write_bytes(bad)
    for source, where in (([b"--prompt", bad], "--prompt"),
                          ([b"--prompt-file", bytes(tmp_path / "prompt.txt")],
                           str(tmp_path / "prompt.txt"))):
        result = subprocess.run([sys.executable.encode(), b"sample.py", b"--run",
                                 bytes(trained_run), *source], cwd=REPO, capture_output=True,
                                timeout=120)
        assert result.returncode == 1
        assert error_line(result.stderr) == (f"error: {where} is not valid UTF-8 (byte offset "
                                             f"5, line 1); convert it to UTF-8 first")
