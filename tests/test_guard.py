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
