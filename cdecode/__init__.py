"""The KV-cache decode step as one hand-written C function (decode_step.c), for CPUs.

Usage:
    from cdecode import CDecodeStep
    step = CDecodeStep(model)                     # builds decode_step.c on first use, then cached
    logits = step(idx, kv_cache, input_pos)       # (B, 1, vocab_size), as generate.py calls it

generate.py's decode="auto" (the default) runs this step on a CPU whenever it builds. The
C compiler builds the file once per weight dtype, for this CPU, and keeps it in the cache
(machine/cbuild.py). A machine without a compiler, or a cache folder that cannot be used, is
a BuildError, so the default step falls back to eager; flags that build something else (a
library for another weight type than the model's, GPTLAB_CFLAGS=-E) are a CompilerError,
one line, because a fallback would hide them. The step reads the model's own
parameter and cache tensors in place, so it sees later weight updates, but the model must
not be moved or cast after the step is built.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from machine.cbuild import BuildError, build_library
from model import GPT, Cache, GPTConfig

SOURCE = Path(__file__).with_name("decode_step.c")
# the weight dtypes the step runs, and the define that builds decode_step.c for each; for
# int8 (weights/quantize.py) the matrices are int8 and the rest of the model float32
WEIGHT_DEFINES = {torch.float32: [], torch.bfloat16: ["-DWEIGHT_BF16"],
                  torch.int8: ["-DWEIGHT_INT8"]}


@functools.cache  # once per process, because each generation builds its step and many may run
def build(dtype: torch.dtype, march: str = "native") -> ctypes.CDLL:
    """decode_step.c built for weights of `dtype` (machine/cbuild.py keeps the build) and
    loaded. march: the instruction set to build for, as gcc's -march names it."""
    wanted = str(dtype).removeprefix("torch.")

    def reads_the_weights(lib: ctypes.CDLL) -> str | None:
        # a library built for another weight type would read every weight as that type and
        # answer noise (GPTLAB_CFLAGS=-DWEIGHT_BF16 with a float32 model would print blank lines)
        built = ctypes.c_char_p.in_dll(lib, "weight_type").value.decode(errors="replace")
        return None if built == wanted else f"for {built} weights, not {wanted}"
    lib = build_library(SOURCE, WEIGHT_DEFINES[dtype], "the C decode step",
                        instead="choose --decode eager", march=march, check=reads_the_weights,
                        exports=("decode_step", "n_block_params", "block_param_names",
                                 "weight_type"))
    ptr, ptrs, i32 = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int
    # the C signature: logits, tokens, pos, rows, T, wte, wte_scales, wpe, wtb, ids, rope_cos,
    # rope_sin, blocks, ln_f_w, ln_f_b, lm_head, lm_head_scales, k_cache, v_cache, work, B,
    # n_layer, n_head, n_embd, vocab_size, max_len, layout, n_threads
    lib.decode_step.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptrs,
                                ptr, ptr, ptr, ptr, ptrs, ptrs, ptr, *[i32] * 6,
                                ctypes.POINTER(Layout), i32]
    lib.decode_step.restype = None
    return lib


class Layout(ctypes.Structure):
    """decode_step.c's layout_t: the switches of GPTConfig that the step follows."""
    _fields_ = [("n_kv_head", ctypes.c_int), ("rms_norm", ctypes.c_int),
                ("qk_norm", ctypes.c_int), ("relu2", ctypes.c_int),
                ("embed_norm", ctypes.c_int), ("hidden", ctypes.c_int),
                ("norm_eps", ctypes.c_float), ("logit_softcap", ctypes.c_float)]


def block_param_names(lib: ctypes.CDLL) -> list[str]:
    """The names of one Block's parameters in the order the C step takes them, read from
    the library itself (decode_step.c's BLOCK_PARAMS), so the list is written only once."""
    count = ctypes.c_int.in_dll(lib, "n_block_params").value
    names = (ctypes.c_char_p * count).in_dll(lib, "block_param_names")
    return [name.decode() for name in names]


def scratch_floats(config: GPTConfig, tokens: int, max_len: int) -> int:
    """The float32 scratch that one call of the step takes (its `work`) for `tokens` tokens in
    all, over a cache of max_len positions; the memory checks count it (measure/memory.py)."""
    return tokens * (5 * config.n_embd + max(config.n_embd, config.mlp_hidden)
                     + config.n_head * max_len)


def address(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None  # None becomes C's NULL, e.g. for a missing bias


def pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    """A C array of the tensors' addresses."""
    return (ctypes.c_void_p * len(tensors))(*(address(t) for t in tensors))


class CDecodeStep:
    """generate.py's DecodeStep in C. It takes (B, 1) tokens, a KVCache and input_pos, either
    (1,) or a position per sequence (B, 1), and returns (B, 1, vocab_size) logits.

    It also prefills (B, T) tokens at consecutive positions input_pos (T,) in one call and
    returns the logits of the last. Each weight is then read once for all B * T tokens, so a
    short window costs little more than one step; past `max_prefill` tokens, PyTorch's matrix
    products are faster, and generate.py prefills with the model instead. It can also step
    chosen rows, so a server's batch steps only the cache rows of the sequences at work.
    """

    name = "C step"
    steps_chosen_rows = True
    # the longest window this step prefills, per weight dtype, which is where it stops
    # beating the model's forward (docs/decoding.md). int8's forward dequantizes every matrix
    # first, so the C step wins on longer windows there; bfloat16's limit stays short for the
    # CPUs with bf16 arithmetic, where PyTorch's forward is fast.
    PREFILL_TOKENS = {torch.float32: 64, torch.bfloat16: 8, torch.int8: 128}

    def __init__(self, model: GPT, march: str = "native") -> None:
        # a tied wte is also lm_head; an int8 model (weights/quantize.py) keeps its matrices in buffers
        params = {**dict(model.named_parameters(remove_duplicate=False)),
                  **dict(model.named_buffers(remove_duplicate=False))}
        self.wte = params["transformer.wte.weight"]
        if self.wte.device.type != "cpu" or self.wte.dtype not in WEIGHT_DEFINES:
            raise BuildError(f"the C decode step runs float32, bfloat16 or int8 weights on the "
                             f"CPU, not {str(self.wte.dtype).removeprefix('torch.')} on "
                             f"{self.wte.device.type}; choose --decode eager or compile")
        self.config = model.config
        self.lib = build(self.wte.dtype, march)
        self.max_prefill = self.PREFILL_TOKENS[self.wte.dtype]
        # the C function gets only addresses, so these references keep the tensors alive
        self.wte_scales = params.get("transformer.wte.scales")  # None unless int8
        # each None below becomes C's NULL, for a layout switch that leaves the tensor out
        self.wpe = params.get("transformer.wpe.weight")
        self.wtb = params.get("transformer.wtb.weight")  # the bigram table
        self.rope_cos, self.rope_sin = params.get("rope_cos"), params.get("rope_sin")
        self.ln_f_w = params.get("transformer.ln_f.weight")  # None with rmsnorm
        self.ln_f_b = params.get("transformer.ln_f.bias")  # None in a model without biases
        untied = not self.config.tie_embeddings
        self.lm_head = params["lm_head.weight"] if untied else None
        self.lm_head_scales = params.get("lm_head.scales") if untied else None
        cfg = self.config
        self.layout = Layout(cfg.n_kv_head, cfg.norm == "rmsnorm", cfg.qk_norm, cfg.mlp == "relu2",
                             cfg.embed_norm, cfg.mlp_hidden, cfg.norm_eps, cfg.logit_softcap)
        names = block_param_names(self.lib)
        self.block_params = [params.get(f"transformer.h.{i}.{name}")
                             for i in range(self.config.n_layer) for name in names]
        # what decode_step.c's types say each tensor holds: matrices (weight_t) in the weight
        # dtype, their row scales in float32, the rest (param_t) and the cache in float32
        # for int8 matrices and in the weight dtype otherwise
        matrix = self.wte.dtype
        self.dtype = torch.float32 if matrix == torch.int8 else matrix  # param_t
        matrices = {name.replace(".scales", ".weight") for name in names
                    if name.endswith(".scales")}
        expected = [(self.wte, matrix), (self.wte_scales, torch.float32),
                    (self.lm_head, matrix), (self.lm_head_scales, torch.float32),
                    (self.wpe, self.dtype), (self.wtb, self.dtype), (self.rope_cos, self.dtype),
                    (self.rope_sin, self.dtype), (self.ln_f_w, self.dtype), (self.ln_f_b, self.dtype)]
        expected += [(t, matrix if name in matrices else
                      torch.float32 if name.endswith(".scales") else self.dtype)
                     for t, name in zip(self.block_params, names * self.config.n_layer, strict=True)]
        if not all(t.is_contiguous() and t.dtype == dtype
                   for t, dtype in expected if t is not None):
            raise BuildError("the C decode step needs contiguous parameters of one dtype, "
                             "or weights/quantize.py's int8 matrices with the rest in float32")
        self.blocks = pointers(self.block_params)
        self.work = torch.empty(0)  # scratch, sized for the cache in use (see __call__)

    def __call__(self, idx: torch.Tensor, kv_cache: Cache, input_pos: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_pos is one (T,) tensor for every sequence, or (B, T) with each sequence's own
        positions. rows is each sequence's cache row (by default row b); a server's batch
        passes it, because its cache has a row per slot and it steps only the slots at work."""
        cfg = self.config
        B, T = idx.size()
        cache_rows, max_len = kv_cache.k[0].size(0), kv_cache.k[0].size(2)
        # checked as Python lists, which beat tensor ops on a step's few numbers
        positions = input_pos.tolist()
        per_row = positions if input_pos.dim() == 2 else [positions] * B
        rows_of = list(range(B)) if rows is None else rows.tolist()
        ids = idx.flatten().tolist()
        # C does not check bounds, so refuse here what would read or write outside a tensor
        if not (len(per_row) == B and all(p == list(range(p[0], p[0] + T)) for p in per_row)
                and 0 <= min(p[0] for p in per_row) and max(p[-1] for p in per_row) < max_len
                and 0 <= min(ids) and max(ids) < cfg.vocab_size
                and len(rows_of) == B == len(set(rows_of))
                and 0 <= min(rows_of) and max(rows_of) < cache_rows):
            raise IndexError(f"positions {per_row}, rows {rows_of} or a token of "
                             f"{idx.tolist()} is out of range")
        tokens = idx.to(torch.int64).contiguous()  # kept alive because C reads it during the call
        starts = (ctypes.c_int64 * B)(*(p[0] for p in per_row))
        rows_array = (ctypes.c_int64 * B)(*rows_of)
        if kv_cache.k[0].dtype != self.dtype:
            raise ValueError("the cache's dtype differs from the step's")
        work_size = scratch_floats(cfg, B * T, max_len)
        if self.work.numel() < work_size:  # grow once for a longer prefill or cache
            self.work = torch.empty(work_size, dtype=torch.float32)
        logits = torch.empty(B, cfg.vocab_size, dtype=torch.float32)
        self.lib.decode_step(
            address(logits), address(tokens), starts, rows_array, T, address(self.wte),
            address(self.wte_scales), address(self.wpe), address(self.wtb),
            address(kv_cache.ids), address(self.rope_cos),
            address(self.rope_sin), self.blocks, address(self.ln_f_w), address(self.ln_f_b),
            address(self.lm_head), address(self.lm_head_scales),
            pointers(kv_cache.k), pointers(kv_cache.v),
            address(self.work), B, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size,
            max_len, ctypes.byref(self.layout), torch.get_num_threads())
        return logits.to(self.dtype).view(B, 1, cfg.vocab_size)
