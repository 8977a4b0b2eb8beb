"""torch.optim's optimizers without the guard that torch wraps around their methods, the
base of this trainer's AdamW (training/optimizer.py) and Muon (training/muon.py).

Usage:
    from training.unguarded import Unguarded
    class AdamW(Unguarded, torch.optim.AdamW): ...   # its own step unwrapped likewise
"""

from __future__ import annotations

import inspect

import torch


class Unguarded:
    """torch.optim.Optimizer's methods without their torch._disable_dynamo wrapper, which keeps
    torch.compile out and imports the compiler (torch._dynamo, slow to import) on its first call.
    This trainer never compiles its optimizers, so it reaches its first step sooner without the
    guard. inspect.unwrap follows a wrapper's __wrapped__ attribute to the function it wraps."""

    add_param_group = inspect.unwrap(torch.optim.Optimizer.add_param_group)
    zero_grad = inspect.unwrap(torch.optim.Optimizer.zero_grad)
    state_dict = inspect.unwrap(torch.optim.Optimizer.state_dict)
    load_state_dict = inspect.unwrap(torch.optim.Optimizer.load_state_dict)
