"""Training's parts, below train.py and its loop: the typed config (config.py), the run folder
(runs.py), checkpoints (checkpoints.py, resume.py), the log (log.py), the optimizers
(optimizer.py), processes under torchrun (distributed.py, fsdp.py), the dtype a run trains
in (precision.py) and whether it fits in memory (memory.py).

Usage:
    from training.config import load_config
    from train import train
    result = train(load_config("config/quickstart.toml", {"max_iters": 100}))
"""
