"""A run's output directory before it writes anything: where it is, the lock that keeps a second run out,
the refusal of a directory that holds another run, the disk check, and the record of the composed config."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from forgetrain import checkpoint
from forgetrain.config import RunConfig
from forgetrain.distributed import DistEnv


def out_dir(cfg: RunConfig) -> Path:
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not under Hydra
        return Path("runs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def missing_dirs(out: Path) -> list[Path]:
    """``out`` and those of its parents that do not exist yet, innermost first."""
    missing, d = [], out.absolute()
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    return missing


def lock_out_dir(out: Path, env: DistEnv):
    """Take ``<out>/.lock`` (an exclusive ``flock``, rank 0) for the run's lifetime, so a second run on the same
    directory -- a fresh one, a resume or an overwrite -- is refused while the first lives. The OS drops the lock
    when the holder dies, even by kill -9. Returns the open lock file (None off rank 0); :func:`unlock_out_dir`
    gives it back. Raises ConfigError on every rank when the directory is in use.

    The holder unlinks the file when it ends (a run that wrote nothing leaves no directory behind), so a run that
    opened the file before that unlink may then lock an inode no path names any more, while a third run creates
    and locks a new ``.lock``: both would hold "the" lock. So a lock counts only when the path still names the
    locked inode afterwards; otherwise it is dropped and taken again on the file the path names now (the
    protocol of lock files that are removed by their holders, e.g. ``flufl.lock``, ``lockfile``)."""
    from forgetrain.errors import ConfigError

    fh, busy = None, None
    if env.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        fh, busy = _flock_current(out / ".lock")
    busy = env.broadcast_object(busy)
    if busy is not None:
        raise ConfigError(f"{out} is in use by another run (pid {busy}); wait for it to end, or choose another "
                          f"train.out_dir")
    return fh


def _flock_current(path: Path):
    """``(open file, None)`` holding an exclusive flock on the inode ``path`` names once it is held, with this pid
    written into it; or ``(None, pid)`` of the holder (``"?"`` when unreadable) when another process holds it."""
    import fcntl

    while True:
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            busy = fh.read().strip() or "?"
            fh.close()
            return None, busy
        try:
            current = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:  # unlinked by the holder that just let go
            current = False
        if current:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            return fh, None
        fh.close()  # a stale inode: its holder has ended; take the file the path names now


def unlock_out_dir(out: Path, fh) -> None:
    """Give back :func:`lock_out_dir`'s lock: unlink ``<out>/.lock`` while still holding it, then release it. A run
    that locks the old inode after the unlink finds it stale and retries (:func:`_flock_current`)."""
    (out / ".lock").unlink(missing_ok=True)
    fh.close()


def claim_out_dir(cfg: RunConfig, out: Path, env: DistEnv) -> None:
    """A fresh run refuses a directory that holds another run's checkpoints or trace (they would be overwritten,
    and pruning would delete this run's own checkpoints), unless ``train.overwrite=true`` clears them first.
    Raises ConfigError."""
    import shutil

    from forgetrain.errors import ConfigError

    if cfg.train.resume:
        return
    ckpts, trace = out / "checkpoints", out / "trace"
    held = any(ckpts.glob("step_*")) or (trace / "trace.jsonl").exists()
    if held and not cfg.train.overwrite:
        raise ConfigError(f"{out} already holds a run (checkpoints or trace); continue it with train.resume=true, "
                          f"replace it with train.overwrite=true, or choose another train.out_dir")
    if held:
        env.barrier()  # every rank has looked before rank 0 deletes
        if env.rank == 0:
            shutil.rmtree(ckpts, ignore_errors=True)
            shutil.rmtree(trace, ignore_errors=True)
        env.barrier()


def check_disk(cfg: RunConfig, out: Path, env: DistEnv, *, final_params: bool) -> None:
    """``forgetrain.disk.check`` on rank 0 before the run writes anything (a resume counts the checkpoints already
    under ``out``); its refusal is raised on every rank as ConfigError."""
    from forgetrain import disk
    from forgetrain.errors import ConfigError
    from forgetrain.trace import stale_temp_files

    line = None
    if env.rank == 0:
        root = out / "checkpoints"
        have = sorted(root.glob("step_*")) if cfg.train.resume and root.is_dir() else []
        done = 0
        if have:
            last = checkpoint.latest(root)
            done = int(last.name.split("_")[-1]) if last is not None else 0
        c = cfg if final_params else with_train(cfg, final_params=False)
        # what the run deletes before it writes: a killed run's temp files (the trace writer removes them), and
        # with train.overwrite the previous run's checkpoints and trace
        freed = sum(f.stat().st_size for f in stale_temp_files(out / "trace"))
        if cfg.train.overwrite and not cfg.train.resume:
            freed = sum(f.stat().st_size for d in (root, out / "trace") if d.is_dir()
                        for f in d.rglob("*") if f.is_file())
        try:
            disk.check(c, out, existing_checkpoints=len(have), done=done, freed=freed)
        except ConfigError as e:
            line = str(e)
    line = env.broadcast_object(line)
    if line:
        raise ConfigError(line)


def with_train(cfg: RunConfig, **changes) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def record_config(out: Path, record, resume: bool) -> None:
    """Write the composed config (and Hydra's overrides, when under Hydra) into ``<out>/.hydra/``, atomically."""
    from omegaconf import OmegaConf

    from forgetrain.trace import atomic_write_bytes

    name = "config.resume.yaml" if resume else "config.yaml"
    atomic_write_bytes(out / ".hydra" / name, OmegaConf.to_yaml(record).encode())
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under Hydra
        return
    atomic_write_bytes(out / ".hydra" / name.replace("config", "overrides"), OmegaConf.to_yaml(task).encode())
