"""The base model that a run fine-tunes (init_from): a Hugging Face folder (GPT-2's or
NanoChat's), a checkpoint, or a run folder, checked against the data it will train on.
Imported only by a run that fine-tunes.

Usage:
    python train.py config/chat_sft.toml --init-from runs/quickstart

    from training.init_from import base_model
    config, weights = base_model(cfg, meta, dist)   # weights read lazily (weights/lazy.py)

The base sets the model's shape and layout; the data must be tokenized as the base's was
or, for a chat dataset, with the chat tokens added, which get new rows.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from data.chat import with_specials
from data.specials import CHAT_SPECIALS
from model import GPTConfig
from training import distributed
from training.config import ConfigError, TrainConfig
from weights.checkpoint import CheckpointError
from weights.gpt2 import layout_problem
from weights.hf import FolderError, model_type
from weights.hub import HubError, local_folder
from weights.lazy import Lazy, cropped, grown
from weights.loading import LoadError, base_weights


def base_model(cfg: TrainConfig, meta: dict,
               dist: distributed.Dist) -> tuple[GPTConfig, dict[str, Lazy]]:
    """The model to fine-tune, its weights not read yet, with its own context unless
    block_size is set; ConfigError where the base and the data or settings do not fit
    together."""
    try:
        folder = local_folder(cfg.init_from)  # a Hub id is downloaded first
        if (folder / "config.json").is_file() and model_type(folder) == "gpt2" \
                and layout_problem(cfg.model_config(meta["vocab_size"])):
            raise ConfigError("init_from loads GPT-2's layout; leave pos_embedding, norm, "
                              "qk_norm, mlp, tie_embeddings, embed_norm, bigram_embedding, "
                              "logit_softcap and n_kv_head at their defaults to fine-tune it")
        config, state, tokenizer, source = base_weights(folder, None, cfg.model.dropout)
    except (FolderError, LoadError, CheckpointError, HubError) as e:
        raise ConfigError(f"init_from: {e}") from None
    # keep the base's context unless block_size is set, in which case crop it and say so
    if "block_size" in cfg.given and cfg.model.block_size != config.block_size:
        if cfg.model.block_size > config.block_size:
            raise ConfigError(f"block_size {cfg.model.block_size} exceeds {source}'s context of "
                              f"{config.block_size} tokens; lower it, or drop it to keep the "
                              f"base's")
        if dist.is_main:
            tqdm.write(f"init_from: the context is cropped from {config.block_size:,} to "
                       f"{cfg.model.block_size:,} tokens (block_size); drop block_size to keep "
                       f"the base's")
        config, state = cropped(config, state, cfg.model.block_size)
    base = tokenizer.to_meta()
    if meta["tokenizer"] not in (base, with_specials(base, CHAT_SPECIALS)):
        hint = ("gpt2" if base["kind"] == "gpt2" else str(folder) if Path(source).is_dir()
                else "BASE_DATASET (the data the base was trained on)")
        raise ConfigError(f"init_from needs data tokenized by {source}'s tokenizer, but "
                          f"{cfg.data_dir} was prepared with another; prepare it with "
                          f"--tokenizer {hint}")
    if config.vocab_size < meta["vocab_size"]:
        added = [t for t in CHAT_SPECIALS if t not in tokenizer.specials]
        if dist.is_main:
            tqdm.write(f"init_from: the vocabulary grows from {config.vocab_size:,} to "
                       f"{meta['vocab_size']:,} tokens for {' '.join(added)}; their new rows "
                       f"start at the mean of the old ones")
        config, state = grown(config, state, meta["vocab_size"])
    return config, state
