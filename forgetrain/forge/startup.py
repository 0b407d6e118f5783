"""What the forge checks before a run starts, so that a bad request is one ``error:`` line that writes nothing:
the options a round would only trip over later (:func:`check_options`), the state a resumed run reads
(:func:`read_state`), and the lock that keeps two forge processes, or one and what a killed one left behind,
out of the same run dir (:func:`lock_out_dir`).
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from pathlib import Path

from forgetrain.errors import ConfigError


def check_agent_command(command) -> None:
    """``agent.command`` must be a string (or unset). Raises ConfigError for anything else: ``agent.command=true``
    is read by Hydra as a boolean, and would run as ``True``."""
    if command is not None and not isinstance(command, str):
        raise ConfigError(f"agent.command must be a shell command (a string), got {type(command).__name__} "
                          f"{command!r}; quote it, e.g. agent.command='\"true\"'")


def check_install(install: str | None) -> None:
    """``forge.install`` must name a directory that can be created or replaced: not a file, and the nearest
    existing directory above it one where a directory can be made (tried, and removed at once). Raises
    ConfigError naming the path."""
    if not install:
        return
    dest = Path(install).absolute()
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"forge.install={install}: {dest} is a file, not a directory")
    p = dest.parent
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"forge.install={install} cannot be created: {p} is a file, not a directory")
    try:  # a real write: permission bits do not tell (root may "write" /proc, where nothing can be created)
        os.rmdir(tempfile.mkdtemp(prefix=".forge-install-probe-", dir=p))
    except OSError as e:
        raise ConfigError(f"forge.install={install} cannot be created: {p} is not writable ({e.strerror})") from None


def check_options(opts, agent) -> None:
    """The checks of :func:`forgetrain.forge.loop.forge` beyond the tiers and rounds: ``agent.command``'s type
    (:func:`check_agent_command`), ``forge.install`` (:func:`check_install`), ``forge.curve_steps`` and
    ``forge.timing_steps`` (positive). Raises ConfigError."""
    check_agent_command(agent.command)
    check_install(opts.install)
    for key in ("curve_steps", "timing_steps"):
        v = getattr(opts, key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"forge.{key} must be a positive integer, got {v!r}")


def read_state(path: Path) -> dict:
    """The state of a forge run being resumed (``workspace/forge_state.json``): a JSON object with an integer
    ``round``, a string ``status``, ``mode`` and ``end_commit``. Raises ConfigError naming the file when it cannot
    be read or is not such an object."""
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({type(e).__name__}: {e}); the run cannot be resumed: start over "
                          f"with forge.overwrite=true") from None
    bad = "not a JSON object" if not isinstance(state, dict) else next(
        (f"its '{k}' is not {want.__name__}" for k, want in (("round", int), ("status", str), ("mode", str),
                                                              ("end_commit", str))
         if not isinstance(state.get(k), want) or isinstance(state.get(k), bool)), None)
    if bad is None and state["round"] < 0:
        bad = "its 'round' is negative"
    if bad:
        raise ConfigError(f"{path} is not a forge run's state ({bad}); the run cannot be resumed: start over with "
                          f"forge.overwrite=true")
    return state


def lock_out_dir(out: Path, wait_s: float = 30.0) -> int:
    """Take the exclusive lock of the forge run dir ``out`` (``flock`` on the directory itself: no file is
    written) and return its descriptor, held until the process exits. The ladder holds it too (it is passed to
    it), so a forge process killed mid-ladder keeps the dir locked until its ladder and the sides the ladder
    ends have exited. Waits up to ``wait_s`` for a holder to go. Raises ConfigError when another forge process
    (or what a killed one left behind) still holds it."""
    import fcntl

    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                os.close(fd)
                raise ConfigError(f"the forge run at {out} is in use by another process (a forge run, or a ladder "
                                  f"a killed one left behind); wait for it to end") from None
        time.sleep(0.2)
