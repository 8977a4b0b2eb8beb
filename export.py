"""Export a checkpoint of ours as a Hugging Face folder that transformers loads.

Usage:
    python export.py runs/shakespeare_bpe/best.pt out/hf-gpt2            # GPT-2's format
    python export.py runs/shakespeare_bpe/best.pt out/hf-gpt2 --force    # replace that export

GPT-2's layout exports to GPT-2's format (weights/gpt2.py); a layout GPT-2 cannot hold is
refused in one line that names the switch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from machine.errors import reported
from weights.checkpoint import load_checkpoint, model_from_checkpoint
from weights.gpt2 import export_hf_gpt2
from weights.hf import ExportError


def main(checkpoint: Path, folder: Path,
         force: Annotated[bool, typer.Option(
             help="Replace the export in a folder that is not empty.")] = False) -> None:
    """Export CHECKPOINT (a .pt written by train.py) to FOLDER in Hugging Face GPT-2 format."""
    with reported(ValueError, OSError):  # OSError: the checkpoint's path
        model = model_from_checkpoint(load_checkpoint(checkpoint))
        try:
            export_hf_gpt2(model, folder, force)
        except OSError as e:
            raise ExportError(f"cannot write {folder} ({e.strerror}); choose another "
                              f"folder") from None
    typer.echo(f"wrote {folder}/config.json and {folder}/model.safetensors")


if __name__ == "__main__":
    typer.run(main)
