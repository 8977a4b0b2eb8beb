"""What a run shows while it trains (rank 0 alone): TensorBoard's scalars, text samples and
attention pictures, and a progress bar on a terminal, or else a plain line per log point.

Usage:
    from training.log import RunLog
    with RunLog(run, cfg, dist, tokenizer, sample_ids, probe_ids, attention=True) as log:
        log.start(iter_num, model, device, dtype, dtype_reason)  # events, the bar
        log.step()                                     # after every step
        log.point(it, steps, loss, lrs, grad_norm)     # every log_interval steps, with tokens/s and MFU
        with log.paused(): ...                         # time that tokens/s leaves out
        log.losses(it, losses); log.samples(it, model, device, autocast)   # at an evaluation
        log.finish(best_val_loss, it)

A failed write (a full disk) ends the run with one line: the intact checkpoint, and how to resume.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from data.tokenizer import Tokenizer
from machine.files import quiet_writer_threads
from machine.perf import peak_flops
from model import GPT
from training.config import TrainConfig
from training.distributed import Dist, is_sharded, whole
from training.runs import Run, TrainingError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class RunLog:
    def __init__(self, run: Run, cfg: TrainConfig, dist: Dist, tokenizer: Tokenizer,
                 sample_ids: list[int], probe_ids: list[int], attention: bool) -> None:
        self.run, self.cfg, self.dist, self.is_main, self.tokenizer = run, cfg, dist, dist.is_main, tokenizer
        self.sample_ids, self.probe_ids, self.attention = sample_ids, probe_ids, attention
        self.writer: SummaryWriter | None = None
        self.layer_pictures = None  # made at the first evaluation
        self.bar: tqdm | None = None
        self.quiet = quiet_writer_threads()

    def start(self, iter_num: int, model: GPT, device: torch.device, dtype: torch.dtype,
              dtype_reason: str) -> None:
        """Say what the run trains and how, and the peak FLOP/s that MFU is measured against; open its
        events (dropping a resumed run's after its checkpoint) and its progress bar at iter_num."""
        n, cfg = self.dist.world_size, self.cfg
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * model.config.block_size
        processes = f" x {n} process{'es' * (n > 1)}" if self.dist.enabled else ""
        self.say(f"{model.num_params() / 1e6:.2f}M parameters (embeddings aside), {self.tokens_per_iter:,} "
                 f"tokens/iter, device {device}{processes}, optimizer {self.cfg.optimizer}, "
                 f"writing to {self.run.path}/")
        self.say(f"dtype {str(dtype).removeprefix('torch.')} ({dtype_reason})")
        peak, peak_source = peak_flops(device, dtype)  # at the thread count the run starts with
        self.say(f"MFU is measured against {peak / 1e12:.3g} TFLOP/s per process ({peak_source})")
        self.flops_per_token, self.peak = model.flops_per_token(), peak * n  # for MFU
        self.t_point = time.perf_counter()
        self.probe_ids = self.probe_ids[-model.config.block_size:]
        self.start_iter, self.iter_num, self.t_start = iter_num, iter_num, time.perf_counter()
        if iter_num >= self.cfg.max_iters:
            self.say(f"{self.run.checkpoint} is at iter {iter_num}, which is max_iters: nothing "
                     f"left to train; raise --max-iters to train it further")
        if not self.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter  # slow to import, so only rank 0 does
        self.writer = SummaryWriter(self.run.path, purge_step=iter_num + 1 if iter_num else None)
        if not iter_num:
            settings = "\n".join(f"{k} = {v!r}" for k, v in self.cfg.to_dict().items())
            self.writer.add_text("config", text_block(settings))
        # a live bar on a terminal; elsewhere a plain line per log point (see point)
        self.bar = tqdm(total=self.cfg.max_iters, initial=iter_num, unit="it",
                        dynamic_ncols=True, disable=not sys.stderr.isatty())

    def __enter__(self) -> RunLog:
        self.quiet.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.quiet.__exit__(kind, error, traceback)
        if self.bar is not None:
            self.bar.close()
        for closeable in (self.writer, self.layer_pictures):
            if closeable is not None:
                with suppress(OSError):  # quietly after a failure, which is reported already
                    closeable.close()
        if isinstance(error, OSError) and self.writer is not None:  # its events or pictures
            raise TrainingError(f"could not write to {self.run.path} ({error.strerror}) at "
                                f"iter {self.iter_num}; {self.run.resume_hint()}") from None

    def say(self, message: str) -> None:
        """A line above the progress bar, from rank 0 alone."""
        if self.is_main:
            tqdm.write(message)

    def step(self) -> None:
        self.iter_num += 1
        if self.bar is not None:
            self.bar.update(1)

    @contextmanager
    def paused(self) -> Iterator[None]:  # tokens/s leaves out the evaluations and saves inside
        t_pause = time.perf_counter()
        yield
        self.t_point += time.perf_counter() - t_pause

    def point(self, it: int, steps: int, loss: float, lrs: dict[str, float], grad_norm: torch.Tensor) -> None:
        """Log the steps since the last point, their mean loss and their tokens/s and MFU, as TensorBoard's
        scalars, with train/lr, train/lr_muon and train/lr_embedding, and show them on the progress bar."""
        norm = whole(grad_norm).item()  # every process gathers FSDP's shards of the norm
        # the time since the last point includes the wait for the device in the loss's .item()
        tokens_per_sec = steps * self.tokens_per_iter / (time.perf_counter() - self.t_point)
        mfu = self.flops_per_token * tokens_per_sec / self.peak  # the share of every process's peak
        self.t_point = time.perf_counter()
        if self.writer is None:
            return
        for tag, value in (("train/loss_step", loss), *((f"train/{name}", lr) for name, lr in lrs.items()),
                           ("train/grad_norm", norm), ("perf/tokens_per_sec", tokens_per_sec),
                           ("perf/mfu", mfu)):
            self.writer.add_scalar(tag, value, it)
        if not self.bar.disable:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{mfu:.0%}")
            return
        elapsed = time.perf_counter() - self.t_start
        left = elapsed / (it - self.start_iter) * (self.cfg.max_iters - it)
        tqdm.write(f"iter {it}/{self.cfg.max_iters}: loss {loss:.4f}, {tokens_per_sec:,.0f} "
                   f"tokens/s, MFU {mfu:.1%}, {tqdm.format_interval(left)} left")

    def losses(self, it: int, losses: dict[str, float]) -> None:
        """Both splits' losses at an evaluation."""
        self.say(f"iter {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if self.writer is None:
            return
        for split, loss in losses.items():
            self.writer.add_scalar(f"loss/{split}", loss, it)

    def samples(self, it: int, model: GPT, device: torch.device, autocast: Any) -> None:
        """An evaluation's text sample, sample_tokens from sample_prompt with the same seed every
        time, and its attention pictures, in eval mode (no dropout). A sharded model samples on
        every process, because its forward is a collective, in eager steps; rank 0 logs the text."""
        model.eval()
        fsdp = is_sharded(model)
        if self.cfg.sample_tokens and (self.is_main or fsdp):
            from generate import generate  # imported at the first evaluation, by a run that samples
            generator = torch.Generator(device=device).manual_seed(self.cfg.seed)
            prompt = torch.tensor([self.sample_ids], dtype=torch.long, device=device)
            # a CPU samples in the weights' fp32, with the C step, which ignores autocast
            with autocast if device.type != "cpu" else nullcontext():
                out = generate(model, prompt, self.cfg.sample_tokens, generator=generator,
                               decode="eager" if fsdp else "auto")
            if self.writer is not None:
                self.writer.add_text("sample", text_block(self.tokenizer.decode(out[0].tolist())), it)
        if self.writer is not None and self.attention:
            from viz.attention_maps import LayerPictures, log_attention, token_labels
            if self.layer_pictures is None:  # matplotlib is slow to load, so only now
                self.layer_pictures = LayerPictures(
                    token_labels(self.tokenizer, self.probe_ids), model.config.n_head)
            log_attention(self.writer, model, self.probe_ids, self.layer_pictures, it)
        model.train()

    def finish(self, best_val_loss: float, it: int) -> None:
        """The run's settings beside its result, and the last events written."""
        if self.writer is None:
            return
        self.writer.add_hparams(self.cfg.to_dict(), {"hparam/best_val_loss": best_val_loss},
                                run_name=".", global_step=it)
        self.writer.close()  # its last writes can fail too, and here they are reported


def text_block(text: str) -> str:
    """TensorBoard renders text as markdown; indenting keeps line breaks and spacing."""
    return "\n".join("    " + line for line in text.splitlines())
