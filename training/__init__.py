"""Training's parts below train.py: the config, the setup before the loop, the run folder,
checkpoints, the log, the optimizers, torchrun's processes, the dtype and the memory check.

Usage:
    from training.config import load_config
"""
