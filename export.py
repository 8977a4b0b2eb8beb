"""Export a checkpoint of ours as a Hugging Face folder that transformers loads: the weights,
config.json, and tokenizer.json for whichever tokenizer the model was trained with.

Usage:
    python export.py runs/quickstart_adamw out/hf-adamw              # best.pt of a run, by folder or name
    python export.py runs/shakespeare_bpe/best.pt out/hf-gpt2 --force # replace that export
    python export.py runs/nano/last.pt out/hf-nano --format nanochat
    python export.py runs/big --plain          # last.pt and best.pt of an FSDP run's shards

The format follows from the layout: GPT-2's for GPT-2's layout (weights/gpt2.py), NanoChat's
for the modern one (weights/nanochat.py); a layout that neither can hold is refused in one
line naming the switch. AutoModelForCausalLM and AutoTokenizer load the folder. A model with
a bigram table (the quickstart's) is exported in NanoChat's format with the table as one more
tensor and a small modeling file that adds it (weights/nanochat_bigram.py), so transformers
loads it with AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True), because
its own NanoChat has no such table. The command's last line says how to load the folder.

--plain turns a run's sharded checkpoints (last.dcp and best.dcp, which training under FSDP
writes) into plain ones beside them (last.pt, best.pt), one tensor at a time
(weights/sharded.py), for sample.py, evaluate.py, serve.py and this command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from data.tokenizer_json import tokenizer_files
from machine.errors import reported, run_command
from model import GPTConfig
from weights import sharded
from weights.checkpoint import link_checkpoint
from weights.gpt2 import LAYOUT as GPT2_LAYOUT
from weights.gpt2 import export_hf_gpt2, gpt2_problem
from weights.hf import ExportError, read_config
from weights.loading import load_model
from weights.nanochat import BIGRAM_FILE as NANOCHAT_BIGRAM_FILE
from weights.nanochat import LAYOUT as NANOCHAT_LAYOUT
from weights.nanochat import export_hf_nanochat, nanochat_problem

FORMATS = ("auto", "gpt2", "nanochat")


def export(source: str, folder: Path, format: str, force: bool) -> tuple[str, Path]:
    """Write the export; return its format and folder."""
    if format not in FORMATS:
        raise ExportError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}")
    path = Path(source)
    # a file, or a missing name ending in .pt, is a checkpoint; anything else names a run (its
    # folder, or a bare name in runs/), which a missing run answers with the runs there are
    is_checkpoint = path.is_file() or (path.suffix == ".pt" and not path.is_dir())
    run, checkpoint = (None, source) if is_checkpoint else (source, None)
    model, tokenizer, _ = load_model(run, checkpoint)
    problems = {"gpt2": gpt2_problem(model.config), "nanochat": nanochat_problem(model.config)}
    if format == "auto":
        format = "gpt2" if problems["gpt2"] is None else "nanochat"
    if problems[format]:
        raise ExportError(f"{problems[format]}; {layout_hint(model.config, problems)}")
    files = tokenizer_files(tokenizer)
    # a folder's own special tokens (nanochat's), else the end-of-text token where there is one
    specials, eot = getattr(tokenizer, "specials", {}), tokenizer.eot_token
    special = {"bos": specials.get("<|bos|>", eot), "eos": specials.get("<|assistant_end|>", eot)}
    try:
        if format == "gpt2":
            return format, export_hf_gpt2(model, folder, force, extra=files, end_of_text=eot)
        return format, export_hf_nanochat(model, folder, force, extra=files, special=special)
    except OSError as e:
        raise ExportError(f"cannot write {folder} ({e.strerror}); choose another "
                          f"folder") from None


# the switches of each format's layout, as train.py's options set them
LAYOUT_SWITCHES = {"NanoChat's": NANOCHAT_LAYOUT, "GPT-2's": {**GPT2_LAYOUT, "bias": True}}


def layout_hint(config: GPTConfig, problems: dict[str, str | None]) -> str:
    """What to do with a model that a format cannot hold: the other format, if it can hold
    it; else the train.py options that would have made the run exportable."""
    for name, problem in problems.items():
        if problem is None:
            return f"export it with --format {name}"
    flags = {fmt: " ".join(switch_flag(key, value) for key, value in layout.items()
                           if getattr(config, key) != value)
             for fmt, layout in LAYOUT_SWITCHES.items()}
    return ("neither NanoChat's format nor GPT-2's holds this layout: keep its checkpoint, or "
            "train it with " + " (NanoChat's), or with ".join(flags.values()) + " (GPT-2's)")


def switch_flag(key: str, value: object) -> str:
    """train.py's option that sets a model switch to value: --embed-norm, --no-bias, ..."""
    flag = key.replace("_", "-")
    return f"--{flag}" if value is True else f"--no-{flag}" if value is False else f"--{flag} {value}"


def make_plain(source: str) -> list[Path]:
    """The plain checkpoints of a run folder's sharded ones (or of one .dcp), written beside
    them; best.pt is a second name for last.pt where both name the same save."""
    path = Path(source)
    pairs = ([(path, path.with_suffix(".pt"))] if path.suffix == sharded.SUFFIX else
             [(path / f"{name}{sharded.SUFFIX}", path / f"{name}.pt") for name in ("last", "best")])
    pairs = [(dcp, pt) for dcp, pt in pairs if dcp.exists()]
    if not pairs:
        raise ExportError(f"no sharded checkpoint (last.dcp or best.dcp) in {source}; --plain "
                          f"reads what a run under FSDP writes")
    written: dict[Path, Path] = {}
    for dcp, pt in pairs:
        same = written.get(dcp.resolve())
        if same is not None:
            link_checkpoint(same, pt)
        else:
            sharded.consolidate(dcp, pt)
        written[dcp.resolve()] = pt
    return [pt for _, pt in pairs]


def main(checkpoint: Annotated[str, typer.Argument(
             help="A checkpoint (.pt written by train.py), or a run (its folder, or its name in "
                  "runs/), whose best.pt is exported; with --plain, a run's folder or a .dcp.")],
         folder: Annotated[Path | None, typer.Argument(
             help="The folder to write (none with --plain).")] = None,
         format: Annotated[str, typer.Option(
             help="auto (GPT-2's for GPT-2's layout, else NanoChat's), gpt2 or nanochat.")] = "auto",
         force: Annotated[bool, typer.Option(
             help="Replace the export in a folder that is not empty.")] = False,
         plain: Annotated[bool, typer.Option(
             "--plain", help="Write plain checkpoints (last.pt, best.pt) of a run's sharded "
                             "ones (last.dcp, best.dcp), beside them.")] = False) -> None:
    """Export CHECKPOINT to FOLDER as a Hugging Face model folder."""
    with reported():
        if plain:
            if folder is not None:
                raise ExportError("--plain writes beside the sharded checkpoints; drop FOLDER")
            typer.echo(f"wrote {', '.join(map(str, make_plain(checkpoint)))}")
            return
        if folder is None:
            raise ExportError("give the FOLDER to write the export to")
        written_format, written = export(checkpoint, folder, format, force)
    names = sorted(p.name for p in written.iterdir())
    typer.echo(f"wrote {written}/ from {checkpoint} in {written_format}'s format: "
               f"{', '.join(names)}")
    if "auto_map" in read_config(written):  # the bigram table, which only our modeling file holds
        typer.echo(f"load it with AutoModelForCausalLM.from_pretrained(\"{written}\", "
                   f"trust_remote_code=True), because the folder's {NANOCHAT_BIGRAM_FILE.name} "
                   f"adds its bigram table")
    else:
        typer.echo(f"load it with AutoModelForCausalLM.from_pretrained(\"{written}\")")


if __name__ == "__main__":
    run_command(main)
