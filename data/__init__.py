"""Corpora: fetch text (sources.py), tokenize it into train/val bins (prepare.py), and draw
training batches from those bins (loader.py)."""
