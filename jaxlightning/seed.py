"""`seed_everything`: one seed for Python, numpy, torch and the Trainer's JAX keys."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

_global_seed: int | None = None


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seeds Python's ``random``, numpy, torch, and every `Trainer` created after
    it that is given no ``seed`` of its own.

    Args:
        seed: the seed; ``None`` reads ``PL_GLOBAL_SEED`` (as Lightning does), else 0.
        workers: accepted for Lightning scripts. DataLoader workers need nothing
            more: torch derives each worker's ``random``, numpy and torch seeds
            from the loader's base seed, which the torch seed set here fixes.

    Returns:
        The seed used.
    """
    global _global_seed
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed_everything(seed={seed!r}): use an int in [0, 2**32)")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    _global_seed = seed
    return seed


def default_seed() -> int:
    """The seed of a Trainer given none: `seed_everything`'s, else the one
    Lightning's own ``seed_everything`` left in ``PL_GLOBAL_SEED``, else 0."""
    if _global_seed is not None:
        return _global_seed
    from_lightning = os.environ.get("PL_GLOBAL_SEED", "")
    return int(from_lightning) if from_lightning.isdigit() else 0
