"""How verify sets up the engine runs it compares, shared by :mod:`forgetrain.verify` and
:mod:`forgetrain.equivalence.inits` (and by the forge and the references that make verify's runs themselves):
the run config cut to a number of steps (the device is freed between two engines by
:func:`forgetrain.distributed.free_device`)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forgetrain.config import RunConfig


def run_cfg(cfg: RunConfig, out: Path, **train_overrides) -> RunConfig:
    """The configured run ``cfg`` as verify runs it, writing into ``out``: a deep copy with ``train_overrides``
    (fields of ``cfg.train``, e.g. ``steps``, ``seed``, ``digests``) applied. Cut to ``steps``, the LR schedule
    stays the full run's (``lr_decay_steps`` pinned to the longer of the two unless set); ``out`` is overwritten
    unless the run resumes; no checkpoints are saved except by a run that stops to be resumed or resumes (the
    resume gate); no samples, no logger, no plots. Raises TypeError for an override that is no field of
    ``cfg.train``."""
    c = copy.deepcopy(cfg)
    if "steps" in train_overrides and cfg.train.lr_decay_steps is None:
        train_overrides.setdefault("lr_decay_steps", max(cfg.train.steps, train_overrides["steps"]))
    train_overrides.setdefault("overwrite", not train_overrides.get("resume", False))  # verify owns `out`
    # no checkpoints, except for a run that stops to be resumed, or resumes (the resume gate)
    train_overrides.setdefault("save", bool(train_overrides.get("stop_after") or train_overrides.get("resume")))
    c.train = dataclasses.replace(c.train, out_dir=str(out), sample_tokens=0, save_interval=0,
                                  **train_overrides)
    c.logger = dataclasses.replace(c.logger, name="none", plots=False)
    return c
