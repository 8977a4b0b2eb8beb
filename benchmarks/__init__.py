"""Scripts that print figures: training speed and time to a loss, decoding speed.

Usage:
    python -m benchmarks.train --time-to-loss 1.95 --input FILE
    python -m benchmarks.decode --preset baby_gpt --lengths 248
"""
