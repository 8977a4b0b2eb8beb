"""Training's parts, below train.py: the typed config (config.py), what a process works with
(session.py), the run folder (runs.py), the loop (loop.py), the optimizers (optimizer.py),
processes under torchrun (distributed.py), the dtype a run trains in (precision.py) and
whether it fits in memory (memory.py).

Usage:
    from training.config import load_config
    from training.loop import train
    result = train(load_config("config/quickstart.toml", {"max_iters": 100}))
"""
