"""Measurements the commands and benchmarks/ share: a model's loss, perplexity and bits per
character on a text (scores.py), each token's log-probability (logprobs.py), a multiple-choice
task's accuracy (choices.py), a chat model's right answers (answers.py), and the speed and
memory of every decoding path (decoding.py, memory.py).

Usage:
    from measure.scores import evaluate
    from measure.decoding import run_benchmark
"""
