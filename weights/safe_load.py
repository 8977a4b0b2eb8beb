"""Reading a file that torch.save wrote without running any pickled code, and every way such
a read fails as one exception. Checkpoints, sharded checkpoints' state and a Hugging Face
folder's pytorch_model.bin are read through it; a plain training run, which only writes
checkpoints, never imports it.

Usage:
    from weights.safe_load import UnreadableFile, safe_load
    try:
        state = safe_load(path, mmap=True)   # tensors mapped from the file, read when used
    except UnreadableFile as e:
        print(f"{path} cannot be read ({e})")
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch


class UnreadableFile(Exception):
    """A file that a safe torch.load cannot read; the message says why, in a few words."""


def safe_load(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> Any:
    """torch.load(weights_only=True), which runs no pickled code. A damaged or foreign file
    fails in many ways inside torch; each becomes one UnreadableFile. mmap maps the file's
    tensors rather than reading them, so only what is used is read."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # torch's own message suggests weights_only=False, which is not the fix for a file
        # from elsewhere
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise UnreadableFile(f"it holds a {refused[1]}, which a safe load refuses" if refused
                             else "not a file that torch.save wrote") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:  # a zip archive cut short
        raise UnreadableFile(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except OSError as e:
        raise UnreadableFile(f"cannot read it: {e.strerror}") from None
    except Exception:  # other bytes fail in the unpickler in other ways (IndexError, ...)
        raise UnreadableFile("not a file that torch.save wrote") from None
