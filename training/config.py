"""The training configuration: one typed dataclass, read from TOML, validated.

Usage:
    from training.config import load_config
    cfg = load_config("config/quickstart.toml", overrides={"max_iters": 100})

Precedence: dataclass defaults < the TOML file < command-line overrides. Unknown keys,
wrong types and impossible values raise ConfigError with a one-line message naming the key.
The defaults below are the only defaults: train.py's --help is generated from them.
"""

from __future__ import annotations

import difflib
import inspect
import math
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from machine.device import DTYPES
from model import GPTConfig


class ConfigError(ValueError):
    """A configuration the trainer cannot run; the message names the key."""


def opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # data
    data_dir: str = opt("data/shakespeare_char", "prepared dataset folder (shards and "
                        "meta.json, from data.prepare); data/shakespeare_char and "
                        "data/shakespeare_bpe are prepared automatically when missing")
    # model
    init_from: str = opt("", "Hugging Face GPT-2 folder to fine-tune; its config.json sets the "
                         "shape (n_layer, n_head, n_embd are then ignored) and block_size "
                         "crops its context")
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads per block")
    n_embd: int = opt(128, "embedding width; a multiple of n_head")
    block_size: int = opt(64, "context length in tokens")
    dropout: float = opt(0.0, "dropout probability (0 for small data or short runs)")
    bias: bool = opt(True, "biases in Linear and LayerNorm layers, as in GPT-2")
    # the layout: GPT-2's by default; each switch one idea of the models since (model.py)
    pos_embedding: str = opt("learned", "positions: learned (GPT-2's table), rope (rotary) or "
                             "none (the causal mask alone carries order)")
    norm: str = opt("layernorm", "layernorm (GPT-2's) or rmsnorm (no mean, bias or gain)")
    qk_norm: bool = opt(False, "RMS-normalize each head's queries and keys before attention")
    mlp: str = opt("gelu", "the MLP's nonlinearity: gelu (GPT-2's) or relu2 (relu(x)^2)")
    tie_embeddings: bool = opt(True, "the output layer shares the token embedding's table")
    n_kv_head: int = opt(0, "key/value heads (grouped-query attention); 0 means n_head, 1 is "
                         "multi-query")
    # optimisation
    batch_size: int = opt(12, "sequences per micro-batch")
    gradient_accumulation_steps: int = opt(1, "micro-batches per optimizer step")
    max_iters: int = opt(2000, "optimizer steps in total")
    optimizer: str = opt("adamw", "adamw (GPT-2's recipe) or muon (Muon on the matrices inside "
                         "the blocks, AdamW on the rest); see optimizer.py")
    learning_rate: float = opt(1e-3, "peak AdamW learning rate")
    min_lr: float = opt(1e-4, "AdamW learning rate at the end of the cosine decay; every "
                        "group decays to the same fraction of its peak")
    embedding_lr: float = opt(0.0, "peak AdamW learning rate of the token table when the head "
                              "is untied (tie_embeddings false); 0 means learning_rate")
    muon_lr: float = opt(0.02, "peak Muon learning rate (optimizer = muon)")
    muon_momentum: float = opt(0.95, "Muon momentum (optimizer = muon)")
    warmup_iters: int = opt(100, "steps of linear warmup from 0 to learning_rate")
    lr_decay_iters: int = opt(0, "step where the cosine decay reaches min_lr; 0 means max_iters")
    decay_lr: bool = opt(True, "warmup then cosine decay; false keeps learning_rate constant")
    weight_decay: float = opt(0.1, "decoupled weight decay on matrices (not on biases, norms)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.99, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the gradient norm to this; 0 disables clipping")
    # evaluation, sampling, logging
    eval_interval: int = opt(250, "steps between evaluations (and checkpoints)")
    eval_iters: int = opt(20, "batches averaged per split at each evaluation")
    log_interval: int = opt(10, "steps between training-loss log points")
    sample_prompt: str = opt("\n", "prompt of the text sample logged at each evaluation")
    sample_tokens: int = opt(200, "tokens in that sample; 0 disables sampling")
    log_attention: bool = opt(True, "log attention heatmaps (an image per layer) and per-head "
                              "attention entropy at each evaluation")
    attention_probe: str = opt("", "text whose attention is logged; default: the first 32 "
                               "tokens of the val split")
    out_dir: str = opt("runs", "parent folder of run folders (TensorBoard events, checkpoints)")
    run_name: str = opt("", "run folder name; default: the config file's name")
    # system
    device: str = opt("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = opt("auto", "auto, float32, bfloat16 or float16 (autocast); auto is "
                     "bfloat16 on GPUs that support it, else float32")
    compile: bool = opt(False, "torch.compile the model (slow start, faster steps)")
    parallel: str = opt("ddp", "under torchrun: ddp (each process holds the whole model) or "
                               "fsdp (each holds 1/N of it; see docs/distributed.md)")
    seed: int = opt(1337, "random seed for initialisation, batches and sampling")

    def __post_init__(self) -> None:
        for f in fields(self):  # nan passes every comparison below, and inf means nothing
            value = getattr(self, f.name)
            if type(value) is float and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        positive = ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval",
                    "eval_iters", "log_interval")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1, got {getattr(self, key)}")
        non_negative = ("learning_rate", "min_lr", "embedding_lr", "muon_lr", "warmup_iters",
                        "lr_decay_iters",
                        "weight_decay", "grad_clip", "sample_tokens")
        for key in non_negative:
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        try:  # the model's shape is checked where the model is defined
            self.model_config(vocab_size=1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.min_lr > self.learning_rate:
            raise ConfigError(f"min_lr ({self.min_lr}) must not exceed learning_rate "
                              f"({self.learning_rate})")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        for key in ("beta1", "beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"{key} must be in [0, 1), got {getattr(self, key)}")
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}, "
                              f"got {self.dtype!r}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            raise ConfigError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        check_seed(self.seed)
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"parallel must be ddp or fsdp, got {self.parallel!r}")

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout,
                         bias=self.bias, pos_embedding=self.pos_embedding, norm=self.norm,
                         qk_norm=self.qk_norm, mlp=self.mlp, tie_embeddings=self.tie_embeddings,
                         n_kv_head=self.n_kv_head)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_seed(seed: int) -> None:
    """A seed every random generator here takes: torch's take 64 bits, and the evaluation
    batches use seed + 1, so 63 bits keep every use in range."""
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be in [0, 2^63), got {seed}")


FIELDS = {f.name: f for f in fields(TrainConfig)}


def field_help(name: str) -> str:
    return FIELDS[name].metadata["help"]


def field_default(name: str) -> Any:
    f = FIELDS[name]
    return f.default if f.default is not MISSING else None


def check_value(key: str, value: Any) -> Any:
    """The value converted to the field's type, or ConfigError if it cannot be one."""
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint}")
    expected = type(field_default(key))
    # TOML has distinct int, float and bool types; an int is a fine float, nothing else mixes
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        raise ConfigError(f"{key} must be {expected.__name__}, got {type(value).__name__} "
                          f"{value!r}")
    return value


def load_config(path: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, updated by the TOML file at `path`, updated by `overrides`."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} not found; presets are in config/")
        if not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise ConfigError(f"config {path} is {kind}; give a TOML file, e.g. "
                              f"config/quickstart.toml")
        try:
            # utf-8-sig: some editors start a UTF-8 file with a byte-order mark
            values = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    values.update(overrides or {})
    checked = {key: check_value(key, value) for key, value in values.items()}
    return TrainConfig(**checked)


def cli_parameters() -> list[inspect.Parameter]:
    """One typer option per field, for a command's signature. Each defaults to None, so
    that only what is given on the command line overrides the config file."""
    params = []
    for f in fields(TrainConfig):
        option = typer.Option(help=f"{field_help(f.name)} [default: {field_default(f.name)!r}]",
                              show_default=False, rich_help_panel="Config fields")
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[type(f.default) | None, option]))
    return params
