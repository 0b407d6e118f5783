"""Content hashes of prepared corpora: written into the manifest when a corpus is prepared, checked on every load.

:func:`file_entries` hashes the files of a cache entry (``train.{bin,idx}``, ``valid.{bin,idx}``, the tokenizer)
into the manifest's ``files`` map: ``name -> {"size", "sha256"}``. :func:`verify` checks them when the entry is
used again. Hashing a large corpus on every load would cost seconds per GB, so a file is hashed once per state:
the state is its ``(size, mtime_ns, ctime_ns, inode)``, remembered with the digest in the entry's
``.verified.json`` and in this process. A write to the file moves its ctime, which no process can set back, so a
changed file is always hashed again; the stamp only saves the re-hash of a file nobody touched.

What this does not stop: a writer that replaces a data file *and* rewrites ``manifest.json`` with the new hashes.
The manifest lives beside the data, with the same permissions. The forge keeps its own record of what the judge
reads, taken before each agent round (``forgetrain.forge.bracket``), for that case.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from forgetrain.errors import DataError

STAMP = ".verified.json"
_CHUNK = 1 << 22
_SEEN: dict[str, tuple] = {}  # path -> (state, sha256) verified in this process


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes, read in 4 MiB chunks. Raises OSError when it cannot be read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _state(path: str) -> tuple:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def file_entries(directory: str | os.PathLike, names: list[str]) -> dict[str, dict]:
    """``{name: {"size", "sha256"}}`` for each of ``names`` that exists in ``directory`` (the manifest's
    ``files``). Raises OSError when one cannot be read."""
    out = {}
    for name in names:
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            out[name] = {"size": os.path.getsize(p), "sha256": sha256_file(p)}
    return out


def _read_stamp(directory: str) -> dict:
    try:
        with open(os.path.join(directory, STAMP)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamp(directory: str, stamp: dict) -> None:
    from forgetrain.trace import atomic_write_json

    try:
        atomic_write_json(os.path.join(directory, STAMP), stamp)
    except OSError:
        pass  # a read-only cache: the files are hashed again next time, nothing else changes


def stamp(directory: str | os.PathLike, files: dict[str, dict]) -> None:
    """Remember the current state of the just-hashed ``files`` (the manifest's map) of ``directory`` as verified,
    so that the first load after preparing does not hash them again."""
    directory = os.fspath(directory)
    out = {}
    for name, want in files.items():
        p = os.path.join(directory, name)
        try:
            state = _state(p)
        except OSError:
            continue
        out[name] = [*state, want.get("sha256")]
        _SEEN[p] = (state, want.get("sha256"))
    _write_stamp(directory, out)


def verify(directory: str | os.PathLike, manifest: dict) -> None:
    """Check every file the manifest's ``files`` lists against its size and sha256 (hashing only files whose
    state changed since they were last verified, see the module docstring). Raises DataError (one line, naming the
    file and the way out) when the manifest has no hashes, a file is missing, or its content differs."""
    directory = os.fspath(directory)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise DataError(f"prepared data '{directory}' has no content hashes in its manifest; delete the directory "
                        f"to prepare it again")
    stamp, dirty = _read_stamp(directory), False
    for name, want in sorted(files.items()):
        p = os.path.join(directory, name)
        try:
            state = _state(p)
        except OSError:
            raise DataError(f"prepared data file '{p}' is missing; delete '{directory}' to prepare it again") from None
        key = [*state, want.get("sha256")]
        if _SEEN.get(p) == (state, want.get("sha256")) or stamp.get(name) == key:
            _SEEN[p] = (state, want.get("sha256"))
            continue
        try:
            got = sha256_file(p) if state[0] == want.get("size") else None
        except OSError as e:
            raise DataError(f"cannot read prepared data file '{p}': {e}") from None
        if got != want.get("sha256"):
            what = f"sha256 {got[:12]} != {str(want.get('sha256'))[:12]}" if got else \
                f"{state[0]} bytes, the manifest says {want.get('size')}"
            raise DataError(f"prepared data file '{p}' was modified after it was prepared ({what}); delete "
                            f"'{directory}' to prepare it again")
        _SEEN[p] = (state, got)
        stamp[name], dirty = key, True
    if dirty:
        _write_stamp(directory, stamp)


def verify_beside(prefix: str) -> bool:
    """For a user-given ``data.path`` prefix: verify the ``manifest.json`` beside it when there is one that lists
    the prefix's files (a prepared cache entry, or a window the forge's judge built). Returns whether one was
    checked. Raises DataError as :func:`verify`."""
    d = os.path.dirname(os.path.abspath(prefix))
    path = Path(d) / "manifest.json"
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        raise DataError(f"unreadable manifest '{path}' beside data path '{prefix}'") from None
    base = os.path.basename(prefix)
    if not isinstance(manifest, dict) or not any(str(n).startswith(base + ".") for n in manifest.get("files") or {}):
        return False
    verify(d, manifest)
    return True
