"""The model layouts that the tests run over: each switch of model.py's GPTConfig on its own,
all but the bigram table together (the modern layout), and nanochat's layout, which adds its
own details at once (a norm after the embedding, capped logits, a different MLP width, norm
epsilon and rope base)."""

import torch

MODERN = dict(pos_embedding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2",
              tie_embeddings=False, n_kv_head=2)
LAYOUTS = {"gpt2": {}, "rope": dict(pos_embedding="rope"), "no_positions": dict(pos_embedding="none"),
           "rmsnorm": dict(norm="rmsnorm"), "qk_norm": dict(qk_norm=True), "relu2": dict(mlp="relu2"),
           "untied": dict(tie_embeddings=False), "gqa": dict(n_kv_head=2), "mqa": dict(n_kv_head=1),
           "bigram": dict(bigram_embedding=True), "modern": MODERN,
           "nanochat": {**MODERN, "embed_norm": True, "logit_softcap": 15.0, "n_inner": 96,
                        "norm_eps": 1e-6, "rope_theta": 500.0}}


def with_bigrams(model):
    """The model, with its bigram table (if it has one) drawn at random instead of zero, so
    that a test of what the model computes sees what the table adds."""
    if "wtb" in model.transformer:
        with torch.no_grad():
            model.transformer.wtb.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(7))
    return model


def cli_args(overrides: dict) -> list[str]:
    """Layout overrides as train.py options."""
    args = []
    for key, value in overrides.items():
        flag = key.replace("_", "-")
        args += [f"--{flag}" if value is True else f"--no-{flag}"] if isinstance(value, bool) \
            else [f"--{flag}", str(value)]
    return args
