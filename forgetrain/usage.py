"""``--help`` / ``-h`` of every Hydra command (``python -m forgetrain``, ``.verify``, ``.bench``, ``.forge``).

The text is built from what already documents each command, so it is written in one place only:

* what the command does: the docstring of the module run as ``__main__`` (``python -m forgetrain.verify`` ->
  forgetrain/verify.py);
* its main options: the fields of the command's own config section (``train.*`` for training; the sections the
  command's Hydra schema adds to :class:`~forgetrain.config.RunConfig` otherwise, e.g. ``forge.*`` and
  ``agent.*``), each with its value in this composition and the comment beside its dataclass field;
* the config groups: the option files under ``conf/<group>/``.

Hydra's own help stays available as ``--hydra-help``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import shutil
import sys
import textwrap
import tokenize
import typing
from pathlib import Path


def field_comments(cls) -> dict[str, str]:
    """``{field: comment}`` for a dataclass: the ``# ...`` comment on a field's line, else the comment lines right
    above it. Fields without a comment are absent."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for i, line in enumerate(lines, start=1):
        head = line.strip().split(":", 1)[0]
        if head in names and line.startswith(" ") and ":" in line and head not in out:
            text = comments.get(i)
            if text is None:  # a comment block right above the field
                above, j = [], i - 1
                while j in comments and lines[j - 1].strip().startswith("#"):
                    above.insert(0, comments[j])
                    j -= 1
                text = " ".join(above) or None
            if text:
                out[head] = text
    return out


def _sections(config_name: str) -> list[tuple[str, type]]:
    """(key prefix, dataclass) of the command's own options: ``train`` for training, else the fields that its
    registered Hydra schema adds to RunConfig."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from forgetrain.config import RunConfig

    schema = "run_schema" if config_name == "config" else f"{config_name}_schema"
    cls = OmegaConf.get_type(ConfigStore.instance().load(f"{schema}.yaml").node)
    hints = typing.get_type_hints(cls)
    base = {f.name for f in dataclasses.fields(RunConfig)}
    own = [f.name for f in dataclasses.fields(cls) if f.name not in base]
    names = own or ["train"]
    return [(n, hints[n]) for n in names if dataclasses.is_dataclass(hints.get(n))]


def _listed_groups(conf_dir: str, config_name: str) -> set[str]:
    """The groups named in the defaults list of ``conf_dir/<config_name>.yaml`` (``- mode: null`` included: a
    ``@package _global_`` group leaves no key of its own in the composed config)."""
    from omegaconf import OmegaConf

    path = Path(conf_dir) / f"{config_name}.yaml"
    if not path.is_file():
        return set()
    names = set()
    for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults") or []:
        if isinstance(entry, dict):
            names.update(k.split()[-1].strip("/").split("@")[0] for k in entry)
    return names


def _groups(conf_dir: str, cfg, config_name: str | None = None) -> list[str]:
    """``group: option, ...`` for every config group the command composes (a key of the composed ``cfg``, or a
    group in the defaults list of the primary config ``config_name``): the YAML files under ``conf_dir`` and the
    options stored in Hydra's ConfigStore (the ``mode`` presets; the ``*_schema`` entries left out)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    stored = {g: [n[:-5] for n in cs.list(g) if n.endswith(".yaml") and not n[:-5].endswith("_schema")]
              for g, node in cs.repo.items() if isinstance(node, dict)}
    dirs = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in Path(conf_dir).iterdir()
            if p.is_dir() and not p.name.startswith(".")}
    out = []
    listed = _listed_groups(conf_dir, config_name) if config_name else set()
    for g in sorted(set(dirs) | set(stored)):
        if g not in cfg and g not in listed:
            continue
        opts = sorted(set(dirs.get(g, [])) | set(stored.get(g, [])))
        if opts:
            out.append(f"{g}: {', '.join(opts)}")
    return out


def help_text(config_name: str, cfg, conf_dir: str) -> str:
    """The ``--help`` text of the command whose primary config is ``config_name``; ``cfg`` is its composed config
    (values shown are this composition's)."""
    from omegaconf import OmegaConf

    width = min(shutil.get_terminal_size((110, 24)).columns, 110)
    doc = inspect.cleandoc(getattr(sys.modules.get("__main__"), "__doc__", None) or "")
    doc = re.sub(r":\w+:`([^`]+)`", r"\1", doc).replace("``", "")  # reST roles and literals, as plain text
    parts = [doc, ""] if doc else []
    parts.append("Options (key=value; the value shown is the one this command line composes to):")
    for prefix, cls in _sections(config_name):
        notes = field_comments(cls)
        for f in dataclasses.fields(cls):
            value = OmegaConf.select(cfg, f"{prefix}.{f.name}")
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            key = f"  {prefix}.{f.name}={'null' if value is None else value}"
            note = notes.get(f.name, "").replace("``", "")
            if len(key) < 34:
                parts.append(textwrap.fill(note, width, initial_indent=key.ljust(36),
                                           subsequent_indent=" " * 36) if note else key)
            else:
                parts.append(key)
                if note:
                    parts.append(textwrap.fill(note, width, initial_indent=" " * 36, subsequent_indent=" " * 36))
    parts += ["", "Config groups (group=option):", *[f"  {g}" for g in _groups(conf_dir, cfg, config_name)], "",
              textwrap.fill("Any key of the composed config can be set the same way (print it with --cfg job); -m "
                            "runs a sweep (key=a,b). Hydra's own flags: --hydra-help.", width)]
    return "\n".join(parts)
