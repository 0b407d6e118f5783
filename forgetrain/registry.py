"""The scenario and reference registries: the harness reaches engines only through here.

A scenario is a package ``scenarios/<name>/`` whose ``engine.py`` defines ``Engine`` (see
:class:`forgetrain.engine.TrainEngine`). A reference is a package ``references/<name>/`` with the same protocol.
Neither is imported at module level by the harness.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from forgetrain.errors import ConfigError

_ROOT = Path(__file__).resolve().parent.parent


def _packages(kind: str) -> list[str]:
    base = _ROOT / kind
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir()
                  if p.is_dir() and (p / "engine.py").exists() and not p.name.startswith(("_", ".")))


def scenarios() -> list[str]:
    """Names of every scenario with an ``engine.py`` under ``scenarios/``."""
    return _packages("scenarios")


def references() -> list[str]:
    """Names of every reference with an ``engine.py`` under ``references/``."""
    return _packages("references")


def scenario_dir(name: str) -> Path:
    return _ROOT / "scenarios" / name


def load_engine_class(kind: str, name: str):
    """Import ``<kind>.<name>.engine`` and return its ``Engine`` class. kind is 'scenarios' or 'references'.

    An engine built on an optional framework declares it as ``Engine.extra = (extra_name, (module, ...))``; when
    one of those modules is missing, a ConfigError names the extra to install (:mod:`forgetrain.extras`).
    Raises ConfigError naming the known entries when ``name`` is unknown.
    """
    known = _packages(kind)
    if name not in known:
        what = "scenario" if kind == "scenarios" else "reference"
        raise ConfigError(f"unknown {what} '{name}'; known: {', '.join(known) or '(none)'}")
    mod = importlib.import_module(f"{kind}.{name}.engine")
    extra = getattr(mod.Engine, "extra", None)
    if extra:
        from forgetrain.extras import require

        require(extra[0], extra[1], f"{kind}/{name}")
    return mod.Engine
