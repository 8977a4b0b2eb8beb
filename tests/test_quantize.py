"""int8 weight-only quantization: the model stays close to the float one, takes fewer bytes
to read, and runs on every path that loads weights (sample.py, evaluate.py, the C step)."""

import subprocess
from pathlib import Path

import torch

from data.loader import load_split
from generate import new_kv_cache
from model import GPT, GPTConfig
from tests.forked import python
from weights.checkpoint import load_checkpoint
from weights.loading import model_from_checkpoint
from weights.quantize import Int8Linear, quantize_int8, quantize_rows, weight_bytes

REPO = Path(__file__).resolve().parent.parent


def test_rows_round_trip_within_half_a_step_of_their_own_scale():
    torch.manual_seed(0)
    w = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different size
    w[5] = 0.0
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (64,)
    assert q.abs().amax(dim=1)[torch.arange(64) != 5].eq(127).all()  # each row uses the full int8 range
    error = (q.float() * scales[:, None] - w).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()
    assert error[5].eq(0).all()  # an all-zero row stays zero


def test_int8_linear_is_the_dequantized_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 64)
    layer, x = Int8Linear(linear), torch.randn(3, 48)
    q, scales = quantize_rows(linear.weight)
    expected = x @ (q.float() * scales[:, None]).T + linear.bias
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)


def test_int8_model_is_a_quarter_of_the_bytes_and_keeps_the_token_table_tied():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=64))
    fp32 = weight_bytes(model)
    model = quantize_int8(model)
    assert model.transformer.wte.weight is model.lm_head.weight
    assert model.lm_head.weight.dtype == torch.int8
    assert weight_bytes(model) < 0.3 * fp32  # the matrices are int8; vectors and row scales stay float
    assert new_kv_cache(model, 1, 8).k[0].dtype == torch.float32  # activations stay float


def test_int8_greedy_picks_the_fp32_token_at_nine_in_ten_teacher_forced_positions(
        trained_run, char_data):
    ckpt = load_checkpoint(trained_run / "best.pt")
    fp32 = model_from_checkpoint(ckpt)
    int8 = quantize_int8(model_from_checkpoint(ckpt))
    block = fp32.config.block_size
    ids = torch.from_numpy(load_split(char_data, "val")[:200 + block].astype("int64"))
    contexts = ids.unfold(0, block, 1)[:200]  # teacher forcing: every context is the true text
    with torch.inference_mode():
        a = fp32(contexts)[0][:, -1].argmax(-1)
        b = int8(contexts)[0][:, -1].argmax(-1)
    agreement = (a == b).float().mean().item()
    assert agreement >= 0.9, f"int8 picked fp32's token at {agreement:.0%} of 200 positions"


def test_sample_cli_decodes_int8_with_the_c_step_as_eager_does(trained_run):
    def sample(*args: str) -> subprocess.CompletedProcess:
        return python(["sample.py", "--run", str(trained_run), "--dtype", "int8", "--temperature",
                       "0", "--max-new-tokens", "60", "--prompt", "ROMEO:", *args], timeout=120)
    default, eager = sample(), sample("--decode", "eager")
    assert default.returncode == 0, default.stderr
    assert default.stderr == eager.stderr == f"loaded {trained_run / 'best.pt'}\n"
    assert default.stdout == eager.stdout and len(default.stdout) == len("ROMEO:") + 60 + 1
