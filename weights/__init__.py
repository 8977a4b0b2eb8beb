"""Weights in and out: our checkpoint format (checkpoint.py), a model to run from a run, a
checkpoint or a Hugging Face folder (loading.py), GPT-2's format (gpt2.py) and int8 weights
(quantize.py).

Usage:
    from weights.loading import load_model
    model, tokenizer, source = load_model(run="quickstart", dtype="int8")
"""
