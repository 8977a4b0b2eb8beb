"""What a training process works with: data, model, optimizers and run folder, built from
the config, or restored from the run's checkpoint (last.pt, or last.dcp under FSDP).

Usage:
    from training.session import setup
    s = setup(cfg, resume=False, dist=distributed.Dist())
    s.model, s.optimizers, s.batches.next(), s.run_dir, s.iter_num, ...
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from data.loader import SPLITS, BatchStream, Sampler, Tokens, batch_sampler, load_meta, load_split
from data.prepare import BUILTIN, prepare_builtin
from data.sources import DataError
from data.tokenizer import CHAT_SPECIALS, Tokenizer, load_tokenizer, with_specials
from machine.device import DTYPES, check_compile, resolve_device
from model import GPT, GPTConfig
from training import checkpoints, distributed
from training.config import ConfigError, TrainConfig
from training.memory import check_memory
from training.optimizer import configure_optimizers
from training.precision import resolve_dtype
from training.runs import RunFolder, check_resumable, check_writable, choose_run_dir
from viz.attention_maps import LayerPictures, token_labels
from weights.checkpoint import CheckpointError, TrainState, state_dict_mismatch
from weights.lazy import Lazy, build, grown


def prepare_data(cfg: TrainConfig, dist: distributed.Dist,
                 ) -> tuple[dict, dict[str, Tokens], Tokenizer]:
    """The dataset's meta, memmapped splits and tokenizer, preparing a built-in dataset if
    missing. Rank 0 prepares and reads it first, while the other processes wait: a missing
    or damaged dataset is one line from rank 0, for all."""
    data_dir = Path(cfg.data_dir)
    read = None  # rank 0's (or a plain process's) reading; memmaps are not for a broadcast

    def prepare_and_read() -> None:
        nonlocal read
        if not (data_dir / "meta.json").exists() and data_dir.name in BUILTIN:
            tqdm.write(f"preparing {data_dir} (first run only)")
            prepare_builtin(data_dir.name, data_dir)
        read = read_data(cfg, data_dir)
    distributed.from_main(prepare_and_read, dist)
    return read or read_data(cfg, data_dir)


def read_data(cfg: TrainConfig, data_dir: Path) -> tuple[dict, dict[str, Tokens], Tokenizer]:
    meta = load_meta(data_dir)
    splits = {split: load_split(data_dir, split, meta) for split in SPLITS}
    for split, data in splits.items():
        if len(data) <= cfg.model.block_size:
            raise ConfigError(f"block_size ({cfg.model.block_size}) must be smaller than the {split} "
                              f"split ({len(data)} tokens); lower block_size or use more text")
    try:
        tokenizer = load_tokenizer(meta["tokenizer"])
    except ValueError as e:
        raise DataError(f"{cfg.data_dir}/meta.json: {e}; prepare the dataset again") from None
    return meta, splits, tokenizer


def build_model(cfg: TrainConfig, meta: dict, device: torch.device, dtype: torch.dtype,
                dist: distributed.Dist, saved: TrainState | None = None) -> GPT:
    """A fresh model of the config's shape on the device, sharded under parallel = fsdp; or
    a pretrained model to fine-tune (resumed: of the checkpoint's shape, whose weights
    replace the base's, which is then not read at all). Sharded, each process reads its
    own rows of the base, one tensor at a time (weights/lazy.py)."""
    config, base = cfg.model_config(meta["vocab_size"]), None
    if cfg.init_from and saved is not None:
        config = GPTConfig(**saved.model_args)
    elif cfg.init_from:
        config, base = pretrained_weights(cfg, meta, dist)
    if sharded(cfg, dist):
        param_dtype = dtype if device.type == "cuda" and dtype != torch.float32 else None
        return distributed.shard_model(config, device, param_dtype, cfg.compile, base)
    return (GPT(config) if base is None else build(config, base)).to(device)


def pretrained_weights(cfg: TrainConfig, meta: dict,
                       dist: distributed.Dist) -> tuple[GPTConfig, dict[str, Lazy]]:
    """The model to fine-tune, not read yet: a Hugging Face folder (GPT-2's or NanoChat's),
    a checkpoint or a run folder, its context cropped to block_size, checked against the
    data it will see. The base sets the model's shape and layout, and the data must be
    tokenized as it was, or (a chat dataset) with the chat tokens added: those get new rows."""
    from weights.hf import FolderError, model_type
    from weights.loading import LoadError, base_weights
    try:
        if (Path(cfg.init_from) / "config.json").is_file() and model_type(cfg.init_from) == "gpt2" \
                and not cfg.model_config(meta["vocab_size"]).is_gpt2:
            raise ConfigError("init_from loads GPT-2's layout; leave pos_embedding, norm, "
                              "qk_norm, mlp, tie_embeddings and n_kv_head at their defaults "
                              "to fine-tune it")
        config, state, tokenizer, source = base_weights(cfg.init_from, cfg.model.block_size,
                                                        cfg.model.dropout)
    except ConfigError:
        raise
    except (FolderError, LoadError, CheckpointError) as e:
        raise ConfigError(f"init_from: {e}") from None
    base = tokenizer.to_meta()
    if meta["tokenizer"] not in (base, with_specials(base, CHAT_SPECIALS)):
        hint = ("gpt2" if base["kind"] == "gpt2" else cfg.init_from if Path(source).is_dir()
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


def sharded(cfg: TrainConfig, dist: distributed.Dist) -> bool:
    """Whether this run shards its model (FSDP); ConfigError where it cannot."""
    if cfg.parallel != "fsdp":
        return False
    if not dist.enabled:
        raise ConfigError("parallel = fsdp shards the model across torchrun's processes; "
                          "launch with torchrun --nproc_per_node=N, or drop --parallel")
    if cfg.dtype == "float16":
        raise ConfigError("parallel = fsdp trains in float32 or bfloat16; float16's loss "
                          "scaling is not wired for sharded gradients: use --dtype bfloat16")
    return True


def run_dtype(cfg: TrainConfig, device: torch.device, vocab_size: int, saved: TrainState | None,
              dist: distributed.Dist) -> tuple[torch.dtype, str]:
    """The compute dtype and why. A resumed run keeps the dtype that auto chose when it
    started (a new measurement could differ); under torchrun rank 0's choice holds for all."""
    if cfg.dtype == "auto" and saved is not None and saved.dtype is not None:
        return DTYPES[saved.dtype], "auto: as the run being resumed chose"
    if cfg.dtype == "auto" and cfg.parallel == "fsdp" and device.type == "cpu":
        return torch.float32, "auto: a sharded model on CPUs trains in float32"
    return distributed.from_main(
        lambda: resolve_dtype(cfg.dtype, device, training_step(cfg, vocab_size, device)), dist)


def training_step(cfg: TrainConfig, vocab_size: int,
                  device: torch.device) -> Callable[[torch.dtype], None]:
    """One step of this run in a given dtype, as the loop runs it (forward and backward of a
    micro-batch, then the optimizers), on a model of its own: what auto times. The model is
    built at the first call only, so a run that measures nothing (a set dtype, a GPU, a CPU
    without native bf16) builds none; its weights come from a forked RNG, so the run's own
    initialisation is as without it."""
    parts: dict = {}

    def step(dtype: torch.dtype) -> None:
        if not parts:
            with torch.random.fork_rng(devices=[]):
                parts["model"] = GPT(cfg.model_config(vocab_size)).to(device)
            parts["x"] = torch.randint(vocab_size, (cfg.batch_size, cfg.model.block_size), device=device,
                                       generator=torch.Generator(device).manual_seed(0))
            parts.update({d: configure_optimizers(parts["model"], cfg, device, d)
                          for d in (torch.float32, torch.bfloat16)})
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            _, loss = parts["model"](parts["x"], parts["x"])
        loss.backward()
        for opt in parts[dtype]:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def setting_tokens(name: str, text: str, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a text setting (sample_prompt, attention_probe); a ConfigError names
    the setting when the text cannot be encoded or encodes to nothing."""
    try:
        ids = tokenizer.encode(text)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    if not ids:
        raise ConfigError(f"{name} encodes to no tokens; give some text")
    return ids


def probe_tokens(cfg: TrainConfig, tokenizer: Tokenizer, val: Tokens) -> list[int]:
    """The token ids whose attention is logged at each evaluation."""
    if not cfg.attention_probe:
        return val[:min(32, cfg.model.block_size)].tolist()
    return setting_tokens("attention_probe", cfg.attention_probe, tokenizer)[-cfg.model.block_size:]


def text_block(text: str) -> str:
    """TensorBoard renders text as markdown; indenting keeps line breaks and spacing."""
    return "\n".join("    " + line for line in text.splitlines())


@dataclass
class Session:
    """What one process's loop works with, built once by `setup`."""
    cfg: TrainConfig
    dist: distributed.Dist
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # why dtype is what it is, as the run's first lines say
    autocast: AbstractContextManager
    run_dir: Path
    meta: dict
    splits: dict[str, Tokens]
    samplers: dict[str, Sampler]  # each split's batches: windows, or whole conversations
    tokenizer: Tokenizer
    raw_model: GPT  # the plain module: checkpoints save its weights, never a compiled one's
    model: torch.nn.Module  # what the step calls: raw_model, maybe compiled, maybe in DDP
    optimizers: list[torch.optim.Optimizer]
    scaler: torch.amp.GradScaler
    batches: BatchStream
    iter_num: int
    best_val_loss: float
    sample_ids: list[int]
    probe_ids: list[int]
    writer: SummaryWriter | None = None  # rank 0 only, as are the pictures and the folder
    pictures: LayerPictures | None = None
    folder: RunFolder | None = None  # run_dir, locked (training/runs.lock_run_dir): no second run there
    saved_iter: int | None = None  # the iteration of the last checkpoint written or resumed
    checkpoint: Path | None = None  # that checkpoint: last.pt, or last.dcp under FSDP


def setup(cfg: TrainConfig, resume: bool, dist: distributed.Dist) -> Session:
    """Data, model, optimizers and run folder, restored from last.pt when resuming."""
    if cfg.gradient_accumulation_steps % dist.world_size != 0:
        raise ConfigError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) "
                          f"must be divisible by the number of processes ({dist.world_size})")
    device = resolve_device(cfg.device, dist.local_rank)
    if cfg.compile:  # before anything is written
        check_compile(device, instead="drop --compile")
    sharded(cfg, dist)  # a parallel setting that cannot be, before the work
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32 matmuls
        torch.backends.cudnn.allow_tf32 = True
    meta, splits, tokenizer = prepare_data(cfg, dist)
    sample_ids = (setting_tokens("sample_prompt", cfg.sample_prompt, tokenizer)
                  if cfg.sample_tokens else [])
    probe_ids = probe_tokens(cfg, tokenizer, splits["val"])
    # rank 0's verdict holds for all: processes that start apart would see different free
    # memory, and one refusing alone would leave the others waiting in a collective
    distributed.from_main(lambda: check_memory(cfg, meta["vocab_size"], device, dist), dist)

    folder = None  # rank 0 holds the run folder's lock for as long as the run goes on

    def take_run_dir() -> Path:
        nonlocal folder
        folder = choose_run_dir(cfg, resume)
        return folder.path
    run_dir = distributed.from_main(take_run_dir, dist)
    try:
        s = build_session(cfg, resume, dist, device, run_dir, meta, splits, tokenizer,
                          sample_ids, probe_ids)
    except BaseException:
        if folder is not None:  # nothing was written: leave no folder or lock behind
            folder.release(undo=True)
        raise
    s.folder = folder
    if dist.is_main:
        # on resume, drop the events a run logged after its last checkpoint (steps > iter_num)
        s.writer = SummaryWriter(run_dir, purge_step=s.iter_num + 1 if resume else None)
        if not resume:
            settings = "\n".join(f"{k} = {v!r}" for k, v in cfg.to_dict().items())
            s.writer.add_text("config", text_block(settings))
        if cfg.log_attention and not distributed.is_sharded(s.raw_model):  # whole weights
            s.pictures = LayerPictures(token_labels(tokenizer, probe_ids),
                                       s.raw_model.config.n_head)
    return s


def build_session(cfg: TrainConfig, resume: bool, dist: distributed.Dist, device: torch.device,
                  run_dir: Path, meta: dict, splits: dict[str, Tokens], tokenizer: Tokenizer,
                  sample_ids: list[int], probe_ids: list[int]) -> Session:
    """Model, optimizers and batch stream, restored from the run's checkpoint when resuming:
    the part of setup that can still fail once the run folder is taken, and writes nothing."""
    # a plain last.pt resumed under FSDP is mapped, not read: each process touches its shards
    saved, shards = (checkpoints.read_saved(run_dir, device, mmap=sharded(cfg, dist))
                     if resume else (None, None))
    dtype, dtype_reason = run_dtype(cfg, device, meta["vocab_size"], saved, dist)
    model = build_model(cfg, meta, device, dtype, dist, saved)
    fsdp = distributed.is_sharded(model)
    # fp32 weights plus AdamW's two moments
    checkpoint_bytes = 3 * 4 * sum(p.numel() for p in model.parameters())
    distributed.from_main(lambda: check_writable(run_dir, checkpoint_bytes), dist)
    # the model's block_size: a base model (init_from) may have cropped the config's
    samplers = {split: batch_sampler(data, meta, model.config.block_size, cfg.batch_size,
                                     tqdm.write if dist.is_main else None)
                for split, data in splits.items()}
    s = Session(
        cfg=cfg, dist=dist, device=device, dtype=dtype, dtype_reason=dtype_reason,
        # under FSDP on a GPU the weights are gathered in bf16 (its mixed precision): no autocast
        autocast=(nullcontext() if dtype == torch.float32 or fsdp and device.type == "cuda"
                  else torch.autocast(device.type, dtype=dtype)),
        run_dir=run_dir, meta=meta, splits=splits, samplers=samplers, tokenizer=tokenizer,
        raw_model=model, model=model,
        optimizers=configure_optimizers(model, cfg, device, dtype),
        scaler=torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
        batches=BatchStream(samplers["train"], cfg.seed, dist.rank, dist.world_size),
        iter_num=0, best_val_loss=float("inf"), sample_ids=sample_ids, probe_ids=probe_ids)
    if saved is not None:
        s.checkpoint = shards or run_dir / "last.pt"
        check_resumable(saved, model, meta, cfg, s.checkpoint)
        if shards is not None:  # each process reads its own shards (all of it, unsharded)
            checkpoints.fill_from_shards(saved, shards, s.raw_model, s.optimizers)
        restore(s, saved)
        if s.iter_num > cfg.max_iters:
            raise ConfigError(f"{s.checkpoint} is at iter {s.iter_num}, past max_iters "
                              f"({cfg.max_iters}), so there is nothing to train; raise "
                              f"--max-iters to continue it")
    if cfg.compile and not fsdp:  # FSDP compiled each block before sharding it
        s.model = torch.compile(s.model)
    if dist.enabled and not fsdp:  # gradients are averaged across processes during backward
        # the gradients live in DDP's buckets rather than beside them: no second copy
        s.model = DDP(s.model, device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True)
    return s


def restore(s: Session, saved: TrainState) -> None:
    """Put a run back as its checkpoint left it: weights, optimizer state, RNGs, batches."""
    problem = state_dict_mismatch(s.raw_model.state_dict(), saved.model, "model_args")
    if problem:
        raise CheckpointError(f"cannot resume: the weights in {s.checkpoint} do not "
                              f"match its model_args ({problem}); the file is damaged: start "
                              f"a new run without --resume")
    current = s.raw_model.state_dict()  # sharded under FSDP: each process takes its part
    s.raw_model.load_state_dict({k: distributed.sharded_like(v, current[k])
                                 for k, v in saved.model.items()})
    for opt, state in zip(s.optimizers, saved.optimizer, strict=True):
        # the state (moments, momentum, step counts) is the run's; the settings (peak lr,
        # decay, betas, momentum) are the config's, which a resumed run may change
        settings = [{k: v for k, v in group.items() if k != "params"}
                    for group in opt.param_groups]
        opt.load_state_dict(distributed.sharded_optimizer_state(state, opt))
        for group, setting in zip(opt.param_groups, settings, strict=True):
            group.update(setting)
    s.scaler.load_state_dict(saved.scaler)
    s.iter_num, s.best_val_loss = saved.iter_num, saved.best_val_loss
    s.saved_iter = s.iter_num
    torch.set_rng_state(saved.rng["torch"])
    if s.device.type == "cuda" and "cuda" in saved.rng:
        torch.cuda.set_rng_state(saved.rng["cuda"].cpu(), s.device)
    s.batches.restore(saved.rng["batches"])
