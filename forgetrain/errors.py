"""User-facing errors. Anything raised as a :class:`ForgeTrainError` is printed as one line and exits non-zero."""

from __future__ import annotations

import errno
import functools
import sys


class ForgeTrainError(Exception):
    """An error caused by the user's input or environment; printed as ``error: <message>``, exit code 2."""

    exit_code = 2


class ConfigError(ForgeTrainError):
    """The composed config is invalid."""


class DataError(ForgeTrainError):
    """A dataset or tokenizer is missing or corrupt."""


class CheckpointError(ForgeTrainError):
    """A checkpoint is missing, incomplete or incompatible."""


class CannotRunHere(ForgeTrainError):
    """A valid config that this machine cannot run (e.g. a reference's host-memory need exceeds the host's memory),
    detected before anything is built. The message is the one-line reason; ``forgetrain.bench`` reports such a side
    as ``<side>: cannot run here: <reason>`` and times the others."""


class Interrupted(ForgeTrainError):
    """Ctrl-C during training: the trace is flushed, the last checkpoint is intact. Exit code 130."""

    exit_code = 130


class DivergenceError(ForgeTrainError):
    """Training produced a non-finite loss (the last checkpoint is intact). Exit code 1."""

    exit_code = 1


_FULL = {errno.ENOSPC, errno.EDQUOT}  # a full disk or quota: the environment, not a bug


def full_disk_line(e: OSError) -> str | None:
    """The one line for a write that found the disk (or the quota) full, else None. Every file ForgeTrain writes
    goes through a temp file and a rename, and checkpoints through a temp directory, so the previous version of
    each stands."""
    if e.errno not in _FULL:
        return None
    where = f" writing {e.filename}" if e.filename else ""
    return (f"{e.strerror}{where}; the files written before it and the last checkpoint (if any) are intact: free "
            f"space, then run the same command with train.resume=true")


def print_error(message: str) -> None:
    """``error: <first line of message>`` on stderr, in one write: ranks sharing a terminal cannot split the line."""
    msg = next((x.strip() for x in str(message).strip().splitlines() if x.strip()), "")
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()


def one_line_errors(fn):
    """Decorator for entry points: ForgeTrainError -> one line on stderr and ``sys.exit(exit_code)``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ForgeTrainError as e:
            print_error(str(e) if str(e).strip() else type(e).__name__)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            print_error("interrupted")
            sys.exit(130)
        except OSError as e:
            line = full_disk_line(e)
            if line is None:
                raise
            print_error(line)
            sys.exit(1)

    return wrapper
