"""The scenario and reference registries: the harness reaches engines only through here.

A scenario is one YAML file, ``conf/scenario/<name>.yaml``. Its ``scenario.engine`` names the engine class as
``"module.path:ClassName"`` (e.g. ``scenarios.llama1b_h200.engine:Engine``); :func:`resolve_engine` is the one
function that turns that string into a class, for train, verify, bench and the forge alike. Several scenarios
may name the same engine (``llama1b_h200``, ``llama8b_h100`` and ``llama3b_h200`` all run the Hopper engine):
only a new engine needs new code.

A reference is a package ``references/<name>/`` whose ``engine.py`` defines ``Engine``
(:func:`load_engine_class`). A forged engine package declares its ``engine.*`` levers and what it implements in
``levers.py`` (:func:`lever_specs`, :mod:`forgetrain.levers`). Both follow :class:`forgetrain.engine.TrainEngine`;
neither engine is imported at module level by the harness.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from pathlib import Path

from forgetrain.errors import ConfigError

_ROOT = Path(__file__).resolve().parent.parent
SCENARIO_CONF = _ROOT / "conf" / "scenario"
# what makes a class an engine: the methods of forgetrain.engine.TrainEngine (checked without instantiating)
_ENGINE_METHODS = ("init_weights", "load_hf_weights", "export_hf_weights", "export_hf_grads", "train_step",
                   "eval_loss", "state_dict", "load_state_dict", "module_probes", "logits")


def _packages(kind: str) -> list[str]:
    base = _ROOT / kind
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir()
                  if p.is_dir() and (p / "engine.py").exists() and not p.name.startswith(("_", ".")))


def scenarios() -> list[str]:
    """Names of every scenario: the stems of ``conf/scenario/*.yaml``."""
    return sorted(p.stem for p in SCENARIO_CONF.glob("*.yaml"))


def references() -> list[str]:
    """Names of every reference with an ``engine.py`` under ``references/``."""
    return _packages("references")


def engine_spec(scenario: str) -> str:
    """The ``scenario.engine`` string that ``conf/scenario/<scenario>.yaml`` itself sets (no composition).
    Raises ConfigError for an unknown scenario or a file that names no engine."""
    from omegaconf import OmegaConf

    path = SCENARIO_CONF / f"{scenario}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown scenario '{scenario}'; known scenarios: {', '.join(scenarios())}")
    spec = OmegaConf.select(OmegaConf.load(path), "scenario.engine")
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"{path} sets no scenario.engine (\"module.path:ClassName\")")
    return spec


def resolve_engine(spec: str) -> type:
    """The engine class named by ``spec`` = ``"module.path:ClassName"`` (a scenario's ``scenario.engine``).

    The module is imported, the attribute must be a class with every method of
    :class:`forgetrain.engine.TrainEngine`. Raises ConfigError (one line) when the string is malformed, the
    module does not import, the class is missing, or it is not an engine.
    """
    mod_name, sep, cls_name = str(spec).partition(":")
    if not sep or not mod_name or not cls_name.isidentifier() or \
            not all(part.isidentifier() for part in mod_name.split(".")):
        raise ConfigError(f"scenario.engine='{spec}' must be \"module.path:ClassName\", e.g. "
                          f"scenarios.llama1b_h200.engine:Engine")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"scenario.engine='{spec}': no module {e.name!r}") from None
    except ImportError as e:
        raise ConfigError(f"scenario.engine='{spec}': importing {mod_name} failed: {e}") from None
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise ConfigError(f"scenario.engine='{spec}': {mod_name} defines no '{cls_name}'")
    missing = [m for m in _ENGINE_METHODS if not callable(getattr(cls, m, None))] if inspect.isclass(cls) else None
    if missing is None or missing:
        what = f"lacks {', '.join(missing)}" if missing else "is not a class"
        raise ConfigError(f"scenario.engine='{spec}' is not an engine class: {cls_name} {what} "
                          f"(see forgetrain.engine.TrainEngine)")
    return cls


def load_engine_class(kind: str, name: str):
    """Import ``references.<name>.engine`` and return its ``Engine`` class (kind must be 'references'; scenario
    engines are found by :func:`resolve_engine`).

    An engine built on an optional framework declares it as ``Engine.extra = (extra_name, (module, ...))``; when
    one of those modules is missing, a ConfigError names the extra to install (:mod:`forgetrain.extras`).
    Raises ConfigError naming the known entries when ``name`` is unknown.
    """
    if kind != "references":
        raise ValueError(f"load_engine_class is for references; scenario engines: resolve_engine(cfg.scenario.engine)")
    known = _packages(kind)
    if name not in known:
        raise ConfigError(f"unknown reference '{name}'; known: {', '.join(known) or '(none)'}")
    mod = importlib.import_module(f"{kind}.{name}.engine")
    extra = getattr(mod.Engine, "extra", None)
    if extra:
        from forgetrain.extras import require

        require(extra[0], extra[1], f"{kind}/{name}")
    return mod.Engine


def lever_specs() -> list:
    """The :class:`forgetrain.levers.EngineSpec` of every forged engine package that declares a lever table: the
    ``SPEC`` of ``scenarios/<package>/levers.py``, by package name. The ``engine.*`` config group is the union of
    their levers (``forgetrain.config.EngineOptions``) and validation runs their rules. Raises ConfigError when a
    ``levers.py`` defines no ``SPEC``."""
    out = []
    for mod in lever_modules():
        spec = getattr(mod, "SPEC", None)
        if spec is None:
            raise ConfigError(f"{mod.__file__} defines no SPEC = forgetrain.levers.EngineSpec(...)")
        out.append(spec)
    return out


@functools.cache
def lever_modules() -> tuple:
    """The ``levers.py`` tables of the forged engine packages under ``scenarios/`` that hold one, by package name,
    each run once per process (the first call, at the config's import) into a module of the harness's own, kept
    here and not entered in ``sys.modules``: the harness imports no engine package (a forge candidate runs with only
    its own engine's modules loaded from outside forgetrain/ and the installed packages). A table imports no torch,
    only :mod:`forgetrain.levers`."""
    import importlib.util

    out = []
    for pkg in _packages("scenarios"):
        path = _ROOT / "scenarios" / pkg / "levers.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(f"scenarios.{pkg}.levers", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            out.append(mod)
    return tuple(out)
