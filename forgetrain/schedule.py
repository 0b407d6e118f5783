"""Learning-rate schedule with Megatron-core's ``OptimizerParamScheduler`` semantics (iteration units).

The scheduler's step counter starts at 0 and is advanced *after* each optimizer step, so the update of step
``k`` (1-based) uses ``lr_at(k - 1)``. In particular the first update under warmup uses lr = 0, exactly as
Megatron-LM does. Formulas (Loshchilov & Hutter, SGDR; Megatron ``get_lr``):

* warmup (``n <= warmup``, warmup > 0): ``lr * n / warmup``
* constant: ``lr``; past ``decay_steps``: ``min_lr``
* linear: ``min_lr + (1 - r) * (lr - min_lr)``; cosine: ``min_lr + 0.5 * (cos(pi * r) + 1) * (lr - min_lr)``
  with ``r = (n - warmup) / (decay_steps - warmup)``.
"""

from __future__ import annotations

import math


def lr_at(n: int, *, lr: float, min_lr: float, warmup: int, decay_steps: int, style: str) -> float:
    """Learning rate after ``n`` completed optimizer steps. Raises ValueError on an unknown style."""
    if warmup > 0 and n <= warmup:
        return 0.0 + (lr - 0.0) * float(n) / float(warmup)
    if style == "constant":
        return lr
    if n > decay_steps:
        return min_lr
    ratio = float(n - warmup) / float(decay_steps - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown lr_decay_style '{style}'")
    return min_lr + coeff * (lr - min_lr)


def lr_for_step(train_cfg, completed_steps: int) -> float:
    """``lr_at`` for a :class:`forgetrain.config.TrainConfig`."""
    decay = train_cfg.lr_decay_steps or train_cfg.steps
    return lr_at(completed_steps, lr=train_cfg.lr, min_lr=train_cfg.min_lr, warmup=train_cfg.lr_warmup_steps,
                 decay_steps=decay, style=train_cfg.lr_decay_style)
