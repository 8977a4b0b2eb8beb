"""The sharded checkpoint format: what FSDP runs save, each process writing its own shards.

Usage:
    from weights.sharded import write_shards, read_shards, consolidate
    write_shards(tensors, rest, folder, is_main)   # every process, into new_folder(run_dir, iter)
    link(run_dir, "last", folder)                  # rank 0, once every process has written
    rest = read_state(run_dir / "last.dcp"); shapes = tensor_shapes(run_dir / "last.dcp")
    read_shards(targets, run_dir / "last.dcp", shapes)
    consolidate(run_dir / "last.dcp", run_dir / "last.pt")           # a plain checkpoint

A sharded checkpoint is a folder written by torch.distributed.checkpoint (DCP): each process
writes the shards it holds, in parallel, and DCP's metadata records where every piece of
every tensor lies, so any number of processes can read it back, each reading only the
pieces it needs (a resume on another world size, or one plain process). It holds the
tensors of a TrainState (the weights as `model.NAME` and each optimizer's state as
`optimizer.I.PARAM.KEY`, by the parameter's name, so that any sharding maps onto it); the
rest (iteration, config, tokenizer, random state) is `state.pt`, a small torch.save file
from rank 0 that loads with weights_only, as last.pt does. DCP reads its metadata with plain
pickle, so it is first read here by an unpickler that builds DCP's records and nothing else.

In a run folder, `last.dcp` and `best.dcp` are symbolic links into `shards/`, where each
save writes a new folder. Only once every process's files and the metadata are on disk is
the link swapped, by an atomic rename, so a crash at any moment leaves the previous
checkpoint whole and linked; the next save deletes folders that no link names.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from machine.files import atomic_write, fsync_dir, write_failure
from weights.checkpoint import FORMAT, VERSION, CheckpointError, check_contents
from weights.safe_load import UnreadableFile, safe_load

SHARDS = "shards"  # the run folder's subfolder of saved checkpoints
STATE = "state.pt"  # a checkpoint folder's small, unsharded part
SUFFIX = ".dcp"


def new_folder(run_dir: Path, iter_num: int) -> Path:
    """A folder under shards/ that no checkpoint uses: the iteration's own, or a numbered
    one beside it (a resumed run saves its first iteration again). Rank 0 chooses."""
    base = run_dir / SHARDS / f"iter-{iter_num:07d}"
    for n in range(1, 10_000):
        folder = base if n == 1 else base.with_name(f"{base.name}.{n}")
        if not folder.exists():
            return folder
    raise CheckpointError(f"{run_dir / SHARDS} holds 9,999 saves of iter {iter_num}; delete "
                          f"the ones that last.dcp and best.dcp do not name")


def write_shards(tensors: dict[str, torch.Tensor], rest: dict[str, Any], folder: Path,
                 is_main: bool) -> None:
    """Every process writes its shards of `tensors` into folder (DCP's save is a collective,
    so all must call it), and rank 0 the metadata and state.pt; each file is fsynced."""
    import torch.distributed.checkpoint as dcp
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
    except dcp.CheckpointException as e:  # every process's failures, gathered
        causes = [write_failure(error) for error, _ in e.failures.values()]
        failed = next((c for c in causes if isinstance(c, OSError)), None)
        if failed is not None:  # a full disk is reported like any failed write
            raise failed from None
        raise CheckpointError(f"the save failed: {causes[0]!r}"[:300]) from None
    if is_main:
        with atomic_write(folder / STATE) as f:
            torch.save({"format": FORMAT, "version": VERSION, **rest}, f)
        fsync_dir(folder)


def link(run_dir: Path, name: str, folder: Path) -> None:
    """Point run_dir/<name>.dcp at folder by renaming a new link over the old one, so that
    the name always leads to a whole checkpoint. A plain <name>.pt (from a run resumed under
    FSDP, or made by export.py --plain) is now older, so it is deleted, and a folder never
    holds two `last` checkpoints that disagree."""
    path = run_dir / f"{name}{SUFFIX}"
    tmp = run_dir / f".{name}{SUFFIX}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(folder.relative_to(run_dir), tmp)
    os.replace(tmp, path)
    fsync_dir(run_dir)
    (run_dir / f"{name}.pt").unlink(missing_ok=True)


def tidy(run_dir: Path) -> None:
    """Delete the folders under shards/ that neither last.dcp nor best.dcp names: older
    saves, and a save that a crash cut short; and shards/ itself once it is empty."""
    shards = run_dir / SHARDS
    if not shards.is_dir():
        return
    kept = {(run_dir / f"{name}{SUFFIX}").resolve() for name in ("last", "best")}
    for folder in shards.iterdir():
        if folder.resolve() not in kept:
            shutil.rmtree(folder, ignore_errors=True)
    if not any(shards.iterdir()):
        shards.rmdir()


def unlink_sharded_twin(run_dir: Path, name: str) -> None:
    """A plain save of <name>.pt makes a sharded <name>.dcp older, so delete its link, and
    its folder too unless the other name still leads there."""
    path = run_dir / f"{name}{SUFFIX}"
    if path.is_symlink():
        path.unlink()
        tidy(run_dir)


def read_state(path: Path, resume: bool = False) -> dict[str, Any]:
    """A sharded checkpoint's state.pt, checked as load_checkpoint checks a plain file."""
    state_path = path / STATE
    if not state_path.is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint (no {STATE}); use another "
                              f"checkpoint")
    try:
        state = safe_load(state_path)
    except UnreadableFile as e:
        raise CheckpointError(f"{state_path} is truncated or damaged ({e})") from None
    return check_contents(state, state_path, resume, sharded=True)


# what DCP's metadata pickles: its own records, paths, shapes, dtypes and layouts
METADATA = {"torch.distributed.checkpoint.metadata": {
                "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
            "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
            "pathlib": {"PosixPath", "PurePosixPath"}, "collections": {"OrderedDict"},
            "torch": {"Size"}, "torch.serialization": {"_get_layout"}}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata records and nothing else, because DCP reads
    its .metadata with plain pickle, which would run whatever a crafted file names."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in METADATA.get(module, ()) or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which shard metadata never does")


def tensor_shapes(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The whole shape and dtype of every tensor the checkpoint holds, from DCP's metadata,
    which is first checked to hold nothing else (DCP then reads the same bytes)."""
    from torch.distributed.checkpoint import TensorStorageMetadata
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise CheckpointError(f"{path} has no readable shard metadata ({e}); the save was cut "
                              f"short or the file is not one: use another checkpoint") from None
    return {key: (meta.size, meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


def read_shards(targets: dict[str, torch.Tensor], path: Path,
                shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Fill each target (this process's part of a sharded tensor, or a plain tensor whole)
    from the checkpoint, in place, reading only the pieces each needs. Under torchrun every
    process calls; a plain process reads alone. shapes is tensor_shapes(path), read once by
    the caller, whose check of the metadata is what makes DCP's unpickling of it safe."""
    import torch.distributed.checkpoint as dcp
    missing = sorted(set(targets) - set(shapes))
    if missing:
        raise CheckpointError(f"{path} holds no {missing[0]}; use another checkpoint")
    try:
        with warnings.catch_warnings():  # a process reading alone is intended here
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(targets, storage_reader=dcp.FileSystemReader(path),
                     no_dist=not torch.distributed.is_initialized())
    except (dcp.CheckpointException, OSError, RuntimeError) as e:
        raise CheckpointError(f"cannot read the shards in {path} "
                              f"({str(e).splitlines()[0][:200]}); the save is damaged: use "
                              f"another checkpoint") from None


class Shard(NamedTuple):
    """A sharded tensor of the checkpoint, by its key, where a plain file holds the whole."""
    key: str


def plain_layout(state: dict[str, Any], shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 ) -> dict[str, Any]:
    """A plain checkpoint's contents (TrainState's keys) with a Shard in place of each
    sharded tensor: the weights by name, each optimizer's state by position."""
    model: dict[str, Any] = {key.removeprefix("model."): Shard(key)
                             for key in shapes if key.startswith("model.")}
    if state["model_args"].get("tie_embeddings", True) and "lm_head.weight" not in model:
        model["lm_head.weight"] = model["transformer.wte.weight"]  # one table, as in last.pt
    optimizers = []
    for i, opt in enumerate(state["shards"]["optimizers"]):
        entries: dict[int, dict[str, Any]] = {}
        for index, name in enumerate(opt["params"]):
            prefix = f"optimizer.{i}.{name}."
            entry = {key.removeprefix(prefix): Shard(key) for key in shapes
                     if key.startswith(prefix)}
            if entry:
                entries[index] = entry
        optimizers.append({"state": entries, "param_groups": opt["param_groups"]})
    rest = {k: v for k, v in state.items() if k not in ("format", "version", "shards")}
    return {"format": FORMAT, "version": VERSION, "model": model, "optimizer": optimizers,
            **rest}


def consolidate(path: Path, out: Path) -> None:
    """Write the plain checkpoint (last.pt's format) of the sharded one at path, one tensor at a
    time, so that it needs the memory of its largest tensor, not of the whole state. torch.save
    first writes the file's layout with every tensor's bytes left empty (skip_data, with
    placeholders that hold no memory); then each tensor is read (from the shards, or state.pt's
    small ones) and written into its place. The write is atomic, like every save."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    shapes = tensor_shapes(path)
    layout = plain_layout(read_state(path), shapes)
    sources: list[Shard | torch.Tensor] = []  # in the order torch.save stores them
    made: dict[int, torch.Tensor] = {}

    def placeholder(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: placeholder(v) for k, v in value.items()}
        if isinstance(value, list):
            return [placeholder(v) for v in value]
        if not isinstance(value, Shard | torch.Tensor):
            return value
        if id(value) not in made:  # the tied head reuses the token table's placeholder
            shape, dtype = shapes[value.key] if isinstance(value, Shard) else (value.shape,
                                                                               value.dtype)
            made[id(value)] = torch.empty(shape, dtype=dtype)
            sources.append(value)
        return made[id(value)]
    with FakeTensorMode():
        skeleton = placeholder(layout)
    with atomic_write(out) as f:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, f)
        f.flush()
        fill(f, sources, shapes, path)


def fill(f: Any, sources: list[Shard | torch.Tensor],
         shapes: dict[str, tuple[torch.Size, torch.dtype]], path: Path) -> None:
    """Write each tensor's bytes into the space torch.save left for it. torch.save numbers
    storages in the order it meets them, the order the placeholders were made in; the
    records' sizes are checked against it."""
    records = [info for info in zipfile.ZipFile(f.name).infolist()
               if info.filename.split("/")[-2:-1] == ["data"]]
    records.sort(key=lambda info: int(info.filename.rsplit("/", 1)[1]))

    def nbytes(source: Shard | torch.Tensor) -> int:
        if isinstance(source, torch.Tensor):
            return source.numel() * source.element_size()
        shape, dtype = shapes[source.key]
        return math.prod(shape) * dtype.itemsize
    if [r.file_size for r in records] != [nbytes(s) for s in sources]:
        raise CheckpointError("torch.save laid the file out in an order this code does not "
                              "know; no plain checkpoint was written")
    reader = open(f.name, "rb")  # noqa: SIM115 (closed below; f is write-only)
    for source, record in zip(sources, records, strict=True):
        reader.seek(record.header_offset + 26)  # the local header's name and extra lengths
        name_len, extra_len = (int.from_bytes(reader.read(2), "little") for _ in range(2))
        if isinstance(source, Shard):
            tensor = torch.empty(shapes[source.key][0], dtype=shapes[source.key][1])
            read_shards({source.key: tensor}, path, shapes)
        else:
            tensor = source
        f.seek(record.header_offset + 30 + name_len + extra_len)
        f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    reader.close()
