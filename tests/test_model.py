"""The transformer computes what it claims: it is causal, its fused qkv equals three
projections, and its two attention paths agree."""

import math

import pytest
import torch
from torch.nn import functional as F

from model import (
    GPT,
    GPTConfig,
    apply_rope,
    explicit_attention,
    relu_squared,
    rms_norm,
    sdpa_attention,
)
from tests.layouts import LAYOUTS, with_bigrams


def layout_model(layout: str) -> GPT:
    torch.manual_seed(0)
    return with_bigrams(GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32,
                                      **LAYOUTS[layout])).eval())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_future_tokens_do_not_change_past_logits(layout):
    tiny_model = layout_model(layout)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    t = 7
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, 50, (2, 16 - t - 1), generator=torch.Generator().manual_seed(2))
    assert not torch.equal(idx, changed)
    logits, _ = tiny_model(idx)
    logits_changed, _ = tiny_model(changed)
    torch.testing.assert_close(logits[:, :t + 1], logits_changed[:, :t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(logits[:, t + 1:], logits_changed[:, t + 1:])


@pytest.mark.parametrize("logits_from", [-1, 5, 0])
def test_logits_from_computes_the_tail_of_the_full_logits(tiny_model, logits_from):
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    full, _ = tiny_model(idx)
    tail, _ = tiny_model(idx, logits_from=logits_from)
    assert tail.shape == (2, len(range(16)[logits_from:]), 50)
    torch.testing.assert_close(tail, full[:, logits_from:], rtol=0, atol=1e-6)


def test_fused_qkv_equals_three_separate_projections(tiny_model):
    attn = tiny_model.transformer.h[0].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    w_q, w_k, w_v = attn.c_attn.weight.split(32, dim=0)
    b_q, b_k, b_v = attn.c_attn.bias.split(32, dim=0)
    q, k, v = attn.c_attn(x).split(32, dim=2)
    torch.testing.assert_close(q, F.linear(x, w_q, b_q))
    torch.testing.assert_close(k, F.linear(x, w_k, b_k))
    torch.testing.assert_close(v, F.linear(x, w_v, b_v))
    assert attn.c_attn.weight.shape == (3 * 32, 32)  # one Linear(d, 3d)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_path_equals_explicit_path(layout):
    tiny_model = layout_model(layout)
    idx = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(4))
    fused, _ = tiny_model(idx)
    explicit, _ = tiny_model(idx, attention="explicit")
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)


def test_the_explicit_paths_weights_pass_attn_dropout_sum_to_one_and_hide_the_future(tiny_model):
    weights = []
    for block in tiny_model.transformer.h:
        block.attn.attn_dropout.register_forward_hook(lambda module, args, out: weights.append(out))
    tiny_model(torch.randint(0, 50, (2, 12)), attention="explicit")
    assert len(weights) == 2 and weights[0].shape == (2, 4, 12, 12)  # one per layer, each (B, nh, T, T)
    for att in weights:
        torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]))
        future = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)
        assert torch.all(att[..., future] == 0)


def test_an_unknown_attention_path_is_refused(tiny_model):
    with pytest.raises(ValueError, match="attention must be sdpa or explicit, got 'flash'"):
        tiny_model(torch.zeros(1, 4, dtype=torch.long), attention="flash")


def test_attention_functions_agree_under_a_cache_mask():
    # 3 queries at positions 5..7 over a cache of 10 slots, as in a prefill after 5 tokens;
    # slots 8 and 9 hold stale values that the mask must hide
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 10, 10))
    mask = torch.arange(5, 8)[:, None] >= torch.arange(10)
    seen = []  # the weights, as they pass through the dropout on their way to V

    def keep(att: torch.Tensor) -> torch.Tensor:
        seen.append(att)
        return att

    y_explicit = explicit_attention(q, k, v, mask, keep)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask, dropout_p=0.0), y_explicit)
    att = seen[0]
    assert torch.all(att[..., 0, 6:] == 0) and torch.all(att[..., 2, 8:] == 0)
    y_prefix = explicit_attention(q, k[:, :, :8], v[:, :, :8], mask[:, :8], torch.nn.Identity())
    torch.testing.assert_close(y_explicit, y_prefix)  # stale slots change nothing


def test_short_bf16_attention_on_a_cpu_computes_in_fp32():
    # torch's CPU kernel is slower in bf16 than in fp32 below 256 keys, so there the fused
    # path computes in fp32, under autocast too (which would otherwise cast back), and rounds
    # the output; from 256 keys on, it stays in bf16
    g = torch.Generator().manual_seed(3)
    for T, fp32 in [(64, True), (256, False)]:
        q, k, v = (torch.randn(2, 4, T, 32, generator=g).bfloat16().requires_grad_()
                   for _ in range(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = sdpa_attention(q, k, v, None, dropout_p=0.0)
        in_fp32 = sdpa_attention(q.float(), k.float(), v.float(), None, 0.0).bfloat16()
        assert y.dtype == torch.bfloat16 and torch.equal(y, in_fp32) == fp32
        y.sum().backward()
        assert q.grad.dtype == torch.bfloat16 and q.grad.abs().max() > 0


def rotated_as_complex_numbers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope's rotation computed another way: each pair as x1 + i x2, times e^(i angle)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    turned = torch.complex(x1, x2) * torch.complex(cos, sin)
    return torch.cat([turned.real, turned.imag], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradients_written_out_equal_autograds(dtype):
    # RMSNorm, ReLU^2 and the rotary rotation are written out for speed (in C for float32, in
    # machine/cpu_kernels.c), and model.py's @on_cpu runs them on a CPU in place of the plain
    # expressions it shows; they must give those expressions' values and gradients, in
    # fp32 and from bf16 activations, and the rotation must be the complex numbers' too
    from machine.cpu_kernels import kernels
    assert kernels() is not None  # the C kernels are built here, so float32 runs them
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(7, 1, 16, generator=gen) * 6  # (T, 1, hd / 2): one row per position
    cos, sin = angles.cos(), angles.sin()
    as_complex = lambda x: rotated_as_complex_numbers(x, cos, sin)  # noqa: E731
    for fast, composed, kernel in [
        (lambda x: rms_norm(x, 1e-6), lambda x: rms_norm.__wrapped__(x, 1e-6), "RMSNormFunction"),
        (relu_squared, relu_squared.__wrapped__, "ReLUSquared"),
        (lambda x: apply_rope(x, cos, sin), as_complex, "RotatePairs" if dtype == torch.float32 else ""),
        (lambda x: apply_rope.__wrapped__(x, cos, sin), as_complex, ""),
    ]:
        x = (3 * torch.randn(4, 7, 3, 32, generator=gen)).to(dtype).requires_grad_()
        g = torch.randn(4, 7, 3, 32, generator=gen).to(dtype)
        ran = type(fast(x).grad_fn).__name__  # the kernel's backward, or a torch operation's
        assert ran.startswith(kernel) if kernel else not ran.startswith("RotatePairs"), ran
        ours, = torch.autograd.grad(fast(x), x, g)
        theirs, = torch.autograd.grad(composed(x), x, g)
        assert fast(x).dtype == composed(x).dtype == ours.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(fast(x), composed(x), rtol=tol, atol=tol)
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
        assert ours.abs().max() > 0.1  # not an empty comparison


def test_a_model_built_on_the_meta_device_gets_the_same_initial_values():
    # training/fsdp.py builds the model on the meta device, where init_weights draws nothing,
    # and fills it later, after other draws from torch's generator
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(0)
    whole = GPT(config)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(config)
    assert meta.lm_head.weight.is_meta
    meta.to_empty(device="cpu")
    meta.transformer.wte.weight = meta.lm_head.weight  # to_empty unties them; fully_shard does not
    torch.rand(1000)  # the generator moves on, as building the layers on a CPU moves it
    meta.init_weights()
    state = whole.state_dict()
    for name, param in meta.named_parameters():
        assert torch.equal(param, state[name]), name


def test_initial_loss_is_close_to_uniform_guess():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32))
    g = torch.Generator().manual_seed(6)
    idx, targets = torch.randint(0, 65, (2, 8, 32), generator=g)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(65)) < 0.1


def test_one_batch_overfits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(0, 20, (4, 16))
    y = torch.randint(0, 20, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        _, loss = model(x, y)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 2.5 and loss.item() < 0.1


def test_lm_head_is_tied_to_token_embedding(tiny_model):
    assert tiny_model.lm_head.weight is tiny_model.transformer.wte.weight


def test_parameter_count_and_flops_follow_the_shape():
    model = GPT(GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384))
    d = 384
    per_block = (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (2 * d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    expected = 6 * per_block + 2 * d + 65 * d  # blocks, ln_f, tied token table (no wpe)
    assert model.num_params() == expected == 10_672_512
    assert model.num_params(non_embedding=False) == expected + 256 * d
    assert model.flops_per_token(256) == 6 * expected + 12 * 6 * d * 256
    # untied, the table is only looked up, and the head does the compute that the tied table did
    untied = GPT(GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384,
                           tie_embeddings=False))
    assert untied.num_params() == expected


@pytest.mark.parametrize("layout", [*LAYOUTS.values(), {"bias": False}, {"norm": "rmsnorm", "bias": False},
                                    {"norm": "layernorm", "bias": False, "tie_embeddings": False}])
def test_the_memory_checks_parameter_counts_equal_a_built_models(layout):
    from training.memory import parameter_counts
    from training.optimizer import muon_parameters
    config = GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=4, n_embd=32, **layout)
    model = GPT(config)
    block, matrices, root = parameter_counts(config)
    assert block == sum(p.numel() for p in model.transformer.h[0].parameters())
    assert config.n_layer * matrices == sum(p.numel() for p in muon_parameters(model))
    assert config.n_layer * block + root == model.num_params(non_embedding=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_embd": 30, "n_head": 4}, "divisible by n_head"),
    ({"n_layer": 0}, "n_layer must be at least 1"),
    ({"dropout": 1.0}, "dropout must be in"),
    ({"n_head": 6, "n_kv_head": 4}, r"n_head \(6\) must be divisible by n_kv_head \(4\)"),
    ({"n_embd": 30, "n_head": 6, "pos_embedding": "rope"}, r"the head size n_embd / n_head \(5\) "
                                                             r"must be even"),
    ({"pos_embedding": "sinusoidal"}, "pos_embedding must be one of learned, rope, none"),
    ({"norm": "batchnorm"}, "norm must be one of layernorm, rmsnorm"),
    ({"mlp": "swiglu"}, "mlp must be one of gelu, relu2"),
])
def test_impossible_shapes_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def last_position_output(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """One block's output (attention and MLP on the residual stream) at every position."""
    x = model.transformer.wte(idx)
    if "wpe" in model.transformer:
        x = x + model.transformer.wpe(torch.arange(idx.size(1)))
    rope = None
    if model.config.pos_embedding == "rope":
        rope = (model.rope_cos[:idx.size(1), None], model.rope_sin[:idx.size(1), None])
    return model.transformer.h[0](x, rope)


@pytest.mark.parametrize("layout", ["no_positions", "gpt2", "rope"])
def test_without_positions_the_last_output_ignores_the_order_of_the_tokens_before_it(layout):
    # attention is a weighted sum over keys, and shuffling the keys leaves the sum unchanged,
    # so with nothing to mark positions the last token cannot tell the order of the others
    model = layout_model(layout)
    with torch.no_grad():  # sharper attention than at initialisation, as after training
        model.transformer.h[0].attn.c_attn.weight.mul_(10)
    idx = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(7))
    shuffled = torch.cat([idx[:, :-1][:, torch.randperm(11, generator=torch.Generator().manual_seed(8))],
                          idx[:, -1:]], dim=1)
    assert not torch.equal(idx, shuffled)
    with torch.no_grad():
        a, b = last_position_output(model, idx), last_position_output(model, shuffled)
    change = (a[0, -1] - b[0, -1]).abs().max().item()
    if layout == "no_positions":
        assert change < 1e-6
        # the causal mask alone still breaks the symmetry for the positions before the
        # last, because each of them sees a different set of tokens
        assert (a[0, :-1] - b[0, :-1]).abs().max().item() > 1e-2
    else:  # learned or rotary positions tell the orders apart
        assert change > 1e-3
