"""Corpora: fetch text (sources.py), tokenize it into train/val bins (prepare.py), and draw
batches from them (loader.py).

Usage:
    python -m data.prepare --input my_corpus.txt --out data/mine
"""
