"""The content check of an engine (escape class 7, the reference in disguise): no reference framework under any
name.

The import guard checks names and paths. A copy of megatron-core or of ``references/megatron`` with its packages
renamed and its computed imports re-spelled passes every name check, so this one compares *code*: each function
and class of the engine, and each module as a whole, is reduced to its normalised syntax tree (every identifier
and string replaced by a placeholder, docstrings dropped: renaming a package, a variable or re-spelling a string
changes nothing) and hashed, and the hashes are looked up in an index of the same hashes over the installed
megatron-core, deepspeed, transformer_engine and apex and the repository's ``references/``
(:func:`build_index`). A fragment counts from :data:`MIN_NODES` tree nodes up (smaller ones, a property or a
two-line helper, are shared by unrelated code); the engine is refused when it shares one fragment of
:data:`LARGE_NODES` nodes or more, or :data:`MAX_SHARED` fragments in all (:func:`scan`).

The index costs a parse of every file of the frameworks (about 1,100 files, 2-3 s); :func:`index_for` keeps it
in the process's memory, never in a file another process could rewrite. The honest engines of ``scenarios/``
share two conversion helpers with ``references/megatron/convert.py`` (under both limits) and nothing else
(``tests/test_guard.py``).
"""

from __future__ import annotations

import ast
import hashlib
import os
from pathlib import Path

MIN_NODES = 40  # a fragment below this many syntax-tree nodes is too common to mean anything
LARGE_NODES = 150  # one shared fragment this large refuses the engine
MAX_SHARED = 4  # ... as do this many shared fragments of any counted size
INDEX_VERSION = 2


_DROP = {"lineno", "col_offset", "end_lineno", "end_col_offset", "ctx", "type_comment", "kind"}
_NAMES = {"id", "arg", "attr", "name", "asname", "module"}  # identifiers: renamed freely, so not compared


def _is_docstring(stmt: ast.AST) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _tree_hashes(tree: ast.AST, out: list) -> tuple[bytes, int]:
    """(hash, nodes) of ``tree`` normalised (identifiers, strings, docstrings, annotations and positions out), one
    pass bottom-up; the hash and size of every function and class is appended to ``out``."""
    h = hashlib.blake2b(type(tree).__name__.encode(), digest_size=16)
    n = 1
    for field, value in ast.iter_fields(tree):
        if field in _DROP or field in _NAMES or field in ("annotation", "returns", "type_params", "level"):
            continue
        if field == "value" and isinstance(tree, ast.Constant):
            h.update(b"S" if isinstance(value, (str, bytes)) else repr(value).encode())
            continue
        items = value if isinstance(value, list) else [value]
        if field == "body" and isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) \
                and items and _is_docstring(items[0]):
            items = items[1:]
        h.update(field.encode())
        for item in items:
            if isinstance(item, ast.AST):
                ch, cn = _tree_hashes(item, out)
                h.update(ch)
                n += cn
            else:
                h.update(repr(item).encode() if not isinstance(item, str) else b"s")
    digest = h.digest()
    if isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n >= MIN_NODES:
        kind = "class" if isinstance(tree, ast.ClassDef) else "function"
        out.append((digest.hex()[:20], n, f"{kind} {tree.name}", tree.lineno))
    return digest, n


def fingerprints(src: str, filename: str = "<src>") -> list[tuple[str, int, str, int]]:
    """(hash, nodes, what, line) of every function and class in ``src`` and of the module, from
    :data:`MIN_NODES` nodes up. Raises SyntaxError."""
    out: list = []
    digest, n = _tree_hashes(ast.parse(src, filename=filename), out)
    if n >= MIN_NODES:
        out.append((digest.hex()[:20], n, "the whole module", 1))
    return out


def reference_roots(workspace: Path | None = None) -> list[Path]:
    """The code the index covers: the installed reference frameworks' packages and the repository's
    ``references/`` (``forgetrain.forge.runtime_guard.forbidden_package_dirs``)."""
    from forgetrain.forge.runtime_guard import forbidden_package_dirs

    return sorted({Path(d) for d, _ in forbidden_package_dirs(workspace)
                   if Path(d).is_dir() and not (workspace and Path(d).is_relative_to(workspace))})


def _py_files(roots: list[Path]) -> list[Path]:
    files = []
    for r in roots:
        files += [p for p in sorted(r.rglob("*.py")) if "__pycache__" not in p.parts]
    return files


def build_index(roots: list[Path], old: dict | None = None) -> dict:
    """``{"version", "files": {path: [size, mtime_ns]}, "hashes": {hash: [nodes, "path:line what"]}}`` over every
    ``.py`` file under ``roots``; the entries of ``old`` whose file is unchanged are reused."""
    old = old if old and old.get("version") == INDEX_VERSION else {"files": {}, "per_file": {}}
    files, per_file = {}, {}
    for p in _py_files(roots):
        st = p.stat()
        key = [st.st_size, st.st_mtime_ns]
        if old["files"].get(str(p)) == key and str(p) in old.get("per_file", {}):
            per_file[str(p)] = old["per_file"][str(p)]
        else:
            try:
                per_file[str(p)] = [[h, n, f"{w}:{line}"] for h, n, w, line in fingerprints(p.read_text(), str(p))]
            except (SyntaxError, UnicodeDecodeError, ValueError):
                per_file[str(p)] = []
        files[str(p)] = key
    hashes = {}
    for path, rows in per_file.items():
        for h, n, where in rows:
            hashes.setdefault(h, [n, f"{path}:{where}"])
    return {"version": INDEX_VERSION, "files": files, "per_file": per_file, "hashes": hashes}


_MEMO: dict = {}


def index_for(workspace: Path | None = None) -> dict:
    """The index over :func:`reference_roots`, built once per process and brought up to date (one ``stat`` per
    file) on each call: no file outside the harness's own memory decides what the check compares against."""
    roots = reference_roots(workspace)
    key = tuple(map(str, roots))
    _MEMO[key] = build_index(roots, _MEMO.get(key))
    return _MEMO[key]


def scan(engine_dir: Path, index: dict) -> list[str]:
    """What ``engine_dir``'s ``.py`` files share with the index, as ``file:line: what`` lines, when it is enough
    to refuse the engine (see the module docstring); empty otherwise. Raises SyntaxError."""
    shared = []
    for f in sorted(Path(engine_dir).rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        for h, n, what, line in fingerprints(f.read_text(), str(f)):
            hit = index["hashes"].get(h)
            if hit:
                shared.append((n, f"{os.path.relpath(f, Path(engine_dir).parent)}:{line}: {what} ({n} nodes) is "
                                  f"{hit[1]}"))
    if not shared or (len(shared) < MAX_SHARED and max(n for n, _ in shared) < LARGE_NODES):
        return []
    return [w for _, w in sorted(shared, key=lambda x: -x[0])]
