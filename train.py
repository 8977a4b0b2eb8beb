"""Train a GPT on a prepared corpus, with TensorBoard logs, evaluation and checkpoints.

Usage:
    python train.py config/quickstart.toml                   # char-level Shakespeare, on a CPU
    python train.py config/quickstart.toml --max-iters 500 --n-layer 2
    python train.py config/quickstart.toml --resume          # continue runs/quickstart
    torchrun --standalone --nproc_per_node=2 train.py config/quickstart.toml
    tensorboard --logdir runs

    from train import train, load_config     # from Python: a TrainConfig in, a TrainResult out
    result = train(load_config("config/tiny.toml", {"max_iters": 100}))

train() reads in nanoGPT's order: the device, the data, the model and its optimizers, then
the loop, where each part of a step is a line or one call away. What a plain run does not
use is imported where it is needed. A run writes runs/<run_name>/: TensorBoard events,
last.pt at every evaluation, best.pt at the best. docs/layout.md follows one step through.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.loader import BatchStream, Sampler, Tokens, batch_sampler, load_dataset
from data.sources import BUILTIN
from data.tokenizer import Tokenizer
from machine.device import check_compile, resolve_device, reuse_freed_memory
from machine.errors import reported, run_command
from machine.perf import peak_flops
from machine.threads import fit_threads
from model import GPT, GPTConfig
from training import distributed
from training.checkpoints import save, snapshot
from training.config import ConfigError, TrainConfig, command_line, load_config
from training.log import RunLog
from training.memory import check_memory, out_of_memory
from training.optimizer import configure_optimizers
from training.precision import choose_dtype
from training.runs import (
    Interrupted,
    Run,
    TrainingError,
    check_resumable_folder,
    run_dir_of,
    run_folder,
    stop_signals,
)


@dataclass
class TrainResult:
    run_dir: Path
    iter_num: int
    best_val_loss: float
    final_losses: dict[str, float]
    wall_time: float
    checkpoint: Path | None  # last.pt, or last.dcp under FSDP; None if no checkpoint was saved
    chat: bool = False  # whether it trained on conversations, to talk to with sample.py --chat


def train(cfg: TrainConfig, resume: bool = False) -> TrainResult:
    """Train the model cfg describes on its data; with resume, go on from the run folder's
    last checkpoint. Under torchrun every process runs this."""
    t_start = time.time()
    with ExitStack() as stack:  # each context entered below closes when the run ends, however it ends
        dist = stack.enter_context(distributed.process_group(cfg.device))  # one process: rank 0 of 1
        # signals are caught from the start, so that a Ctrl-C pressed while the data is prepared
        # is answered after the first step, with a checkpoint
        stop = stack.enter_context(stop_signals())
        device, sharded = choose_device(cfg, dist)
        torch.manual_seed(cfg.seed)  # for the initial weights; the batches have a generator of their own
        if device.type == "cpu" and not dist.enabled:  # where it was measured to pay (docs/performance.md)
            reuse_freed_memory()  # glibc keeps freed memory for the next step's activations
        if resume:  # a run to continue must exist, which is checked before the data is read
            check_resumable_folder(run_dir_of(cfg))

        # --- the data, and the run folder that the log and the checkpoints go to ----------
        meta, splits, tokenizer = load_data(cfg, dist)
        sample_ids = setting_ids("sample_prompt", cfg.sample_prompt, tokenizer) if cfg.sample_tokens else []
        probe_ids = (setting_ids("attention_probe", cfg.attention_probe, tokenizer)
                     if cfg.attention_probe else splits["val"][:32].tolist())
        run, log = stack.enter_context(open_run(cfg, resume, dist, device, meta, tokenizer, probe_ids,
                                                sharded))

        # --- the model and its optimizers: new, or as the checkpoint left them -----------
        saved = checkpoint = None
        if resume:  # resuming's code is imported only by a run that resumes
            from training.resume import check_resumable, read_saved, restore
            saved, checkpoint = read_saved(run.path, device, mmap=sharded)
        dtype, dtype_reason = choose_dtype(cfg.dtype, device, saved, sharded)
        raw_model = build_model(cfg, meta, device, dtype, dist, sharded, saved)
        run.check_room(raw_model, dist)
        # Muon on the blocks' matrices: Nesterov momentum, made orthogonal (every direction moves
        # at the same rate), at muon_lr; AdamW on the rest (the head; the lookup tables at embedding_lr)
        optimizers = configure_optimizers(raw_model, cfg, device, dtype)
        # float16 alone scales its loss up, because its small gradients would round to zero; for
        # every other dtype the scaler is disabled, and each of its calls does nothing
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        # each split's sampler draws batch_size random starts s and returns x = data[s:s+T] and
        # y = data[s+1:s+T+1], where T is the model's block_size (for a fine-tuned base, the
        # base's own); the stream below draws with a seeded generator of its own
        samplers = {split: batch_sampler(data, meta, raw_model.config.block_size, cfg.batch_size,
                                         log.say) for split, data in splits.items()}
        batches = BatchStream(samplers["train"], cfg.seed, dist.rank, dist.world_size)
        iter_num, best_val_loss = 0, math.inf
        if saved is not None:
            check_resumable(saved, raw_model, meta, cfg, checkpoint)
            iter_num, best_val_loss = restore(saved, checkpoint, raw_model, optimizers, scaler,
                                              batches, device)
            run.saved(checkpoint, iter_num)
            del saved  # its tensors are copied into the model and optimizers, so free them
        model = for_training(raw_model, cfg, device, dist, sharded)  # compiled, or wrapped for torchrun
        # FSDP on a GPU gathers the weights in bf16 (its mixed precision), so no autocast there
        autocast = (nullcontext() if dtype == torch.float32 or (sharded and device.type == "cuda")
                    else torch.autocast(device.type, dtype=dtype))
        log.start(iter_num, raw_model.config)
        tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * raw_model.config.block_size
        # on a CPU, the thread count whose steps are fastest, measured as the run goes, because
        # another process on the machine can make fewer threads faster than all of them
        threads = stack.enter_context(fit_threads(cfg.threads, device, log.say))
        peak, peak_source = peak_flops(device, dtype)  # for the thread count that the run starts with
        processes = f" x {dist.world_size} process{'es' * (dist.world_size > 1)}" if dist.enabled else ""
        log.say(f"{raw_model.num_params() / 1e6:.2f}M parameters, {tokens_per_iter:,} tokens/iter, "
                f"device {device}{processes}, optimizer {cfg.optimizer}, writing to {run.path}/")
        log.say(f"dtype {str(dtype).removeprefix('torch.')} ({dtype_reason})")
        log.say(f"MFU is measured against {peak / 1e12:.3g} TFLOP/s per process ({peak_source})")
        if iter_num >= cfg.max_iters:
            log.say(f"{checkpoint} is at iter {iter_num}, which is max_iters: nothing left to "
                    f"train; raise --max-iters to train it further")

        def evaluate(it: int) -> dict[str, float]:
            """Log and return both splits' losses, then log a sample and the attention pictures."""
            raw_model.eval()  # no dropout while measuring or sampling
            # uncompiled, so that a compiled run compiles one graph, not a second one at its first evaluation
            losses = estimate_loss(raw_model, samplers, cfg, device, autocast, dist)
            log.losses(it, losses)  # "iter 100: train loss 1.8754, val loss 1.9436"
            if not math.isfinite(losses["val"]):
                raise TrainingError(f"val loss is {losses['val']} at iter {it}; the last good "
                                    f"checkpoint is kept: lower learning_rate or set grad_clip")
            log.pictures(it, sample(raw_model, sample_ids, tokenizer, cfg, device, autocast, dist),
                         raw_model)
            raw_model.train()
            return losses

        # --- the loop ---------------------------------------------------------------------
        losses: dict[str, float] = {}  # the last evaluation's
        accum_steps = cfg.gradient_accumulation_steps // dist.world_size  # this process's share
        t_log, iters_since_log = time.perf_counter(), 0
        loss_sum = torch.zeros((), device=device)  # each step's mean loss, summed until a log point
        # the first forward pass's batch: (B, T) windows at random places in the train split, and
        # y is x shifted by one token; each forward pass below draws the batch of the next
        x, y = batches.next()
        while iter_num < cfg.max_iters:
            t_step = time.perf_counter()  # the step alone, without the evaluation after it
            lr_scale = get_lr_scale(iter_num, cfg)  # warmup, then cosine decay
            for opt in optimizers:  # peak_lr, from configure_optimizers: muon_lr, embedding_lr, learning_rate
                for group in opt.param_groups:
                    group["lr"] = group["peak_lr"] * lr_scale
            for micro_step in range(accum_steps):
                if dist.enabled:  # the processes reduce their gradients after the last one only
                    distributed.sync_gradients(model, now=micro_step == accum_steps - 1)
                with autocast:
                    _, loss = model(to_device(x, device), to_device(y, device))
                loss = loss / accum_steps  # so that the summed gradients are those of the step's mean loss
                # the next forward pass's batch, drawn before this backward pass (as in nanoGPT), so
                # that the CPU reads it while a GPU still computes
                x, y = batches.next()
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
            grad_norm = clip_and_step(optimizers, raw_model, cfg.grad_clip, scaler)
            iter_num += 1
            iters_since_log += 1
            log.step()  # the progress bar moves on
            threads.step(time.perf_counter() - t_step)  # from which the thread count is chosen

            if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
                # .item() waits for the device, so it is called only here, every log_interval steps
                train_loss = (distributed.all_sum(loss_sum, dist).item()  # summed over processes
                              / (iters_since_log * dist.world_size))
                if not math.isfinite(train_loss):
                    raise TrainingError(f"training loss became {train_loss} at iter {iter_num}; "
                                        f"the last good checkpoint is kept: lower learning_rate "
                                        f"or set grad_clip")
                tokens_per_sec = iters_since_log * tokens_per_iter / (time.perf_counter() - t_log)
                mfu = raw_model.flops_per_token() * tokens_per_sec / (peak * dist.world_size)
                # TensorBoard and the terminal get what log.point lists; the lr is learning_rate's (the
                # other groups follow the same schedule), and whole() gathers FSDP's grad norm
                log.point(iter_num, train_loss, cfg.learning_rate * lr_scale,
                          distributed.whole(grad_norm).item(), tokens_per_sec, mfu)
                t_log, iters_since_log = time.perf_counter(), 0
                loss_sum = torch.zeros_like(loss_sum)

            paused = time.perf_counter()  # evaluating and saving do not count as training time
            evaluated = iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters
            is_best = False
            if evaluated:
                losses = evaluate(iter_num)
                is_best = losses["val"] < best_val_loss
                best_val_loss = min(best_val_loss, losses["val"])
            # whether Ctrl-C, SIGTERM or SIGHUP asked to stop (under torchrun the processes
            # agree on it only at log points)
            stopping = stop.asked(dist, device, at_log_point=iter_num % cfg.log_interval == 0)
            if evaluated or stopping:  # a save without an evaluation records its val loss as NaN
                # writes last.pt (and best.pt, when this is the best val loss so far), which holds the
                # weights, the optimizers and the random generators, to resume to the bit. The next
                # step's batch is drawn already; the checkpoint holds the batch generator's state from
                # just before that draw, so a resumed run draws the same batch again
                state = snapshot(raw_model, optimizers, scaler, batches, iter_num, dtype,
                                 best_val_loss, losses["val"] if evaluated else math.nan,
                                 cfg.to_dict(), meta["tokenizer"], device)
                save(run, state, raw_model, optimizers, dist, is_best)  # FSDP's processes save their shards
            t_log += time.perf_counter() - paused
            if stopping:
                raise Interrupted(f"stopped by {signal.Signals(stop.signal).name} at iter "
                                  f"{iter_num}; saved {run.checkpoint}; continue with the "
                                  f"same command and {run.resume_flags}", stop.signal)
        log.finish(best_val_loss, iter_num)
    return TrainResult(run.path, iter_num, best_val_loss, losses, time.time() - t_start,
                       run.checkpoint, bool(meta.get("chat")))


def clip_and_step(optimizers: list[torch.optim.Optimizer], model: GPT, grad_clip: float,
                  scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Clip the gradients, take each optimizer's step and clear the gradients; return their norm
    before clipping. Clipping multiplies every gradient by one factor, so that their norm is at
    most grad_clip (0 clips at inf, which only measures it). Muon's orthogonalized update has the
    same size whatever the factor, but its momentum, from which that update is made, counts a
    clipped step less. Under float16, the scaler first divides its scale out of the gradients,
    and it skips the step where a gradient is inf or NaN; otherwise it is disabled, so that
    scaler.step(opt) is opt.step() and its other calls do nothing."""
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    for opt in optimizers:
        scaler.step(opt)
        opt.zero_grad(set_to_none=True)
    scaler.update()  # a smaller scale after an inf or NaN, a larger one after a run of good steps
    return grad_norm


def get_lr_scale(it: int, cfg: TrainConfig) -> float:
    """The multiplier of every group's peak lr at step `it`: a linear rise over the first
    warmup_iters steps, then a cosine from 1 down to min_lr / learning_rate at lr_decay_iters
    (0 means max_iters), the same fraction for every group."""
    if not cfg.decay_lr:
        return 1.0
    if it < cfg.warmup_iters:
        return (it + 1) / (cfg.warmup_iters + 1)
    floor = cfg.min_lr / cfg.learning_rate if cfg.learning_rate > 0 else 1.0
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return floor
    progress = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)  # 1 -> floor


def choose_device(cfg: TrainConfig, dist: distributed.Dist) -> tuple[torch.device, bool]:
    """This process's device, and whether FSDP shards the model. A compiler or a parallel
    setting that cannot work here is refused now, before anything is written."""
    device = resolve_device(cfg.device, dist.local_rank)  # auto: CUDA, else MPS, else the CPU
    sharded = distributed.check_parallel(cfg, dist)
    if cfg.compile:
        check_compile(device, instead="drop --compile")
    if device.type == "cuda":  # TF32 tensor cores for fp32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, sharded


def load_data(cfg: TrainConfig, dist: distributed.Dist,
              ) -> tuple[dict, dict[str, Tokens], Tokenizer]:
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
def open_run(cfg: TrainConfig, resume: bool, dist: distributed.Dist, device: torch.device, meta: dict,
             tokenizer: Tokenizer, probe_ids: list[int], sharded: bool) -> Iterator[tuple[Run, RunLog]]:
    """The run folder (new, or the one to resume) and its log, opened once the model's memory is
    known to fit; inside, running out of memory is one line that says what to lower."""
    check_memory(cfg, meta["vocab_size"], device, dist)
    with run_folder(cfg, resume, dist) as run, out_of_memory(cfg, device, dist), \
            RunLog(run, cfg, dist, tokenizer, probe_ids, attention=cfg.log_attention and not sharded) as log:
        yield run, log


def build_model(cfg: TrainConfig, meta: dict, device: torch.device, dtype: torch.dtype,
                dist: distributed.Dist, sharded: bool, saved: Any) -> GPT:
    """A new model of the config's shape, or the base model to fine-tune (init_from), on the
    device, sharded under parallel = fsdp. A resumed fine-tuning has the checkpoint's shape,
    and its weights replace the base's, which is then not read at all."""
    config, base = cfg.model_config(meta["vocab_size"]), None
    if cfg.init_from and saved is not None:
        config = GPTConfig(**saved.model_args)
    elif cfg.init_from:
        from training.init_from import base_model  # a Hugging Face folder, a run ...
        config, base = base_model(cfg, meta, dist)
    if sharded:
        from training.fsdp import shard_model
        param_dtype = dtype if device.type == "cuda" and dtype != torch.float32 else None
        return shard_model(config, device, param_dtype, cfg.compile, base)
    if base is not None:
        from weights.lazy import build
        return build(config, base).to(device)
    return GPT(config).to(device)


def for_training(model: GPT, cfg: TrainConfig, device: torch.device, dist: distributed.Dist,
                 sharded: bool) -> torch.nn.Module:
    """What the loop calls: the model compiled if cfg.compile (FSDP compiled each block before
    sharding it), and under torchrun wrapped by DDP, unless FSDP shards it."""
    if cfg.compile and not sharded:
        # On one GPU, each compiled pass is replayed as a CUDA graph, because launching its many
        # kernels one at a time from Python would hold a small model back. Graphs are not used
        # with gradient accumulation, because the next replay would overwrite the gradients that
        # are still accumulating, nor under torchrun, which reduces gradients during the backward.
        graphs = device.type == "cuda" and cfg.gradient_accumulation_steps == 1 and not dist.enabled
        model = torch.compile(model, mode="reduce-overhead" if graphs else None)
    if dist.enabled and not sharded:  # DDP's wrapper, imported only under torchrun
        from training.torchrun import ddp
        model = ddp(model, device)
    return model


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, samplers: dict[str, Sampler], cfg: TrainConfig,
                  device: torch.device, autocast: Any,
                  dist: distributed.Dist | None = None) -> dict[str, float]:
    """The mean loss over the same eval_iters batches of each split at every evaluation (call it in
    eval mode), so that the curve shows how the model changes; under torchrun the processes share them."""
    dist = dist or distributed.Dist()
    out = {}
    for split, draw in samplers.items():
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        batches = [draw(generator) for _ in range(cfg.eval_iters)]
        total = torch.zeros((), device=device)
        for x, y in batches[dist.rank::dist.world_size]:
            with autocast:
                _, loss = model(to_device(x, device), to_device(y, device))
            total += loss.float()
        if distributed.is_sharded(model):
            from training.fsdp import forward_as_often_as_the_others
            forward_as_often_as_the_others(batches, dist, lambda x, y: model(
                to_device(x, device), to_device(y, device)), autocast)
        out[split] = distributed.all_sum(total, dist).item() / cfg.eval_iters
    return out


def sample(model: GPT, ids: list[int], tokenizer: Tokenizer, cfg: TrainConfig,
           device: torch.device, autocast: Any, dist: distributed.Dist) -> str | None:
    """An evaluation's text sample, from sample_prompt with the same seed every time, or
    None where nothing is sampled. A sharded model samples on every process (its forward is
    a collective), in eager steps (the C step reads whole weights); rank 0 keeps the text."""
    fsdp = distributed.is_sharded(model)
    if not cfg.sample_tokens or not (dist.is_main or fsdp):
        return None
    from generate import generate
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    # a CPU samples in the weights' fp32, with the C step, which ignores autocast
    with autocast if device.type != "cpu" else nullcontext():
        out = generate(model, prompt, cfg.sample_tokens, generator=generator,
                       decode="eager" if fsdp else "auto")
    return tokenizer.decode(out[0].tolist()) if dist.is_main else None


def main(config: Path | None, overrides: dict[str, Any], resume: bool, debug: bool) -> None:
    """Train a GPT. Settings: TrainConfig's defaults < the CONFIG file < options."""
    rank = distributed.environment().rank  # under torchrun, rank 0 reports
    try:
        with reported(debug=debug, rank=rank):
            cfg = load_config(config, overrides)
            if not cfg.run_name:
                cfg.run_name = config.stem if config else "run"
            result = train(cfg, resume)
    except KeyboardInterrupt:  # a second Ctrl-C, which stops at once (training/runs.py)
        if rank == 0:
            print("interrupted: stopped at once by a second Ctrl-C; the last checkpoint, if "
                  "any, is intact", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    if rank == 0:
        sharded = result.checkpoint is not None and result.checkpoint.suffix == ".dcp"
        ext, plain = (".dcp", f"python export.py {result.run_dir} --plain, then ") if sharded else (".pt", "")
        print(f"done: {result.iter_num} iters in {result.wall_time:.0f}s, "
              f"best val loss {result.best_val_loss:.4f}\n"
              f"checkpoints: {result.run_dir}/best{ext}, {result.run_dir}/last{ext}\n"
              f"next: {plain}python sample.py --run {result.run_dir}"
              f"{' --chat' if result.chat else ''}   |   "
              f"tensorboard --logdir {result.run_dir.parent}")


if __name__ == "__main__":
    run_command(command_line(main))
