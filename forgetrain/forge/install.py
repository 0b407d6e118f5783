"""Install a sealed engine into ``scenarios/``: ``python -m forgetrain.forge.install SEAL_DIR scenarios/NAME``.

``SEAL_DIR`` is a forge run's ``sealed/`` directory (``engine/`` + ``seal.json``). The engine's source hash is
checked against ``seal.json`` first, file by file, and against the installed copy that passed the seal's re-check
and the forge run's state (a modified sealed engine is refused: it must be gated again), the import guard and the content check
(:mod:`forgetrain.forge.content`: no reference framework's code under any name) are run on it, and its
files are copied beside the destination, hashed again (the installed bytes must be the sealed ones) and swapped
in, with ``SEAL.json`` (:func:`package_seal`: the provenance known before the seal's re-checks, so that every
judged copy held the same bytes; the whole record stays in ``SEAL_DIR/seal.json``). An existing
engine at the destination is replaced only with ``--force``. Exit 0 on success, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from forgetrain.errors import ConfigError, one_line_errors
from forgetrain.forge.workspace import ENGINE_DIR, REPO_ROOT, file_hashes, source_hash
from forgetrain.guard import UnscannableSource, scan_tree
from forgetrain.trace import atomic_write_bytes


PACKAGE_SEAL_KEYS = ("scenario", "source_hash", "files", "tier", "target_tier", "record")


def package_seal(seal: dict) -> dict:
    """What ``SEAL.json`` inside an installed engine holds: the keys of :data:`PACKAGE_SEAL_KEYS` of the seal
    record ``seal`` (``record``: where the whole record, verdicts and re-checks included, lies). Every one of them
    is known before the seal's re-checks, so the copies they judge hold the same bytes as the final install: an
    engine that reads its ``SEAL.json`` cannot tell a judged copy from a user's (escape class 6)."""
    return {k: seal.get(k) for k in PACKAGE_SEAL_KEYS}


def _write_package_seal(d: Path, seal: dict) -> None:
    """``d/SEAL.json`` := :func:`package_seal` of ``seal``, left untouched when it holds those bytes already (the
    copy the seal's re-checks judged keeps its file as they saw it)."""
    f = d / "SEAL.json"
    body = json.dumps(package_seal(seal), indent=1, sort_keys=True) + "\n"
    if not (f.is_file() and f.read_text() == body):
        atomic_write_bytes(f, body.encode())


def _sealed_hashes(seal_dir: Path, seal: dict, eng: Path, staged: bool = False) -> dict[str, str]:
    """The engine files' sha256 that the seal vouches for, checked against every record of them: the engine's
    own files, ``seal.json``'s ``files`` and ``source_hash``, the hashes of the installed copy that passed the
    seal's re-check (``installed_check.files``), and the forge run's state beside the seal
    (``../workspace/forge_state.json``, when there: it must name this dir as its seal, unless ``staged``, the
    forge's own copy for its re-checks). Raises ConfigError naming the first disagreement."""
    got = file_hashes(eng)
    if seal.get("source_hash") != source_hash(eng):
        raise ConfigError(f"{eng} does not match its seal (source hash {source_hash(eng)[:12]} != "
                          f"{str(seal.get('source_hash'))[:12]})")
    records = [("seal.json's files", seal.get("files")),
               ("the installed copy its re-check judged", (seal.get("installed_check") or {}).get("files"))]
    state_file = seal_dir.parent / "workspace" / "forge_state.json"
    if state_file.is_file() and not staged:  # the forge's staged copy is judged before its state names a seal
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{state_file} cannot be read ({type(e).__name__}: {e})") from None
        named = state.get("seal")
        if state.get("status") != "sealed" or not isinstance(named, str) or Path(named).resolve() != seal_dir:
            # the forge rewrites its state after every round: at the run's end it names the seal it wrote, and a
            # sealed/ dir it does not name was written by someone else (an agent can write anywhere the user can)
            raise ConfigError(f"{seal_dir} was not sealed by the forge run beside it ({state_file} says status "
                              f"{state.get('status')!r}, seal {state.get('seal')!r}): gate the engine with "
                              f"python -m forgetrain.forge")
        records.append((f"the forge run's state ({state_file})", (state.get("reverify") or {}).get("files")))
    for what, want in records:
        if want is None:
            continue
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        if diff:
            raise ConfigError(f"{eng} is not the engine that was sealed: {len(diff)} file(s) differ from "
                              f"{what} (first: {diff[0]}); re-gate it with python -m forgetrain.forge")
    return got


def install(seal_dir: str | Path, dest: str | Path, force: bool = False, staged: bool = False) -> Path:
    """Copy the sealed engine in ``seal_dir`` into ``dest``; returns ``dest``. Raises ConfigError (nothing written)
    on a missing, unreadable or modified seal (the engine's bytes must be the ones sealed and re-checked:
    :func:`_sealed_hashes`), forbidden imports, a reference framework's code in it, an existing different engine
    at ``dest`` without ``force``, a seal dir that the forge run beside it did not seal (``staged``: the forge's
    own staged copy, which its re-checks judge before any seal), or a copy whose installed bytes do not hash as
    sealed."""
    seal_dir, dest = Path(seal_dir).resolve(), Path(dest).resolve()
    seal_file, eng = seal_dir / "seal.json", seal_dir / ENGINE_DIR
    if not seal_file.exists() or not (eng / "engine.py").exists():
        raise ConfigError(f"{seal_dir} is not a sealed engine (needs seal.json and engine/engine.py)")
    try:
        seal = json.loads(seal_file.read_text())
        if not isinstance(seal, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{seal_file} cannot be read ({type(e).__name__}: {e})") from None
    want = _sealed_hashes(seal_dir, seal, eng, staged)
    got = source_hash(eng)
    try:
        hits = scan_tree(eng)
    except UnscannableSource as e:
        raise ConfigError(f"sealed engine holds a file Python would compile as other code than the scanned (escape "
                          f"class 7): {e}") from None
    if hits:
        raise ConfigError(f"sealed engine imports a reference framework: {hits[0]}")
    from forgetrain.forge import content

    shared = content.scan(eng, content.index_for())
    if shared:
        raise ConfigError(f"sealed engine contains a reference framework's code (escape class 7): {shared[0]}")
    if (dest / "engine.py").exists():
        current = {k: v for k, v in file_hashes(dest).items() if k != "SEAL.json"}
        if current == want:
            _write_package_seal(dest, seal)
            print(f"{dest} already holds this engine ({got[:12]})", file=sys.stderr)
            return dest
        if not force:
            raise ConfigError(f"{dest} already holds an engine; pass --force (forge.install does) to replace it")
    # copied beside the destination, checked, then swapped in: a copy that does not hash as sealed writes nothing
    new, old = dest.with_name(dest.name + ".installing"), dest.with_name(dest.name + ".replaced")
    for d in (new, old):
        shutil.rmtree(d, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(eng, new, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    landed = file_hashes(new)
    if landed != want:
        shutil.rmtree(new, ignore_errors=True)
        bad = sorted(k for k in set(want) | set(landed) if want.get(k) != landed.get(k))
        raise ConfigError(f"the copy of {eng} at {dest} does not hash as sealed ({len(bad)} file(s), first "
                          f"{bad[0]}): the engine changed while it was installed; nothing was installed")
    _write_package_seal(new, seal)
    if dest.exists():
        dest.rename(old)
    new.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    name = dest.name
    tier = seal.get("tier") if "verdicts" in seal else "not yet sealed: the copy its re-check judges"
    print(f"installed {seal.get('scenario')} engine ({tier}, source {got[:12]}) -> {dest}", file=sys.stderr)
    if dest.parent == REPO_ROOT / "scenarios" and not (REPO_ROOT / "conf" / "scenario" / f"{name}.yaml").exists():
        print(f"note: add conf/scenario/{name}.yaml (scenario.name: {name}, scenario.engine: "
              f"\"scenarios.{name}.engine:Engine\") so that scenario={name} composes", file=sys.stderr)
    return dest


@one_line_errors
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge.install", description=__doc__.split("\n\n")[0])
    ap.add_argument("seal_dir", help="a forge run's sealed/ directory")
    ap.add_argument("dest", help="destination, e.g. scenarios/NAME")
    ap.add_argument("--force", action="store_true", help="replace an existing engine at dest")
    a = ap.parse_args(argv)
    install(a.seal_dir, a.dest, force=a.force)


if __name__ == "__main__":
    main()
