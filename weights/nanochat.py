"""Hugging Face NanoChat folders (transformers' NanoChatForCausalLM): load one into model.py,
export one of ours to that format.

Usage:
    from weights.nanochat import load_hf_nanochat, export_hf_nanochat
    model = load_hf_nanochat("models/nanochat-d20")   # config.json + model.safetensors
    export_hf_nanochat(model, "out/hf-nanochat")      # AutoModelForCausalLM loads this folder

NanoChat is this project's modern layout with nanochat's details switched on: rotary
positions, RMSNorm without gains (also right after the embedding), QK-norm, ReLU^2, no
biases, an untied head and capped logits. The names map one to one, except that model.py
fuses the query, key and value projections into one c_attn:

    transformer.wte               model.embed_tokens
    transformer.wtb               model.embed_bigrams (the bigram table, see below)
    transformer.h.N.attn.c_attn   model.layers.N.self_attn.{q,k,v}_proj, stacked
    transformer.h.N.attn.c_proj   model.layers.N.self_attn.o_proj
    transformer.h.N.mlp.c_fc      model.layers.N.mlp.fc1
    transformer.h.N.mlp.c_proj    model.layers.N.mlp.fc2
    lm_head                       lm_head

Both rotate the pairs (x_i, x_{i + head_dim/2}) of a head, but in opposite directions:
nanochat turns by -angle where model.py turns by +angle. Negating the second half of every
query and key head, which is what flip_rope does to their projection rows, turns one into
the other, because the rotated queries and keys then differ only in those signs, which
cancel in every query-key dot product. QK-norm comes before the rotation here and after it in
transformers; a norm without a gain has the same length before and after a rotation, so
the order changes nothing.

transformers' NanoChat has no bigram table, so a model trained with one is exported with
the table as one more tensor and a small modeling file of ours, nanochat_bigram.py, which
config.json's auto_map names: a NanoChatForCausalLM that adds the table's rows to its token
embedding, which transformers loads with trust_remote_code=True. model_type stays
"nanochat", and load_hf_nanochat reads such a folder back, table included, knowing it by the
class that config.json's architectures name (transformers writes auto_map anew when it saves
a model that it loaded from elsewhere, but keeps the class).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from model import GPT, GPTConfig
from weights.hf import FolderError, read_config, read_weights, write_folder
from weights.lazy import Lazy, build, cropped, expected, state_dict_mismatch

# what a NanoChat model always is, in model.py's switches
# (with a bigram table or without, which config.json's architectures say)
LAYOUT = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2", bias=False,
              embed_norm=True)
# the modeling file that an export with a bigram table carries, and how config.json names it
BIGRAM_FILE = Path(__file__).with_name("nanochat_bigram.py")
BIGRAM_CLASS = "NanoChatBigramForCausalLM"
BIGRAM_AUTO_MAP = {"AutoModelForCausalLM": f"{BIGRAM_FILE.stem}.{BIGRAM_CLASS}"}
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "max_position_embeddings")


def flip_rope(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Projection rows of query or key heads, (heads * head_dim, n_embd), with the second
    half of each head negated, which turns nanochat's rotation into model.py's and back."""
    rows = w.reshape(-1, 2, head_dim // 2, w.size(-1)).clone()
    rows[:, 1] = -rows[:, 1]
    return rows.reshape(w.shape)


def config_from_hf(hf: dict, path: Path, dropout: float = 0.0) -> GPTConfig:
    """model.py's GPTConfig for a NanoChat config.json, or FolderError naming what does not fit."""
    missing = [key for key in CONFIG_KEYS if key not in hf]
    if missing:
        raise FolderError(f"{path} lacks {', '.join(missing)}; is it a NanoChat config?")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise FolderError(f"{path}: rope_type {rope['rope_type']} (scaled rotary positions) "
                          f"is unsupported")
    if hf.get("hidden_act", "relu2") != "relu2" or hf.get("attention_bias"):
        raise FolderError(f"{path}: NanoChat with another activation or attention biases is "
                          f"unsupported")
    n_embd = hf["hidden_size"]
    try:
        return GPTConfig(
            vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"],
            n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], n_embd=n_embd,
            n_kv_head=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            n_inner=0 if hf["intermediate_size"] == 4 * n_embd else hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope.get("rope_theta", 10000.0),
            logit_softcap=hf.get("final_logit_softcapping") or 0.0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=dropout,
            bigram_embedding=BIGRAM_CLASS in (hf.get("architectures") or ()), **LAYOUT)
    except (TypeError, ValueError) as e:
        raise FolderError(f"{path}: {e}") from None


def hf_nanochat_weights(folder: str | Path, dropout: float = 0.0,
                        ) -> tuple[GPTConfig, dict[str, Lazy]]:
    """The shape of a NanoChat folder's model and its weights by model.py's names, not read
    yet (weights/lazy.py); the separate q, k and v projections become one fused c_attn."""
    folder = Path(folder)
    config = config_from_hf(read_config(folder), folder / "config.json", dropout)
    try:
        shapes = expected(config)
    except ValueError as e:
        raise FolderError(f"{folder / 'config.json'}: {e}") from None
    hd, state = config.head_dim, {}
    for key, tensor in read_weights(folder).items():
        name = key.removeprefix("model.")
        if name == "embed_tokens.weight":
            state["transformer.wte.weight"] = tensor
        elif name == "embed_bigrams.weight":
            state["transformer.wtb.weight"] = tensor
        elif key == "lm_head.weight":
            state["lm_head.weight"] = tensor
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            state[f"transformer.h.{i}.{rest}"] = tensor
    for i in range(config.n_layer):
        prefix = f"transformer.h.{i}."
        q, k, v = (state.pop(f"{prefix}self_attn.{p}_proj.weight", None) for p in "qkv")
        if q is not None and k is not None and v is not None:
            state[f"{prefix}attn.c_attn.weight"] = Lazy(
                torch.Size([q.shape[0] + k.shape[0] + v.shape[0], q.shape[1]]),
                lambda q=q, k=k, v=v: torch.cat([flip_rope(q.load(), hd),
                                                 flip_rope(k.load(), hd), v.load()]))
        renames = {"self_attn.o_proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
        for theirs, ours in renames.items():
            if f"{prefix}{theirs}.weight" in state:
                state[f"{prefix}{ours}.weight"] = state.pop(f"{prefix}{theirs}.weight")
    if config.tie_embeddings and "transformer.wte.weight" in state:
        state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    problem = state_dict_mismatch(shapes, state, "config.json")
    if problem:
        raise FolderError(f"weights in {folder} do not match its config.json: {problem}")
    return config, state


def load_hf_nanochat(folder: str | Path, block_size: int | None = None,
                     dropout: float = 0.0) -> GPT:
    """A GPT holding the weights of a NanoChat folder; block_size below its context crops it."""
    config, state = hf_nanochat_weights(folder, dropout)
    if block_size is not None and block_size > config.block_size:
        raise FolderError(f"block_size {block_size} exceeds {folder}'s context of "
                          f"{config.block_size} tokens (max_position_embeddings)")
    return build(*cropped(config, state, block_size)).eval()


def nanochat_problem(config: GPTConfig) -> str | None:
    """Why a NanoChat folder cannot hold this layout, naming the switch; None if it can."""
    for name, value in LAYOUT.items():
        if getattr(config, name) != value:
            return (f"a NanoChat folder holds {name} = {value!r}, and this model has "
                    f"{getattr(config, name)!r}")
    return None


def hf_config(cfg: GPTConfig, special: dict[str, int]) -> dict:
    """NanoChat's config.json for a model of this shape; `special` holds the ids of the
    tokenizer's bos and eos tokens, where it has them. A bigram table adds auto_map, which
    names the modeling file that holds it."""
    bigram = {"auto_map": BIGRAM_AUTO_MAP} if cfg.bigram_embedding else {}
    return {
        "architectures": [BIGRAM_CLASS if bigram else "NanoChatForCausalLM"], **bigram,
        "model_type": "nanochat",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "max_position_embeddings": cfg.block_size, "hidden_act": "relu2",
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "final_logit_softcapping": cfg.logit_softcap or None, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": special.get("bos"), "eos_token_id": special.get("eos"),
        "pad_token_id": special.get("eos"),
    }


def export_hf_nanochat(model: GPT, folder: str | Path, force: bool = False,
                       extra: dict[str, bytes] | None = None,
                       special: dict[str, int] | None = None) -> Path:
    """Write config.json and model.safetensors (and the `extra` files, the tokenizer's) that
    transformers' NanoChatForCausalLM loads, as weights.hf.write_folder writes a folder; with
    a bigram table, also the modeling file that holds it (nanochat_bigram.py)."""
    cfg = model.config
    problem = nanochat_problem(cfg)
    if problem:
        raise FolderError(problem)
    hd, state = cfg.head_dim, {}
    weights = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    state["model.embed_tokens.weight"] = weights["transformer.wte.weight"]
    if cfg.bigram_embedding:
        state["model.embed_bigrams.weight"] = weights["transformer.wtb.weight"]
        extra = {**(extra or {}), BIGRAM_FILE.name: BIGRAM_FILE.read_bytes()}
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        q, k, v = weights[f"{ours}attn.c_attn.weight"].split(
            [cfg.n_embd, cfg.n_kv_head * hd, cfg.n_kv_head * hd])
        state[f"{theirs}self_attn.q_proj.weight"] = flip_rope(q, hd)
        state[f"{theirs}self_attn.k_proj.weight"] = flip_rope(k, hd)
        state[f"{theirs}self_attn.v_proj.weight"] = v
        state[f"{theirs}self_attn.o_proj.weight"] = weights[f"{ours}attn.c_proj.weight"]
        state[f"{theirs}mlp.fc1.weight"] = weights[f"{ours}mlp.c_fc.weight"]
        state[f"{theirs}mlp.fc2.weight"] = weights[f"{ours}mlp.c_proj.weight"]
    state = {k: v.contiguous() for k, v in state.items()}
    config = hf_config(cfg, special or {})
    files = {"model.safetensors": save(state, metadata={"format": "pt"}), **(extra or {}),
             "config.json": (json.dumps(config, indent=2) + "\n").encode()}  # last, as write_folder expects
    return write_folder(folder, files, force)
