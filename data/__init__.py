"""Corpora: fetch text (sources.py), read documents of every format (documents.py), train a
BPE (bpe.py), tokenize on every core into shards (prepare.py, format in shards.py), read
them back (loader.py) and draw batches from them (batches.py).

Usage:
    python -m data.prepare --input my_corpus.txt --out data/mine
"""
