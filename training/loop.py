"""The training loop: evaluate, step, log, save, until max_iters or a signal.

Usage:
    from training.loop import train
    result = train(cfg)                   # a TrainConfig; TrainResult(run_dir, iter_num, ...)
    result = train(cfg, resume=True)      # continue runs/<run_name> from its last.pt

train.py is its command line. The loop is nanoGPT's: random windows from memory-mapped
shards, gradient accumulation, clipping, warmup then cosine decay; session.py builds what it
works with, and weights/checkpoint.py owns what last.pt holds.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.loader import Sampler
from generate import generate
from machine.device import resolve_device
from machine.errors import UserError
from machine.files import quiet_writer_threads
from machine.perf import peak_flops
from training import checkpoints, distributed
from training.config import TrainConfig
from training.memory import steps_in_memory
from training.optimizer import lr_multiplier, set_lr
from training.runs import stop_signals
from training.session import Session, setup, text_block
from viz.attention_maps import log_attention
from weights.checkpoint import CheckpointError, TrainState


class TrainingError(UserError):
    """Training cannot go on (a non-finite loss, a failed write); the last good checkpoint
    is kept."""


class Interrupted(TrainingError):
    """SIGINT or SIGTERM arrived; a checkpoint of the last finished step was written."""
    label = "interrupted"  # what train.py's one line starts with, in place of "error"
    everywhere = True  # every process saves and leaves together

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention for death by signal




@dataclass
class TrainResult:
    run_dir: Path
    iter_num: int
    best_val_loss: float
    final_losses: dict[str, float]
    wall_time: float
    checkpoint: Path | None  # last.pt, or last.dcp: sharded, under FSDP; None: none saved
    chat: bool = False  # trained on conversations: a model to talk to (sample.py --chat)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, samplers: dict[str, Sampler], cfg: TrainConfig,
                  device: torch.device, autocast: Any,
                  dist: distributed.Dist | None = None) -> dict[str, float]:
    """Mean loss over eval_iters batches per split (call it in eval mode). The batches are
    the same at every evaluation (a fixed seed), so the curve shows the model changing,
    not the sample. Under torchrun the processes share the batches out and average."""
    dist = dist or distributed.Dist()
    # a sharded model's forward is a collective: every process runs as many, the last
    # batch again (and not counted) where eval_iters does not divide among them
    rounds = -(-cfg.eval_iters // dist.world_size) * dist.world_size
    out = {}
    for name, draw in samplers.items():
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        total = torch.zeros(2, device=device)  # (sum of losses, batches)
        for k in range(rounds if distributed.is_sharded(model) else cfg.eval_iters):
            if k < cfg.eval_iters:
                x, y = draw(generator)
            if k % dist.world_size == dist.rank:
                with autocast:
                    _, loss = model(to_device(x, device), to_device(y, device))
                counted = float(k < cfg.eval_iters)
                total += torch.stack([loss.float() * counted,
                                      torch.full((), counted, device=device)])
        loss_sum, count = distributed.all_sum(total, dist).tolist()
        out[name] = loss_sum / count
    return out


def train_step(s: Session, x: torch.Tensor, y: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One optimizer step over this process's micro-batches, starting with (x, y). Returns
    the step's mean loss and gradient norm (on the device, unsynchronised) and the next
    micro-batch."""
    accum_steps = s.cfg.gradient_accumulation_steps // s.dist.world_size  # this process's
    loss_sum = torch.zeros((), device=s.device)
    for micro_step in range(accum_steps):
        # under torchrun, reduce gradients across processes only after the last micro-step:
        # the earlier all-reduces would be wasted work
        last = micro_step == accum_steps - 1
        with distributed.gradient_sync(s.model, s.dist, sync=last):
            with s.autocast:
                _, loss = s.model(to_device(x, s.device), to_device(y, s.device))
            loss = loss / accum_steps
            x, y = s.batches.next()  # before backward: a GPU has work while the CPU gathers
            s.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    for opt in s.optimizers:
        s.scaler.unscale_(opt)
    grad_norm = distributed.whole(torch.nn.utils.clip_grad_norm_(  # over every shard
        s.raw_model.parameters(), s.cfg.grad_clip or math.inf))
    for opt in s.optimizers:
        s.scaler.step(opt)
    s.scaler.update()
    for opt in s.optimizers:
        opt.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, (x, y)


def evaluate(s: Session, it: int) -> dict[str, float]:
    """Losses on both splits, logged with a text sample and the attention pictures."""
    s.model.eval()  # no dropout while measuring or sampling
    losses = estimate_loss(s.model, s.samplers, s.cfg, s.device, s.autocast, s.dist)
    # a sharded model samples on every process (its forward is a collective), in eager
    # steps (the C step reads whole weights); rank 0 logs the text
    fsdp = distributed.is_sharded(s.raw_model)
    if s.cfg.sample_tokens and (s.writer is not None or fsdp):
        sample_gen = torch.Generator(device=s.device).manual_seed(s.cfg.seed)
        prompt = torch.tensor([s.sample_ids], dtype=torch.long, device=s.device)
        # a CPU samples in the weights' fp32, unsharded with the C step: under bf16 autocast
        # only the eager step could run (the quickstart's 200 tokens: 1.06 s against 0.07)
        with s.autocast if s.device.type != "cpu" else nullcontext():
            out = generate(s.raw_model, prompt, s.cfg.sample_tokens, generator=sample_gen,
                           decode="eager" if fsdp else "auto")
        if s.writer is not None:
            s.writer.add_text("sample", text_block(s.tokenizer.decode(out[0].tolist())), it)
    if s.writer is not None:
        for split, loss in losses.items():
            s.writer.add_scalar(f"loss/{split}", loss, it)
        if s.pictures is not None:
            log_attention(s.writer, s.raw_model, s.probe_ids, s.pictures, it)
    s.model.train()
    if not math.isfinite(losses["val"]):
        raise TrainingError(f"val loss is {losses['val']} at iter {it}; the last good "
                            f"checkpoint is kept: lower learning_rate or set grad_clip")
    return losses


def train_state(s: Session, val_loss: float) -> TrainState:
    """What a checkpoint holds now. The batch state is the batch stream's before the batch
    still pending was drawn, so a resumed run draws exactly the batches this run would have
    drawn next. A sharded model's weights and moments are not in it: each process saves its
    own shards of them (training/checkpoints.py)."""
    rng = {"torch": torch.get_rng_state(), "batches": s.batches.state}
    if s.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(s.device)
    plain = not distributed.is_sharded(s.raw_model)
    return TrainState(
        model_args=vars(s.raw_model.config).copy(),
        model=s.raw_model.state_dict() if plain else {},
        optimizer=[opt.state_dict() for opt in s.optimizers] if plain else [],
        scaler=s.scaler.state_dict(), iter_num=s.iter_num,
        dtype=str(s.dtype).removeprefix("torch."), best_val_loss=s.best_val_loss,
        val_loss=val_loss, config=s.cfg.to_dict(), tokenizer=s.meta["tokenizer"], rng=rng)


def save(s: Session, losses: dict[str, float], is_best: bool) -> None:
    """Write last.pt from rank 0, or under FSDP last.dcp from every process (and best, the
    same checkpoint), if the state is finite: every process hears of a NaN, so all of them
    stop together."""
    state = train_state(s, losses.get("val", math.nan))
    sharded = distributed.is_sharded(s.raw_model)
    tensors = checkpoints.shard_tensors(s.raw_model, s.optimizers) if sharded else None
    broken = checkpoints.broken_tensor(state, tensors, s.dist)
    if broken is not None:  # a loss that turned NaN between log points: no other trace
        raise TrainingError(f"{broken} holds NaN or inf at iter {s.iter_num}, so no "
                            f"checkpoint was written and the last good one is kept: "
                            f"lower learning_rate or set grad_clip", everywhere=True)
    try:
        s.checkpoint = checkpoints.write(s.run_dir, state, tensors, s.raw_model, s.optimizers,
                                         s.dist, is_best)
    except (OSError, CheckpointError) as e:  # a full disk, mid-write too
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:200]
        # a sharded save fails on every process alike (DCP gathers the failures)
        raise TrainingError(f"could not write a checkpoint in {s.run_dir} ({reason}) at "
                            f"iter {s.iter_num}; {resume_hint(s)}", everywhere=sharded) from None
    s.saved_iter = s.iter_num


def resume_command(s: Session) -> str:
    """The same command resumes this run, unless it had to take another name than the
    config's."""
    flag = ("--resume" if s.run_dir.name == (s.cfg.run_name or "run")
            else f"--run-name {s.run_dir.name} --resume")
    return f"continue with the same command and {flag}"


def resume_hint(s: Session) -> str:
    """What is on disk to go on from after a failure, and how."""
    if s.saved_iter is None:
        return "no checkpoint was written yet; free space and start again"
    return f"{s.checkpoint} (iter {s.saved_iter}) is intact; {resume_command(s)}"


def train(cfg: TrainConfig, resume: bool = False) -> TrainResult:
    """Run the training loop described by cfg; returns where it wrote and how it ended."""
    t_start = time.time()
    dist = distributed.setup(use_cuda=resolve_device(cfg.device).type == "cuda")
    # from before the run folder exists: a Ctrl-C in the first seconds (while data is
    # prepared, or at the first evaluation) is answered by the loop's first step and a save
    finished = False
    try:
        with stop_signals() as stop:
            result = train_process(cfg, resume, dist, t_start, stop)
        finished = True
        return result
    finally:
        distributed.teardown(dist, finished)


def train_process(cfg: TrainConfig, resume: bool, dist: distributed.Dist,
                  t_start: float, stop: dict[str, int]) -> TrainResult:
    """The loop as each process runs it (the only one, or one of torchrun's); `stop` holds
    the signal that asks it to save and leave (see training/runs.stop_signals)."""
    device = resolve_device(cfg.device, dist.local_rank)
    with steps_in_memory(cfg, device, "setting up the model, its optimizer state and data"):
        s = setup(cfg, resume, dist)
    try:
        with quiet_writer_threads(), steps_in_memory(cfg, s.device):
            return loop(s, t_start, stop)
    except OSError as e:  # TensorBoard's events or pictures; a checkpoint's is a TrainingError
        raise TrainingError(f"could not write to {s.run_dir} ({e.strerror}) at iter "
                            f"{s.iter_num}; {resume_hint(s)}") from None
    finally:  # once more, quietly, after a failure: closed files need no second report
        for closeable in (s.writer, s.pictures):
            if closeable is not None:
                with suppress(OSError):
                    closeable.close()
        if s.folder is not None:
            s.folder.release()


def say(s: Session, message: str) -> None:
    """A line above the progress bar, from rank 0 alone."""
    if s.dist.is_main:
        tqdm.write(message)


def announce(s: Session, peak: float, peak_source: str) -> None:
    """The run's first lines: its size, where it runs, its dtype and why, MFU's yardstick."""
    dist = s.dist
    processes = (f" x {dist.world_size} process{'es' if dist.world_size > 1 else ''}"
                 if dist.enabled else "")
    say(s, f"{s.raw_model.num_params() / 1e6:.2f}M parameters, {s.cfg.tokens_per_iter:,} tokens/iter, "
           f"device {s.device}{processes}, optimizer {s.cfg.optimizer}, writing to {s.run_dir}/")
    say(s, f"dtype {str(s.dtype).removeprefix('torch.')} ({s.dtype_reason})")
    say(s, f"MFU is measured against {peak / 1e12:.3g} TFLOP/s per process ({peak_source})")


def log_point(s: Session, bar: tqdm, loss_sum: torch.Tensor, iters: int, seconds: float,
              lr_scale: float, grad_norm: torch.Tensor, peak: float) -> None:
    """The mean training loss of the last `iters` steps, the lr, the gradient norm, tokens/s
    and MFU, to TensorBoard and the bar. .item() waits for the device: only here."""
    cfg, it = s.cfg, s.iter_num
    train_loss = distributed.all_sum(loss_sum, s.dist).item() / (iters * s.dist.world_size)
    if not math.isfinite(train_loss):
        raise TrainingError(f"training loss became {train_loss} at iter {it}; the last good "
                            f"checkpoint is kept: lower learning_rate or set grad_clip")
    tokens_per_iter = cfg.tokens_per_iter
    tokens_per_sec = iters * tokens_per_iter / seconds
    flops = s.raw_model.flops_per_token(s.raw_model.config.block_size) * tokens_per_iter * iters
    mfu = flops / seconds / (peak * s.dist.world_size)
    if s.writer is not None:
        for tag, value in (("train/loss_step", train_loss),
                           ("train/lr", cfg.learning_rate * lr_scale),
                           ("train/grad_norm", grad_norm.item()),
                           ("perf/tokens_per_sec", tokens_per_sec), ("perf/mfu", mfu)):
            s.writer.add_scalar(tag, value, it)
    bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{mfu:.0%}")


def evaluate_and_say(s: Session) -> dict[str, float]:
    """Losses at this step, logged and printed."""
    losses = evaluate(s, s.iter_num)
    say(s, f"iter {s.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    return losses


def evaluate_and_save(s: Session) -> dict[str, float]:
    """Losses at this step, logged and printed; last.pt written, and best.pt if they are the
    best yet."""
    losses = evaluate_and_say(s)
    is_best = losses["val"] < s.best_val_loss
    s.best_val_loss = min(s.best_val_loss, losses["val"])
    save(s, losses, is_best)
    return losses


def stop_asked(s: Session, stop: dict[str, int]) -> bool:
    """Whether SIGINT or SIGTERM asked this run to save and leave. Processes must agree on
    when to leave; under DDP they compare notes only at log points, where the loop waits for
    the device anyway, never on every step."""
    if not s.dist.enabled:
        return bool(stop)
    at_log_point = s.iter_num % s.cfg.log_interval == 0
    return at_log_point and distributed.any_true(bool(stop), s.dist, s.device)


def loop(s: Session, t_start: float, stop: dict[str, int]) -> TrainResult:
    """Evaluate, step, log, evaluate and save, until max_iters or a signal."""
    cfg = s.cfg
    peak, peak_source = peak_flops(s.device, s.dtype)
    announce(s, peak, peak_source)
    losses = evaluate_and_say(s) if s.iter_num == 0 else {}
    x, y = s.batches.next()
    # disable=None: a live bar on a terminal, no carriage-return noise in logs and pipes
    bar = tqdm(total=cfg.max_iters, initial=s.iter_num, unit="it", dynamic_ncols=True,
               disable=None if s.dist.is_main else True)
    t_log, iters_since_log = time.perf_counter(), 0
    loss_sum = torch.zeros((), device=s.device)
    try:
        while s.iter_num < cfg.max_iters:
            lr_scale = lr_multiplier(s.iter_num, cfg)
            set_lr(s.optimizers, lr_scale)
            step_loss, grad_norm, (x, y) = train_step(s, x, y)
            loss_sum += step_loss
            s.iter_num += 1
            iters_since_log += 1
            bar.update(1)
            it = s.iter_num
            if it % cfg.log_interval == 0 or it == cfg.max_iters:
                log_point(s, bar, loss_sum, iters_since_log, time.perf_counter() - t_log,
                          lr_scale, grad_norm, peak)
                t_log, iters_since_log = time.perf_counter(), 0
                loss_sum = torch.zeros_like(loss_sum)
            evaluated = it % cfg.eval_interval == 0 or it == cfg.max_iters
            if evaluated:
                losses = evaluate_and_save(s)
                t_log = time.perf_counter()  # evaluation time is not training throughput
            if stop_asked(s, stop):  # this step is done: save it and leave
                # an earlier evaluation's val loss is not this state's: NaN says unmeasured
                save(s, losses if evaluated else {}, is_best=False)
                signum = stop.get("signal", signal.SIGTERM)
                raise Interrupted(f"stopped by {signal.Signals(signum).name} at iter {it}; "
                                  f"saved {s.checkpoint}; {resume_command(s)}",
                                  signum)
        if s.writer is not None:
            s.writer.add_hparams(cfg.to_dict(), {"hparam/best_val_loss": s.best_val_loss},
                                 run_name=".", global_step=s.iter_num)
            s.writer.close()  # its last writes can fail too: here, where they are reported
    finally:
        bar.close()
    return TrainResult(s.run_dir, s.iter_num, s.best_val_loss, losses, time.time() - t_start,
                       s.checkpoint, bool(s.meta.get("chat")))

