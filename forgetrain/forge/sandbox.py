"""The forge's sandbox: the escape classes its rejections name, and the checks that run outside the candidate.

A hostile agent has eight ways to get a wrong engine sealed (docs/forge.md, threat model). Each rejection names
its class (:func:`reason`), defined once here:

1. *candidate code reaching into the judge* -- rebinding the verdict functions, patching the reference engine,
   reading or rewriting the goldens. Closed by process separation: the goldens are made first by a process that
   runs only the reference (``forgetrain.forge._golden``), the candidate runs in a process of its own that only
   writes its trace (``forgetrain.forge._candidate``), and the verdict is computed by the ladder process, which
   never imports candidate code and only reads traces (``forgetrain.forge._ladder``). What the candidate does to
   the harness in its own process is reported by the run-time guard (:mod:`forgetrain.forge.runtime_guard`).
2. *an import the guard cannot see* -- ``references``, names built at run time, ``exec`` of a string, a child
   process. The static scan (:mod:`forgetrain.guard`) rejects what it can see; the run-time guard rejects any
   load of a forbidden module in the candidate's process.
3. *code that runs but was never scanned* -- bytecode or native modules beside the scanned source, modules from
   outside ``engine/``, an engine rewritten while it is judged. Bytecode is refused in the workspace
   (:func:`unscanned_files`); the candidate's modules are compiled from their ``.py`` source only
   (``workspace.load_engine_class``); the forge's processes use a private bytecode cache that starts empty and
   that only the harness's own processes write (:func:`sandbox_env`), so no ``__pycache__`` anyone else wrote
   runs; each candidate process gets a private view of it (:func:`candidate_cache`), compared file by file after
   the process and what it started have ended (:func:`cache_changes`): a change names the file, and the harness's
   cache is emptied, so no bytecode a candidate wrote is ever loaded by another process. A process the agent
   leaves behind is killed after its round and rejects it (:func:`forgetrain.forge.procs.run_agent`).
4. *an edit outside the hashed gate set* -- the hashed set is everything of the repository that the judge or the
   candidate's process imports or reads (:func:`gate_paths`: all of ``forgetrain/``, ``references/``,
   ``conf/``, ``tests/``, plus the interpreter's site hooks) and every importable file elsewhere on the forge
   processes' import path (:func:`importable_files`); a change aborts the run and names the file.
5. *replaying the reference* -- a reference run recorded in advance, written out by the candidate's process.
   Closed by the gate's secret values (:mod:`.secret`), the judge's rechecks of every trace (:mod:`.recheck`) and
   the run-time guard's snapshot of every module.
6. *knowing it is being judged* -- an engine honest only under the gate. Closed by importing it under its
   installed name in a process that looks like a user's run, and by sealing only an installed copy that passed
   the gate again (:mod:`.seal`).
7. *the reference in disguise* -- a reference framework's code under other names, or in another encoding. Closed by
   the content check (:mod:`.content`), by refusing edits of the import path (``forgetrain.guard``, the run-time
   guard) and by refusing a file Python would compile as other text than the scans read
   (``forgetrain.guard.engine_source``: a UTF-7 coding cookie, a byte-order mark other than UTF-8's, bytes that are
   not UTF-8).
8. *writing outside the workspace* -- poisoned corpora or packages the judge reads. Closed by content hashes in
   the corpora's manifests (``forgetrain.data.integrity``), the bracket of every round and ladder run
   (:mod:`.bracket`), and a candidate process that writes only its run dir (:mod:`.isolate`, the guard).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import os
import shutil
import site
import sys
import tempfile
from pathlib import Path

from forgetrain.forge import workspace as wsmod
from forgetrain.forge.runtime_guard import GATE_DIRS, REPO_ROOT
from forgetrain.guard import UnscannableSource, engine_source, scan_tree_findings

ESCAPE_CLASSES = {
    1: "candidate code reaching into the judge",
    2: "an import the guard cannot see",
    3: "code that runs but was never scanned",
    4: "an edit outside the hashed gate set",
    5: "replaying the reference",
    6: "knowing it is being judged",
    7: "the reference in disguise",
    8: "writing outside the workspace",
}
GUARD_LABELS = {1: "rejected: reaches into the judge", 2: "rejected: forbidden import",
                3: "rejected: unscanned code", 4: "rejected: gates changed", 5: "rejected: replays the reference",
                6: "rejected: honest only when judged", 7: "rejected: reference in disguise",
                8: "rejected: writes outside the workspace"}
BYTECODE_SUFFIXES = tuple(sorted({".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll",
                                  *importlib.machinery.EXTENSION_SUFFIXES,
                                  *importlib.machinery.BYTECODE_SUFFIXES}))
_NOT_JUDGED = (".git", ".gate")  # the workspace's git dir and the agent's scratch: never loaded by the gates


def reason(cls: int, detail: str) -> str:
    """A rejection line naming its escape class: ``escape class 2 (an import the guard cannot see): ...``."""
    return f"escape class {cls} ({ESCAPE_CLASSES[cls]}): {detail}"


# ---------------------------------------------------------------------------------------------------- class 4

def site_hooks() -> list[Path]:
    """Files that every Python process of this interpreter runs at start-up: ``*.pth``, ``sitecustomize.py`` and
    ``usercustomize.py`` in the site directories."""
    dirs = list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
    out = []
    for d in map(Path, dict.fromkeys(dirs)):
        if d.is_dir():
            out += sorted(d.glob("*.pth")) + [d / n for n in ("sitecustomize.py", "usercustomize.py")
                                             if (d / n).exists()]
    return out


def gate_paths(root: Path = REPO_ROOT) -> list[Path]:
    """The hashed gate set: ``root``'s ``forgetrain/``, ``references/``, ``conf/`` and ``tests/`` (everything the
    judge or the candidate's process imports or reads from the repository), and the interpreter's site hooks."""
    return [root / d for d in GATE_DIRS] + site_hooks()


IMPORTABLE_SUFFIXES = tuple(sorted({".pth", *importlib.machinery.SOURCE_SUFFIXES, *BYTECODE_SUFFIXES}))


def import_roots() -> list[Path]:
    """The directories on the forge processes' import path (:func:`sandbox_env`) that the agent could write and that
    no other check covers: the repository root, first on their ``PYTHONPATH``, and this process's own
    ``PYTHONPATH`` entries, but those of the interpreter (its standard library and ``site-packages`` are
    stat-signed, :mod:`.bracket`)."""
    interp = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    out: list[Path] = []
    for p in [str(REPO_ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep):
        real = os.path.realpath(p) if p else ""
        if real and os.path.isdir(real) and not any(_inside(real, i) for i in interp) and Path(real) not in out:
            out.append(Path(real))
    return out


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _importable_name(name: str) -> bool:
    """Whether a file of this name in a directory on ``sys.path`` (or in a package) can be imported or run at
    start-up: a module's source, bytecode or native module named by an identifier, or a ``.pth`` file."""
    return any(name.endswith(suf) and (suf == ".pth" or name[:-len(suf)].isidentifier())
               for suf in IMPORTABLE_SUFFIXES)


def importable_files(roots: list[Path], skip: list[Path] = ()) -> list[Path]:
    """Every file Python could import from ``roots`` (directories on the import path): the importable files
    (:func:`_importable_name`: ``*.py``, bytecode, native modules, ``*.pth``; a ``sitecustomize.py``, a module
    shadowing a library's) directly in a root and in every directory reachable from it through directories named
    by identifiers (packages and namespace packages). ``skip`` (dirs hashed whole, the forge run's own dir),
    virtual environments (``pyvenv.cfg``: their packages are stat-signed, class 8) and, below the top level, other
    forge runs' workspaces (``forge_state.json``: their engines are loaded from their files, never imported by a
    name on the path, and a concurrent run edits them) are not walked."""
    skips = [os.path.realpath(x) for x in skip]
    out: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            marks = ("pyvenv.cfg",) if dirpath == str(root) else ("pyvenv.cfg", "forge_state.json")
            dirnames[:] = sorted(d for d in dirnames if d.isidentifier() and not any(
                _inside(os.path.realpath(os.path.join(dirpath, d)), x) for x in skips)
                and not any(os.path.exists(os.path.join(dirpath, d, m)) for m in marks))
            out += [Path(dirpath) / f for f in sorted(filenames) if _importable_name(f)]
    return out


def stat_signature(paths: list[Path]) -> dict[str, tuple]:
    """(inode, size, mtime_ns, ctime_ns) of every file under ``paths``: any write, replacement or restored mtime
    changes it (a process cannot set ctime back), for one ``stat`` per file instead of reading it. Used while a
    candidate runs, where hashing a large golden twice per run would cost more than the run."""
    out = {}
    for root in map(Path, paths):
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        for f in files:
            st = f.stat()
            out[str(f)] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


# ---------------------------------------------------------------------------------------------------- class 3

def unscanned_files(ws: Path) -> list[str]:
    """Workspace paths (relative) of bytecode caches, compiled bytecode and native modules, outside ``.git/`` and
    ``.gate/``: code the scan never read. Git ignores them, so the filesystem is walked."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ws):
        rel = Path(dirpath).relative_to(ws)
        if rel.parts[:1] and rel.parts[0] in _NOT_JUDGED:
            dirnames[:] = []
            continue
        for d in dirnames:
            if d == "__pycache__":
                out.append(str(rel / d) + "/")
        out += [str(rel / f) for f in filenames if f.endswith(BYTECODE_SUFFIXES) and "__pycache__" not in rel.parts]
    return sorted(out)


def remove_unscanned(ws: Path) -> None:
    """Delete what :func:`unscanned_files` lists (git's revert leaves ignored files alone)."""
    for rel in unscanned_files(ws):
        p = ws / rel
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


@contextlib.contextmanager
def private_cache(cache_dir: Path | None = None):
    """``cache_dir`` when given, else a new, empty bytecode cache dir removed afterwards."""
    if cache_dir is not None:
        yield Path(cache_dir)
        return
    d = tempfile.mkdtemp(prefix="forge-pycache-")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fresh_cache(cache_dir: Path) -> Path:
    """Empty ``cache_dir`` (a forge run's private bytecode cache) and return it. The old tree is first renamed
    aside, so that a file a leftover process writes meanwhile lands in the tree being removed, never in the new
    one, and a dir that reappears under the name is taken as it is. Raises OSError when it cannot be made."""
    cache_dir = Path(cache_dir)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    if cache_dir.exists() or cache_dir.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-old-", dir=cache_dir.parent))
        try:
            os.rename(cache_dir, aside / cache_dir.name)
        except FileNotFoundError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    cache_dir.mkdir(exist_ok=True)
    for x in list(cache_dir.iterdir()):  # written after the rename by a process that is still running
        shutil.rmtree(x, ignore_errors=True) if x.is_dir() and not x.is_symlink() else x.unlink(missing_ok=True)
    return cache_dir


def candidate_cache(judge_cache: Path, dest: Path) -> dict[str, tuple]:
    """Make ``dest`` a candidate process's private bytecode cache: the tree of ``judge_cache`` (the bytecode the
    harness's processes compiled) with every file hard-linked, or copied across file systems. The candidate adds,
    replaces or removes files in its own tree only; a write into a linked file's data would reach the harness's
    copy, and is caught by :func:`cache_changes` (its ctime moves). Returns the view's :func:`stat_signature`.
    Costs one link per file (about 1,700 files with torch: docs/forge.md, threat model), where an empty cache
    would recompile torch in every candidate process."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for dirpath, dirnames, filenames in os.walk(judge_cache):
        rel = Path(dirpath).relative_to(judge_cache)
        for d in dirnames:
            (dest / rel / d).mkdir()
        for f in filenames:
            try:
                os.link(Path(dirpath) / f, dest / rel / f)
            except OSError:
                shutil.copy2(Path(dirpath) / f, dest / rel / f)
    return stat_signature([dest])


def cache_changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """``added F`` / ``removed F`` / ``changed F`` for every file whose :func:`stat_signature` entry differs."""
    return wsmod.hash_changes(before, after, ("removed", "added", "changed"))


def sandbox_env(cache_dir: Path, *, writable: bool, base: dict | None = None) -> dict:
    """The environment of a forge process: the repository first on ``PYTHONPATH``; ``cache_dir`` as the whole
    bytecode cache (``PYTHONPYCACHEPREFIX``: no ``__pycache__`` of the repository, the workspace or the installed
    packages is ever read), which only the harness's own processes write (``writable``; a candidate's process gets
    its private view, :func:`candidate_cache`, with ``PYTHONDONTWRITEBYTECODE``, and its guard refuses writes
    there); no script dir or cwd on ``sys.path``
    (``PYTHONSAFEPATH``), no user site, and none of the agent round's ``FORGE_*`` variables."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith("FORGE_") and k not in ("PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONUSERBASE",
                                                       "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(PYTHONPYCACHEPREFIX=str(cache_dir), PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1")
    if not writable:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    for k in ("FORGE_PYTHON", "FORGE_ISOLATION"):  # the interpreter of the forge's processes; isolation off
        if k in os.environ:
            env[k] = os.environ[k]
    return env


# ---------------------------------------------------------------------------------------------------- the round

def guard_round(ws: Path, rows: list[tuple[str, str]]) -> tuple[str, list[str]]:
    """Judge an agent round's edits before any gate runs: ``rows`` are git's changed paths. Returns (label,
    problems): ``ok``; ``syntax error``; ``rejected: writes outside engine/``; or a rejection naming its escape
    class (bytecode or native modules: class 3; forbidden or hidden imports, ``exec``: class 2; edits of the
    import path, code shared with a reference framework (:mod:`forgetrain.forge.content`), a file Python would
    compile as other text than the scans read (``forgetrain.guard.engine_source``): class 7)."""
    outside, links = wsmod.outside_engine(rows), wsmod.engine_symlinks(ws)
    if outside or links:
        return "rejected: writes outside engine/", [f"write outside engine/: {x}" for x in outside] + \
            [f"symlink in engine/: {x}" for x in links]
    unscanned = unscanned_files(ws)
    if unscanned:
        return GUARD_LABELS[3], [reason(3, f"{x}: bytecode or a native module beside the scanned source (only .py "
                                           f"source runs; the agent's Python writes no bytecode)") for x in unscanned]
    refused = []
    for f in sorted(f for f in (ws / wsmod.ENGINE_DIR).rglob("*.py") if f.is_file()):
        try:
            engine_source(f)
        except UnscannableSource as e:
            refused.append(reason(7, f"{os.path.relpath(e.file, ws)}: {e.what}"))
        except OSError:
            pass  # a directory named *.py: the scan below reports what it cannot read
    if refused:
        return GUARD_LABELS[7], refused[:20]
    try:
        found = scan_tree_findings(ws / wsmod.ENGINE_DIR)
    except SyntaxError as e:
        where = os.path.relpath(e.filename, ws) if e.filename else "?"
        return "syntax error", [f"{where}:{e.lineno}: {e.msg}"]
    if found:
        cls = {f: 7 if f.kind == "path_edit" else 2 for f in found}
        first = min(cls.values())
        return GUARD_LABELS[first], [reason(cls[f], f"{'forbidden import ' if f.kind == 'import' else ''}"
                                                    f"{os.path.relpath(f.file, ws)}:{f.line}: {f.what}")
                                     for f in found]
    from forgetrain.forge import content

    shared = content.scan(ws / wsmod.ENGINE_DIR, content.index_for(ws))
    if shared:
        return GUARD_LABELS[7], [reason(7, f"{x} (the engine's code is a reference framework's, renamed or not)")
                                 for x in shared[:20]]
    return "ok", []


# ---------------------------------------------------------------------------------------------------- reports

def read_report(lines: list[str]) -> dict:
    """Parse the candidate process's report lines (:mod:`forgetrain.forge.runtime_guard`): ``violations`` [(class,
    what)], ``error`` and ``traceback`` when the candidate raised, ``done`` when the run finished its checks.
    Lines that are not the protocol's are ignored (the candidate may write to the pipe too, which only adds)."""
    rep: dict = {"violations": [], "error": None, "traceback": None, "done": False}
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        v = obj.get("violation")
        if isinstance(v, dict) and v.get("class") in ESCAPE_CLASSES:
            rep["violations"].append((int(v["class"]), str(v.get("what"))))
        if obj.get("error") and rep["error"] is None:
            rep["error"], rep["traceback"] = str(obj["error"]), str(obj.get("traceback") or "")
        if obj.get("done") is True:
            rep["done"] = True
    return rep


def rejection(violations: list[tuple[int, str]], where: str) -> dict:
    """The ``rejected`` entry of a ladder result: the first violation's class sets the label; every violation is a
    problem line naming its class."""
    seen = list(dict.fromkeys(violations))
    cls = seen[0][0]
    return {"class": cls, "guard": GUARD_LABELS[cls],
            "problems": [reason(c, f"{w} [{where}]") for c, w in seen[:50]]}
