"""The content check of an engine (escape class 7, the reference in disguise): no reference framework under any
name.

The import guard checks names and paths. A copy of megatron-core or of ``references/megatron`` with its packages
renamed, its computed imports re-spelled and its code reshaped (no-op statements inserted, functions split or
reordered, loops rewritten) passes every name check, so this one compares *code*, the way MOSS compares programs
(Schleimer, Wilkerson and Aiken, "Winnowing: local algorithms for document fingerprinting", SIGMOD 2003):

1. every ``.py`` file is parsed and *normalised* (:class:`Normalise`): statements that do nothing are dropped
   (``pass``, a bare constant, docstring or ``...``, a bare name or attribute, ``x = x``, an annotation without a
   value) and constant branches unwrapped (``if True:`` keeps its body, ``if False:`` / ``while False:`` their
   ``else``); imports are dropped (they name packages, which is what a disguise renames);
2. the normalised tree is written out as the sequence of its node types in pre-order (:func:`tokens`):
   identifiers, strings and numbers are abstracted to their kind, annotations left out, so renaming a package, a
   variable or a string changes nothing;
3. every run of :data:`K` consecutive tokens (a k-gram) is hashed; the index (:func:`build_index`) keeps the
   *winnowed* ones of the installed megatron-core, deepspeed, transformer_engine and apex and the repository's
   ``references/``: the smallest hash of every window of :data:`WINDOW` consecutive k-grams. Any stretch of code
   of ``K + WINDOW - 1`` tokens or more that an engine shares with the index contains one of those (the
   guarantee of winnowing), whatever surrounds it;
4. each k-gram of the engine is looked up; the tokens under a matched k-gram are *shared*. Shared stretches
   separated by at most :data:`GAP` unshared tokens (a no-op statement or a dead branch inserted between two
   copied statements) are one *run*; runs shorter than :data:`MIN_RUN` tokens (idioms any Llama has) are not
   counted (:func:`measure`).

Each engine file is read by :func:`forgetrain.guard.engine_source`, as Python compiles it (a file Python would read
as other text than the scanned, a UTF-7 coding cookie, is refused there). The engine is refused (:func:`scan`) when
its longest run reaches :data:`LONG_RUN` tokens or its counted shared tokens, over all its files, reach
:data:`MAX_SHARED`. The counts are absolute, so padding a copy with honest code does not dilute it. The thresholds
were calibrated on the honest engines of ``scenarios/`` (which must pass), on plain and disguised copies of
megatron-core and ``references/megatron`` and on further rewrites (which must be refused): ``docs/forge.md`` (the
content check) holds the table, ``tests/test_forge_content.py`` replays it.

The index costs a parse of every file of the frameworks (about 1,100 files); :func:`index_for` keeps it in the
process's memory, never in a file another process could rewrite, and reuses a file's fingerprints while its size
and mtime are unchanged.
"""

from __future__ import annotations

import ast
import hashlib
import os
from pathlib import Path

import numpy as np

from forgetrain.guard import UnscannableSource, engine_source

# The values and their calibration: docs/forge.md (the content check), replayed by tests/test_forge_content.py.
K = 20  # tokens per k-gram (a statement is 5-20): K of 16 to 32 separate the same cases, shorter ones do not
WINDOW = 8  # k-grams per winnowing window: every shared stretch of K + WINDOW - 1 = 27 tokens is found
GAP = 12  # unshared tokens a run bridges: an inserted no-op statement is 3, a dead branch 9
MIN_RUN = 40  # a run shorter than this is not counted: idioms (the honest engines hold 8 runs of 40-91)
LONG_RUN = 150  # one run this long refuses the engine (the honest engines' longest: 91)
MAX_SHARED = 800  # ... as do this many tokens in counted runs, over all the engine's files (honest: 489)
INDEX_VERSION = 3


def _const(node: ast.AST):
    """(True, value) when ``node`` is a constant, else (False, None)."""
    return (True, node.value) if isinstance(node, ast.Constant) else (False, None)


def _noop(s: ast.stmt) -> bool:
    if isinstance(s, (ast.Pass, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
        return True
    if isinstance(s, ast.Expr) and isinstance(s.value, (ast.Constant, ast.Name, ast.Attribute)):
        return True
    if isinstance(s, ast.AnnAssign) and s.value is None:
        return True
    return (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
            and isinstance(s.value, ast.Name) and s.targets[0].id == s.value.id)


class Normalise(ast.NodeTransformer):
    """Drop the statements that do nothing and unwrap constant branches, in every statement list of the tree
    (the module docstring lists them)."""

    def _clean(self, stmts: list) -> list:
        out = []
        for s in stmts:
            if _noop(s):
                continue
            if isinstance(s, (ast.If, ast.While)):
                is_const, value = _const(s.test)
                if is_const and isinstance(s, ast.If):
                    out += self._clean(s.body if value else s.orelse)
                    continue
                if is_const and not value:
                    out += self._clean(s.orelse)
                    continue
            out.append(self.visit(s))
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                setattr(node, field, self._clean(value))
            elif isinstance(value, list):
                setattr(node, field, [self.visit(v) if isinstance(v, ast.AST) else v for v in value])
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value))
        return node


_SKIP = {"ctx", "type_comment", "annotation", "returns", "type_params", "kind"}
_IDS: dict[str, int] = {}


def _tid(name: str) -> int:
    t = _IDS.get(name)
    if t is None:
        t = _IDS[name] = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return t


def _const_token(v) -> str:
    if isinstance(v, (str, bytes)):
        return "C:str"
    if v is None or isinstance(v, bool) or v is Ellipsis:
        return f"C:{v!r}"
    return "C:num"


def tokens(src: str, filename: str = "<src>") -> tuple[np.ndarray, np.ndarray]:
    """(token ids, line of each token) of ``src`` normalised (:class:`Normalise`): its node types in pre-order,
    identifiers, strings and numbers abstracted to their kind, annotations left out. Raises SyntaxError, also for
    a tree nested past the interpreter's recursion limit (it cannot be checked, so it is refused)."""
    try:
        tree = Normalise().visit(ast.parse(src, filename=filename))
    except RecursionError:
        raise SyntaxError("nested too deeply to check", (filename, 1, 0, "")) from None
    ids, lines = [], []
    stack = [(tree, 1)]
    while stack:
        node, line = stack.pop()
        line = getattr(node, "lineno", line)
        name = _const_token(node.value) if isinstance(node, ast.Constant) else type(node).__name__
        ids.append(_tid(name))
        lines.append(line)
        kids = []
        for field, value in ast.iter_fields(node):
            if field in _SKIP:
                continue
            if isinstance(value, list):
                kids += [v for v in value if isinstance(v, ast.AST)]
            elif isinstance(value, ast.AST):
                kids.append(value)
        stack += [(kid, line) for kid in reversed(kids)]
    return np.array(ids, dtype=np.uint64), np.array(lines, dtype=np.int32)


def kgrams(ids: np.ndarray, k: int | None = None) -> np.ndarray:
    """The hash of every k-gram of ``ids``: a polynomial in a fixed odd 64-bit base, modulo 2**64 (Karp and
    Rabin's rolling hash, as Schleimer et al. use). Empty when there are fewer than ``k`` tokens."""
    k = K if k is None else k
    if len(ids) < k:
        return np.zeros(0, dtype=np.uint64)
    base = np.uint64(0x9E3779B97F4A7C15)
    powers = np.ones(k, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(k - 2, -1, -1):
            powers[i] = powers[i + 1] * base
    win = np.lib.stride_tricks.sliding_window_view(ids, k)
    with np.errstate(over="ignore"):
        h = np.zeros(len(win), dtype=np.uint64)
        for j in range(k):
            h += win[:, j] * powers[j]
    return h


def winnow(h: np.ndarray, w: int | None = None) -> np.ndarray:
    """Positions of the k-grams winnowing keeps: the smallest hash of every window of ``w`` consecutive k-grams
    (Schleimer et al., SIGMOD 2003), each position once."""
    w = WINDOW if w is None else w
    if len(h) <= w:
        return np.array([int(np.argmin(h))]) if len(h) else np.zeros(0, dtype=np.int64)
    win = np.lib.stride_tricks.sliding_window_view(h, w)
    return np.unique(np.argmin(win, axis=1) + np.arange(len(win)))


def fingerprints(src: str, filename: str = "<src>") -> tuple[np.ndarray, np.ndarray]:
    """(winnowed k-gram hashes, line of each) of ``src``. Raises SyntaxError."""
    ids, lines = tokens(src, filename)
    h = kgrams(ids)
    pos = winnow(h)
    return h[pos], lines[pos]


def reference_roots(workspace: Path | None = None) -> list[Path]:
    """The code the index covers: the installed reference frameworks' packages and the repository's
    ``references/`` (``forgetrain.forge.runtime_guard.forbidden_package_dirs``)."""
    from forgetrain.forge.runtime_guard import forbidden_package_dirs

    return sorted({Path(d) for d, _ in forbidden_package_dirs(workspace)
                   if Path(d).is_dir() and not (workspace and Path(d).is_relative_to(workspace))})


def _py_files(root: Path) -> list[Path]:
    return [p for p in sorted(Path(root).rglob("*.py")) if "__pycache__" not in p.parts and p.is_file()]


def build_index(roots: list[Path], old: dict | None = None) -> dict:
    """``{"version", "files": {path: [size, mtime_ns]}, "per_file": {path: (hashes, lines)}, "paths",
    "hashes", "file", "line"}``: the winnowed fingerprints (:func:`fingerprints`) of every ``.py`` file under
    ``roots``, ``hashes`` sorted with the file (an index into ``paths``) and line of each; the fingerprints of
    ``old`` whose file is unchanged are reused. A file that does not parse adds nothing. Raises OSError for a
    file that cannot be read."""
    old = old if old and old.get("version") == INDEX_VERSION else {"files": {}, "per_file": {}}
    files, per_file = {}, {}
    for p in [f for r in roots for f in _py_files(r)]:
        st = p.stat()
        key = [st.st_size, st.st_mtime_ns]
        if old["files"].get(str(p)) == key and str(p) in old["per_file"]:
            per_file[str(p)] = old["per_file"][str(p)]
        else:
            try:
                per_file[str(p)] = fingerprints(p.read_text(), str(p))
            except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
                per_file[str(p)] = (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int32))
        files[str(p)] = key
    paths = list(per_file)
    h = np.concatenate([per_file[p][0] for p in paths] + [np.zeros(0, dtype=np.uint64)])
    line = np.concatenate([per_file[p][1] for p in paths] + [np.zeros(0, dtype=np.int32)])
    fid = np.concatenate([np.full(len(per_file[p][0]), i, dtype=np.int32) for i, p in enumerate(paths)]
                         + [np.zeros(0, dtype=np.int32)])
    order = np.argsort(h, kind="stable")
    return {"version": INDEX_VERSION, "files": files, "per_file": per_file, "paths": paths,
            "hashes": h[order], "file": fid[order], "line": line[order]}


_MEMO: dict = {}


def index_for(workspace: Path | None = None) -> dict:
    """The index over :func:`reference_roots`, built once per process and brought up to date (one ``stat`` per
    file) on each call: no file outside the harness's own memory decides what the check compares against."""
    roots = reference_roots(workspace)
    key = tuple(map(str, roots))
    _MEMO[key] = build_index(roots, _MEMO.get(key))
    return _MEMO[key]


def _runs(cover: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """[start, end) of the stretches of ``cover``, those at most ``gap`` tokens apart joined."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], cover.view(np.int8), [0]])))
    out: list[list[int]] = []
    for s, e in zip(edges[::2].tolist(), edges[1::2].tolist()):
        if out and s - out[-1][1] <= gap:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def measure_source(src: str, index: dict, filename: str = "<src>") -> dict:
    """What ``src`` shares with ``index``: ``tokens`` (after normalising), ``shared`` (tokens under a k-gram the
    index holds) and ``runs``, each ``(tokens shared, first line, last line, "reference path:line")``, longest
    first (module docstring, step 4). Raises SyntaxError."""
    ids, lines = tokens(src, filename)
    h = kgrams(ids)
    ih = index["hashes"]
    at = np.minimum(np.searchsorted(ih, h), max(len(ih) - 1, 0))
    hit = (ih[at] == h) if len(ih) else np.zeros(len(h), dtype=bool)
    starts = np.flatnonzero(hit)
    d = np.zeros(len(ids) + 1, dtype=np.int32)
    np.add.at(d, starts, 1)
    np.add.at(d, starts + K, -1)
    cover = np.cumsum(d[:-1]) > 0
    runs = []
    for s, e in _runs(cover, GAP):
        inside = starts[(starts >= s) & (starts < e)]
        files = index["file"][at[inside]]
        top = int(np.bincount(files).argmax())
        first = int(index["line"][at[inside]][files == top].min())
        runs.append((int(cover[s:e].sum()), int(lines[s]), int(lines[e - 1]), f"{index['paths'][top]}:{first}"))
    return {"tokens": len(ids), "shared": int(cover.sum()), "runs": sorted(runs, reverse=True)}


def measure(engine_dir: Path, index: dict) -> dict:
    """Per ``.py`` file of ``engine_dir`` (relative to its parent), :func:`measure_source`; and over all of them
    ``tokens``, ``shared``, ``counted`` (tokens in runs of :data:`MIN_RUN` or more) and ``longest`` (the longest
    run). Each file is read by :func:`forgetrain.guard.engine_source`. Raises SyntaxError, and UnscannableSource
    (a ConfigError) for a file Python would compile as other text than the scanned."""
    out = {"files": {}, "tokens": 0, "shared": 0, "counted": 0, "longest": 0}
    for f in _py_files(engine_dir):
        m = measure_source(engine_source(f), index, str(f))
        out["files"][os.path.relpath(f, Path(engine_dir).parent)] = m
        out["tokens"] += m["tokens"]
        out["shared"] += m["shared"]
        out["counted"] += sum(r[0] for r in m["runs"] if r[0] >= MIN_RUN)
        out["longest"] = max([out["longest"]] + [r[0] for r in m["runs"]])
    return out


def _defs(path: Path) -> list[tuple[int, int, str]]:
    """(first line, last line, "function NAME" or "class NAME") of every def and class of ``path``."""
    try:
        tree = ast.parse(engine_source(path))
    except (SyntaxError, OSError, ValueError, UnscannableSource):
        return []
    return [(n.lineno, n.end_lineno or n.lineno, f"{'class' if isinstance(n, ast.ClassDef) else 'function'} {n.name}")
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _scope(defs: list[tuple[int, int, str]], line: int) -> str:
    """The innermost def or class of ``defs`` around ``line``; "module level" outside any."""
    inside = [d for d in defs if d[0] <= line <= d[1]]
    return max(inside)[2] if inside else "module level"


def scan(engine_dir: Path, index: dict) -> list[str]:
    """What ``engine_dir``'s ``.py`` files share with the index, as ``file:lines: what`` lines (longest run
    first), when it is enough to refuse the engine: a run of :data:`LONG_RUN` tokens or more, or
    :data:`MAX_SHARED` tokens in runs of :data:`MIN_RUN` or more (the module docstring); empty otherwise.
    Raises SyntaxError and UnscannableSource (:func:`measure`)."""
    m = measure(engine_dir, index)
    if m["longest"] < LONG_RUN and m["counted"] < MAX_SHARED:
        return []
    rows = sorted(((r[0], f, r) for f, fm in m["files"].items() for r in fm["runs"] if r[0] >= MIN_RUN),
                  key=lambda x: -x[0])
    out, defs = [], {f: _defs(Path(engine_dir).parent / f) for f in {f for _, f, _ in rows}}
    for n, f, (_, a, b, ref) in rows:
        out.append(f"{f}:{a}-{b}: {_scope(defs[f], a)}: {n} tokens shared with {ref}")
    out[0] += (f" ({m['counted']} tokens of the engine in shared runs of {MIN_RUN} or more, longest {m['longest']}: "
               f"refused from {MAX_SHARED}, or one run of {LONG_RUN})")
    return out
