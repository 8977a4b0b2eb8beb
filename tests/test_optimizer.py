"""The two training recipes (AdamW, Muon + AdamW), the schedule they share, and the CPU's
choice of dtype: Muon trains the block matrices, its state survives a checkpoint, resuming
with the other optimizer is refused, and auto picks bf16 only where it is native and
measured faster. Bit-exact resume and torchrun with Muon are tested beside AdamW's, in
test_train.py and test_distributed.py."""

import dataclasses

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from data.loader import load_meta
from machine.device import DeviceError, resolve_device
from model import GPT
from train import get_lr_scale, train
from training.config import ConfigError
from training.optimizer import Muon, by_shape, configure_optimizers, muon_parameters, orthogonalize
from training.precision import choose_cpu_dtype
from weights.checkpoint import load_checkpoint


def val_losses(run_dir) -> list[float]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in acc.Scalars("loss/val")]


def test_muon_trains_the_block_matrices_and_adamw_the_rest(tiny_config):
    model = GPT(tiny_config.model_config(vocab_size=30))
    muon_cfg = dataclasses.replace(tiny_config, optimizer="muon")
    adamw, muon = configure_optimizers(model, muon_cfg, torch.device("cpu"))
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    names = {p: name for name, p in model.named_parameters()}
    in_muon = sorted(names[p] for g in muon.param_groups for p in g["params"])
    assert in_muon == sorted(n for n, p in model.named_parameters()
                             if n.startswith("transformer.h.") and p.dim() == 2)
    assert len(in_muon) == 4 * tiny_config.model.n_layer  # qkv, attention out, MLP in and out
    in_adamw = {names[p] for g in adamw.param_groups for p in g["params"]}
    assert "transformer.wte.weight" in in_adamw and "transformer.wpe.weight" in in_adamw
    assert in_adamw.isdisjoint(in_muon) and len(in_adamw) + len(in_muon) == len(names)
    decay = {names[p]: g["weight_decay"] for opt in (adamw, muon)
             for g in opt.param_groups for p in g["params"]}
    assert decay["transformer.h.0.ln_1.weight"] == decay["transformer.h.0.attn.c_attn.bias"] == 0
    assert decay["transformer.wte.weight"] == decay["transformer.h.0.mlp.c_fc.weight"] == 0.1
    assert muon.param_groups[0]["peak_lr"] == muon_cfg.muon_lr
    # Newton-Schulz runs in bf16 only for a bf16 run, because elsewhere bf16 may be emulated
    # and slow
    assert muon.ns_dtype == torch.float32
    for dtype, ns_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]:
        assert configure_optimizers(model, muon_cfg, torch.device("cpu"), dtype)[1].ns_dtype \
            == ns_dtype
    assert configure_optimizers(model, tiny_config, torch.device("cpu"))[0].param_groups[0][
        "peak_lr"] == tiny_config.learning_rate
    assert len(configure_optimizers(model, tiny_config, torch.device("cpu"))) == 1
    # an untied table trains at embedding_lr, and its lr is logged as lr_embedding
    untied = dataclasses.replace(muon_cfg, embedding_lr=0.1, model=dataclasses.replace(
        muon_cfg.model, tie_embeddings=False))
    groups = [g for opt in configure_optimizers(GPT(untied.model_config(30)), untied,
                                                torch.device("cpu")) for g in opt.param_groups]
    assert {g["logged_as"]: g["peak_lr"] for g in groups if g["params"]} == {
        "lr": untied.learning_rate, "lr_embedding": 0.1, "lr_muon": untied.muon_lr}


def test_muon_loss_falls_and_its_state_lands_in_the_checkpoint(tiny_config):
    cfg = dataclasses.replace(tiny_config, optimizer="muon", max_iters=60, eval_interval=30,
                              sample_tokens=0, log_attention=False)
    result = train(cfg)
    val = val_losses(result.run_dir)
    vocab_size = load_meta(cfg.data_dir)["vocab_size"]
    assert len(val) == 2 and val[0] > val[-1]  # evaluated at 30 and 60
    assert val[-1] < 2.1
    # each group's lr is logged under its own name, on one schedule: GPT-2's layout ties wte
    # to the head, so there are no tables at embedding_lr
    acc = EventAccumulator(str(result.run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert "train/lr_embedding" not in acc.Tags()["scalars"]
    for tag, peak in (("train/lr", cfg.learning_rate), ("train/lr_muon", cfg.muon_lr)):
        logged = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [step for step, _ in logged] == list(range(5, 61, 5))
        for step, value in logged:  # the lr of the step that ended at `step`
            assert value == pytest.approx(peak * get_lr_scale(step - 1, cfg), rel=1e-6)
    ckpt = load_checkpoint(result.run_dir / "last.pt")
    adamw_state, muon_state = ckpt["optimizer"]
    assert len(muon_state["state"]) == 4 * cfg.model.n_layer
    assert all("momentum_buffer" in s for s in muon_state["state"].values())
    # the loaded state equals what was saved, tensor for tensor
    model = GPT(cfg.model_config(vocab_size))
    optimizers = configure_optimizers(model, cfg, torch.device("cpu"))
    for opt, saved in zip(optimizers, ckpt["optimizer"], strict=True):
        opt.load_state_dict(saved)
        for key, state in opt.state_dict()["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved["state"][key][name]))


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_in_bf16_steps_as_torch_does_bit_for_bit(nesterov):
    generator = torch.Generator().manual_seed(0)
    shapes = [(96, 32), (32, 96), (48, 48)]  # tall (its lr scaled up), wide and square
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(3)]
    ours, theirs = ([torch.nn.Parameter(w.clone()) for w in start] for _ in range(2))
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov}
    optimizers = [Muon(ours, ns_dtype=torch.bfloat16, **settings),
                  torch.optim.Muon(theirs, **settings)]
    for step_grads in grads:
        for params, opt in zip((ours, theirs), optimizers, strict=True):
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b, w in zip(ours, theirs, start, strict=True):
        assert not torch.equal(a, w) and torch.equal(a, b)


def test_orthogonalize_in_fp32_flattens_the_spectrum_as_bf16_does():
    generator = torch.Generator().manual_seed(0)
    # a gradient-like matrix: a few strong directions over weak noise
    g = (torch.randn(128, 4, generator=generator) @ torch.randn(4, 64, generator=generator)
         * 10 + torch.randn(128, 64, generator=generator))
    coefficients = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults
    fp32 = orthogonalize(g, coefficients, 5, 1e-7, torch.float32)
    bf16 = orthogonalize(g, coefficients, 5, 1e-7, torch.bfloat16)
    assert fp32.dtype == torch.float32 and fp32.shape == g.shape
    singular = torch.linalg.svdvals(fp32)
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 10
    assert 0.5 < singular.min() and singular.max() < 1.5
    # bf16's rounding moves the singular values within that band, and so moves the matrix by
    # a few percent (an unrelated matrix of the same norm is about 140% away)
    assert (fp32 - bf16.float()).norm() / fp32.norm() < 0.1


def test_matrices_of_one_shape_are_orthogonalized_together_as_one_by_one():
    generator = torch.Generator().manual_seed(0)
    shapes = [(96, 32), (32, 96), (96, 32), (48, 48), (96, 32), (32, 96)]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    coefficients = (3.4445, -4.775, 2.0315)
    alone = [orthogonalize(g, coefficients, 5, 1e-7, torch.float32) for g in grads]
    together = by_shape(grads, [1] * len(grads),
                        lambda g, n: orthogonalize(g, coefficients, 5, 1e-7, torch.float32, n))
    for a, b, g in zip(alone, together, grads, strict=True):
        assert b.shape == g.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_muon_steps_a_matrix_in_row_blocks_as_it_steps_the_blocks_as_matrices():
    """c_attn's queries, keys and values move as if they were three matrices, as in nanochat."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(96, 32, generator=generator)
    grads = [torch.randn(96, 32, generator=generator) for _ in range(3)]
    fused = torch.nn.Parameter(start.clone())
    apart = [torch.nn.Parameter(block.clone()) for block in start.split(32)]
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "ns_dtype": torch.float32}
    ours = Muon([fused], row_blocks={fused: 3}, **settings)
    blocks = Muon(apart, **settings)
    plain = torch.nn.Parameter(start.clone())  # the same matrix, orthogonalized whole
    whole = Muon([plain], **settings)
    for g in grads:
        fused.grad, plain.grad = g.clone(), g.clone()
        for p, block in zip(apart, g.split(32), strict=True):
            p.grad = block.clone()
        for opt in (ours, blocks, whole):
            opt.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in apart]))
    assert not torch.allclose(fused, plain, atol=1e-4)


def test_configure_optimizers_gives_muon_c_attn_in_three_blocks_unless_gqa(tiny_config):
    for n_kv_head, blocks in ((0, 3), (1, None)):
        model = GPT(dataclasses.replace(tiny_config.model, n_kv_head=n_kv_head, vocab_size=30))
        _, muon = configure_optimizers(model, dataclasses.replace(tiny_config, optimizer="muon"),
                                       torch.device("cpu"))
        for block in model.transformer.h:
            assert muon.row_blocks.get(block.attn.c_attn.weight) == blocks
        assert len(muon.row_blocks) == (tiny_config.model.n_layer if blocks else 0)


def test_resuming_with_the_other_optimizer_is_one_clear_error(tiny_config):
    cfg = dataclasses.replace(tiny_config, max_iters=5, eval_interval=5, sample_tokens=0,
                              log_attention=False)
    train(cfg)
    with pytest.raises(ConfigError, match="was trained with optimizer = adamw, not muon; "
                                          "resume with --optimizer adamw"):
        train(dataclasses.replace(cfg, optimizer="muon", max_iters=10), resume=True)


def test_unknown_optimizer_is_refused(tiny_config):
    with pytest.raises(ConfigError, match="optimizer must be adamw or muon, got 'sgd'"):
        dataclasses.replace(tiny_config, optimizer="sgd")


def test_schedule_warms_up_then_decays_every_group_to_the_same_fraction(tiny_config):
    cfg = dataclasses.replace(tiny_config, learning_rate=1.0, min_lr=0.1, warmup_iters=10,
                              max_iters=110)
    m = [get_lr_scale(it, cfg) for it in range(120)]
    assert m[0] < m[5] < m[9] < 1.0
    assert m[10] == pytest.approx(1.0)
    assert m[60] == pytest.approx(0.55)  # halfway through the cosine
    assert all(a >= b for a, b in zip(m[10:], m[11:], strict=False))
    assert m[110] == m[119] == pytest.approx(0.1)
    assert get_lr_scale(50, dataclasses.replace(cfg, decay_lr=False)) == 1.0


def test_muon_parameters_of_a_model_without_biases(tiny_config):
    model = GPT(dataclasses.replace(tiny_config.model, bias=False, vocab_size=30))
    assert all(p.dim() == 2 for p in muon_parameters(model))
    assert len(muon_parameters(model)) == 4 * tiny_config.model.n_layer


@pytest.mark.parametrize("flags, expected, reason", [
    ({"avx2", "fma"}, torch.float32, "no native bf16"),
    ({"avx512f", "avx512_bf16"}, torch.bfloat16, "natively (avx512_bf16)"),
    ({"amx_bf16", "amx_tile"}, torch.bfloat16, "natively (amx_bf16)"),
    (set(), torch.float32, "no native bf16"),  # no /proc/cpuinfo, as on macOS and Windows
])
def test_auto_dtype_on_a_cpu_is_bf16_where_the_cpu_multiplies_it_natively(flags, expected, reason):
    dtype, why = choose_cpu_dtype(flags)
    assert dtype == expected and reason in why


def test_a_device_this_machine_lacks_is_one_clear_error():
    with pytest.raises(DeviceError, match="device 'cuda:abc' is not a device; use auto, cpu"):
        resolve_device("cuda:abc")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU is available to this torch; use "
                                              "--device cpu"):
            resolve_device("cuda:0")
