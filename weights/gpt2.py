"""Hugging Face GPT-2 folders: load one into model.py, export one of ours to that format.

Usage:
    from weights.gpt2 import load_hf_gpt2, export_hf_gpt2
    model = load_hf_gpt2("models/gpt2")           # config.json + model.safetensors or pytorch_model.bin
    export_hf_gpt2(model, "out/hf-gpt2")          # transformers' GPT2LMHeadModel loads this folder

Nothing is downloaded: point at a folder you have. model.py already uses GPT-2's names,
so the mapping is one to one, except that GPT-2 stores its attention and MLP projections
as Conv1D weights, (in, out), which are transposed into Linear's (out, in).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import save

from model import GPT, GPTConfig
from weights.hf import FolderError, read_config, read_weights, write_folder
from weights.lazy import Lazy, build, cropped, expected, state_dict_mismatch

# Conv1D weights in GPT-2 are (in_features, out_features), so they are transposed for nn.Linear
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
CONFIG_KEYS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
# the layout's switches of model.GPTConfig (its other fields are the shape), which a GPT-2
# folder holds at GPT-2's values, their defaults
LAYOUT = {f.name: f.default for f in fields(GPTConfig) if f.name in (
    "pos_embedding", "norm", "qk_norm", "mlp", "tie_embeddings", "embed_norm", "bigram_embedding",
    "logit_softcap", "norm_eps")}


def read_hf_config(folder: Path) -> dict:
    """Read a GPT-2 folder's config.json, refusing a model that computes what model.py does not."""
    hf = read_config(folder)
    path = folder / "config.json"
    missing = [key for key in CONFIG_KEYS if key not in hf]
    if missing:
        raise FolderError(f"{path} lacks {', '.join(missing)}; is it a GPT-2 config?")
    # the variants of GPT-2 that compute something model.py does not
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise FolderError(f"{path}: n_inner {hf['n_inner']} is not 4 * n_embd; unsupported")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise FolderError(f"{path}: activation {hf['activation_function']} is unsupported")
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
        raise FolderError(f"{path}: layer_norm_epsilon {hf['layer_norm_epsilon']} is unsupported")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise FolderError(f"{path}: attention variants of GPT-2 are unsupported")
    return hf


def hf_gpt2_weights(folder: str | Path, dropout: float = 0.0,
                    ) -> tuple[GPTConfig, dict[str, Lazy]]:
    """The shape of a Hugging Face GPT-2 folder's model (of any size, read from config.json)
    and its weights by model.py's names, not read yet (weights/lazy.py)."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    try:
        config = GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"],
                           n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                           dropout=dropout, bias=True)
        shapes = expected(config)
    except (TypeError, ValueError) as e:
        raise FolderError(f"{folder / 'config.json'}: {e}") from None
    state = {}
    for key, tensor in read_weights(folder).items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
            continue
        if key.endswith(CONV1D):
            tensor = tensor.then(torch.Tensor.t, torch.Size(reversed(tensor.shape)))
        state[key if key == "lm_head.weight" else f"transformer.{key}"] = tensor
    if "transformer.wte.weight" in state:
        state.setdefault("lm_head.weight", state["transformer.wte.weight"])  # tied
    problem = state_dict_mismatch(shapes, state, "config.json")
    if problem:
        raise FolderError(f"weights in {folder} do not match its config.json: {problem}")
    return config, state


def load_hf_gpt2(folder: str | Path, block_size: int | None = None,
                 dropout: float = 0.0) -> GPT:
    """A GPT holding the weights of a Hugging Face GPT-2 folder (of any size, because the shape
    comes from config.json). block_size below n_positions crops the position table."""
    config, state = hf_gpt2_weights(folder, dropout)
    if block_size is not None and block_size > config.block_size:
        raise FolderError(f"block_size {block_size} exceeds the checkpoint's n_positions "
                          f"{config.block_size}")
    return build(*cropped(config, state, block_size)).eval()


def gpt2_problem(cfg: GPTConfig) -> str | None:
    """Why a GPT-2 folder cannot hold this model, naming the switch; None if it can."""
    if not cfg.bias:
        return "a GPT-2 folder holds biases, and this model has bias = False"
    return layout_problem(cfg)


def layout_problem(cfg: GPTConfig) -> str | None:
    """Why this model's layout is not GPT-2's, biases aside, naming the switch; None if it is."""
    for name, value in LAYOUT.items():
        if getattr(cfg, name) != value:
            return (f"a GPT-2 folder holds {name} = {value!r}, and this model has "
                    f"{getattr(cfg, name)!r}")
    if cfg.n_kv_head != cfg.n_head or cfg.mlp_hidden != 4 * cfg.n_embd:
        return "a GPT-2 folder holds n_kv_head = n_head and n_inner = 4 n_embd"
    return None


def export_hf_gpt2(model: GPT, folder: str | Path, force: bool = False,
                   extra: dict[str, bytes] | None = None, end_of_text: int | None = None) -> Path:
    """Write config.json and model.safetensors that transformers' GPT2LMHeadModel loads, with
    end_of_text (the tokenizer's end-of-text id, if it has one; by default GPT-2's 50256 for
    GPT-2's vocabulary, else none) as the id that begins and ends a text.
    A new folder appears whole or not at all (written beside it, then renamed); a folder
    that holds anything is refused unless `force`, and then its two files are replaced."""
    problem = gpt2_problem(model.config)
    if problem:
        raise FolderError(problem)
    cfg = model.config
    state = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":  # tied to wte, which GPT-2 folders store once
            continue
        if key.endswith(CONV1D):
            tensor = tensor.t()
        state[key] = tensor.detach().to("cpu", torch.float32).contiguous()
    hf = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "tie_word_embeddings": True,
    }
    if end_of_text is None and cfg.vocab_size == 50257:  # GPT-2's own vocabulary
        end_of_text = 50256
    # The ids are written even where there is none (as null), because transformers reads a
    # missing id as GPT-2's 50256, which a smaller vocabulary does not have.
    hf.update(bos_token_id=end_of_text, eos_token_id=end_of_text)
    files = {"model.safetensors": save(state, metadata={"format": "pt"}), **(extra or {}),
             "config.json": (json.dumps(hf, indent=2) + "\n").encode()}  # last, as write_folder expects
    return write_folder(folder, files, force)
