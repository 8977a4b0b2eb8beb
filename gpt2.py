"""The export's old name: `python gpt2.py CHECKPOINT FOLDER` is `python export.py CHECKPOINT
FOLDER`, kept so that commands written before the move still work.

Usage:
    python export.py runs/shakespeare_bpe/best.pt out/hf-gpt2
"""

import typer

from export import main

if __name__ == "__main__":
    typer.run(main)
