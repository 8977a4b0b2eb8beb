"""The hand-written C decode step (cdecode/decode_step.c) computes what the PyTorch model computes,
builds from source with the system compiler, and refuses what it cannot run."""

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cdecode import BuildError, CDecodeStep, block_param_names, build
from generate import ModelStep, decode_step, generate, new_kv_cache, stream
from machine.device import cpu_flags
from model import GPT, GPTConfig
from tests.forked import python
from tests.layouts import LAYOUTS, with_bigrams
from tests.output import error_line
from weights.quantize import quantize_int8

REPO = Path(__file__).resolve().parent.parent


def small_gpt(**overrides) -> GPT:
    # widths that are not multiples of the vector width, so that every loop of the C step's
    # dot product runs: 72 = 64 + 8 and head_dim 18 = 16 + 2
    torch.manual_seed(0)
    shape = dict(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=72)
    return with_bigrams(GPT(GPTConfig(**{**shape, **overrides})).eval())


X86 = platform.machine() == "x86_64"
AVX2 = X86 and {"avx2", "fma"} <= cpu_flags()
# decode_step.c has an AVX-512 dot product, an AVX2 one and a plain loop for other CPUs
MARCHES = [
    "native",
    pytest.param("haswell", marks=pytest.mark.skipif(not AVX2, reason="needs AVX2 and FMA")),
    pytest.param("x86-64", marks=pytest.mark.skipif(not X86, reason="needs an x86 CPU")),
]


def decode_logits(model: GPT, prompt: torch.Tensor, n: int, step=None) -> list[torch.Tensor]:
    """Greedy generation that records the logits of every decode step, leaving out prefills
    of more than one token, which the model's forward runs. With step None, the eager model
    runs the steps."""
    step = step or decode_step(model, "eager")
    seen = []

    def recording_step(*args):
        logits = step(*args)
        seen.append(logits[:, -1].float().clone())
        return logits

    list(stream(model, prompt, n, temperature=0.0, decode=ModelStep("recording", recording_step)))
    return seen


def test_every_decode_step_declares_what_it_can_do():
    model = small_gpt()
    steps = {backend: decode_step(model, backend) for backend in ("eager", "compile", "c")}
    declared = {backend: (s.name, s.max_prefill, s.steps_chosen_rows) for backend, s in steps.items()}
    assert declared == {"eager": ("eager", 1, False), "compile": ("compiled", 1, False),
                        "c": ("C step", CDecodeStep.PREFILL_TOKENS[torch.float32], True)}


def test_a_step_of_the_models_forward_refuses_to_step_chosen_rows():
    model = small_gpt()
    with pytest.raises(ValueError, match="the eager decode step steps every row of the cache"):
        decode_step(model, "eager")(torch.zeros(1, 1, dtype=torch.long), new_kv_cache(model, 2),
                                    torch.zeros(1, 1, dtype=torch.long), rows=torch.tensor([1]))


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("bias", [True, False])
def test_c_step_logits_equal_eager_at_every_step_past_block_size(bias, march):
    model = small_gpt(bias=bias)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = decode_logits(model, prompt, 40)  # 45 tokens with block_size 16, so it re-prefills
    c = decode_logits(model, prompt, 40, CDecodeStep(model, march))
    assert len(c) == len(eager) == 35  # 40 steps less the first prefill and four re-prefills
    for step, (a, b) in enumerate(zip(c, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_c_step_follows_every_layout_switch(layout):
    model = small_gpt(**LAYOUTS[layout])
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    eager = decode_logits(model, prompt, 30)
    c = decode_logits(model, prompt, 30, CDecodeStep(model))
    for step, (a, b) in enumerate(zip(c, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    int8 = quantize_int8(model)
    eager = decode_logits(int8, prompt, 30)
    c = decode_logits(int8, prompt, 30, CDecodeStep(int8))
    for step, (a, b) in enumerate(zip(c, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"int8, step {step}")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("layout", ["gpt2", "modern"])
def test_c_prefill_fills_the_cache_and_gives_the_logits_eager_does(quantized, layout):
    model = small_gpt(**LAYOUTS[layout])
    model = quantize_int8(model) if quantized else model
    prompt = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(5))
    c_cache, eager_cache = new_kv_cache(model, 2, 16), new_kv_cache(model, 2, 16)
    with torch.inference_mode():
        c = CDecodeStep(model)(prompt, c_cache, torch.arange(11))
        eager, _ = model(prompt, kv_cache=eager_cache, logits_from=-1)
    torch.testing.assert_close(c, eager, rtol=0, atol=1e-4)
    for a, b in zip(c_cache.k + c_cache.v, eager_cache.k + eager_cache.v, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_c_step_greedy_tokens_equal_eager_for_a_batch():
    model = small_gpt()
    prompts = torch.randint(0, 40, (3, 4), generator=torch.Generator().manual_seed(2))
    eager = generate(model, prompts, 50, temperature=0.0, decode="eager")
    assert torch.equal(generate(model, prompts, 50, temperature=0.0, decode="c"), eager)


@pytest.mark.parametrize("quantized", [False, True])
def test_c_step_gives_a_sequence_the_same_bits_alone_and_in_any_batch(quantized):
    """The server's promise: an answer does not depend on who else is served. A sequence's
    logits in a batch of 2 to 7 equal its logits alone, bit for bit. The kernel takes inputs
    in pairs and weight rows in fours, and rows 76 wide leave a tail past the vector width."""
    model = small_gpt(n_embd=76, n_head=4)
    model = quantize_int8(model) if quantized else model
    step = CDecodeStep(model)
    tokens = torch.randint(0, 40, (7, 1), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        alone = [step(tokens[b:b + 1], new_kv_cache(model, 1, 16), torch.tensor([5]))
                 for b in range(7)]
        for B in range(2, 8):
            together = step(tokens[:B], new_kv_cache(model, B, 16), torch.tensor([5]))
            for b in range(B):
                assert torch.equal(together[b], alone[b][0]), (B, b)


@pytest.mark.parametrize("quantized", [False, True])
def test_c_step_gives_the_same_bits_on_any_number_of_threads(quantized):
    """The step's threads (as many as torch uses) split each matrix's rows between them in
    groups of four, and one thread computes each row, so the bits do not depend on how many
    threads there are. The suite runs one thread per process (tests/conftest.py), so this test
    sets 2 and 3 threads itself. They share 76 rows, which do not split evenly, in a prefill
    whose rows run past the vector width, and the logits also match eager's to 1e-5."""
    model = small_gpt(n_embd=76, n_head=4)
    model = quantize_int8(model) if quantized else model
    step = CDecodeStep(model)
    prompt = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(4))
    threads, logits = torch.get_num_threads(), {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.inference_mode():
                logits[n] = step(prompt, new_kv_cache(model, 3, 16), torch.arange(6))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits[2], logits[1]) and torch.equal(logits[3], logits[1])
    with torch.inference_mode():
        eager = model(prompt, kv_cache=new_kv_cache(model, 3, 16), logits_from=-1)[0]
    torch.testing.assert_close(logits[1], eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["gpt2", "modern"])
@pytest.mark.parametrize("backend", ["eager", "c"])
def test_sequences_at_their_own_positions_step_as_each_would_alone(backend, layout):
    """A server's batch: sequences of different lengths, each prefilled into its own row of
    one cache, then stepped together, each at its own position. The C step steps only the
    rows it is given (here rows 2 and 0 of 3), while the model steps every row."""
    model = small_gpt(**LAYOUTS[layout])
    lengths, rows = [5, 9], torch.tensor([2, 0])
    prompts = [torch.randint(0, 40, (1, n), generator=torch.Generator().manual_seed(n))
               for n in lengths]
    alone = [decode_logits(model, p, 5) for p in prompts]  # 4 steps each, each with its own cache
    step = decode_step(model, backend)
    cache = new_kv_cache(model, 3, 16)
    with torch.inference_mode():
        tokens = [model(p, kv_cache=cache.rows(r, r + 1), logits_from=-1)[0][:, -1].argmax(-1)
                  for p, r in zip(prompts, rows.tolist(), strict=True)]
        for i in range(4):
            idx = torch.stack(tokens)  # (2, 1)
            positions = torch.tensor(lengths)[:, None] + i
            if backend == "c":
                logits = step(idx, cache, positions, rows=rows)[:, -1]
            else:  # every row of the cache steps, so the idle row 1 steps at position 0
                idx = torch.cat([idx[1:], torch.zeros(1, 1, dtype=idx.dtype), idx[:1]])
                positions = torch.cat([positions[1:], torch.zeros(1, 1, dtype=torch.int64),
                                       positions[:1]])
                logits = step(idx, cache, positions)[[2, 0], -1]
            for b in range(2):
                torch.testing.assert_close(logits[b], alone[b][i][0], rtol=0, atol=1e-5)
            tokens = list(logits.argmax(-1, keepdim=True))


@pytest.mark.parametrize("layout", ["gpt2", "modern"])
@pytest.mark.parametrize("march", MARCHES)
def test_c_step_bf16_matches_eager_to_bf16_rounding(march, layout):
    # eager rounds every activation to bf16; the C step keeps activations in float32
    model = small_gpt(**LAYOUTS[layout]).to(torch.bfloat16)
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(3))
    eager = decode_logits(model, prompt, 30)
    c = decode_logits(model, prompt, 30, CDecodeStep(model, march))
    for step, (a, b) in enumerate(zip(c, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2, msg=f"step {step}")
        if a.argmax() != b.argmax():  # rounding may flip a near tie, and the texts diverge from there
            top2 = b.topk(2).values[0]
            assert top2[0] - top2[1] < 6e-2, f"step {step}: a token that was no near tie"
            break


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("bias", [True, False])
def test_c_step_int8_equals_the_int8_torch_path(bias, march):
    # the same int8 weights and scales on both sides, activations in float32 on both
    model = quantize_int8(small_gpt(bias=bias))
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(4))
    eager = decode_logits(model, prompt, 40)
    c = decode_logits(model, prompt, 40, CDecodeStep(model, march))
    assert len(c) == len(eager) == 35
    for step, (a, b) in enumerate(zip(c, eager, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"step {step}")


def test_c_step_refuses_what_it_cannot_run():
    with pytest.raises(BuildError, match="float32, bfloat16 or int8 weights on the CPU, not float16"):
        CDecodeStep(small_gpt().half())
    model = small_gpt()
    step = CDecodeStep(model)
    cache = new_kv_cache(model, 1, 8)
    with pytest.raises(IndexError, match=r"positions \[\[8\]\]"):  # past the cache's 8 slots
        step(torch.tensor([[1]]), cache, torch.tensor([8]))
    with pytest.raises(IndexError, match=r"a token of \[\[40\]\]"):  # outside the vocabulary
        step(torch.tensor([[40]]), cache, torch.tensor([0]))
    with pytest.raises(IndexError, match=r"rows \[1\]"):  # the cache has one row
        step(torch.tensor([[1]]), cache, torch.tensor([0]), rows=torch.tensor([1]))
    with pytest.raises(IndexError, match=r"rows \[0, 0\]"):  # one row written twice
        step(torch.tensor([[1], [2]]), new_kv_cache(model, 2, 8), torch.tensor([[0], [0]]),
             rows=torch.tensor([0, 0]))


def test_the_block_parameter_list_comes_from_the_c_source():
    names = block_param_names(build(torch.float32))
    assert names[:2] == ["ln_1.weight", "ln_1.bias"] and len(names) == 16

    def block_tensors(model: GPT) -> set[str]:
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return {n.removeprefix("transformer.h.0.") for n, _ in tensors
                if n.startswith("transformer.h.0.")}
    # a float block lacks only the int8 row scales; an int8 one has every name
    assert set(names) - block_tensors(small_gpt()) == {n for n in names if n.endswith(".scales")}
    assert set(names) == block_tensors(quantize_int8(small_gpt()))


def test_without_a_compiler_the_cli_says_so(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "GPTLAB_CACHE": str(tmp_path)}
    result = python(["sample.py", "--benchmark", "--preset", "baby_gpt", "--decode", "c"], env=env,
                    timeout=120)
    assert result.returncode == 1
    assert error_line(result.stderr) == (
        f"error: the C decode step needs a C compiler, and '{tmp_path / 'no-such-cc'}' was "
        f"not found; install gcc or clang (or set CC), or choose --decode eager")


def test_gptlab_cflags_reach_the_compiler_after_its_own_flags(tmp_path, monkeypatch):
    from machine.cbuild import CompilerError, build_library
    source = tmp_path / "flags.c"
    source.write_text("#ifndef CHOSEN\n#define CHOSEN 0\n#endif\nint chosen(void) { return CHOSEN; }\n"
                      "#ifdef __AVX512F__\nint avx512(void) { return 1; }\n"
                      "#else\nint avx512(void) { return 0; }\n#endif\n")
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))

    def built(cflags: str):
        monkeypatch.setenv("GPTLAB_CFLAGS", cflags)
        return build_library(source, [], "a test library", instead="skip it")
    plain, flagged = built(""), built("-DCHOSEN=7" + " -march=x86-64-v3" * X86)
    assert (plain.chosen(), flagged.chosen()) == (0, 7)
    # after -march=native, so that their -march wins: an AVX2 build on a CPU with AVX-512
    assert plain.avx512() == ("avx512f" in cpu_flags())
    assert flagged.avx512() == 0
    # the user's own flags are theirs to fix, so a caller does not fall back from them
    monkeypatch.setenv("GPTLAB_CFLAGS", "-mno-such-flag")
    with pytest.raises(CompilerError, match=r"could not build flags\.c: .*; check GPTLAB_CFLAGS \(-mno-such"):
        build_library(source, [], "a test library", instead="skip it")


def test_a_build_without_openmp_or_march_says_so_and_still_computes_the_same(tmp_path):
    # a real compiler that refuses OpenMP and -march, as Apple's clang refuses OpenMP
    cc = tmp_path / "plain-cc"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -fopenmp|-march=*) exit 1;; '
                  'esac; done\nexec cc "$@"\n')
    cc.chmod(0o755)
    script = ("import torch; from tests.test_decode_step import small_gpt, decode_logits; "
              "from cdecode import CDecodeStep; m = small_gpt(); p = torch.zeros(1, 3, "
              "dtype=torch.long); a = decode_logits(m, p, 20); b = decode_logits(m, p, 20, "
              "CDecodeStep(m)); "
              "print(all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b, strict=True))); "
              "from cdecode import build; build.cache_clear(); build(torch.float32)")
    env = {**os.environ, "CC": str(cc), "GPTLAB_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    note = (f"note: {cc} built the C decode step without -march=native or OpenMP (one thread), "
            f"so it runs slower than it could")
    assert result.stderr.strip().splitlines() == [note, note]  # built, then loaded from cache


def sample_c(checkpoint: Path, cache: Path, decode: str = "c", **env: str):
    """sample.py with the C step, a build cache of its own and the given variables."""
    return python(["sample.py", "--checkpoint", str(checkpoint), "--max-new-tokens", "5",
                   "--decode", decode], env={**os.environ, "GPTLAB_CACHE": str(cache), **env},
                  timeout=300)


def test_a_cached_build_that_cannot_be_read_or_trusted_is_built_again(tmp_path, trained_run):
    """Files beside a cached build that are not UTF-8, a note that names no known reason, and
    a library whose digest matches but that lacks decode_step each read as no build: the next
    run builds again and answers as the first did."""
    checkpoint, cache = trained_run / "best.pt", tmp_path / "cache"
    first = sample_c(checkpoint, cache)
    assert first.returncode == 0, first.stderr
    [library] = (cache / "decode_step").glob("*.so")
    digest, note = library.with_suffix(".sha256"), library.with_suffix(".note")
    stranger = tmp_path / "stranger.c"  # a real library, without the step's symbols
    stranger.write_text("int something_else(void) { return 1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(stranger), "-o", str(tmp_path / "stranger.so")],
                   check=True)

    def wrong_library() -> None:
        data = (tmp_path / "stranger.so").read_bytes()
        library.write_bytes(data)
        digest.write_text(hashlib.sha256(data).hexdigest())
    damages = {"digest not UTF-8": lambda: digest.write_bytes(b"\xff\xfe\x00"),
               "note not UTF-8": lambda: note.write_bytes(b"without \xff"),
               "note of no known reason": lambda: note.write_text("without everything"),
               "matching digest, no decode_step": wrong_library}
    for name, damage in damages.items():
        damage()
        again = sample_c(checkpoint, cache)
        assert again.returncode == 0 and again.stdout == first.stdout, (name, again.stderr)
        assert "note:" not in again.stderr, name  # not the bad note's words
        assert b"decode_step" in library.read_bytes() and not note.exists(), name


@pytest.mark.parametrize("env, words", [
    ({"GPTLAB_CFLAGS": "-E"}, "cc exited without an error but wrote no library that loads for "
     "the C decode step (invalid ELF header); check GPTLAB_CFLAGS (-E)"),
    ({"GPTLAB_CFLAGS": "--version"}, "cc exited without an error but wrote no library for the "
     "C decode step; check GPTLAB_CFLAGS (--version)"),
    ({"CC": "true"}, "true exited without an error but wrote no library for the C decode step; "
     "check CC (true)"),
    ({"GPTLAB_CFLAGS": "-Ddecode_step=renamed"}, "cc built the C decode step without "
     "decode_step; check GPTLAB_CFLAGS (-Ddecode_step=renamed)"),
    ({"GPTLAB_CFLAGS": '-O2 "'}, 'GPTLAB_CFLAGS (-O2 ") cannot be split into flags as a shell '
     'would (No closing quotation); close its quotes'),
    # a library for another weight type than the model's printed blank lines
    ({"GPTLAB_CFLAGS": "-DWEIGHT_BF16"}, "cc built the C decode step for bfloat16 weights, not "
     "float32; check GPTLAB_CFLAGS (-DWEIGHT_BF16)"),
    ({"GPTLAB_CFLAGS": "-DWEIGHT_INT8"}, "cc built the C decode step for int8 weights, not "
     "float32; check GPTLAB_CFLAGS (-DWEIGHT_INT8)"),
])
def test_a_compiler_or_flags_that_build_something_else_are_one_line(tmp_path, trained_run, env,
                                                                   words):
    """The default step does not fall back from these, because the same settings would build
    the same wrong thing on every run; and nothing is cached."""
    result = sample_c(trained_run / "best.pt", tmp_path / "cache", decode="auto", **env)
    assert result.returncode == 1 and result.stdout == ""
    assert error_line(result.stderr) == f"error: {words}"
    assert "cache" not in error_line(result.stderr)
    assert [p.name for p in (tmp_path / "cache").rglob("*") if not p.is_dir()] == []


def test_a_library_that_ends_the_process_loading_it_is_one_line(tmp_path, trained_run):
    """A new build is loaded first in a process of its own, so that a library whose loading
    ends the process (an ASan build's runtime does) is one line naming the flags."""
    result = sample_c(trained_run / "best.pt", tmp_path / "cache", decode="auto",
                      GPTLAB_CFLAGS="-fsanitize=address")
    if "could not build" in result.stderr:
        pytest.skip("this compiler cannot build with AddressSanitizer")
    assert result.returncode == 1 and result.stdout == ""
    line = error_line(result.stderr)
    assert line.startswith("error: cc exited without an error but wrote no library that loads "
                           "for the C decode step (loading it ended Python: ")
    assert line.endswith("; check GPTLAB_CFLAGS (-fsanitize=address)")


def test_cc_may_hold_a_command_with_its_arguments(tmp_path, trained_run):
    """CC may be a command with its arguments (CC="ccache gcc"), as make reads it."""
    result = sample_c(trained_run / "best.pt", tmp_path / "cache", CC="env cc")
    assert result.returncode == 0 and result.stdout, result.stderr
    result = sample_c(trained_run / "best.pt", tmp_path / "cache", CC="'cc")
    assert error_line(result.stderr) == ("error: CC ('cc) cannot be split as a shell would (No "
                                         "closing quotation); close its quotes")
