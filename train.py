"""Train a GPT on a prepared corpus, with TensorBoard logs, evaluation and checkpoints.

Usage:
    python train.py config/quickstart.toml --max-iters 500   # char-level Shakespeare, on a CPU
    python train.py config/quickstart.toml --resume          # continue runs/quickstart
    torchrun --standalone --nproc_per_node=2 train.py config/quickstart.toml

    from train import train, load_config     # from Python: a TrainConfig in, a TrainResult out
    result = train(load_config("config/tiny.toml", {"max_iters": 100}))

train() reads in nanoGPT's order: the device, the data, the run folder and the model (each a
step of training/setup.py), the optimizers, then the loop. A step computes with the device, the
batches, the model, its dtype and the optimizers; the rest (stop, run, log, checkpoints and
thread_fit) keeps the run stoppable, logged and resumable. A run writes runs/<run_name>/.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from data.batches import BatchStream, Sampler, batch_sampler
from machine.errors import reported, run_command
from machine.threads import fit_threads
from model import GPT
from training import distributed
from training.checkpoints import Checkpoints
from training.config import TrainConfig, command_line, load_config
from training.optimizer import configure_optimizers
from training.precision import autocast_for, choose_dtype
from training.runs import Interrupted, TrainingError, TrainResult, check_resumable_folder, stop_signals
from training.setup import build_model, choose_device, for_training, load_data, open_run


def train(cfg: TrainConfig, resume: bool = False) -> TrainResult:
    """Train the model cfg describes on its data; with resume, go on from the run folder's last
    checkpoint. Under torchrun every process runs this; in a plain run the calls into
    training/distributed.py return at once, and the loop skips syncing the gradients."""
    t_start = time.time()
    with ExitStack() as stack:  # it closes the contexts entered below, however the run ends
        # --- where the run computes -----------------------------------------------------
        dist = stack.enter_context(distributed.process_group(cfg))  # a plain run is rank 0 of 1
        stop = stack.enter_context(stop_signals())  # Ctrl-C, SIGTERM or SIGHUP: save, then stop
        device = choose_device(cfg, dist)
        torch.manual_seed(cfg.seed)  # init_weights seeds its own generator with it; dropout uses it
        if resume:  # before the data is read
            check_resumable_folder(cfg)

        # --- the data, and the run folder that the log and the checkpoints go to --------
        meta, splits, tokenizer = load_data(cfg, dist)
        # the log needs the tokenizer for its samples, and val's first tokens for attention maps
        run, log = stack.enter_context(open_run(cfg, resume, meta, tokenizer, splits["val"],
                                                dist=dist, device=device))

        # --- the model, and the dtype it computes in ------------------------------------
        saved = None  # a resumed run's state: weights, moments, iteration, random streams
        if resume:
            from training.resume import read_saved  # imported only by a run that resumes
            checkpoint, saved = read_saved(run.path, device, mmap=dist.sharded)
            run.record_checkpoint(checkpoint, saved.iter_num)  # so that an error names it
        # auto: bf16 where the CPU or the GPU multiplies it natively, else fp32
        dtype, dtype_reason = choose_dtype(cfg.dtype, device, saved, dist.sharded)
        autocast = autocast_for(dtype, device, dist.sharded)  # in fp32, a context that does nothing
        # float16 alone needs its loss scaled up, lest small gradients round to zero (bf16 has
        # fp32's range); as in nanoGPT, a disabled scaler's calls below pass straight through
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        # for a new run, GPT(cfg.model_config(vocab_size)).to(device)
        raw_model: GPT = build_model(cfg, meta, saved, device=device, dtype=dtype, dist=dist)
        run.check_room(raw_model, dist)  # room on disk for last.pt, best.pt and the next last.pt

        # --- the optimizers and the batches, then a resumed run's state put back --------
        # [AdamW] or [AdamW, Muon]; in the quickstart, Muon takes the blocks' matrices (lr 0.05),
        # and AdamW lm_head (5e-3, decayed) and the tables wte and wtb (0.1, not decayed)
        optimizers = configure_optimizers(raw_model, cfg, device, dtype)
        # samplers[split](generator) draws x = data[s:s+T] and y = data[s+1:s+T+1], (batch_size, T)
        # each, from random starts s, where T is block_size; chat data gives conversations instead
        samplers = {split: batch_sampler(data, meta, raw_model.config.block_size, cfg.batch_size,
                                         say=log.say) for split, data in splits.items()}
        # one seeded stream of training batches, which a checkpoint saves its place in
        batches = BatchStream(samplers["train"], cfg.seed, dist.rank, dist.world_size)
        checkpoints = Checkpoints(run, raw_model, optimizers, scaler, batches, cfg=cfg, meta=meta,
                                  dtype=dtype, device=device, dist=dist)
        iter_num, best_val_loss = 0, math.inf
        if saved is not None:
            iter_num, best_val_loss = checkpoints.restore(saved)
            del saved  # its tensors are copied into the model and optimizers, so free them
        model = for_training(raw_model, cfg, device=device, dist=dist)  # compiled, or in DDP

        # --- the loop -------------------------------------------------------------------
        thread_fit = stack.enter_context(fit_threads(cfg.threads, device, log.say))
        log.start(iter_num, raw_model, device, dtype, dtype_reason)
        losses: dict[str, float] = {}  # both splits' losses at the last evaluation
        accum_steps = cfg.gradient_accumulation_steps // dist.world_size  # this process's share
        # the micro-batches' losses, summed on the device, so that no step waits to read one
        loss_sum, steps_since_log = torch.zeros((), device=device), 0
        x, y = to_device(batches.next(), device)  # the first micro-batch (or a resumed run's next)
        while iter_num < cfg.max_iters:
            t_step = time.perf_counter()  # the step alone, without the evaluation after it
            lr_scale = get_lr_scale(iter_num, cfg)  # warmup, then cosine decay
            for opt in optimizers:  # configure_optimizers gave each group its peak_lr
                for group in opt.param_groups:
                    group["lr"] = group["peak_lr"] * lr_scale
            for micro_step in range(accum_steps):
                if dist.enabled:  # DDP reduces the gradients after the last micro-step only
                    distributed.sync_gradients(model, now=micro_step == accum_steps - 1)
                with autocast:
                    _, loss = model(x, y)
                loss_sum += loss.detach()
                loss = loss / accum_steps  # so that the gradients sum to those of the mean loss
                # the next batch, drawn while a GPU still runs this forward pass (as in nanoGPT)
                x, y = to_device(batches.next(), device)
                scaler.scale(loss).backward()
            for opt in optimizers:  # float16's gradients back to their true size, to be clipped
                scaler.unscale_(opt)
            # over every parameter, Muon's too: orthogonalizing discards the size of Muon's update,
            # but its momentum sums the clipped gradients; grad_clip 0 clips nothing
            max_norm = cfg.grad_clip or math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), max_norm)
            for opt in optimizers:
                scaler.step(opt)  # opt.step(), unless float16's gradients hold an inf or NaN
                opt.zero_grad(set_to_none=True)
            scaler.update()  # the scale: halved on an inf or NaN, doubled after 2,000 clean steps
            iter_num += 1
            steps_since_log += 1
            log.step()
            thread_fit.step(time.perf_counter() - t_step)  # may move torch to a faster thread count

            at_log_point = iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters
            if at_log_point:
                # the mean over every micro-batch since the last point (nanoGPT logs the last one),
                # every process's under torchrun; .item() waits for the device, so only here
                loss_sum = distributed.all_sum(loss_sum, dist)
                train_loss = loss_sum.item() / (steps_since_log * accum_steps * dist.world_size)
                if not math.isfinite(train_loss):
                    raise TrainingError.diverged(f"training loss became {train_loss} "
                                                 f"at iter {iter_num}")
                lrs = {group["logged_as"]: group["lr"]  # groups of one name share one lr
                       for opt in optimizers for group in opt.param_groups}
                log.point(iter_num, steps_since_log, train_loss, lrs, grad_norm)
                loss_sum, steps_since_log = torch.zeros_like(loss_sum), 0

            # unlike nanoGPT, no evaluation before the first step
            eval_now = iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters
            if eval_now:
                with log.paused():  # evaluating and saving do not count toward tokens/s
                    # raw_model, because a compiled one would compile again for eval mode
                    losses = estimate_loss(raw_model, samplers, cfg, device, autocast, dist)
                    log.losses(iter_num, losses)  # "iter 80: train loss 1.9020, val loss 1.9310"
                    if not math.isfinite(losses["val"]):
                        raise TrainingError.diverged(f"val loss is {losses['val']} "
                                                     f"at iter {iter_num}")
                    log.samples(iter_num, raw_model, device, autocast)  # text, attention maps
                    is_best = losses["val"] < best_val_loss
                    best_val_loss = min(best_val_loss, losses["val"])
                    # last.pt, which --resume continues, and best.pt when this val loss is the best
                    checkpoints.save(iter_num, best_val_loss, losses["val"], is_best=is_best)
            # whether a stop signal came (under torchrun, the processes agree at log points)
            if stop.asked(dist, device, at_log_point=at_log_point):
                if not eval_now:  # a save between evaluations, which has no val loss
                    checkpoints.save(iter_num, best_val_loss, math.nan, is_best=False)
                raise Interrupted(f"stopped by {signal.Signals(stop.signal).name} at iter "
                                  f"{iter_num}; saved {run.checkpoint}; continue with the "
                                  f"same command and {run.resume_flags}", stop.signal)
        log.finish(best_val_loss, iter_num)
    return TrainResult(run_dir=run.path, iter_num=iter_num, best_val_loss=best_val_loss,
                       final_losses=losses, wall_time=time.time() - t_start,
                       checkpoint=run.checkpoint, chat=bool(meta.get("chat")))


def get_lr_scale(it: int, cfg: TrainConfig) -> float:
    """The multiplier of every group's peak lr at step `it`: a linear rise over the first
    warmup_iters steps, then a cosine from 1 down to min_lr / learning_rate at lr_decay_iters
    (0 means max_iters), the same fraction for every group. Without decay_lr, 1 throughout."""
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:  # as in nanoGPT: 1/(w+1), 2/(w+1), ... for w = warmup_iters steps
        return (it + 1) / (cfg.warmup_iters + 1)
    # the config refuses min_lr > learning_rate, so the floor is at most 1
    floor = cfg.min_lr / cfg.learning_rate if cfg.learning_rate > 0 else 0.0
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return floor
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)


def to_device(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    if device.type == "cuda":  # from pinned memory, the copy to the GPU does not block the CPU
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)
    return tuple(t.to(device) for t in batch)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, samplers: dict[str, Sampler], cfg: TrainConfig,
                  device: torch.device, autocast: Any, dist: distributed.Dist) -> dict[str, float]:
    """The mean loss in eval mode over eval_iters batches of each split, the same ones at every
    evaluation, so that the curve shows the model change; under torchrun, processes share them."""
    model.eval()
    out = {}
    for split, draw in samplers.items():
        generator = torch.Generator().manual_seed(cfg.seed + 1)  # not the training stream's seed
        batches = [draw(generator) for _ in range(cfg.eval_iters)]
        total = torch.zeros((), device=device)
        for batch in batches[dist.rank::dist.world_size]:
            x, y = to_device(batch, device)
            with autocast:
                _, loss = model(x, y)
            total += loss
        if distributed.is_sharded(model):  # FSDP's processes must run equally many forwards
            from training.fsdp import forward_as_often_as_the_others
            forward_as_often_as_the_others(model, batches, dist, device, autocast)
        out[split] = distributed.all_sum(total, dist).item() / cfg.eval_iters
    model.train()
    return out


def main(config: Path | None, overrides: dict[str, Any], resume: bool, debug: bool) -> None:
    """Train a GPT. Settings: TrainConfig's defaults < the CONFIG file < options."""
    rank = distributed.environment().rank  # under torchrun, rank 0 reports
    with reported(debug=debug, rank=rank):
        cfg = load_config(config, overrides)
        cfg.run_name = cfg.run_name or (config.stem if config else "run")  # the folder's name
        result = train(cfg, resume)
    if rank == 0:
        print(result.report())


if __name__ == "__main__":
    run_command(command_line(main))  # an option per TrainConfig field; bad input: a one-line error
