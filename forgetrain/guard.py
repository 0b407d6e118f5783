"""Import guard: forged engines must not import a reference framework (megatron, deepspeed, transformer_engine).

An AST scan (not a regex) of every ``.py`` file under a directory: ``import X``, ``from X import ...`` and
``importlib.import_module("X")`` / ``__import__("X")`` with a literal name. Used by the tests and the forge loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = ("megatron", "deepspeed", "transformer_engine", "apex")


def _root(name: str) -> str:
    return name.split(".")[0]


def scan_source(src: str, filename: str = "<src>") -> list[str]:
    """Forbidden imports in ``src`` as ``file:line: module`` strings. Raises SyntaxError on unparsable code."""
    hits = []
    for node in ast.walk(ast.parse(src, filename=filename)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname in ("import_module", "__import__"):
                names = [node.args[0].value]
        hits += [f"{filename}:{node.lineno}: {n}" for n in names if _root(n) in FORBIDDEN]
    return hits


def scan_tree(path: str | Path) -> list[str]:
    """Forbidden imports in every ``.py`` file under ``path`` (a file or a directory)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.rglob("*.py"))
    hits = []
    for f in files:
        hits += scan_source(f.read_text(), str(f))
    return hits
