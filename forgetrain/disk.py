"""The disk a training run will write, and the check that refuses a run whose outputs cannot fit.

A run that fills the disk fails late -- at a checkpoint after hours, or when it exports the final weights after the
last step (an 8B model's fp32 export is 32 GB). :func:`check` refuses such a run before anything is written, with
one line giving the estimate, as ``forgetrain.memory`` does for device memory.

**What is counted** (bytes; N = ``metrics.param_counts(model)["total"]``):

=================  ==================================================================================
final weights      4 * N when ``train.final_params`` (``trace/final.safetensors``: every parameter in fp32,
                   the HF layout)
checkpoints        12 * N per checkpoint when ``train.save`` (the engines' ``state_dict``: fp32 main weights
                   4 * N plus AdamW's exp_avg and exp_avg_sq 8 * N; measured on CPU: 60,197,020 bytes for the
                   5.0 M-parameter llama_tiny), times the most checkpoints on disk at once: the run keeps the
                   newest :data:`forgetrain.checkpoint.KEEP` and writes the next one before pruning, so
                   min(saves, KEEP + 1); a resume with C checkpoints already there adds min(saves,
                   max(C, KEEP) + 1 - C) of them (the next save lands before the oldest is pruned)
=================  ==================================================================================

Not counted: the trace (kilobytes per step, digests included), plots, W&B's offline files, Hydra's records --
all small beside the weights; :data:`RESERVE_BYTES` covers them. ``train.skip_disk_check=true`` runs anyway.
"""

from __future__ import annotations

import shutil
from pathlib import Path

GB = 1e9
RESERVE_BYTES = 256 << 20  # 256 MiB kept free for the trace, plots and logs
CKPT_BYTES_PER_PARAM = 12  # fp32 main weights + two fp32 AdamW moments
FINAL_BYTES_PER_PARAM = 4  # fp32 export


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.0f} MB"


def saves(t, done: int = 0) -> int:
    """How many checkpoints a run of TrainConfig ``t`` writes from step ``done`` to its stop step (the
    ``_loop``'s rule: every ``save_interval`` steps, and at the stop step)."""
    if not t.save:
        return 0
    stop = min(t.steps, t.stop_after) if t.stop_after else t.steps
    if stop <= done:
        return 0
    every = t.save_interval or 0
    n = (stop // every - done // every) if every else 0
    return n + (0 if every and stop % every == 0 else 1)


def estimate_bytes(cfg, existing_checkpoints: int = 0, done: int = 0) -> dict[str, int]:
    """``{"final_weights", "checkpoints"}``: the bytes a run of ``cfg`` (a RunConfig) still adds to its output
    directory's file system at its fullest (module doc for the formulas). ``existing_checkpoints`` are those
    already in the directory (a resume), ``done`` the step it resumes from."""
    from forgetrain.checkpoint import KEEP
    from forgetrain.metrics import param_counts

    t = cfg.train
    n = param_counts(cfg.model)["total"]
    stop = min(t.steps, t.stop_after) if t.stop_after else t.steps
    final = FINAL_BYTES_PER_PARAM * n if getattr(t, "final_params", True) and stop == t.steps else 0
    have, new = existing_checkpoints, saves(t, done)
    # each save lands before the prune, so the directory peaks at max(have, KEEP) + 1 checkpoints, or fewer when
    # fewer saves come; what it adds to the disk is that peak less the ones already there
    extra = min(new, max(have, KEEP) + 1 - have) if new else 0
    return {"final_weights": final, "checkpoints": CKPT_BYTES_PER_PARAM * n * extra}


def free_bytes(path: str | Path) -> int:
    """Free bytes for an unprivileged writer on the file system that holds ``path`` (or its nearest existing
    parent: the output directory need not exist yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def check(cfg, out: str | Path, existing_checkpoints: int = 0, done: int = 0, freed: int = 0) -> None:
    """Refuse a run whose outputs cannot fit the disk under ``out``, before anything is written. ``freed``: bytes
    the run deletes before it writes (``train.overwrite`` clears a previous run's checkpoints and trace).
    Raises ConfigError with one line: the estimate, its parts, the free space and what to change.
    Nothing happens with ``train.skip_disk_check``."""
    from forgetrain.errors import ConfigError

    t = cfg.train
    if getattr(t, "skip_disk_check", False):
        return
    need = estimate_bytes(cfg, existing_checkpoints, done)
    total = sum(need.values())
    if total == 0:
        return
    free = free_bytes(out) + freed
    if total <= free - RESERVE_BYTES:
        return
    parts = []
    if need["final_weights"]:
        parts.append(f"final weights {_size(need['final_weights'])} (train.final_params=false skips them)")
    if need["checkpoints"]:
        fewer = ", or a larger train.save_interval" if saves(t, done) > 1 else ""
        parts.append(f"checkpoints {_size(need['checkpoints'])} (train.save=false{fewer})")
    raise ConfigError(f"this run writes an estimated {_size(total)} under {out}: {'; '.join(parts)}; the file "
                      f"system has {_size(free)} free less a {_size(RESERVE_BYTES)} reserve "
                      f"(forgetrain/disk.py has the estimate; train.skip_disk_check=true runs anyway)")
