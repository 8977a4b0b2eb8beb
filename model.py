"""A decoder-only transformer: GPT-2's layout, or a modern one, switch by switch.

Usage:
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits, loss = model(idx, targets)                                    # training
    logits, _ = model(idx, kv_cache=cache, input_pos=torch.arange(T))    # decoding (generate.py)

In nanoGPT's order: a block's parts, the block, the configuration, the GPT; then what it asks of
a KV cache, and the configuration's checks. Beyond nanoGPT, each switch of GPTConfig turns on one
idea of nanochat or the modded-nanogpt speedruns (GPT-2's layout at their defaults).

Each function's plain torch body is its definition, and on a GPU it is what runs. On a CPU,
@on_cpu(kernel) swaps in a faster kernel of machine/cpu_kernels.py with the same values and
gradients (tests/test_model.py compares them), and @fp32_below(keys=256) computes bf16 attention
over fewer than 256 keys in fp32, where torch is faster; docs/model.md says which of them run in
the quickstart. A learner can read the decorators as absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.nn import functional as F

from machine.cpu_kernels import ReLUSquared, RMSNormFunction, RotatePairs, can_rotate, fp32_below, on_cpu

Rope = tuple[torch.Tensor, torch.Tensor]  # cos and sin of each token's angles


def make_norm(config: GPTConfig) -> nn.Module:
    return (RMSNorm(config.norm_eps) if config.norm == "rmsnorm"
            else nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias))


class RMSNorm(nn.Module):
    """nanochat's x / sqrt(mean(x^2) + eps): LayerNorm with no mean subtracted, bias or gain."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps)


@on_cpu(RMSNormFunction.apply)  # on a CPU, this kernel runs instead: the same values, faster
def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=eps)  # over the last dimension


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which of the KV cache's layers this block writes
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        self.qk_norm = config.qk_norm
        self.eps = config.norm_eps
        self.dropout_p = config.dropout  # for the fused kernel; the explicit path has attn_dropout
        # one matmul projects to the query heads, then the key heads and the value heads, which
        # GQA makes fewer
        qkv_width = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv_width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # the dropout on explicit_attention's weights; viz/ reads the weights with a hook on it
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: Rope | None, kv_cache: Cache | None = None,
                input_pos: torch.Tensor | None = None, attention: str = "sdpa") -> torch.Tensor:
        B, T, C = x.size()
        nh, n_kv = self.n_head, self.n_kv_head
        qkv = self.c_attn(x).view(B, T, nh + 2 * n_kv, self.head_dim)  # query, key, value heads
        q, k, v = qkv.split([nh, n_kv, n_kv], dim=2)  # (B, T, heads, hd) each, nanoGPT's columns
        if self.qk_norm:  # at unit RMS, q.k / sqrt(hd) is at most sqrt(hd), whatever the lr
            q, k = rms_norm(q, self.eps), rms_norm(k, self.eps)
        if rope is not None:  # a rotation keeps each vector's norm, so the bound still holds
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hd)
        mask = None  # None means causal attention over these T tokens; a cache gives its own mask
        if kv_cache is not None:
            k, v, mask = kv_cache.update(self.layer_idx, input_pos, k, v)  # (B, n_kv, max_len, hd)
        if attention == "sdpa":
            y = sdpa_attention(q, k, v, mask, self.dropout_p if self.training else 0.0)
        else:
            y = explicit_attention(q, k, v, mask, self.attn_dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again: (B, T, C)
        return self.resid_dropout(self.c_proj(y))


@fp32_below(keys=256)  # on a CPU, bf16 over fewer than 256 keys runs in fp32, which is faster
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """Fused attention; mask (T_q, T_k) or (B, 1, T_q, T_k) marks the allowed pairs; None: causal."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=mask is None, enable_gqa=k.size(1) != q.size(1))


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       dropout: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """softmax(QK^T / sqrt(d_k)) V written out, where the weights pass through `dropout`."""
    group = q.size(1) // k.size(1)  # query heads per key/value head (GQA)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mask is None:
        mask = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T_q, T_k)
    att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
    return dropout(att) @ v  # (B, nh, T_q, hd)


def rope_tables(config: GPTConfig) -> Rope:
    """cos and sin of every position's angles, (block_size, head_dim / 2) each."""
    freqs = config.rope_theta ** (-torch.arange(0, config.head_dim, 2).double() / config.head_dim)
    angles = torch.arange(config.block_size).double()[:, None] * freqs  # (block_size, hd/2)
    return angles.cos().float(), angles.sin().float()


@on_cpu(RotatePairs.apply, where=can_rotate)  # on a CPU in fp32, a C kernel of the same values
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pair i, (x_i, x_{i + hd/2}), of every head of (B, T, heads, hd) by the angle
    pos / theta^(2i / hd), so that a query's dot product with a key depends on their distance."""
    x1, x2 = x.chunk(2, dim=-1)
    y1 = x1 * cos - x2 * sin  # [y1]   [cos  -sin] [x1]
    y2 = x1 * sin + x2 * cos  # [y2] = [sin   cos] [x2]
    return torch.cat([y1, y2], dim=-1).to(x.dtype)  # the fp32 tables made the products fp32


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.relu2 = config.mlp == "relu2"
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, mlp_hidden)
        h = relu_squared(h) if self.relu2 else F.gelu(h, approximate="tanh")  # GPT-2's tanh form
        return self.dropout(self.c_proj(h))


@on_cpu(ReLUSquared.apply)  # on a CPU, this kernel runs instead: the same values, faster
def relu_squared(h: torch.Tensor) -> torch.Tensor:
    return F.relu(h).square()


class Block(nn.Module):
    """A pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: Rope | None, kv_cache: Cache | None = None,
                input_pos: torch.Tensor | None = None, attention: str = "sdpa") -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, kv_cache, input_pos, attention)
        return x + self.mlp(self.ln_2(x))


def setting(default: object, help: str) -> Any:
    """A config field with its default and its description, which train.py's --help shows."""
    return field(default=default, metadata={"help": help})


@dataclass
class GPTConfig:
    vocab_size: int = setting(65, "tokens in the vocabulary (the dataset's)")
    block_size: int = setting(256, "the context length: the most tokens the model sees at once")
    n_layer: int = setting(6, "transformer blocks")
    n_head: int = setting(6, "attention heads per block")
    n_embd: int = setting(384, "the embedding width; a multiple of n_head")
    dropout: float = setting(0.0, "the dropout probability, against overfitting (0: none)")
    bias: bool = setting(True, "GPT-2's biases in the Linear and LayerNorm layers, not lm_head")
    pos_embedding: str = setting("learned", "learned (GPT-2's table), rope (rotary) or none")
    norm: str = setting("layernorm", "layernorm (GPT-2's) or rmsnorm (no mean, bias or gain)")
    qk_norm: bool = setting(False, "RMS-normalize each head's queries and keys before attention")
    mlp: str = setting("gelu", "the MLP's nonlinearity: gelu (GPT-2's) or relu2 (relu(x)^2)")
    tie_embeddings: bool = setting(True, "the output layer shares the token embedding's table")
    n_kv_head: int = setting(0, "key and value heads (GQA); 0 means n_head, and 1 is multi-query")
    embed_norm: bool = setting(False, "RMS-normalize the embeddings' sum before the first block")
    bigram_embedding: bool = setting(False, "add a learned vector for each token's predecessor")
    logit_softcap: float = setting(0.0, "logits = cap * tanh(logits / cap); 0: off; nanochat: 15")
    n_inner: int = setting(0, "the MLP's hidden width; 0 means 4 * n_embd")
    norm_eps: float = setting(1e-5, "every norm's epsilon; Hugging Face's NanoChat has 1e-6")
    rope_theta: float = setting(10000.0, "rope's base: pair i turns by pos / theta^(2i / head_dim)")

    def __post_init__(self) -> None:
        if self.n_kv_head == 0:  # one key/value head per query head
            self.n_kv_head = self.n_head
        check_config(self)

    @property
    def mlp_hidden(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        if config.pos_embedding == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        if config.bigram_embedding:  # a row for each token, and a last one for no predecessor
            self.transformer.wtb = nn.Embedding(config.vocab_size + 1, config.n_embd)
        if config.pos_embedding == "rope":  # the tables are computed here and never saved
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one table: the head's row t is the embedding of token t
            self.transformer.wte.weight = self.lm_head.weight
        self.init_weights()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                kv_cache: Cache | None = None, input_pos: torch.Tensor | None = None,
                attention: str = "sdpa", logits_from: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits for (B, T) token ids, and with targets, the mean cross-entropy over the
        targets that are not -1 (chat data marks the tokens it leaves unscored with -1). Training
        passes idx and targets alone; the other arguments serve decoding and viz/.
        kv_cache: where this pass writes its keys and values, and those it attends to (generate.py)
        input_pos: the tokens' positions, (T,) for every row or (B, T); when omitted, 0 to T-1
        logits_from: without targets, the first position whose logits are returned (-1: the last)
        attention: "sdpa" (the fused kernel) or "explicit" (explicit_attention, which viz/ shows)"""
        B, T = idx.size()
        if attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be sdpa or explicit, got {attention!r}")
        if input_pos is None:
            if T > self.config.block_size:
                raise ValueError(f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
            input_pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.embed(idx, input_pos, kv_cache)  # (B, T, C)
        rope = None  # None unless pos_embedding is rope
        if self.config.pos_embedding == "rope":
            # each token's angles, (T, 1, hd/2) or (B, T, 1, hd/2), to broadcast over the heads
            rope = (self.rope_cos[input_pos].unsqueeze(-2), self.rope_sin[input_pos].unsqueeze(-2))
        for block in self.transformer.h:
            x = block(x, rope, kv_cache, input_pos, attention)
        if targets is None:  # decoding, which needs only the logits from logits_from on
            return self.to_logits(x[:, logits_from:, :]), None
        logits = self.to_logits(x)  # (B, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def to_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the last block's outputs: ln_f, lm_head, then the softcap if it is set."""
        logits = self.lm_head(self.transformer.ln_f(x))
        if cap := self.config.logit_softcap:  # squashed smoothly into (-cap, cap), in fp32
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def embed(self, idx: torch.Tensor, input_pos: torch.Tensor, kv_cache: Cache | None
              ) -> torch.Tensor:
        """Each token's vector: its row of wte, plus its predecessor's row of the bigram table and
        its position's row of wpe where the model has them, normalized if embed_norm is set."""
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.config.bigram_embedding:
            no_prev = self.config.vocab_size  # the last row, for a first token with no predecessor
            if kv_cache is None:
                prev_ids = F.pad(idx[:, :-1], (1, 0), value=no_prev)  # idx shifted right by one
            else:  # the cache keeps every id it was given, so it knows earlier calls' tokens
                prev_ids = kv_cache.update_ids(idx, input_pos, no_prev)
            x = x + self.transformer.wtb(prev_ids)
        if self.config.pos_embedding == "learned":  # GPT-2's position vectors, one per position
            x = x + self.transformer.wpe(input_pos)
        if self.config.embed_norm:
            x = rms_norm(x, self.config.norm_eps)
        return self.transformer.drop(x)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initial values in every layout, the quickstart's too (unlike nanochat, which
        starts lm_head and c_proj at zero): N(0, 0.02) weights, zero biases, LayerNorm at the
        identity, and the projections into the residual stream (the two c_proj) scaled down with
        depth, because each block adds two terms to it; the bigram table at zero, so that training
        starts from the plain model. A tied table, drawn as wte and then as lm_head, keeps lm_head's
        draw."""
        # a generator of its own, so that earlier draws from torch's do not change the weights
        generator = torch.Generator().manual_seed(torch.initial_seed())
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for module_name, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if name == "bias" or module_name == "transformer.wtb":  # the bigram table too
                    param.zero_()
                elif isinstance(module, nn.LayerNorm):  # its weight, the gain
                    param.fill_(1.0)
                elif module_name.endswith(".c_proj"):  # attn.c_proj and mlp.c_proj
                    param.normal_(0.0, residual_std, generator=generator)
                else:
                    param.normal_(0.0, 0.02, generator=generator)

    def num_params(self, non_embedding: bool = True) -> int:
        """The parameter count, by default without the embeddings (wpe, wtb, an untied wte)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            tables = [name for name in ("wpe", "wtb") if name in self.transformer]
            tables += [] if self.config.tie_embeddings else ["wte"]
            n -= sum(self.transformer[name].weight.numel() for name in tables)
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward and backward) per token, as in the PaLM paper's appendix B."""
        T = seq_len or self.config.block_size
        return 6 * self.num_params() + 12 * self.config.n_layer * self.config.n_embd * T


class Cache(Protocol):
    """What the model and the C decode step ask of a KV cache; decoding builds generate.KVCache."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    ids: torch.Tensor

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def update_ids(self, idx: torch.Tensor, input_pos: torch.Tensor, no_prev: int
                   ) -> torch.Tensor: ...


# the configuration's checks: each field's type (that of its default), then its value
FIELD_TYPES = {int: (int, "an integer"), float: ((int, float), "a number"),
               bool: (bool, "true or false"), str: (str, "a string")}
CHOICES = {"pos_embedding": ("learned", "rope", "none"), "norm": ("layernorm", "rmsnorm"),
           "mlp": ("gelu", "relu2")}


def check_config(config: GPTConfig) -> None:
    """Raise ValueError for a shape or a switch the model cannot be built with. A file (a
    checkpoint, a config.json) may hold 1.0 or "12" for a count, so types are checked too."""
    for f in fields(config):
        value, (kind, described) = getattr(config, f.name), FIELD_TYPES[type(f.default)]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{f.name} must be {described}, got {value!r}")
    for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(config, name)}")
    if config.n_embd % config.n_head != 0:
        raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    if config.n_head % config.n_kv_head != 0:  # each key/value head serves a group of query heads
        raise ValueError(f"n_head ({config.n_head}) must be divisible by n_kv_head ({config.n_kv_head})")
    if config.pos_embedding == "rope" and config.head_dim % 2:  # rope turns pairs of dimensions
        raise ValueError(f"with rope, the head size n_embd / n_head ({config.head_dim}) must be even")
    for name, choices in CHOICES.items():
        if (value := getattr(config, name)) not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {config.dropout}")
    for name, low in {"logit_softcap": 0, "n_inner": 0, "norm_eps": 1e-12, "rope_theta": 1}.items():
        if not (math.isfinite(value := getattr(config, name)) and value >= low):
            raise ValueError(f"{name} must be a finite number >= {low}, got {value}")

