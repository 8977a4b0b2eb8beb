"""The KV-cache decode step as one hand-written C function (decode_step.c), for CPUs.

Usage:
    model.compile_decode(backend="c")   # builds decode_step.c on first use, then cached
    model.generate(idx, 100)            # decode steps now run the C function

The C compiler (`cc`, or $CC) builds the file once per weight dtype, with OpenMP when the
compiler has it, into $GPTLAB_CACHE/decode_step (default ~/.cache/gptlab). The step reads
the model's own parameter and cache tensors in place, so it sees later weight updates, but
the model must not be moved or cast after the step is built.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from data.sources import cache_dir
from model import GPT, KVCache

SOURCE = Path(__file__).with_name("decode_step.c")
WEIGHT_TYPES = {torch.float32: "float", torch.bfloat16: "uint16_t"}
BLOCK_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")


class BuildError(RuntimeError):
    """The C step cannot be built or cannot run this model; the message says what to do."""


def build(dtype: torch.dtype, march: str = "native") -> ctypes.CDLL:
    """Compile decode_step.c for weights of `dtype` (or reuse the cached build) and load it.

    march: the instruction set to build for, as gcc's -march names it; "native" is this CPU.
    """
    found = [c for c in ("cc", "gcc", "clang") if shutil.which(c)]
    compiler = os.environ.get("CC") or (found[0] if found else "cc")
    if shutil.which(compiler) is None:
        raise BuildError(f"the C decode step needs a C compiler, and {compiler!r} was not "
                         f"found; install gcc or clang (or set CC), or use --compile instead")
    defines = [f"-DWEIGHT={WEIGHT_TYPES[dtype]}"]
    if dtype == torch.bfloat16:
        defines.append("-DWEIGHT_BF16")
    base = ["-O3", "-shared", "-fPIC", *defines]
    # the library is built on the machine that runs it, so it may use all of this CPU;
    # full-width AVX-512 in the loops left to the compiler (attention, LayerNorm) makes a
    # bf16 step about 3% faster than gcc's default half width
    arch = [f"-march={march}"]
    if platform.machine() == "x86_64":
        arch.append("-mprefer-vector-width=512")
    # threads need OpenMP; a compiler without it (Apple's clang) builds a one-thread step
    attempts = [[*base, *arch, "-fopenmp"], [*base, "-fopenmp"], base]
    # -march=native builds for this CPU, and a cache folder may be shared between machines
    key = hashlib.sha256(" ".join([compiler, *attempts[0], cpu_identity()]).encode()
                         + SOURCE.read_bytes())
    out = cache_dir() / "decode_step" / f"{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            for flags in attempts:
                result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(tmp_out),
                                         "-lm"], capture_output=True, text=True)
                if result.returncode == 0:
                    break
            else:
                last_line = (result.stderr.strip().splitlines() or ["no message"])[-1]
                raise BuildError(f"{compiler} could not build {SOURCE.name}: {last_line}")
            tmp_out.replace(out)  # whole or not at all: a concurrent build cannot see half
    lib = ctypes.CDLL(str(out))
    ptr, ptrs, i32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
    # the C signature: logits, tokens, pos, wte, wpe, blocks, ln_f_w, ln_f_b, k_cache,
    # v_cache, work, B, n_layer, n_head, n_embd, vocab_size, max_len, n_threads
    lib.decode_step.argtypes = [ptr, ptr, i32, ptr, ptr, ptrs, ptr, ptr, ptrs, ptrs, ptr,
                                *[i32] * 7]
    lib.decode_step.restype = None
    return lib


def cpu_identity() -> str:
    """The CPU's architecture and, on Linux, its feature flags: what -march=native reads."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line for line in cpuinfo.read_text().splitlines()
                  if line.startswith(("flags", "Features"))), "") if cpuinfo.exists() else ""
    return f"{platform.machine()} {flags}"


def address(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None  # None: C's NULL, e.g. a missing bias


def pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    """A C array of the tensors' addresses."""
    return (ctypes.c_void_p * len(tensors))(*(address(t) for t in tensors))


class CDecodeStep:
    """A callable with the signature of GPT.forward for decode steps: (B, 1) tokens, a
    KVCache and a one-element input_pos in; ((B, 1, vocab_size) logits, None) out."""

    def __init__(self, model: GPT, march: str = "native") -> None:
        params = dict(model.named_parameters(remove_duplicate=False))  # wte is also lm_head
        self.wte = params["transformer.wte.weight"]
        if self.wte.device.type != "cpu" or self.wte.dtype not in WEIGHT_TYPES:
            raise BuildError(f"the C decode step runs float32 or bfloat16 weights on the CPU, "
                             f"not {str(self.wte.dtype).removeprefix('torch.')} on "
                             f"{self.wte.device.type}; use --compile instead")
        self.config = model.config
        self.dtype = self.wte.dtype
        self.lib = build(self.dtype, march)
        # the C function gets only addresses: these references keep the tensors alive
        self.wpe = params["transformer.wpe.weight"]
        self.ln_f_w = params["transformer.ln_f.weight"]
        self.ln_f_b = params.get("transformer.ln_f.bias")  # None in a model without biases
        self.block_params = [params.get(f"transformer.h.{i}.{name}")
                             for i in range(self.config.n_layer) for name in BLOCK_PARAMS]
        tensors = [self.wte, self.wpe, self.ln_f_w, self.ln_f_b, *self.block_params]
        if not all(t.is_contiguous() and t.dtype == self.dtype
                   for t in tensors if t is not None):
            raise BuildError("the C decode step needs contiguous parameters of one dtype")
        self.blocks = pointers(self.block_params)

    def __call__(self, idx: torch.Tensor, kv_cache: KVCache, input_pos: torch.Tensor,
                 ) -> tuple[torch.Tensor, None]:
        cfg = self.config
        B = idx.size(0)
        pos = input_pos.item()
        max_len = kv_cache.k[0].size(2)
        # C does not check bounds: refuse here what would read or write outside a tensor
        tokens = idx.reshape(B).to(torch.int64).contiguous()
        ids = tokens.tolist()
        if not (0 <= pos < max_len and 0 <= min(ids) and max(ids) < cfg.vocab_size):
            raise IndexError(f"position {pos} or a token of {ids} is out of range")
        if kv_cache.k[0].dtype != self.dtype or kv_cache.k[0].size(0) != B:
            raise ValueError("the cache's dtype or batch size differs from the step's")
        logits = torch.empty(B, cfg.vocab_size, dtype=torch.float32)
        work = torch.empty(B * (9 * cfg.n_embd + cfg.n_head * max_len), dtype=torch.float32)
        self.lib.decode_step(
            address(logits), address(tokens), pos, address(self.wte), address(self.wpe),
            self.blocks, address(self.ln_f_w), address(self.ln_f_b),
            pointers(kv_cache.k), pointers(kv_cache.v),
            address(work), B, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, max_len,
            torch.get_num_threads())
        return logits.to(self.dtype).view(B, 1, cfg.vocab_size), None
