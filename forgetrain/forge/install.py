"""Install a sealed engine into ``scenarios/``: ``python -m forgetrain.forge.install SEAL_DIR scenarios/NAME``.

``SEAL_DIR`` is a forge run's ``sealed/`` directory (``engine/`` + ``seal.json``). The engine's source hash is
checked against ``seal.json`` first (a modified sealed engine is refused), the import guard and the content check
(:mod:`forgetrain.forge.content`: no reference framework's code under any name) are run on it, and its
files are copied into the destination with ``seal.json`` beside them as ``SEAL.json`` (provenance). An existing
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
from forgetrain.guard import scan_tree


def install(seal_dir: str | Path, dest: str | Path, force: bool = False) -> Path:
    """Copy the sealed engine in ``seal_dir`` into ``dest``; returns ``dest``. Raises ConfigError on a missing or
    modified seal, forbidden imports, a reference framework's code in it, or an existing different engine at
    ``dest`` without ``force``."""
    seal_dir, dest = Path(seal_dir).resolve(), Path(dest).resolve()
    seal_file, eng = seal_dir / "seal.json", seal_dir / ENGINE_DIR
    if not seal_file.exists() or not (eng / "engine.py").exists():
        raise ConfigError(f"{seal_dir} is not a sealed engine (needs seal.json and engine/engine.py)")
    seal = json.loads(seal_file.read_text())
    got = source_hash(eng)
    if seal.get("source_hash") != got:
        raise ConfigError(f"{eng} does not match its seal (source hash {got[:12]} != {str(seal.get('source_hash'))[:12]})")
    hits = scan_tree(eng)
    if hits:
        raise ConfigError(f"sealed engine imports a reference framework: {hits[0]}")
    from forgetrain.forge import content

    shared = content.scan(eng, content.index_for())
    if shared:
        raise ConfigError(f"sealed engine contains a reference framework's code (escape class 7): {shared[0]}")
    if (dest / "engine.py").exists():
        current = {k: v for k, v in file_hashes(dest).items() if k != "SEAL.json"}
        if current == file_hashes(eng):
            print(f"{dest} already holds this engine ({got[:12]})", file=sys.stderr)
            return dest
        if not force:
            raise ConfigError(f"{dest} already holds an engine; pass --force (forge.install does) to replace it")
        for p in dest.iterdir():  # replace: files removed in the sealed engine must not linger
            if p.name in ("__pycache__",):
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(eng, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(seal_file, dest / "SEAL.json")
    name = dest.name
    print(f"installed {seal.get('scenario')} engine ({seal.get('tier')}, source {got[:12]}) -> {dest}",
          file=sys.stderr)
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
