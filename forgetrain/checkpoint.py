"""Atomic checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout under ``<out_dir>/checkpoints``::

    step_000100/          a complete DCP checkpoint (every rank's shard + .metadata) plus harness.json
    latest                text file naming the newest complete step directory

A save writes ``.tmp_step_000100`` first, and only when every rank has finished is it renamed into place and
``latest`` rewritten (both atomic renames). A crash mid-save leaves the previous checkpoint and ``latest``
intact; stale ``.tmp_*`` directories are removed at the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from forgetrain.errors import CheckpointError
from forgetrain.trace import atomic_write_bytes, atomic_write_json


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save(ckpt_root: str | os.PathLike, step: int, state: dict, harness: dict) -> Path:
    """Save ``state`` (tensors / nested dicts) for ``step``; rank 0 also writes ``harness`` (JSON). Atomic."""
    root = Path(ckpt_root)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        atomic_write_json(tmp / "harness.json", harness)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_bytes(root / "latest", (final.name + "\n").encode())
    _barrier()
    return final


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory, or None when there is none."""
    root = Path(ckpt_root)
    ptr = root / "latest"
    if not ptr.exists():
        return None
    d = root / ptr.read_text().strip()
    return d if (d / "harness.json").exists() and (d / ".metadata").exists() else None


def load(ckpt_dir: str | os.PathLike, template: dict) -> tuple[dict, dict]:
    """Load into ``template`` (in place, DCP semantics) and return ``(state, harness)``.

    Raises CheckpointError when the directory is incomplete or does not match the template.
    """
    d = Path(ckpt_dir)
    try:
        harness = json.loads((d / "harness.json").read_text())
        dcp.load(template, checkpoint_id=str(d))
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {d}: {first}") from e
    return template, harness


def prune(ckpt_root: str | os.PathLike, keep: int = 2) -> None:
    """Keep the newest ``keep`` complete checkpoints (rank 0 only)."""
    if _rank() != 0:
        return
    dirs = sorted(Path(ckpt_root).glob("step_*"))
    for d in dirs[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def to_cpu_tree(x):
    """Detach/clone every tensor of a nested dict to CPU (for templates that must not alias live state)."""
    if isinstance(x, dict):
        return {k: to_cpu_tree(v) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    return x
