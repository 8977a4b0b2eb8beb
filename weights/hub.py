"""Models from the Hugging Face Hub: `--init-from gpt2` (or `openai-community/gpt2`, or a
NanoChat repository) downloads the model's folder once, with huggingface_hub, into its
cache (~/.cache/huggingface, or $HF_HUB_CACHE), and reads it from there afterwards.

Usage:
    from weights.hub import local_folder
    folder = local_folder("openai-community/gpt2")   # a Path: the cached snapshot
    folder = local_folder("models/gpt2")             # a folder you have, as it is

huggingface_hub owns the cache: its layout, its locks, resumed downloads, and offline use
(HF_HUB_OFFLINE=1 reads only what is cached).
"""

from __future__ import annotations

import re
from pathlib import Path

from machine.errors import UserError

# what a model folder needs: config.json, the weights, the tokenizer
PATTERNS = ["config.json", "*.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"]
HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


class HubError(UserError):
    """A Hub model that cannot be had: unknown, private, or not cached while offline."""


def local_folder(name: str | Path) -> Path:
    """The folder that `name` names: a local path, as it is (even one that does not exist if
    its first part does, because runs/nosuch is a mistyped run, not a Hub model), or else a
    Hub repository id, downloaded into the Hub's cache (or found there) with a progress bar."""
    path = Path(name)
    if path.exists() or Path(path.parts[0]).exists() or not HUB_ID.fullmatch(str(name)) \
            or str(name).startswith("."):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    try:
        return Path(snapshot_download(str(name), allow_patterns=PATTERNS))
    except GatedRepoError:
        raise HubError(f"{name} on the Hugging Face Hub is gated; accept its terms on its page "
                       f"and log in (hf auth login), or give a folder") from None
    except RepositoryNotFoundError:
        raise HubError(f"{name} is neither a folder here nor a model on the Hugging Face Hub "
                       f"(or it is private: log in with hf auth login); check the name") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{name} is not a folder here, and it is not in the Hugging Face cache "
                       f"while the Hub cannot be reached (offline, or HF_HUB_OFFLINE=1); "
                       f"download it where there is a connection, or give a folder") from None
    except HfHubHTTPError as e:
        raise HubError(f"the Hugging Face Hub refused {name} ({str(e).splitlines()[0]}); "
                       f"try again, or give a folder") from None
