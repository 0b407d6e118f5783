"""The optional extras (``pip install -e '.[NAME]'``): one place that knows their pins, read from pyproject.toml.

The quick-start install has none of them; a feature that needs one checks for it up front with :func:`require`
and, when a package is missing, stops with one :class:`~forgetrain.errors.ConfigError` line naming the extra to
install and its pins (``python -m forgetrain.kernels`` -> ``kernels``, ``verify.reference=deepspeed`` ->
``deepspeed``, ``verify.reference=torchtitan`` -> ``torchtitan``).

The pins come from ``[project.optional-dependencies]`` of the checkout's pyproject.toml, or, for an installed
wheel without it, from the package metadata that pyproject.toml produced; they are written nowhere else.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from forgetrain.errors import ConfigError

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@functools.lru_cache(maxsize=None)
def requirements(extra: str) -> tuple[str, ...]:
    """The requirement strings of ``extra`` (``("triton==<pin>",)`` for ``kernels``); empty when it is unknown."""
    if _PYPROJECT.is_file():
        try:
            import tomllib
        except ImportError:  # Python 3.10: read the installed metadata below
            tomllib = None
        if tomllib is not None:
            with open(_PYPROJECT, "rb") as fh:
                opt = tomllib.load(fh).get("project", {}).get("optional-dependencies", {})
            return tuple(opt.get(extra, ()))
    try:
        from importlib.metadata import requires

        reqs = requires("forgetrain") or []
    except Exception:  # noqa: BLE001 - not installed: nothing to name
        return ()
    marker = re.compile(r"""extra\s*==\s*["']%s["']""" % re.escape(extra))
    return tuple(r.split(";")[0].strip() for r in reqs if ";" in r and marker.search(r.split(";", 1)[1]))


def install_hint(extra: str) -> str:
    """``pip install -e '.[kernels]' (triton==<pin>)``: the command that installs ``extra``, with its pins."""
    pins = ", ".join(requirements(extra))
    return f"pip install -e '.[{extra}]'" + (f" ({pins})" if pins else "")


def require(extra: str, modules: tuple[str, ...] | list[str], what: str) -> None:
    """Check that every module of ``extra`` can be imported, without importing it.

    ``what`` names the feature (``"verify.reference=deepspeed"``). Raises ConfigError naming the first missing
    module, the extra and its pins.
    """
    for mod in modules:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):  # a blocked or half-installed package
            found = False
        if not found:
            raise ConfigError(f"{what} needs the optional '{extra}' extra (no module named '{mod}'): "
                              f"{install_hint(extra)}")
