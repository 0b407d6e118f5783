"""Forged engines must not import reference frameworks; the guard itself must be able to fail."""

from pathlib import Path

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
