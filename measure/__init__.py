"""Measurements the commands and benchmarks/ share: a model's loss, perplexity and bits per
character on a text (scores.py), and the speed of every decoding path (decoding.py).

Usage:
    from measure.scores import evaluate
    from measure.decoding import run_benchmark
"""
