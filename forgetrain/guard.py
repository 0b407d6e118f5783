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

What is scanned is what runs: every scan of an engine's files (this one, the content check
:mod:`forgetrain.forge.content`, the workspace's) and the forge's loader of the engine
(``forgetrain.forge.workspace.load_engine_class``, which compiles the text returned) read a file through
:func:`engine_source`, which returns its source exactly as Python compiles it and refuses
(:class:`UnscannableSource`) a file Python would read as other text: a coding cookie other than UTF-8's (a
UTF-7 file is one comment line as UTF-8 text, and a whole module to Python), a byte-order mark other than
UTF-8's, bytes that are not UTF-8, a NUL byte.
"""

from __future__ import annotations

import ast
import codecs
import re
from dataclasses import dataclass
from pathlib import Path

from forgetrain.errors import ConfigError

FORBIDDEN = ("megatron", "deepspeed", "transformer_engine", "apex")  # reference frameworks
FORBIDDEN_ROOTS = FORBIDDEN + ("references",)  # ... and the repository's reference engines
_DYNAMIC_IMPORT = ("import_module", "__import__")
_CODE_BUILTINS = ("exec", "eval", "compile")
_IMPORT_STATE = ("path", "meta_path", "path_hooks")  # sys.<x>: where imports come from
_PATH_CALLS = {("site", "addsitedir"), ("util", "spec_from_file_location"), ("importlib", "spec_from_file_location"),
               ("machinery", "SourceFileLoader"), ("machinery", "SourcelessFileLoader"),
               ("machinery", "ExtensionFileLoader"), ("machinery", "PathFinder"), ("machinery", "FileFinder")}


# PEP 263: a comment on line 1 or 2 naming the source's encoding. Matched on either of the first two lines, whatever
# line 1 holds, and with every line break Python knows: wider than CPython's own rule, never narrower.
_COOKIE = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.ASCII)
_FOREIGN_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
                 (codecs.BOM_UTF16_BE, "UTF-16"))


class UnscannableSource(ConfigError):
    """An engine file whose bytes Python would compile as other text than the UTF-8 text the scans read
    (:func:`engine_source`); the forge rejects the round naming escape class 7. ``file`` names it, ``what`` says
    why."""

    def __init__(self, file: str, what: str):
        self.file, self.what = file, what
        super().__init__(f"{file}: {what}")


def _utf8_name(name: str) -> bool:
    """Whether CPython decodes a source whose cookie names ``name`` as UTF-8 (its tokenizer's ``get_normal_name``
    first: ``utf_8``, ``UTF-8-sig``, ``utf-8-anything`` are UTF-8 without a codec lookup)."""
    norm = name[:12].lower().replace("_", "-")
    if norm == "utf-8" or norm.startswith("utf-8-"):
        return True
    try:
        return codecs.lookup(name).name == "utf-8"
    except Exception:  # noqa: BLE001 - LookupError, or a codec search function that fails: not UTF-8
        return False


def _tree(src: str | bytes) -> str | None:
    """The syntax tree Python builds of ``src`` (bytes: decoded as Python decodes a file), dumped; None when it
    does not parse."""
    try:
        return ast.dump(ast.parse(src))
    except Exception:  # noqa: BLE001 - SyntaxError, a decoding error, a tree too deep to dump: no tree
        return None


def source_text(data: bytes, filename: str = "<src>") -> str:
    """The text Python compiles from the bytes ``data`` of a ``.py`` file, decoded as UTF-8 (a UTF-8 byte-order
    mark dropped, as Python drops it). Raises :class:`UnscannableSource`, naming ``filename``, where Python would
    compile other text, or the scans could not read what it compiles: a NUL byte, a byte-order mark other than
    UTF-8's, bytes that are not UTF-8, a coding cookie (PEP 263, line 1 or 2) naming another encoding than UTF-8,
    or any other bytes Python parses to another syntax tree than their UTF-8 text (a check against Python's own
    decoder, whatever the rules above miss)."""
    def refuse(what: str) -> UnscannableSource:
        return UnscannableSource(filename, f"{what}: Python would compile other code than the UTF-8 text every "
                                           f"scan reads (write engine files as UTF-8, with no coding cookie or a "
                                           f"utf-8 one)")

    for bom, name in _FOREIGN_BOMS:
        if data.startswith(bom):
            raise refuse(f"a {name} byte-order mark")
    body = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    head = body.decode("latin-1")  # every byte one character: a cookie is ASCII, whatever surrounds it
    for line in head.split("\n", 2)[:2] + re.split(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85]", head, maxsplit=2)[:2]:
        m = _COOKIE.match(line)
        if m and not _utf8_name(m.group(1)):
            raise refuse(f"declares the source encoding {m.group(1)!r} (a coding cookie: {line.strip()[:80]!r})")
    nul = data.find(b"\0")
    if nul >= 0:
        raise refuse(f"a NUL byte at offset {nul}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    as_python, as_text = _tree(data), _tree(text)
    if as_python != as_text:
        raise refuse("Python decodes its bytes to other code than their UTF-8 text")
    return text


def engine_source(path: str | Path) -> str:
    """The source of the engine file ``path`` exactly as Python compiles it: the one reading of an engine's files
    by every scan and by the forge's loader (:func:`source_text`). Raises :class:`UnscannableSource` for a file
    Python would read as other text, OSError for one that cannot be read."""
    return source_text(Path(path).read_bytes(), str(path))


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
    """Findings in every ``.py`` file under ``path`` (a file or a directory), each read by :func:`engine_source`.
    Raises SyntaxError, and UnscannableSource for a file Python would compile as other text."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*.py") if f.is_file())
    out = []
    for f in files:
        out += findings(engine_source(f), str(f))
    return out


def scan_tree(path: str | Path) -> list[str]:
    """:func:`scan_tree_findings` as ``file:line: what`` strings."""
    return [str(f) for f in scan_tree_findings(path)]
