"""The forge workspace: a git repo the harness owns, seeded from a scenario's engine; the agent edits ``engine/``.

Layout::

    workspace/
      BRIEF.md              this round's brief (harness-written; read-only for the agent)
      scenario.yaml         the scenario, its ``scenario.engine`` naming the workspace engine (``engine.<mod>:<Class>``)
      engine/               the candidate engine (the only path the agent may change): a copy of the package that
                            holds the scenario's engine class, plus a copy of each shared part it imports
                            (``scenarios/_llama`` -> ``engine/_llama/``)
      gates/                read-only copies: conf/tier/*.yaml, forgetrain/equivalence/*.py, ladder_spec.json
      references/<ref>/     read-only copy of the reference engine's source, to read (never to import)
      forge_state.json      the loop's state (git-ignored; written atomically by the harness)
      .gate/                scratch of the agent's own gate runs (git-ignored; the harness never reads it)

The scenario's ``scenario.engine`` (``scenarios.<pkg>.<mod>:<Class>``) picks the template: ``scenarios/<pkg>/``.
Its absolute imports of ``scenarios.<pkg>.x`` and of shared parts ``scenarios._<part>.x`` are rewritten to
relative ones (``from .x import ...``, ``from ._llama.x import ...``) so the workspace engine is self-contained: a
forged scenario owns its copy of every part it runs. An import of another scenario's package is refused (copy
what it needs into a shared ``scenarios/_<part>`` package instead). The ladder loads ``engine/`` as a package
under a private name (:func:`load_engine_class`); relative imports keep working once the engine is installed
back into scenarios/.

Git is used for snapshots: every round's end state is a commit under ``refs/forge/rounds/<k>`` (not on the
branch); rounds that pass a tier are also committed onto the branch. :func:`changed_paths` and :func:`revert_to`
implement the write guard.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.abc
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from forgetrain.errors import ConfigError
from forgetrain.guard import engine_source

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = "engine"
EDITABLE_PREFIX = ENGINE_DIR + "/"
# Ignored (never judged, never read by the harness): caches, the harness's state, the agent's scratch (.gate/) and
# the per-project settings dirs that agent CLIs may create.
GITIGNORE = "__pycache__/\n*.pyc\n/forge_state.json\n/.gate/\n/.claude/\n/.codex/\n"
_GIT = ["git", "-c", "user.name=forgetrain-forge", "-c", "user.email=forge@localhost", "-c", "commit.gpgsign=false",
        "-c", "core.autocrlf=false", "-c", "init.defaultBranch=main"]
_SKIP = ("__pycache__", ".pytest_cache")


def git(ws: Path, *args: str, check: bool = True) -> str:
    """Run git in ``ws``; returns stdout. Raises RuntimeError (with git's stderr) on failure when ``check``."""
    r = subprocess.run([*_GIT, *args], cwd=ws, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {ws}: {r.stderr.strip()}")
    return r.stdout.strip()


# ---------------------------------------------------------------------------------------------------- seeding

def _relative(target: tuple[str, ...], here: tuple[str, ...]) -> str:
    """The relative module that names ``engine/<target...>`` from a module in the package ``engine/<here...>``."""
    common = 0
    while common < min(len(target), len(here)) and target[common] == here[common]:
        common += 1
    return "." * (1 + len(here) - common) + ".".join(target[common:])


def rewrite_scenario_imports(src: str, scenario: str, shared: tuple[str, ...] = (),
                             here: tuple[str, ...] = ()) -> str:
    """Make a template file's scenario imports relative to the workspace engine.

    ``scenario`` is the template package (``scenarios.<scenario>`` = ``engine/``), ``shared`` the shared parts
    copied in (``scenarios.<s>`` = ``engine/<s>/``), ``here`` the file's own package inside ``engine/`` (``()``
    at the top, ``("_llama",)`` for a shared part). At the top: ``from scenarios.<scenario>.m import X`` ->
    ``from .m import X``; ``import scenarios.<scenario>.m as y`` -> ``from . import m as y``;
    ``from scenarios._llama.m import X`` -> ``from ._llama.m import X``. Line-based rewrite of the exact
    statements the AST finds (formatting kept). Raises ConfigError for an ``import scenarios.x.m`` without ``as``.
    """
    targets = {f"scenarios.{scenario}": (), **{f"scenarios.{s}": (s,) for s in shared}}

    def split(module: str):
        for prefix, path in targets.items():
            if module == prefix or module.startswith(prefix + "."):
                rest = module[len(prefix):].lstrip(".")
                return prefix, path + tuple(rest.split(".") if rest else ())
        return None

    lines = src.splitlines(keepends=True)
    edits: dict[int, tuple[int, int, str]] = {}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and split(node.module):
            _, path = split(node.module)
            seg = ast.get_source_segment(src, node)
            new = seg.replace(f"from {node.module}", f"from {_relative(path, here)}", 1)
            edits[node.lineno] = (node.lineno, node.end_lineno, new)
        elif isinstance(node, ast.Import) and any(split(a.name) and split(a.name)[0] != a.name for a in node.names):
            if len(node.names) != 1 or not node.names[0].asname:
                raise ConfigError(f"cannot rewrite '{ast.get_source_segment(src, node)}' to a relative import; "
                                  f"use 'from scenarios.<package>.x import y' in the scenario template")
            a = node.names[0]
            path = split(a.name)[1]
            new = f"from {_relative(path[:-1], here)} import {path[-1]} as {a.asname}"
            edits[node.lineno] = (node.lineno, node.end_lineno, new)
    for lineno in sorted(edits, reverse=True):
        start, end, new = edits[lineno]
        first = lines[start - 1]
        indent = first[:len(first) - len(first.lstrip())]
        lines[start - 1:end] = [indent + new + "\n"]
    return "".join(lines)


def _copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*_SKIP, "*.pyc"), dirs_exist_ok=True)


def gate_sources(reference: str) -> dict[str, tuple[Path, list[Path]]]:
    """Read-only material copied into the workspace: workspace subdir -> (source root, files under it). Files keep
    their path relative to the root (the tier modules live in ``equivalence/tiers/``)."""
    eq = REPO_ROOT / "forgetrain" / "equivalence"
    ref = REPO_ROOT / "references" / reference
    tier = REPO_ROOT / "conf" / "tier"
    return {"gates/tier": (tier, sorted(tier.glob("*.yaml"))),
            "gates/equivalence": (eq, sorted(eq.rglob("*.py"))),
            f"references/{reference}": (ref, sorted(ref.glob("*.py")) + sorted(ref.glob("*.md")))}


WORKSPACE_SCENARIO = "scenario.yaml"


def engine_template(spec: str) -> tuple[str, str, str]:
    """``scenario.engine`` = ``scenarios.<pkg>.<mod>:<Class>`` -> ``(pkg, mod, Class)`` (``mod`` dotted inside the
    package). Raises ConfigError for an engine outside a ``scenarios/<pkg>/`` package (the forge copies that
    package) or a malformed string."""
    mod, _, cls = spec.partition(":")
    parts = mod.split(".")
    if len(parts) < 3 or parts[0] != "scenarios" or not cls or parts[1].startswith("_"):
        raise ConfigError(f"scenario.engine='{spec}': the forge seeds from an engine class in a scenario package, "
                          f"scenarios.<package>.<module>:<Class>")
    return parts[1], ".".join(parts[2:]), cls


def _scenario_imports(root: Path) -> set[str]:
    """The second component of every absolute ``scenarios.<x>...`` import in the ``.py`` files under ``root``."""
    found = set()
    for f in (f for f in root.rglob("*.py") if f.is_file()):
        if any(part in _SKIP for part in f.parts):
            continue
        for node in ast.walk(ast.parse(engine_source(f), str(f))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found.update(n.split(".")[1] for n in names if n.startswith("scenarios.") and n.count(".") >= 1)
    return found


def shared_parts(package: str) -> tuple[str, ...]:
    """The shared packages (``scenarios/_<part>``) that ``scenarios/<package>`` imports, directly or through
    another shared part, sorted. Raises ConfigError when it imports another scenario's package (a workspace can
    carry its own package and shared parts only)."""
    todo, seen = [REPO_ROOT / "scenarios" / package], set()
    while todo:
        for name in sorted(_scenario_imports(todo.pop())):
            if name == package or name in seen:
                continue
            if not name.startswith("_"):
                raise ConfigError(f"scenarios/{package} imports scenarios.{name}, another scenario's package; move "
                                  f"what it shares into a scenarios/_<part> package so the forge can copy it")
            if not (REPO_ROOT / "scenarios" / name).is_dir():
                raise ConfigError(f"scenarios/{package} imports scenarios.{name}, which does not exist")
            seen.add(name)
            todo.append(REPO_ROOT / "scenarios" / name)
    return tuple(sorted(seen))


def workspace_entry(ws: Path) -> str:
    """The workspace engine as ``<module inside engine/>:<Class>``, from ``scenario.yaml``'s ``scenario.engine``
    (``engine.<module>:<Class>``); ``engine:Engine`` when the workspace has no scenario.yaml. Raises ConfigError."""
    path = ws / WORKSPACE_SCENARIO
    if not path.is_file():
        return "engine:Engine"
    from omegaconf import OmegaConf

    spec = str(OmegaConf.select(OmegaConf.load(path), "scenario.engine") or "")
    if not spec.startswith(ENGINE_DIR + ".") or ":" not in spec:
        raise ConfigError(f"{path}: scenario.engine='{spec}' must name a class in {ENGINE_DIR}/ "
                          f"({ENGINE_DIR}.<module>:<Class>)")
    return spec[len(ENGINE_DIR) + 1:]


def _write_scenario(ws: Path, scenario: str, module: str, cls: str) -> None:
    """``scenario.yaml``: the scenario's own file with ``scenario.engine`` pointing at the workspace engine."""
    from omegaconf import OmegaConf

    src = REPO_ROOT / "conf" / "scenario" / f"{scenario}.yaml"
    node = OmegaConf.load(src) if src.is_file() else OmegaConf.create({"scenario": {"name": scenario}})
    OmegaConf.update(node, "scenario.engine", f"{ENGINE_DIR}.{module}:{cls}", force_add=True)
    (ws / WORKSPACE_SCENARIO).write_text(f"# {scenario}, forged in this workspace: scenario.engine is the engine in "
                                         f"{ENGINE_DIR}/ (read-only; written by the harness)\n"
                                         + OmegaConf.to_yaml(node))


def seed(ws: Path, scenario: str, seed_from: str | None, reference: str, ladder_spec: Path,
         engine: str | None = None) -> dict:
    """Create the workspace (a fresh git repo) from the scenario's engine package (and the shared parts it
    imports) or a sealed engine. ``engine``: the ``scenario.engine`` to forge (default: the one
    ``conf/scenario/<scenario>.yaml`` names). Returns seed info. Raises ConfigError."""
    from forgetrain.registry import engine_spec

    package, module, cls = engine_template(engine or engine_spec(scenario))
    template = REPO_ROOT / "scenarios" / package
    entry = Path(*module.split(".")).with_suffix(".py")
    if not (template / entry).exists():
        raise ConfigError(f"scenario template {template} has no {entry}")
    if ws.exists():
        shutil.rmtree(ws)
    eng = ws / ENGINE_DIR
    info = {"template": str(template)}
    shared: tuple[str, ...] = ()
    if seed_from:
        sealed = Path(seed_from).expanduser().resolve()
        src = sealed / ENGINE_DIR if (sealed / ENGINE_DIR).is_dir() else sealed
        if not (src / entry).exists():
            raise ConfigError(f"forge.seed_from={seed_from}: no {entry} in {src} (expected a seal dir with engine/)")
        seal = sealed / "seal.json"
        if seal.exists():
            import json

            want = json.loads(seal.read_text()).get("source_hash")
            got = source_hash(src)
            if want and want != got:
                raise ConfigError(f"forge.seed_from={seed_from}: engine source hash {got} does not match "
                                  f"seal.json's {want}; the sealed engine was modified")
            info["seal"] = str(seal)
        _copy_tree(src, eng)
        info["seed_from"] = str(src)
    else:
        shared = shared_parts(package)
        _copy_tree(template, eng)
        for part in shared:
            _copy_tree(REPO_ROOT / "scenarios" / part, eng / part)
        info["shared"] = list(shared)
    for f in (f for f in eng.rglob("*.py") if f.is_file()):
        src_text = engine_source(f)
        new = rewrite_scenario_imports(src_text, package, shared, f.parent.relative_to(eng).parts)
        if new != src_text:
            f.write_text(new, encoding="utf-8")
    _write_scenario(ws, scenario, module, cls)
    for sub, (root, files) in gate_sources(reference).items():
        for f in files:
            dst = ws / sub / f.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
    shutil.copy2(ladder_spec, ws / "gates" / "ladder_spec.json")
    (ws / ".gitignore").write_text(GITIGNORE)
    (ws / "BRIEF.md").write_text("# brief\n(written by the harness each round)\n")
    git(ws, "init", "-q")
    git(ws, "config", "gc.autoDetach", "false")  # no git process outlives an agent's command (a leftover rejects)
    git(ws, "add", "-A")
    git(ws, "commit", "-q", "-m", f"seed: {info.get('seed_from', info['template'])}")
    info["commit"] = git(ws, "rev-parse", "HEAD")
    return info


# ---------------------------------------------------------------------------------------------------- snapshots

def stage_tree(ws: Path) -> str:
    """Stage the whole working tree (``git add -A``) and return its tree id."""
    git(ws, "add", "-A")
    return git(ws, "write-tree")


def snapshot(ws: Path, ref: str, message: str) -> str:
    """Record the working tree as a commit at ``ref`` (off the branch); returns the commit id."""
    tree = stage_tree(ws)
    commit = git(ws, "commit-tree", tree, "-p", "HEAD", "-m", message)
    git(ws, "update-ref", ref, commit)
    return commit


def commit_branch(ws: Path, message: str) -> str:
    """Commit the working tree onto the branch (even when nothing changed); returns the commit id."""
    stage_tree(ws)
    git(ws, "commit", "-q", "--allow-empty", "-m", message)
    return git(ws, "rev-parse", "HEAD")


def restore_head(ws: Path, head_ref: str, head: str) -> bool:
    """Put HEAD back on ``head_ref`` at ``head`` (working tree untouched); True when it had moved."""
    if not (ws / ".git").is_dir():
        raise RuntimeError(f"the workspace's git repo {ws / '.git'} was deleted; the run cannot continue")
    cur_ref = git(ws, "symbolic-ref", "-q", "HEAD", check=False)
    cur = git(ws, "rev-parse", "-q", "--verify", "HEAD", check=False)
    if cur_ref == head_ref and cur == head:
        return False
    git(ws, "update-ref", head_ref, head)
    git(ws, "symbolic-ref", "HEAD", head_ref)
    return True


def changed_paths(ws: Path, base: str) -> list[tuple[str, str]]:
    """``(status, path)`` for every path that differs between ``base`` (a tree or commit) and the working tree
    (untracked files included, ignored ones not). Renames are reported as delete + add."""
    stage_tree(ws)
    out = git(ws, "diff", "--cached", "--no-renames", "--name-status", base)
    rows = []
    for line in out.splitlines():
        status, _, path = line.partition("\t")
        rows.append((status.strip(), path.strip()))
    return rows


def revert_to(ws: Path, base: str) -> None:
    """Make the working tree and index exactly ``base`` (tree or commit): restore changed/deleted files, remove
    added ones. Ignored files (caches, forge_state.json) are left alone."""
    git(ws, "read-tree", base)
    git(ws, "checkout-index", "-a", "-f")
    git(ws, "clean", "-fdq")


def outside_engine(rows: list[tuple[str, str]]) -> list[str]:
    return [f"{s} {p}" for s, p in rows if not p.startswith(EDITABLE_PREFIX)]


def engine_symlinks(ws: Path) -> list[str]:
    eng = ws / ENGINE_DIR
    return [str(p.relative_to(ws)) for p in eng.rglob("*") if p.is_symlink()] if eng.exists() else []


def diff_summary(ws: Path, a: str, b: str, max_lines: int = 12) -> dict:
    """What changed in engine/ between two commits: ``stat`` (files/lines) and the first changed lines."""
    stat = git(ws, "diff", "--shortstat", a, b, "--", ENGINE_DIR, check=False)
    files = git(ws, "diff", "--numstat", a, b, "--", ENGINE_DIR, check=False)
    body = git(ws, "diff", "-U0", a, b, "--", ENGINE_DIR, check=False)
    changed = [ln[:160] for ln in body.splitlines()
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    per_file = []
    for ln in files.splitlines():
        parts = ln.split("\t")
        if len(parts) == 3:
            per_file.append(f"{parts[2]} (+{parts[0]} -{parts[1]})")
    return {"stat": stat, "files": per_file, "lines": changed[:max_lines],
            "truncated": max(0, len(changed) - max_lines)}


# ---------------------------------------------------------------------------------------------------- hashing

def source_hash(engine_dir: Path) -> str:
    """sha256 over the engine's files (relative path + bytes, sorted), caches excluded."""
    h = hashlib.sha256()
    for rel, digest in sorted(file_hashes(engine_dir).items()):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def file_hashes(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not any(part in _SKIP for part in p.parts) and p.suffix != ".pyc":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def hash_paths(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file under ``paths`` (files or dirs; missing ones hash as absent)."""
    out: dict[str, str] = {}
    for p in paths:
        p = Path(p)
        if p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out.update({str(p / k): v for k, v in file_hashes(p).items()})
    return out


def hash_changes(before: dict, after: dict, words: tuple[str, str, str] = ("deleted", "added", "modified")
                 ) -> list[str]:
    """``<word> KEY`` for every key of two snapshots (path -> hash or stat tuple) that differs, sorted by key;
    ``words`` name a key gone, a new key and a changed value."""
    rows = []
    for k in sorted(set(before) | set(after)):
        if k not in after:
            rows.append(f"{words[0]} {k}")
        elif k not in before:
            rows.append(f"{words[1]} {k}")
        elif before[k] != after[k]:
            rows.append(f"{words[2]} {k}")
    return rows


# ---------------------------------------------------------------------------------------------------- loading

_PKG = "_forge_candidate"


class _SourceOnly(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the candidate package's modules from their ``.py`` source only: every module is compiled
    from the file the guard scanned, whatever bytecode or native module lies beside it, and from the text the scans
    read (:func:`forgetrain.guard.engine_source`: a file Python would decode to other text, a UTF-7 coding cookie,
    is refused, UnscannableSource). A name with no ``.py`` file is an ImportError (the path finder, which would
    take a sourceless ``.pyc`` or a ``.so``, is never asked)."""

    def __init__(self, package: str, engine_dir: Path):
        self.package, self.engine_dir = package, engine_dir

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        rel = [x for x in fullname[len(self.package):].split(".") if x]
        base = self.engine_dir.joinpath(*rel)
        if (base / "__init__.py").is_file() or not rel:
            return importlib.util.spec_from_file_location(fullname, base / "__init__.py", loader=self,
                                                          submodule_search_locations=[str(base)])
        if base.with_name(base.name + ".py").is_file():
            return importlib.util.spec_from_file_location(fullname, base.with_name(base.name + ".py"), loader=self)
        raise ModuleNotFoundError(f"No module named {fullname!r}: the engine's modules load from .py files in "
                                  f"{self.engine_dir} only", name=fullname)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        path = Path(module.__spec__.origin)
        src = engine_source(path) if path.is_file() else ""  # a package without __init__.py
        exec(compile(src, str(path), "exec", dont_inherit=True), module.__dict__)


def load_engine_class(engine_dir: str | Path, package: str = _PKG, entry: str = "engine:Engine"):
    """Import ``engine_dir/<module>.py`` as ``<package>.<module>`` (``engine_dir`` becomes the package, so relative
    imports resolve inside it; a dotted ``package`` such as ``scenarios.NAME``, the name the engine is installed
    under, imports its parents as usual) and return its class; ``entry`` = ``<module>:<Class>`` (a workspace's is
    :func:`workspace_entry`). Modules are compiled from their ``.py`` source only (:class:`_SourceOnly`). Raises
    ImportError / AttributeError, and ``forgetrain.guard.UnscannableSource`` (a ConfigError) for a module Python
    would read as other text than the scans do."""
    engine_dir = Path(engine_dir).resolve()
    module, _, cls = entry.partition(":")
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, _SourceOnly) and f.package == package)]
    sys.meta_path.insert(0, _SourceOnly(package, engine_dir))
    path = engine_dir.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        raise ImportError(f"no {path.relative_to(engine_dir)} in {engine_dir}")
    mod = importlib.import_module(f"{package}.{module}")
    if not hasattr(mod, cls):
        raise AttributeError(f"{path} defines no {cls} class")
    return getattr(mod, cls)


def python() -> str:
    return os.environ.get("FORGE_PYTHON", sys.executable)
