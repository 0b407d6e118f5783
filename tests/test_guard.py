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
