"""The sharded checkpoint reader refuses what DCP's own reader would run, because the format's
metadata is a pickle and a crafted one must not execute on load. The saves themselves are
tested in tests/test_distributed.py."""

import os
import pickle
from pathlib import Path

import pytest
import torch

from weights.checkpoint import CheckpointError
from weights.sharded import read_shards, tensor_shapes


class Crafted:
    """A pickle that runs a command when loaded, as a file from elsewhere could."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_shard_metadata_is_refused_before_anything_runs(tmp_path):
    checkpoint, marker = tmp_path / "last.dcp", tmp_path / "ran"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Crafted(marker)))
    # every read starts with tensor_shapes, whose result read_shards takes
    with pytest.raises(CheckpointError, match=r"names posix\.system, which shard metadata "
                                              r"never does"):
        read_shards({"model.w": torch.empty(2)}, checkpoint, tensor_shapes(checkpoint))
    assert not marker.exists()
