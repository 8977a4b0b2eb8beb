"""int8 weight-only quantization: every matrix stored as int8 with one float scale per output
row; activations, biases, LayerNorms, the position table and RoPE's tables stay in float32.

Usage:
    from weights.quantize import cast_weights
    model = cast_weights(model, "int8")        # or "float32", "bfloat16", "float16"
    logits = model(idx)[0]                     # the same forward, a quarter of the weight bytes

Decoding one token reads every weight once, so on a CPU it is bound by memory traffic, and
int8 weights are a quarter of fp32's bytes and half of bf16's. Each row keeps its own
scale (max |w| / 127), so that an outlier costs precision in its own row only.

The token table is quantized too, and stays tied: the output layer (lm_head) reads the int8
matrix and its row scales, and the embedding looks up an int8 row and multiplies it by that
row's scale. It is a large share of GPT-2's weights, so leaving it in float would cost
most of the speed; docs/quality.md gives the loss that quantizing it costs. An untied head
is an int8 matrix of its own, and so is the table.

The Int8Linear forward here dequantizes its weight to the activations' dtype on each call,
which makes it the plain reference (exact in float32). The fast path on a CPU is cdecode's
C step, which reads the int8 rows directly.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn import functional as F

from machine.device import DTYPES
from machine.errors import InputError
from model import GPT

WEIGHT_DTYPES = (*DTYPES, "int8")  # what --dtype accepts where weights are loaded for inference


def check_weight_dtype(dtype: str) -> None:
    """Refuse a --dtype that is not one of WEIGHT_DTYPES, naming those that are."""
    if dtype not in WEIGHT_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (out, in) float -> int8 (out, in), float32 scales (out,),
    with weight ~= int8 * scales[:, None]."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # an all-zero row gets a tiny scale
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """y = x W^T * scales + bias, with W int8 (out, in), in buffers because nothing trains."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight, scales = quantize_rows(linear.weight)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y + self.bias.to(x.dtype) if self.bias is not None else y


class Int8Embedding(nn.Module):
    """The token table: rows of an int8 table times their scales. With tied embeddings its
    tensors are the output layer's Int8Linear's own, not copies."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx].float() * self.scales[idx, None]


def quantize_int8(model: GPT) -> GPT:
    """Quantize `model` in place (see the module docstring) and return it, in eval mode."""
    model.float().eval()
    for block in model.transformer.h:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
    model.lm_head = Int8Linear(model.lm_head)
    if model.config.tie_embeddings:
        model.transformer.wte = Int8Embedding(model.lm_head.weight, model.lm_head.scales)
    else:  # an untied head is a matrix of its own, and so is the table
        model.transformer.wte = Int8Embedding(*quantize_rows(model.transformer.wte.weight))
    return model


def cast_weights(model: GPT, dtype: str) -> GPT:
    """The model with its weights in `dtype`, one of WEIGHT_DTYPES."""
    check_weight_dtype(dtype)
    if dtype == "int8":
        return quantize_int8(model)
    return model.to(dtype=DTYPES[dtype])


def weight_bytes(model: GPT) -> int:
    """Bytes of every parameter and buffer, each shared tensor counted once."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
