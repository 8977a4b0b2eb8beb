"""The training configuration: one typed dataclass, read from TOML, validated, and the
command line that sets it.

Usage:
    from training.config import load_config, command_line
    cfg = load_config("config/quickstart.toml", overrides={"max_iters": 100})
    run_command(command_line(main))   # train.py: an option per field, --help grouped

Precedence: dataclass defaults < the TOML file < command-line overrides. Unknown keys,
wrong types and impossible values raise ConfigError with a one-line message naming the key.
The defaults below are the only defaults: train.py's options and --help come from them.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import click

from machine.device import DTYPES
from machine.errors import UserError
from model import GPTConfig, setting


class ConfigError(UserError):
    """A configuration the trainer cannot run; the message names the key. Every process
    under torchrun reads the same configuration, and fails alike."""
    everywhere = True


# Training starts from a smaller shape than GPTConfig's defaults; every other field of the
# model keeps model.py's default. vocab_size is not a setting, because it is the dataset's.
MODEL_DEFAULTS = dict(block_size=64, n_layer=4, n_head=4, n_embd=128)
MODEL_FIELDS = {f.name: f for f in fields(GPTConfig) if f.name != "vocab_size"}


@dataclass
class TrainConfig:
    # data
    data_dir: str = setting("data/shakespeare_char", "prepared dataset folder (shards and "
                            "meta.json, from data.prepare); the built-in data/shakespeare_char, "
                            "shakespeare_bpe and shakespeare_bpe2048 are prepared when missing")
    init_from: str = setting("", "the model to fine-tune: a run folder, a checkpoint, or a "
                             "Hugging Face GPT-2 or NanoChat folder or Hub id; it sets the model "
                             "(the model fields are then ignored) and block_size crops its context")
    # the model: GPTConfig's fields (model.py declares each switch once, with its help),
    # written flat in a TOML file and on the command line, as n_layer = 4 or --n-layer 4
    model: GPTConfig = field(default_factory=lambda: GPTConfig(**MODEL_DEFAULTS))
    # optimisation
    batch_size: int = setting(12, "sequences per micro-batch")
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step")
    max_iters: int = setting(2000, "optimizer steps in total")
    optimizer: str = setting("adamw", "adamw (GPT-2's recipe) or muon (Muon on the matrices inside "
                             "the blocks, AdamW on the rest); see training/optimizer.py")
    learning_rate: float = setting(1e-3, "peak AdamW learning rate")
    min_lr: float = setting(1e-4, "learning_rate at the end of the cosine decay; every group, "
                            "Muon's too, decays to the same fraction of its peak")
    embedding_lr: float = setting(0.0, "peak AdamW learning rate of the lookup tables: wte when the "
                                  "head is untied (tie_embeddings false), and the bigram table; "
                                  "0 means learning_rate")
    muon_lr: float = setting(0.02, "peak Muon learning rate (optimizer = muon)")
    muon_momentum: float = setting(0.95, "Muon momentum (optimizer = muon)")
    warmup_iters: int = setting(100, "steps of linear warmup to each group's peak learning rate")
    lr_decay_iters: int = setting(0, "step where the cosine decay reaches min_lr; 0 means max_iters")
    decay_lr: bool = setting(True, "warmup, then cosine decay; false keeps every group at its peak")
    weight_decay: float = setting(0.1, "decoupled weight decay on the matrices, Muon's and AdamW's (wpe "
                                  "and a tied wte among them, as in nanoGPT); not on biases, norm "
                                  "gains, an untied wte or the bigram table")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.99, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the gradient norm to this; 0 disables clipping")
    # evaluation, sampling, logging
    eval_interval: int = setting(250, "steps between evaluations (and checkpoints)")
    eval_iters: int = setting(20, "batches averaged per split at each evaluation")
    log_interval: int = setting(10, "steps between training-loss log points")
    sample_prompt: str = setting("\n", "prompt of the text sample logged at each evaluation")
    sample_tokens: int = setting(200, "tokens in that sample; 0 disables sampling")
    log_attention: bool = setting(True, "log attention heatmaps (an image per layer) and per-head "
                                  "attention entropy at each evaluation")
    attention_probe: str = setting("", "text whose attention is logged; default: the first 32 "
                                   "tokens of the val split")
    out_dir: str = setting("runs", "parent folder of run folders (TensorBoard events, checkpoints)")
    run_name: str = setting("", "run folder name; default: the config file's name")
    # system
    device: str = setting("auto", "auto, cpu, cuda, cuda:N or mps")
    dtype: str = setting("auto", "auto, float32, bfloat16 or float16 (autocast); auto is bfloat16 "
                         "where the hardware multiplies it natively (a GPU with bf16, a CPU with "
                         "avx512_bf16 or AMX), else float32")
    compile: bool = setting(False, "torch.compile the model (slow start, faster steps)")
    threads: int = setting(0, "CPU threads; 0 measures each count over the first steps, keeps the "
                           "fastest, and measures again when the step's time changes "
                           "(machine/threads.py); OMP_NUM_THREADS also fixes the count")
    parallel: str = setting("ddp", "under torchrun: ddp (each process holds the whole model) or "
                                   "fsdp (each holds 1/N of it; see docs/distributed.md)")
    seed: int = setting(1337, "random seed for initialisation, batches and sampling")
    # The keys that a TOML file or the command line set (the rest are defaults). A fine-tuned
    # model keeps its base's context unless block_size is among them.
    given: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # no nan, which passes every comparison below, nor inf
            value = getattr(self, f.name)
            if type(value) is float and not math.isfinite(value):
                raise ConfigError(f"{f.name} must be a finite number, got {value}")
        for key in ("batch_size", "gradient_accumulation_steps", "max_iters", "eval_interval",
                    "eval_iters", "log_interval"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("learning_rate", "min_lr", "embedding_lr", "muon_lr", "warmup_iters",
                    "lr_decay_iters", "weight_decay", "grad_clip", "sample_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.min_lr > self.learning_rate:
            raise ConfigError(f"min_lr ({self.min_lr}) must not exceed learning_rate ({self.learning_rate})")
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        for key in ("beta1", "beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"{key} must be in [0, 1), got {getattr(self, key)}")
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda", "mps"):
            raise ConfigError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        check_seed(self.seed)
        if not 0 <= self.threads <= 1024:
            raise ConfigError(f"threads must be 0 (measure) or a count up to 1024, got {self.threads}")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"parallel must be ddp or fsdp, got {self.parallel!r}")

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The model to build for a dataset of vocab_size tokens."""
        return replace(self.model, vocab_size=vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """Every setting by its key, flat, as a TOML file writes them (checkpoints keep this).
        n_kv_head is 0 where it equals n_head, so that a new n_head keeps the two equal."""
        settings = {f.name: getattr(self, f.name) for f in fields(self)
                    if f.name not in ("model", "given")}
        shape = {name: getattr(self.model, name) for name in MODEL_FIELDS}
        if shape["n_kv_head"] == shape["n_head"]:
            shape["n_kv_head"] = 0
        return {**settings, **shape}

    def updated(self, **settings: Any) -> TrainConfig:
        """This config with some settings changed, by their flat keys (the model's too),
        checked as a TOML file's are: cfg.updated(max_iters=10, n_layer=2)."""
        cfg = load_config(None, {**self.to_dict(), **settings})
        return replace(cfg, given=self.given | set(settings))


def check_seed(seed: int) -> None:
    """Refuse a seed that some random generator here would not take. torch's take 64 bits
    and the evaluation batches use seed + 1, so 63 bits keep every use in range."""
    if not 0 <= seed < 2**63:
        raise ConfigError(f"seed must be in [0, 2^63), got {seed}")


# every key a TOML file or the command line may set: training's own and the model's
FIELDS = {**{f.name: f for f in fields(TrainConfig) if f.name not in ("model", "given")},
          **MODEL_FIELDS}


def field_default(name: str) -> Any:
    return MODEL_DEFAULTS.get(name, FIELDS[name].default)


def check_value(key: str, value: Any) -> Any:
    """The value converted to the field's type, or ConfigError if it cannot be one."""
    if key not in FIELDS:
        close = difflib.get_close_matches(key, FIELDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint}")
    expected = type(field_default(key))
    # TOML has distinct int, float and bool types; an int is a fine float, and nothing else mixes
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        raise ConfigError(f"{key} must be {expected.__name__}, got {type(value).__name__} {value!r}")
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
            raise ConfigError(f"config {path} is {kind}; give a TOML file, e.g. config/quickstart.toml")
        try:
            # utf-8-sig, because some editors start a UTF-8 file with a byte-order mark
            values = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    values.update(overrides or {})
    checked = {key: check_value(key, value) for key, value in values.items()}
    shape = {key: checked.pop(key) for key in MODEL_FIELDS if key in checked}
    try:  # the model's shape is checked where the model is defined
        model = GPTConfig(**{**MODEL_DEFAULTS, **shape})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return TrainConfig(**checked, model=model, given=frozenset(values))


# train.py --help lists the options under these headings, in this order
SECTIONS = {
    "Data": ("data_dir", "init_from"),
    "Model (model.py's GPTConfig)": tuple(MODEL_FIELDS),
    "Optimization": ("batch_size", "gradient_accumulation_steps", "max_iters", "optimizer", "learning_rate",
                     "min_lr", "embedding_lr", "muon_lr", "muon_momentum", "warmup_iters",
                     "lr_decay_iters", "decay_lr", "weight_decay", "beta1", "beta2", "grad_clip"),
    "Evaluation and logging": ("eval_interval", "eval_iters", "log_interval", "sample_prompt",
                               "sample_tokens", "log_attention", "attention_probe"),
    "The run": ("out_dir", "run_name", "device", "dtype", "compile", "threads", "parallel",
                "seed"),
}
CLICK_TYPES = {int: click.INT, float: click.FLOAT, str: click.STRING, bool: click.BOOL}


class SectionedCommand(click.Command):
    """A command whose --help lists its field options under the headings of SECTIONS, in
    plain text that fits a terminal: full option names, and each one's default."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)
                   if isinstance(p, click.Option)}
        fields = {name for names in SECTIONS.values() for name in names}
        with formatter.section("Options"):
            formatter.write_dl([r for name, r in records.items() if name not in fields and r])
        for title, names in SECTIONS.items():
            with formatter.section(title):
                formatter.write_dl([records[name] for name in names])


def command_line(main: Callable[[Path | None, dict[str, Any], bool, bool], None],
                 ) -> click.Command:
    """A command that calls main(config file, overrides, resume, debug), with the config file
    (first, or as --config), --resume, --debug and one option per field (--n-layer for
    n_layer; --compile and --no-compile for a switch). Each option defaults to None, so only
    what the command line gives overrides the config file; its help shows the field's default."""
    params: list[click.Parameter] = [
        # nanoGPT's habit, `train.py config/x.py`, works here with a TOML file
        click.Argument(["preset"], required=False, type=click.Path(path_type=Path),
                       metavar="[CONFIG]"),
        click.Option(["--config"], type=click.Path(path_type=Path), metavar="FILE",
                     help="TOML preset (see config/); its keys are the options below. Or "
                          "give the file first, without --config."),
        click.Option(["--resume"], is_flag=True,
                     help="Continue runs/<run_name> from its last checkpoint."),
        click.Option(["--debug"], is_flag=True,
                     help="Show tracebacks for configuration and data errors."),
    ]
    for name in FIELDS:
        default, flag = field_default(name), "--" + name.replace("_", "-")
        shown = repr(default) if isinstance(default, str) else json.dumps(default)  # true, as in TOML
        params.append(click.Option(
            [f"{flag}/--no-{flag[2:]}" if isinstance(default, bool) else flag, name],
            type=CLICK_TYPES[type(default)], default=None,
            help=f"{FIELDS[name].metadata['help']}  [default: {shown}]"))

    def callback(preset: Path | None, config: Path | None, resume: bool, debug: bool,
                 **fields: Any) -> None:
        if preset is not None and config is not None and preset != config:
            raise click.UsageError(f"two configs, {preset} and --config {config}; give one")
        main(preset or config, {k: v for k, v in fields.items() if v is not None}, resume,
             debug)
    return SectionedCommand("train.py", params=params, callback=callback, help=main.__doc__,
                            context_settings={"help_option_names": ["-h", "--help"]})
