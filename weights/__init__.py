"""Weights in and out: last.pt (checkpoint.py, fields.py; FSDP's shards: sharded.py), a model
from a run, a checkpoint, a Hugging Face folder or the Hub (loading.py, hf.py, hub.py, lazy.py),
GPT-2's and NanoChat's formats (gpt2.py, nanochat.py) and int8 weights (quantize.py).

Usage:
    from weights.loading import load_model
    model, tokenizer, source = load_model(run="quickstart", dtype="int8")
"""
