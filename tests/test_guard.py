"""Forged engines must not import reference frameworks; the guard itself must be able to fail."""

import ast
from pathlib import Path

import pytest

from forgetrain.guard import scan_source, scan_tree

ROOT = Path(__file__).resolve().parent.parent


def test_forged_engines_import_no_reference_framework():
    assert scan_tree(ROOT / "scenarios") == []


def test_guard_rejects_planted_imports(tmp_path):
    bad = tmp_path / "scenarios" / "evil"
    bad.mkdir(parents=True)
    (bad / "engine.py").write_text("import torch\nfrom megatron.core import parallel_state\n")
    (bad / "k.py").write_text("import importlib\nte = importlib.import_module('transformer_engine.pytorch')\n")
    (bad / "d.py").write_text("def f():\n    import deepspeed\n")
    hits = scan_tree(tmp_path / "scenarios")
    assert len(hits) == 3
    assert any("megatron.core" in h for h in hits) and any("deepspeed" in h for h in hits)
    assert any("transformer_engine" in h for h in hits)


def test_guard_ignores_lookalikes():
    assert scan_source("import megatron_like\nx = 'import megatron'\n") == []


def test_guard_rejects_references_and_hidden_imports():
    """Imports the old scan did not see: the repository's references, names built at run time, exec of a string
    (escape class 2 of the forge sandbox)."""
    from forgetrain.guard import findings

    src = ("from references.megatron.engine import Engine\n"
           "import importlib\n_ps = importlib.import_module('mega' + 'tron.core')\n"
           "_mc = __import__('.'.join(['megatron', 'core']))\n"
           "exec('from megatron.core import parallel_state')\n"
           "import builtins\nbuiltins.eval('1')\ncode = compile('x = 1', 'f', 'exec')\n")
    got = [(f.line, f.kind) for f in findings(src)]
    assert got == [(1, "import"), (3, "hidden_import"), (4, "hidden_import"), (5, "exec"), (7, "exec"), (8, "exec")]
    assert "references.megatron.engine" in scan_source(src)[0]


def test_guard_lets_methods_and_literal_imports_through():
    src = ("import importlib, re, torch\nm = importlib.import_module('json')\nmodel.eval()\nf = torch.compile(g)\n"
           "p = re.compile('x')\nself.model.eval()\n")
    assert scan_source(src) == []


def test_guard_flags_edits_of_where_imports_come_from():
    """A package imported from the engine's files under a name of its own (a renamed copy of a reference) needs
    an edit of the import path: every spelling of one is a ``path_edit`` finding."""
    from forgetrain.guard import findings

    src = ("import sys, site, importlib.util, importlib.machinery\n"
           "sys.path.insert(0, '_vendor')\nsys.path += ['x']\nsys.path[:] = ['y']\nsys.meta_path.append(F())\n"
           "site.addsitedir('z')\ns = importlib.util.spec_from_file_location('m', 'p.py')\n"
           "L = importlib.machinery.SourceFileLoader('m', 'p.py')\nsys.path_hooks.insert(0, h)\n"
           "paths = list(sys.path)\n")
    got = [(f.line, f.kind) for f in findings(src)]
    assert got == [(n, "path_edit") for n in range(2, 10)], got
    assert scan_source("import sys\nprint(sys.path[0], len(sys.meta_path))\n") == []


def _renamed_copy(src: Path, dst: Path) -> None:
    import re

    text = re.sub(r"\bmegatron\b", "mgt", src.read_text()).replace("references.", "refs_")
    text = text.replace("deepspeed", "dspd").replace("transformer_engine", "trf").replace("apex", "apx")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text)


def test_content_check_refuses_a_reference_under_any_name(tmp_path):
    """A renamed copy of megatron-core's code, or of references/megatron, shares its normalised code with the
    index whatever the names; the scenarios' own engines share nothing that counts (the reshaped copies:
    ``tests/test_forge_content.py``)."""
    import importlib.util

    from forgetrain.forge import content

    idx = content.index_for()
    # each engine as the forge judges one: its package with the shared parts it carries (a forged engine owns its
    # copy of scenarios/_llama, so the copies would count twice over the whole directory)
    for pkg in sorted(p for p in (ROOT / "scenarios").iterdir() if (p / "engine.py").is_file()):
        own = pkg if (pkg / "_llama").is_dir() else None
        assert content.scan(own or pkg, idx) == [], pkg.name
    assert content.scan(ROOT / "scenarios" / "_llama", idx) == []
    mc = Path(importlib.util.find_spec("megatron").submodule_search_locations[0]) / "core"
    _renamed_copy(mc / "optimizer" / "clip_grads.py", tmp_path / "a" / "engine" / "_vendor" / "grads.py")
    hits = content.scan(tmp_path / "a" / "engine", idx)
    assert hits and "_vendor/grads.py" in hits[0] and "megatron/core/optimizer/clip_grads.py" in hits[0]
    _renamed_copy(ROOT / "references" / "megatron" / "engine.py", tmp_path / "b" / "engine" / "x.py")
    assert any("references/megatron/engine.py" in h for h in content.scan(tmp_path / "b" / "engine", idx))


# ---------------------------------------------------------------------------------------------------- what is scanned

def _utf7(text: str) -> bytes:
    """``text`` as UTF-7 source whose UTF-8 reading is one comment line: the cookie on line 1, then the module with
    every newline and punctuation mark base64-escaped (the security tester's encoding)."""
    import base64
    import string

    direct = set(string.ascii_letters + string.digits + " '(),./:?")
    body = "".join(c if c in direct else "+" + base64.b64encode(c.encode("utf-16-be")).decode().rstrip("=") + "-"
                   for c in "\n" + text)
    return ("# -*- coding: utf-7 -*-\n# " + body + "\n").encode("ascii")


HIDDEN = "import megatron.core\nVALUE = 'ran'\n"
REFUSED = {  # name: (bytes, what the reason says)
    "utf-7 cookie": (_utf7(HIDDEN), "'utf-7'"),
    "latin-1 cookie on line 2": (b"#!/usr/bin/env python\n# coding: latin-1\nx = '\xe9'\n", "'latin-1'"),
    "cookie after a form feed": (b"\x0c# vim: set fileencoding=utf-7 :\nx = 1\n", "'utf-7'"),
    "cookie on line 2 after code": (b"x = 1\n# coding: utf-7\n", "'utf-7'"),
    "unknown encoding": (b"# coding: no-such-codec\nx = 1\n", "'no-such-codec'"),
    "utf-16 with its BOM": ("x = 1\n".encode("utf-16"), "UTF-16 byte-order mark"),
    "utf-32 with its BOM": ("x = 1\n".encode("utf-32"), "byte-order mark"),
    "utf-8 BOM and a latin-1 cookie": (b"\xef\xbb\xbf# coding: latin-1\nx = 1\n", "'latin-1'"),
    "NUL byte": (b"x = 1\n\0import megatron\n", "NUL byte at offset 6"),
    "not UTF-8": (b"x = '\xe9'\n", "not UTF-8 (byte 0xe9 at offset 5)"),
}
ACCEPTED = {
    "plain": b"import torch\nx = 1\n",
    "utf-8 cookie": b"# -*- coding: utf-8 -*-\nx = '\xc3\xa9'\n",
    "utf8 cookie on line 2": b"#!/usr/bin/env python\n# coding=utf8\nx = 1\n",
    "utf_8 cookie": b"# vim: set fileencoding=UTF_8 :\nx = 1\n",
    "utf-8 BOM": b"\xef\xbb\xbfx = 1\n",
    "CRLF and CR line ends": b"x = 1\r\ny = 2\rz = 3\n",
    "non-ASCII UTF-8": "s = 'é ∑ 日本'  # é\n".encode(),
    "a cookie on line 3 (Python ignores it)": b"x = 1\ny = 2\n# coding: latin-1\n",
    "coding in a string": b"x = '# coding: utf-7'\n",
    "empty": b"",
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_engine_source_refuses_what_python_would_read_as_other_text(tmp_path, name):
    from forgetrain.errors import ConfigError
    from forgetrain.guard import UnscannableSource, engine_source

    data, why = REFUSED[name]
    f = tmp_path / "m.py"
    f.write_bytes(data)
    with pytest.raises(UnscannableSource) as e:
        engine_source(f)
    assert isinstance(e.value, ConfigError) and e.value.file == str(f) and why in e.value.what, e.value.what


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_engine_source_is_the_text_python_compiles(tmp_path, name):
    from forgetrain.guard import engine_source

    data = ACCEPTED[name]
    f = tmp_path / "m.py"
    f.write_bytes(data)
    text = engine_source(f)
    assert not text.startswith("\ufeff")
    # the code Python compiles from the file's bytes (cookie and BOM honoured) is the code of the text returned
    assert compile(text, str(f), "exec", dont_inherit=True) == compile(data, str(f), "exec", dont_inherit=True)
    assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(data))


def test_engine_source_checks_against_python_s_own_decoder(tmp_path, monkeypatch):
    """Whatever the cookie rule misses, Python's own reading of the bytes is compared with the text: with the rule
    blinded, the UTF-7 file is still refused."""
    import re

    from forgetrain import guard

    monkeypatch.setattr(guard, "_COOKIE", re.compile(r"(?!x)x"))
    f = tmp_path / "m.py"
    f.write_bytes(_utf7(HIDDEN))
    with pytest.raises(guard.UnscannableSource, match="other code than their UTF-8 text"):
        guard.engine_source(f)


def test_scans_and_loader_refuse_what_python_would_run_unscanned(tmp_path, monkeypatch):
    """A UTF-7 module that imports megatron: Python's importer runs it (the escape), the scans read it through
    :func:`engine_source` and refuse it, and the forge's loader refuses to run it."""
    import subprocess
    import sys

    from forgetrain.forge import content
    from forgetrain.forge import workspace as wsmod
    from forgetrain.guard import UnscannableSource

    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "engine.py").write_text("from .hidden import VALUE\n\nclass Engine:\n    value = VALUE\n")
    (eng / "hidden.py").write_bytes(_utf7(HIDDEN.replace("import megatron.core\n", "import json\n")))
    assert (eng / "hidden.py").read_text().count("\n") == 2  # a str reading: the cookie and one comment line
    p = subprocess.run([sys.executable, "-c", "import hidden; print(hidden.VALUE)"], cwd=eng, capture_output=True,
                       text=True)
    assert p.stdout.strip() == "ran", p.stderr  # Python's own importer runs it
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    with pytest.raises(UnscannableSource, match="utf-7"):
        wsmod.load_engine_class(eng, package="_forge_test_utf7")
    (eng / "hidden.py").write_bytes(_utf7(HIDDEN))
    with pytest.raises(UnscannableSource, match="hidden.py"):
        scan_tree(eng)
    with pytest.raises(UnscannableSource, match="hidden.py"):
        content.measure(eng, content.build_index([]))
    (eng / "hidden.py").write_text(HIDDEN.replace("import megatron.core\n", "import json\n"))
    assert wsmod.load_engine_class(eng, package="_forge_test_utf7").value == "ran"  # the same module as UTF-8


def test_a_directory_named_like_a_module_is_no_crash_of_the_scans(tmp_path):
    """A directory ``x.py`` under an engine is not a file Python compiles: the scans skip it, not crash on it."""
    from forgetrain.forge import content
    from forgetrain.guard import scan_tree

    (tmp_path / "trap.py").mkdir()
    (tmp_path / "engine.py").write_text("import math\n")
    assert scan_tree(tmp_path) == []
    assert content.scan(tmp_path, content.build_index([])) == []
