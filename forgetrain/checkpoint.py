"""Atomic checkpoints through ``torch.distributed.checkpoint`` (DCP).

Layout under ``<out_dir>/checkpoints``::

    step_000100/          a complete DCP checkpoint (every rank's shard + .metadata) plus harness.json
    latest                text file naming the newest complete step directory

A save writes ``.tmp_step_000100`` first, and only when every rank has finished is it renamed into place and
``latest`` rewritten (both atomic renames). A crash mid-save leaves the previous checkpoint and ``latest``
intact; stale ``.tmp_*`` directories and pointer temp files are removed at the next save. When ``latest`` is
missing, unreadable or names an incomplete directory, :func:`latest` falls back to the highest-numbered
complete ``step_*`` directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
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


@contextlib.contextmanager
def _deferred_sigint():
    """Hold Ctrl-C until the block ends, so a save is never cut in half by it; then hand it to the handler that was
    in place (the training loop's, which stops at the step boundary: ``forgetrain.run.loop.CtrlC``), or, when that
    is Python's default, raise KeyboardInterrupt."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):  # ignored (nohup, a background job): stays so
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signal.SIGINT, None)
        else:
            raise KeyboardInterrupt


def save(ckpt_root: str | os.PathLike, step: int, state: dict, harness: dict) -> Path:
    """Save ``state`` (tensors / nested dicts) for ``step``; rank 0 also writes ``harness`` (JSON). Atomic; a
    Ctrl-C during the save takes effect when it is complete.

    Raises CheckpointError (one line) when the save fails -- a full disk, an unwritable directory, any error DCP
    wraps in its ``CheckpointException`` (a BaseException). Then this step's temp directory is removed, and the
    previous checkpoint and the ``latest`` pointer are left as they were, so the run resumes from them.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    root = Path(ckpt_root)
    with _deferred_sigint():
        try:
            return _save(root, step, state, harness)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - every failure becomes one line
            shutil.rmtree(root / f".tmp_step_{step:06d}", ignore_errors=True)
            for stale in root.glob(".latest*.tmp") if root.is_dir() else ():
                stale.unlink(missing_ok=True)
            prev = latest(root)
            raise CheckpointError(f"cannot save the step-{step} checkpoint under {root}: {_first_line(e)}; "
                                  f"the last good checkpoint is {prev.name if prev else 'none'}") from None


def _save(ckpt_root: str | os.PathLike, step: int, state: dict, harness: dict) -> Path:
    root = Path(ckpt_root)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in root.glob(".latest*.tmp"):
            stale.unlink(missing_ok=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if _rank() == 0:
        atomic_write_json(tmp / "harness.json", harness)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if (root / "latest").is_dir():  # a damaged pointer cannot be replaced atomically by a file
            shutil.rmtree(root / "latest")
        atomic_write_bytes(root / "latest", (final.name + "\n").encode())
    _barrier()
    return final


def _complete(d: Path) -> bool:
    return d.is_dir() and (d / "harness.json").is_file() and (d / ".metadata").is_file()


def latest(ckpt_root: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names if it is complete; else the highest-numbered complete ``step_*``
    directory (a damaged or missing pointer costs nothing); None when there is no complete checkpoint."""
    root = Path(ckpt_root)
    ptr = root / "latest"
    try:
        name = ptr.read_text(encoding="utf-8").strip()
        if name and "/" not in name and _complete(root / name):
            return root / name
    except (OSError, UnicodeDecodeError):
        pass
    steps = sorted((d for d in root.glob("step_*") if _complete(d)), key=lambda d: d.name)
    return steps[-1] if steps else None


# what a damaged file (not a checkpoint of another model) makes DCP's loader say: a short read, a bad pickle
_DAMAGE_MARKS = ("EOFError", "UnpicklingError", "invalid load key", "truncated", "unexpected end")


def load(ckpt_dir: str | os.PathLike, template: dict) -> tuple[dict, dict]:
    """Load into ``template`` (in place, DCP semantics) and return ``(state, harness)``.

    Raises CheckpointError when the directory is incomplete or does not match the template.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    d = Path(ckpt_dir)
    try:
        harness = json.loads((d / "harness.json").read_text())
        if not isinstance(harness, dict) or not isinstance(harness.get("step"), int):
            raise ValueError("harness.json has no integer 'step'")
        with _quiet_dcp_fallback_logs():
            dcp.load(template, checkpoint_id=str(d))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every failure becomes one line
        why = _first_line(e)
        damaged = isinstance(e, (ValueError, OSError)) or any(m in why for m in _DAMAGE_MARKS)
        hint = "is it damaged or truncated?" if damaged else "does it match this model and layout?"
        raise CheckpointError(f"cannot load checkpoint {d} ({hint}): "
                              f"{why if len(why) <= 300 else why[:297] + '...'}") from e
    return template, harness


class _DropDcpRecords(logging.Filter):
    """Drops the records DCP's loader logs on the *root* logger (``torch/distributed/checkpoint/*.py`` calls
    ``logging.getLogger()``) -- a damaged ``.metadata`` makes it log two warnings with full tracebacks while it tries
    the global and then the rank-local metadata. Both failures are also in the exception it raises, which
    :func:`load` turns into one line, so nothing is lost."""

    _DIR = os.path.join("torch", "distributed", "checkpoint") + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and self._DIR in record.pathname)


@contextlib.contextmanager
def _quiet_dcp_fallback_logs():
    """Install :class:`_DropDcpRecords` on the root logger for the block."""
    f = _DropDcpRecords()
    root = logging.getLogger()
    root.addFilter(f)
    try:
        yield
    finally:
        root.removeFilter(f)


def load_newest_good(ckpt_root: str | os.PathLike, make_template) -> tuple[dict, dict, Path, list[str]]:
    """Load the newest checkpoint that loads: :func:`latest` first, then every older complete ``step_*``.

    ``make_template()`` gives a fresh template for each try (a failed DCP load may have written part of one).
    Returns ``(state, harness, path, skipped)``, ``skipped`` naming each damaged newer checkpoint with its
    reason (the caller warns). Raises CheckpointError when none loads or none exists.
    """
    root = Path(ckpt_root)
    first = latest(root)
    if first is None:
        raise CheckpointError(f"no complete checkpoint under {root}")
    older = sorted((d for d in root.glob("step_*") if _complete(d) and d.name < first.name), reverse=True)
    skipped: list[str] = []
    for d in [first, *older]:
        try:
            state, harness = load(d, make_template())
            return state, harness, d, skipped
        except CheckpointError as e:
            skipped.append(f"{d.name}: {e}")
    newest = skipped[0].split(": ", 1)[1]
    older_n = len(skipped) - 1
    raise CheckpointError(newest + (f" (and the {older_n} older checkpoint{'s' if older_n > 1 else ''} under "
                                    f"{root} do{'es' if older_n == 1 else ''} not load either)" if older_n else ""))


def _first_line(e: BaseException) -> str:
    """The most telling line of a (possibly DCP-wrapped) exception, truncated."""
    try:
        text = str(e).strip()
    except Exception:  # noqa: BLE001 - a wrapper whose formatting itself fails
        text = ""
    for line in text.splitlines():  # DCP wraps per-rank failures; the wrapped error's last line says most
        line = line.strip()
        if line and ("Error" in line or "mismatch" in line.lower() or "Missing" in line):
            text = line
    first = text.splitlines()[0].strip() if text else type(e).__name__
    return f"{type(e).__name__}: {first}"[:400]


KEEP = 2  # complete checkpoints a run keeps (the newest); forgetrain.disk counts on it


def prune(ckpt_root: str | os.PathLike, keep: int = KEEP) -> None:
    """Keep the newest ``keep`` complete checkpoints (rank 0 only). The directory holds one run's lineage only:
    ``run.outdir.claim_out_dir`` refuses (or clears, with ``train.overwrite``) another run's checkpoints."""
    if _rank() != 0:
        return
    dirs = sorted(Path(ckpt_root).glob("step_*"))
    for d in dirs[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def to_cpu_tree(x, share_pinned: bool = False):
    """Detach/clone every tensor of a nested dict to CPU (for templates that must not alias live state).

    ``share_pinned``: page-locked host tensors are kept as they are, so a load writes them in place. These are an
    engine's state that already lives in host memory (the Hopper engine's offloaded AdamW moments: 64 GB at 8B,
    which a copy would double on a 128 GiB host). The resume may do this safely: :func:`load_newest_good` ends
    either with a load that wrote every key (a partial write by a damaged newer checkpoint is overwritten) or
    with CheckpointError, which ends the run."""
    if isinstance(x, dict):
        return {k: to_cpu_tree(v, share_pinned) for k, v in x.items()}
    if isinstance(x, torch.Tensor):
        if share_pinned and x.device.type == "cpu" and x.is_pinned():
            return x.detach()
        return x.detach().cpu().clone()
    return x
