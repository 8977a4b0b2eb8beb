"""Train a GPT on a prepared corpus, with TensorBoard logs, evaluation and checkpoints.

Usage:
    python train.py --config config/quickstart.toml               # char-level Shakespeare, CPU
    python train.py --config config/quickstart.toml --max-iters 500 --n-layer 2
    python train.py --config config/quickstart.toml --resume      # continue runs/quickstart
    tensorboard --logdir runs

Every field of TrainConfig (train_config.py) is also a command-line option. A run writes
runs/<run_name>/: TensorBoard events, last.pt (every evaluation) and best.pt (best val loss).
"""

from __future__ import annotations

import inspect
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import torch
import typer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import distributed
from attention import LayerPictures, log_attention, token_labels
from checkpoint import (CheckpointError, link_checkpoint, load_checkpoint, save_checkpoint,
                        unwrap_state_dict)
from data.loader import SPLITS, get_batch, load_meta, load_split
from data.prepare import BUILTIN, prepare_builtin
from data.sources import DataError
from generate import generate
from model import GPT
from optimizer import configure_optimizers, lr_multiplier, set_lr
from perf import peak_flops
from precision import DTYPES, DeviceError, resolve_device, resolve_dtype
from tokenizer import load_tokenizer
from train_config import ConfigError, TrainConfig, cli_parameters, load_config


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, a failed write); the last good checkpoint
    is kept."""


class Interrupted(TrainingError):
    """SIGINT or SIGTERM arrived; a checkpoint of the last finished step was written."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for death by signal


USER_ERRORS = (ConfigError, DataError, CheckpointError, DeviceError, TrainingError)


@dataclass
class TrainResult:
    run_dir: Path
    iter_num: int
    best_val_loss: float
    final_losses: dict[str, float]
    wall_time: float


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, splits: dict[str, np.ndarray], cfg: TrainConfig,
                  device: torch.device, autocast: Any,
                  dist: distributed.Dist = distributed.Dist()) -> dict[str, float]:
    """Mean loss over eval_iters batches per split (call it in eval mode). The batches are
    the same at every evaluation (a fixed seed), so the curve shows the model changing,
    not the sample. Under torchrun the processes share the batches out and average."""
    out = {}
    for name, data in splits.items():
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        total = torch.zeros(2, device=device)  # (sum of losses, batches)
        for k in range(cfg.eval_iters):
            x, y = get_batch(data, cfg.block_size, cfg.batch_size, generator)
            if k % dist.world_size == dist.rank:
                with autocast:
                    _, loss = model(to_device(x, device), to_device(y, device))
                total += torch.stack([loss.float(), torch.ones((), device=device)])
        loss_sum, count = distributed.all_sum(total, dist).tolist()
        out[name] = loss_sum / count
    return out


def prepare_data(cfg: TrainConfig, dist: distributed.Dist) -> tuple[dict, dict[str, np.ndarray]]:
    """The dataset's meta and memmapped splits, preparing a built-in dataset if missing
    (by rank 0 alone, while the other processes wait)."""
    data_dir = Path(cfg.data_dir)
    if not (data_dir / "meta.json").exists() and data_dir.name in BUILTIN and dist.is_main:
        tqdm.write(f"preparing {data_dir} (first run only)")
        prepare_builtin(data_dir.name, data_dir)
    distributed.barrier(dist)
    meta = load_meta(data_dir)
    splits = {split: load_split(data_dir, split, meta) for split in SPLITS}
    for split, data in splits.items():
        if len(data) <= cfg.block_size:
            raise ConfigError(f"block_size ({cfg.block_size}) must be smaller than the {split} "
                              f"split ({len(data)} tokens); lower block_size or use more text")
    return meta, splits


def choose_run_dir(cfg: TrainConfig, resume: bool) -> Path:
    """runs/<run_name>; a new run never writes into an old run's folder (it takes the next
    free -2, -3, ... name instead), a resumed run must find its last.pt there."""
    base = Path(cfg.out_dir) / (cfg.run_name or "run")
    if resume:
        if not (base / "last.pt").is_file():
            raise ConfigError(f"nothing to resume: {base / 'last.pt'} not found; "
                              f"drop --resume to start a new run")
        return base
    run_dir, n = base, 1
    while run_dir.exists() and any(run_dir.iterdir()):
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    return run_dir


def check_writable(run_dir: Path, checkpoint_bytes: int) -> None:
    """Fail before training rather than at the first checkpoint: the folder must take a
    file, and the disk must hold last.pt, best.pt and one temporary copy."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write to {run_dir} ({e.strerror}); choose another --out-dir") from None
    free = shutil.disk_usage(run_dir).free
    if free < 3 * checkpoint_bytes:
        raise ConfigError(f"{run_dir} has {free / 1e6:.0f} MB free but checkpoints need about "
                          f"{3 * checkpoint_bytes / 1e6:.0f} MB; free space or choose another --out-dir")


@contextmanager
def stop_signals() -> Iterator[dict[str, int]]:
    """While active, SIGINT and SIGTERM only set stop["signal"], so the loop can finish its
    step and save. A second Ctrl-C interrupts at once, as usual."""
    stop: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return

    def handler(signum: int, frame: object) -> None:
        stop["signal"] = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def build_model(cfg: TrainConfig, meta: dict) -> GPT:
    """A fresh model of the config's shape, or a pretrained GPT-2 to fine-tune."""
    if not cfg.init_from:
        return GPT(cfg.model_config(meta["vocab_size"]))
    if meta["tokenizer"]["kind"] != "gpt2":
        raise ConfigError(f"init_from needs GPT-2 BPE data, but {cfg.data_dir} is "
                          f"{meta['tokenizer']['kind']}; prepare it with --tokenizer gpt2")
    from gpt2 import GPT2FormatError, load_hf_gpt2
    try:
        return load_hf_gpt2(cfg.init_from, block_size=cfg.block_size, dropout=cfg.dropout)
    except GPT2FormatError as e:
        raise ConfigError(f"init_from: {e}") from None


def check_resumable(ckpt: dict, model: GPT, meta: dict, cfg: TrainConfig, path: Path) -> None:
    """Refuse to resume with other data, a different model shape or another optimizer."""
    saved_optimizer = ckpt["config"].get("optimizer", "adamw")
    if saved_optimizer != cfg.optimizer:
        raise ConfigError(f"cannot resume: {path} was trained with optimizer = "
                          f"{saved_optimizer}, not {cfg.optimizer}; resume with --optimizer "
                          f"{saved_optimizer}, or start a new run")
    if ckpt["tokenizer"] != meta["tokenizer"]:
        raise ConfigError(f"cannot resume: {path} was trained with another tokenizer or "
                          f"vocabulary than the {meta['tokenizer']['kind']} data in data_dir; "
                          f"use the run's original data_dir")
    for key, value in ckpt["model_args"].items():
        if getattr(model.config, key) != value:
            raise ConfigError(f"cannot resume: {key} is {getattr(model.config, key)} in the "
                              f"config but {value} in {path}; use the run's original settings")


def run_dtype(cfg: TrainConfig, device: torch.device, ckpt: dict | None,
              dist: distributed.Dist) -> tuple[torch.dtype, str]:
    """The compute dtype and why. A resumed run keeps the dtype that auto chose when it
    started (a new measurement could differ); under torchrun rank 0's choice holds for all."""
    if cfg.dtype == "auto" and ckpt is not None and "dtype" in ckpt:
        return DTYPES[ckpt["dtype"]], "auto: as the run being resumed chose"
    return distributed.from_main(
        resolve_dtype(cfg.dtype, device, cfg.batch_size * cfg.block_size, cfg.n_embd)
        if dist.is_main else None, dist)


def probe_tokens(cfg: TrainConfig, tokenizer: Any, val: np.ndarray) -> list[int]:
    """The token ids whose attention is logged at each evaluation."""
    if not cfg.attention_probe:
        return val[:min(32, cfg.block_size)].tolist()
    try:
        ids = tokenizer.encode(cfg.attention_probe)
    except ValueError as e:
        raise ConfigError(f"attention_probe: {e}") from None
    if not ids:
        raise ConfigError("attention_probe encodes to no tokens; give some text or leave it empty")
    return ids[-cfg.block_size:]


def text_block(text: str) -> str:
    """TensorBoard renders text as markdown; indenting keeps line breaks and spacing."""
    return "\n".join("    " + line for line in text.splitlines())


def train(cfg: TrainConfig, resume: bool = False) -> TrainResult:
    """Run the training loop described by cfg; returns where it wrote and how it ended."""
    t_start = time.time()
    dist = distributed.setup(use_cuda=resolve_device(cfg.device).type == "cuda")
    try:
        return train_process(cfg, resume, dist, t_start)
    finally:
        distributed.teardown(dist)


def train_process(cfg: TrainConfig, resume: bool, dist: distributed.Dist,
                  t_start: float) -> TrainResult:
    """The loop as each process runs it (the only one, or one of torchrun's)."""
    if cfg.gradient_accumulation_steps % dist.world_size != 0:
        raise ConfigError(f"gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) "
                          f"must be divisible by the number of processes ({dist.world_size})")
    accum_steps = cfg.gradient_accumulation_steps // dist.world_size  # this process's share
    device = resolve_device(cfg.device, dist.local_rank)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores for fp32 matmuls
        torch.backends.cudnn.allow_tf32 = True

    meta, splits = prepare_data(cfg, dist)
    tokenizer = load_tokenizer(meta["tokenizer"])
    sample_ids = tokenizer.encode(cfg.sample_prompt) if cfg.sample_tokens else []
    if cfg.sample_tokens and not sample_ids:
        raise ConfigError("sample_prompt encodes to no tokens; give a non-empty prompt")
    probe_ids = probe_tokens(cfg, tokenizer, splits["val"])

    run_dir = distributed.from_main(choose_run_dir(cfg, resume) if dist.is_main else None, dist)
    ckpt = load_checkpoint(run_dir / "last.pt", map_location=device) if resume else None
    dtype, dtype_reason = run_dtype(cfg, device, ckpt, dist)
    autocast = (nullcontext() if dtype == torch.float32
                else torch.autocast(device_type=device.type, dtype=dtype))
    model = build_model(cfg, meta).to(device)
    if dist.is_main:  # fp32 weights plus AdamW's two moments
        check_writable(run_dir, 3 * 4 * sum(p.numel() for p in model.parameters()))
    optimizers = configure_optimizers(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    batch_gen = torch.Generator().manual_seed(cfg.seed)
    iter_num, best_val_loss = 0, float("inf")
    if ckpt is not None:
        check_resumable(ckpt, model, meta, cfg, run_dir / "last.pt")
        model.load_state_dict(unwrap_state_dict(ckpt["model"]))
        states = ckpt["optimizer"]  # a list since optimizer = muon; one dict before
        for opt, state in zip(optimizers, states if isinstance(states, list) else [states],
                              strict=True):
            opt.load_state_dict(state)
        scaler.load_state_dict(ckpt["scaler"])
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"].cpu(), device)
        batch_gen.set_state(ckpt["rng"]["batches"])
        del ckpt
    raw_model = model  # checkpoints save the plain module's weights, never the compiled one's
    if cfg.compile:
        model = torch.compile(model)
    if dist.enabled:  # gradients are averaged across processes during backward
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    flops_per_iter = raw_model.flops_per_token(cfg.block_size) * tokens_per_iter
    peak, peak_source = peak_flops(device, dtype)
    say = tqdm.write if dist.is_main else (lambda message: None)
    writer = None
    if dist.is_main:
        # on resume, drop the events a run logged after its last checkpoint (steps > iter_num)
        writer = SummaryWriter(run_dir, purge_step=iter_num + 1 if resume else None)
        if not resume:
            settings = "\n".join(f"{k} = {v!r}" for k, v in cfg.to_dict().items())
            writer.add_text("config", text_block(settings))
    pictures = (LayerPictures(token_labels(tokenizer, probe_ids), raw_model.config.n_head)
                if cfg.log_attention and dist.is_main else None)
    processes = f" x {dist.world_size} processes" if dist.enabled else ""
    say(f"{raw_model.num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens/iter, "
        f"device {device}{processes}, optimizer {cfg.optimizer}, writing to {run_dir}/")
    say(f"dtype {str(dtype).removeprefix('torch.')} ({dtype_reason})")
    say(f"MFU is measured against {peak / 1e12:.3g} TFLOP/s per process ({peak_source})")

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        """This process's next micro-batch. All processes draw the same stream and take
        every world_size-th batch, so N processes see exactly the batches that one
        process with N times the accumulation would."""
        for r in range(dist.world_size):
            batch = get_batch(splits["train"], cfg.block_size, cfg.batch_size, batch_gen)
            if r == dist.rank:
                mine = batch
        return mine

    def evaluate(it: int) -> dict[str, float]:
        model.eval()  # no dropout while measuring or sampling
        losses = estimate_loss(model, splits, cfg, device, autocast, dist)
        if dist.is_main:
            for split, loss in losses.items():
                writer.add_scalar(f"loss/{split}", loss, it)
            if cfg.sample_tokens:
                sample_gen = torch.Generator(device=device).manual_seed(cfg.seed)
                prompt = torch.tensor([sample_ids], dtype=torch.long, device=device)
                with autocast:
                    out = generate(raw_model, prompt, cfg.sample_tokens, generator=sample_gen)
                writer.add_text("sample", text_block(tokenizer.decode(out[0].tolist())), it)
            if cfg.log_attention:
                log_attention(writer, raw_model, probe_ids, pictures, it)
        model.train()
        say(f"iter {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        return losses

    def checkpoint(it: int, losses: dict[str, float], is_best: bool) -> None:
        if not dist.is_main:
            return
        rng = {"torch": torch.get_rng_state(),
               # the generator as it was before drawing the batch still pending, so a
               # resumed run draws exactly the batches this run would have drawn next
               "batches": pending_batch_state}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        state = {
            "model_args": vars(raw_model.config).copy(),
            "model": raw_model.state_dict(),
            "optimizer": [opt.state_dict() for opt in optimizers],
            "scaler": scaler.state_dict(),
            "iter_num": it,
            "dtype": str(dtype).removeprefix("torch."),
            "best_val_loss": best_val_loss,
            "val_loss": losses.get("val", math.nan),
            "config": cfg.to_dict(),
            "tokenizer": meta["tokenizer"],
            "rng": rng,
        }
        try:
            save_checkpoint(state, run_dir / "last.pt")
            if is_best:  # the same file under a second name: no second write
                link_checkpoint(run_dir / "last.pt", run_dir / "best.pt")
        except OSError as e:
            raise TrainingError(f"could not write a checkpoint in {run_dir} ({e.strerror}); "
                                f"the previous one is intact") from None

    losses = evaluate(iter_num) if iter_num == 0 else {}
    pending_batch_state = batch_gen.get_state()
    x, y = next_batch()
    # disable=None: a live bar on a terminal, no carriage-return noise in logs and pipes
    bar = tqdm(total=cfg.max_iters, initial=iter_num, unit="it", dynamic_ncols=True,
               disable=None if dist.is_main else True)
    t_log, iters_since_log, loss_sum = time.perf_counter(), 0, torch.zeros((), device=device)
    with stop_signals() as stop:
        try:
            while iter_num < cfg.max_iters:
                lr_scale = lr_multiplier(iter_num, cfg)
                set_lr(optimizers, lr_scale)
                for micro_step in range(accum_steps):
                    # under DDP, average gradients across processes only after the last
                    # micro-step: the earlier all-reduces would be wasted work
                    last = micro_step == accum_steps - 1
                    sync = model.no_sync() if dist.enabled and not last else nullcontext()
                    with sync:
                        with autocast:
                            _, loss = model(to_device(x, device), to_device(y, device))
                        loss = loss / accum_steps
                        # draw the next batch before backward: a GPU has work while the CPU gathers
                        pending_batch_state = batch_gen.get_state()
                        x, y = next_batch()
                        scaler.scale(loss).backward()
                    loss_sum += loss.detach()
                for opt in optimizers:
                    scaler.unscale_(opt)
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(),
                                                           cfg.grad_clip or math.inf)
                for opt in optimizers:
                    scaler.step(opt)
                scaler.update()
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                iter_num += 1
                iters_since_log += 1
                bar.update(1)

                if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
                    # .item() waits for the device: only at log points
                    train_loss = distributed.all_sum(loss_sum, dist).item() / (
                        iters_since_log * dist.world_size)
                    if not math.isfinite(train_loss):
                        raise TrainingError(f"training loss became {train_loss} at iter "
                                            f"{iter_num}; the last good checkpoint is kept: "
                                            f"lower learning_rate or set grad_clip")
                    elapsed = time.perf_counter() - t_log
                    tokens_per_sec = iters_since_log * tokens_per_iter / elapsed
                    mfu = iters_since_log * flops_per_iter / elapsed / (peak * dist.world_size)
                    if dist.is_main:
                        writer.add_scalar("train/loss_step", train_loss, iter_num)
                        writer.add_scalar("train/lr", cfg.learning_rate * lr_scale, iter_num)
                        writer.add_scalar("train/grad_norm", grad_norm.item(), iter_num)
                        writer.add_scalar("perf/tokens_per_sec", tokens_per_sec, iter_num)
                        writer.add_scalar("perf/mfu", mfu, iter_num)
                    bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}",
                                    mfu=f"{mfu:.0%}")
                    t_log, iters_since_log = time.perf_counter(), 0
                    loss_sum = torch.zeros_like(loss_sum)

                if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
                    losses = evaluate(iter_num)
                    if not math.isfinite(losses["val"]):
                        raise TrainingError(f"val loss is {losses['val']} at iter {iter_num}; "
                                            f"the last good checkpoint is kept: lower "
                                            f"learning_rate or set grad_clip")
                    is_best = losses["val"] < best_val_loss
                    best_val_loss = min(best_val_loss, losses["val"])
                    checkpoint(iter_num, losses, is_best)
                    t_log = time.perf_counter()  # evaluation time is not training throughput
                # SIGINT/SIGTERM: this step is done; save it and leave. Processes must agree
                # on when to leave; under DDP they compare notes only at log points, where
                # the loop waits for the device anyway, never on every step.
                at_log_point = iter_num % cfg.log_interval == 0
                if (stop if not dist.enabled else
                        at_log_point and distributed.any_true(bool(stop), dist, device)):
                    checkpoint(iter_num, losses, is_best=False)
                    signum = stop.get("signal", signal.SIGTERM)
                    raise Interrupted(f"stopped by {signal.Signals(signum).name} at iter "
                                      f"{iter_num}; saved {run_dir / 'last.pt'}; continue with "
                                      f"the same command and --resume", signum)
            if dist.is_main:
                writer.add_hparams(cfg.to_dict(), {"hparam/best_val_loss": best_val_loss},
                                   run_name=".", global_step=iter_num)
        finally:
            bar.close()
            if writer is not None:
                writer.close()
            if pictures is not None:
                pictures.close()
    return TrainResult(run_dir, iter_num, best_val_loss, losses, time.time() - t_start)


def build_cli() -> typer.Typer:
    """A typer command with --config, --resume, --debug and one option per TrainConfig field
    (default None: only what is given on the command line overrides the config file)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]})

    def command(**kwargs: Any) -> None:
        config, resume, debug = kwargs.pop("config"), kwargs.pop("resume"), kwargs.pop("debug")
        overrides = {key: value for key, value in kwargs.items() if value is not None}
        is_main = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 reports
        try:
            cfg = load_config(config, overrides)
            if not cfg.run_name:
                cfg.run_name = config.stem if config else "run"
            result = train(cfg, resume)
        except Interrupted as e:
            if is_main:
                typer.echo(f"interrupted: {e}", err=True)
            raise typer.Exit(e.exit_code)
        except USER_ERRORS as e:
            if debug:
                raise
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1)
        if not is_main:
            return
        typer.echo(f"done: {result.iter_num} iters in {result.wall_time:.0f}s, "
                   f"best val loss {result.best_val_loss:.4f}\n"
                   f"checkpoints: {result.run_dir}/best.pt, {result.run_dir}/last.pt\n"
                   f"next: python sample.py --run {result.run_dir}   |   "
                   f"tensorboard --logdir {result.run_dir.parent}")

    params = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Annotated[Optional[Path], typer.Option(
                              help="TOML preset; see config/. Its keys are the options below.")]),
        inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=False,
                          annotation=Annotated[bool, typer.Option(
                              help="Continue runs/<run_name> from its last.pt.")]),
        inspect.Parameter("debug", inspect.Parameter.KEYWORD_ONLY, default=False,
                          annotation=Annotated[bool, typer.Option(
                              help="Show tracebacks for configuration and data errors.")]),
        *cli_parameters(),
    ]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = "Train a GPT. Settings: TrainConfig defaults < --config file < options."
    app.command()(command)
    return app


if __name__ == "__main__":
    build_cli()()
