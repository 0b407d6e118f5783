"""Import guard: forged engines must not import a reference framework (megatron, deepspeed, transformer_engine,
apex) nor the repository's ``references`` package, and must not hide what they import.

An AST scan (not a regex) of every ``.py`` file under a directory. Findings, by kind:

* ``import``: ``import X``, ``from X import ...`` and ``importlib.import_module("X")`` / ``__import__("X")`` with a
  literal name whose root is forbidden;
* ``hidden_import``: ``importlib.import_module`` / ``__import__`` with a name built at run time (a concatenation,
  a join, a variable): the scan cannot tell what it loads;
* ``exec``: ``exec`` / ``eval`` / ``compile`` of code (source text is code the scan never sees);
* ``path_edit``: an edit of where imports come from (``sys.path``, ``sys.meta_path``, ``sys.path_hooks``:
  mutated or assigned; ``site.addsitedir``; a module built from a file by hand, ``spec_from_file_location`` or an
  ``importlib.machinery`` loader): a package imported from the engine's files under a name of its own escapes the
  name the engine is judged by (a renamed copy of a reference framework would be imported that way).

The scan is the first line only: what it cannot see (``getattr(builtins, "ex" + "ec")``, a module file written at
run time) is caught in the candidate's process at run time (:mod:`forgetrain.forge.runtime_guard`). Used by the
tests, ``forgetrain.forge.install`` and the forge loop.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

FORBIDDEN = ("megatron", "deepspeed", "transformer_engine", "apex")  # reference frameworks
FORBIDDEN_ROOTS = FORBIDDEN + ("references",)  # ... and the repository's reference engines
_DYNAMIC_IMPORT = ("import_module", "__import__")
_CODE_BUILTINS = ("exec", "eval", "compile")
_IMPORT_STATE = ("path", "meta_path", "path_hooks")  # sys.<x>: where imports come from
_PATH_CALLS = {("site", "addsitedir"), ("util", "spec_from_file_location"), ("importlib", "spec_from_file_location"),
               ("machinery", "SourceFileLoader"), ("machinery", "SourcelessFileLoader"),
               ("machinery", "ExtensionFileLoader"), ("machinery", "PathFinder"), ("machinery", "FileFinder")}


def _import_state(node: ast.expr) -> str | None:
    """``sys.path`` (or ``sys.meta_path``, ``sys.path_hooks``) when ``node`` is one, else None."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in _IMPORT_STATE and isinstance(node.value, ast.Name) \
            and node.value.id == "sys":
        return f"sys.{node.attr}"
    return None


def _path_edit(node: ast.AST) -> str | None:
    """What edits the import system's search state in ``node`` (see the module docstring), or None."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        for t in targets:
            if _import_state(t):
                return f"assignment to {_import_state(t)}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if _import_state(node.func.value):
            return f"{_import_state(node.func.value)}.{node.func.attr}()"
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if (name, node.func.attr) in _PATH_CALLS:
            return f"{name}.{node.func.attr}()"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {c for _, c in _PATH_CALLS}:
        return f"{node.func.id}()"
    return None


@dataclass(frozen=True)
class Finding:
    """One guard finding: ``kind`` is ``import``, ``hidden_import`` or ``exec``; ``what`` names the module or the
    construct."""

    file: str
    line: int
    kind: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


def _root(name: str) -> str:
    return name.split(".")[0]


def _func_name(f: ast.expr) -> tuple[str, str]:
    """(owner, name) of a called function: ``importlib.import_module`` -> ('importlib', 'import_module')."""
    if isinstance(f, ast.Attribute):
        owner = f.value.id if isinstance(f.value, ast.Name) else ""
        return owner, f.attr
    return "", getattr(f, "id", "")


def findings(src: str, filename: str = "<src>") -> list[Finding]:
    """Every finding in ``src``. Raises SyntaxError on unparsable code."""
    out = []
    for node in ast.walk(ast.parse(src, filename=filename)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call):
            owner, fname = _func_name(node.func)
            if fname in _DYNAMIC_IMPORT:
                first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names = [first.value]
                elif first is not None:
                    out.append(Finding(filename, node.lineno, "hidden_import",
                                       f"{fname}() of a module name built at run time (the guard cannot see what "
                                       f"it imports; import modules by name)"))
            elif fname in _CODE_BUILTINS and (isinstance(node.func, ast.Name) or owner in ("builtins",
                                                                                          "__builtins__")):
                out.append(Finding(filename, node.lineno, "exec",
                                   f"{fname}() of code the guard never sees (write the code in engine/ instead)"))
        edit = _path_edit(node)
        if edit:
            out.append(Finding(filename, node.lineno, "path_edit",
                               f"{edit}: an edit of where imports come from (import the engine's modules "
                               f"relatively, under its own package)"))
        out += [Finding(filename, node.lineno, "import", n) for n in names if _root(n) in FORBIDDEN_ROOTS]
    return sorted(out, key=lambda f: f.line)


def scan_source(src: str, filename: str = "<src>") -> list[str]:
    """Findings in ``src`` as ``file:line: what`` strings (``what`` is the module for a forbidden import). Raises
    SyntaxError on unparsable code."""
    return [str(f) for f in findings(src, filename)]


def scan_tree_findings(path: str | Path) -> list[Finding]:
    """Findings in every ``.py`` file under ``path`` (a file or a directory). Raises SyntaxError."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.rglob("*.py"))
    out = []
    for f in files:
        out += findings(f.read_text(), str(f))
    return out


def scan_tree(path: str | Path) -> list[str]:
    """:func:`scan_tree_findings` as ``file:line: what`` strings."""
    return [str(f) for f in scan_tree_findings(path)]
