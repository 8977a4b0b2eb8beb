"""A decoder-only transformer (GPT-2 layout) with a KV cache for incremental decoding.

Usage:
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)                          # training
    cache = model.new_kv_cache(batch_size=1)                    # for generate.py's decoding
    logits, _ = model(idx, kv_cache=cache, input_pos=torch.arange(T))

This file is about the model alone: no I/O, no CLI, no training state, no sampling (that is
generate.py). Names follow GPT-2
(`wte`, `wpe`, `c_attn`, `c_proj`, `c_fc`, `ln_1`, `ln_2`, `ln_f`) so its checkpoints map
one to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 256  # the longest context the position embedding covers
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as in GPT-2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def from_name(cls, name: str) -> GPTConfig:
        """A named shape from PRESETS, e.g. GPTConfig.from_name("gpt2")."""
        if name not in PRESETS:
            raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**PRESETS[name])


PRESETS = {
    "baby_gpt": dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "gpt2": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(vocab_size=50257, block_size=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600),
}


class KVCache:
    """Preallocated keys and values of every layer, written in place as decoding goes on.

    Each forward writes its keys/values at the window positions it is given (`input_pos`) and
    attends over the whole buffer under a mask, so a one-token decode step has the same shapes
    at every position; that is what lets torch.compile build it once. The same mask hides
    entries left over from before a re-prefill. The cache keeps no position of its own: the
    caller says where each forward's tokens go.
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch_size, config.n_head, max_len, config.n_embd // config.n_head)
        # one tensor per layer rather than one stacked buffer: compiled code writes into
        # separate inputs in place, but copied the whole buffer to write into a view of it
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.key_pos = torch.arange(max_len, device=device)  # (max_len,)

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store (B, n_head, T, head_dim) keys/values at input_pos (T,). Return all keys and
        values, (B, n_head, max_len, head_dim), and the (T, max_len) mask of what each
        query may see."""
        self.k[layer][:, :, input_pos] = k
        self.v[layer][:, :, input_pos] = v
        mask = input_pos[:, None] >= self.key_pos  # a query at p sees keys 0..p, nothing later
        return self.k[layer], self.v[layer], mask


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # one fused projection for queries, keys and values: a single matmul instead of three
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                input_pos: torch.Tensor | None = None,
                attn_weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        B, T, C = x.size()
        qkv = self.c_attn(x)  # (B, T, 3C)
        q, k, v = qkv.split(self.n_embd, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        mask = None  # None: plain causal attention over these T tokens
        if kv_cache is not None:
            k, v, mask = kv_cache.update(self.layer_idx, input_pos, k, v)  # (B, nh, max_len, hd)

        dropout_p = self.dropout if self.training else 0.0
        if attn_weights is None:
            y = sdpa_attention(q, k, v, mask, dropout_p)
        else:
            y, att = explicit_attention(q, k, v, mask, dropout_p)
            attn_weights.append(att)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """Fused attention; mask is a (T_q, T_k) bool of allowed pairs, None for causal."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None,
                       dropout_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QK^T / sqrt(d_k)) V written out, returning the (B, nh, T_q, T_k) weights too."""
    t_q, t_k = q.size(2), k.size(2)
    if mask is None:
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril()
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T_q, T_k)
    att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    y = F.dropout(att, p=dropout_p) @ v  # (B, nh, T_q, hd)
    return y, att


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None,
                input_pos: torch.Tensor | None = None,
                attn_weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, input_pos, attn_weights)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: the output projection reads tokens with the same table that embeds them
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual projections so the residual stream's variance does not grow
        # with depth (each block adds two of them)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position table (the token table is tied
        to the output layer, so it does its share of the compute and stays counted)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def crop_block_size(self, block_size: int) -> None:
        """Shorten the context, e.g. of a pretrained model, by cutting the position table."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token, as in the PaLM paper's appendix B:
        6 per parameter plus the attention scores, 12 * n_layer * n_embd * seq_len."""
        seq_len = seq_len or self.config.block_size
        return 6 * self.num_params() + 12 * self.config.n_layer * self.config.n_embd * seq_len

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                kv_cache: KVCache | None = None, input_pos: torch.Tensor | None = None,
                attn_weights: list[torch.Tensor] | None = None,
                logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for (B, T) token ids, and the mean cross-entropy when targets are given.

        kv_cache: write this pass's keys/values into the cache and attend over all it holds.
        input_pos: (T,) positions of idx's tokens in the context window, 0.. by default; with
            a cache, the caller advances them and keeps them below block_size.
        attn_weights: pass a list to run the explicit attention path and receive each
            layer's (B, n_head, T, T_k) weights in it.
        logits_from: without targets, compute logits for positions logits_from: onwards
            only: -1 for the last, all that sampling needs, or the tail of an evaluation
            window that is scored. With a large vocabulary the output layer is much of
            the work.
        """
        B, T = idx.size()
        if input_pos is None:
            if T > self.config.block_size:
                raise ValueError(
                    f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
            input_pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(input_pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, kv_cache, input_pos, attn_weights)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)  # (B, T, vocab)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1),
                                   ignore_index=-1)
            return logits, loss
        return self.lm_head(x[:, logits_from:, :]), None

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache on this model's device, in the dtype its keys and values come out
        in: that of the float weights (the position table: quantize.py's int8 models keep it
        in float), or the autocast dtype when autocast is on (as it is when a bf16 training
        run samples at an evaluation)."""
        p = self.transformer.wpe.weight
        dtype = p.dtype
        if torch.is_autocast_enabled(p.device.type):
            dtype = torch.get_autocast_dtype(p.device.type)
        return KVCache(self.config, batch_size, max_len or self.config.block_size, dtype, p.device)
