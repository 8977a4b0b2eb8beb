"""What train.py does before its loop, a named step each: the device, the data, the run
folder and its log, the model, and the model as the loop calls it.

Usage:
    from training.setup import build_model, choose_device, for_training, load_data, open_run
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.loader import Tokens, load_dataset
from data.sources import BUILTIN
from data.tokenizer import Tokenizer
from machine.device import check_compile, resolve_device, reuse_freed_memory
from model import GPT, GPTConfig
from training import distributed
from training.config import ConfigError, TrainConfig
from training.log import RunLog
from training.memory import check_memory, out_of_memory
from training.runs import Run, run_folder


def choose_device(cfg: TrainConfig, dist: distributed.Dist) -> torch.device:
    """This process's device, set up for training; a compiler that cannot work here is refused
    before anything is written."""
    device = resolve_device(cfg.device, dist.local_rank)  # auto: CUDA, else MPS, else the CPU
    if cfg.compile:
        check_compile(device, instead="drop --compile")
    if device.type == "cuda":  # TF32 tensor cores for fp32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu" and not dist.enabled:  # where it was measured to pay (docs/performance.md)
        reuse_freed_memory()  # glibc keeps freed memory for the next step's activations
    return device


def load_data(cfg: TrainConfig, dist: distributed.Dist) -> tuple[dict, dict[str, Tokens], Tokenizer]:
    """The dataset's meta.json, its memory-mapped splits and its tokenizer. A built-in dataset is
    prepared on first use, by rank 0 while the others wait, so that a problem is reported once."""
    data_dir = Path(cfg.data_dir)
    read = None  # rank 0's memmaps; the other processes open their own

    def prepare_and_read() -> None:
        nonlocal read
        if not (data_dir / "meta.json").exists() and data_dir.name in BUILTIN:
            tqdm.write(f"preparing {data_dir} (first run only)")
            from data.prepare import prepare_builtin  # its tokenizers and workers, only when needed
            prepare_builtin(data_dir.name, data_dir)
        read = load_dataset(data_dir)
    distributed.from_main(prepare_and_read, dist)
    return read or load_dataset(data_dir)


def setting_ids(name: str, text: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a text setting (sample_prompt, attention_probe); a ConfigError names
    the setting when the text cannot be encoded or encodes to nothing."""
    try:
        ids = tokenizer.encode(text)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    if not ids:
        raise ConfigError(f"{name} encodes to no tokens; give some text")
    return ids


@contextmanager
def open_run(cfg: TrainConfig, resume: bool, meta: dict, tokenizer: Tokenizer, val: Tokens, *,
             dist: distributed.Dist, device: torch.device) -> Iterator[tuple[Run, RunLog]]:
    """The run folder (new, or the one to resume) and its log, opened once the model's memory is
    known to fit; inside, running out of memory is one line that says what to lower. The log
    samples from sample_prompt and pictures the attention to attention_probe (or the val split's)."""
    check_memory(cfg, meta["vocab_size"], device, dist)
    sample_ids = setting_ids("sample_prompt", cfg.sample_prompt, tokenizer) if cfg.sample_tokens else []
    probe_ids = (setting_ids("attention_probe", cfg.attention_probe, tokenizer)
                 if cfg.attention_probe else val[:32].tolist())
    pictures = cfg.log_attention and not dist.sharded  # the pictures read whole weights
    with (run_folder(cfg, resume, dist) as run, out_of_memory(cfg, device, dist),
          RunLog(run, cfg, dist, tokenizer, sample_ids, probe_ids, pictures) as log):
        yield run, log


def build_model(cfg: TrainConfig, meta: dict, saved: Any, *, device: torch.device, dtype: torch.dtype,
                dist: distributed.Dist) -> GPT:
    """A new model of the config's shape, or the base model to fine-tune (init_from), on the
    device, sharded under parallel = fsdp. A resumed fine-tuning has the checkpoint's shape,
    and its weights replace the base's, which is then not read at all."""
    config, base = cfg.model_config(meta["vocab_size"]), None
    if cfg.init_from and saved is not None:
        config = GPTConfig(**saved.model_args)
    elif cfg.init_from:
        from training.init_from import base_model  # a Hugging Face folder, a run ...
        config, base = base_model(cfg, meta, dist)
    if dist.sharded:
        from training.fsdp import shard_model
        param_dtype = dtype if device.type == "cuda" and dtype != torch.float32 else None
        return shard_model(config, device, param_dtype, cfg.compile, base)
    if base is not None:
        from weights.lazy import build
        return build(config, base).to(device)
    return GPT(config).to(device)


def for_training(model: GPT, cfg: TrainConfig, *, device: torch.device,
                 dist: distributed.Dist) -> torch.nn.Module:
    """What the loop calls: the model compiled if cfg.compile (FSDP compiled each block before
    sharding it), and under torchrun wrapped by DDP, unless FSDP shards it."""
    if cfg.compile and not dist.sharded:
        # On one GPU, each compiled pass is replayed as a CUDA graph, because launching its many
        # kernels one at a time from Python would hold a small model back. Graphs are not used
        # with gradient accumulation, because the next replay would overwrite the gradients that
        # are still accumulating, nor under torchrun, which reduces gradients during the backward.
        graphs = device.type == "cuda" and cfg.gradient_accumulation_steps == 1 and not dist.enabled
        model = torch.compile(model, mode="reduce-overhead" if graphs else None)
    if dist.enabled and not dist.sharded:  # DDP's wrapper, imported only under torchrun
        from training.torchrun import ddp
        model = ddp(model, device)
    return model
