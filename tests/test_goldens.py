"""The forged engine against the stored golden reference traces (no reference re-run), where the platform matches."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from forgetrain import equivalence as eq
from forgetrain.verify import GOLDEN_ROOT, VerifyConfig, run_candidate
from tests.helpers import ladder_cfg as _cfg
from tests.limits import hang_s

GOLDENS = sorted((GOLDEN_ROOT / "cpu").glob("llama_tiny_cpu-bitwise-*")) if (GOLDEN_ROOT / "cpu").exists() else []


def _platform_matches(meta: dict) -> tuple[bool, str]:
    """A bitwise golden holds on the CPU model, thread count and torch build that made it (the matrix library
    picks its kernels per CPU model); elsewhere the test is skipped, naming the difference."""
    from forgetrain.metrics import cpu_model

    v = meta.get("versions", {})
    here = {"torch": torch.__version__, "cpu": cpu_model(), "threads": torch.get_num_threads()}
    diff = {k: (v.get(k), here[k]) for k in here if v.get(k) is not None and v.get(k) != here[k]}
    return not diff, f"golden made on another platform (golden, here): {diff}"


@pytest.mark.parametrize("golden", GOLDENS, ids=lambda p: p.name)
def test_forged_matches_golden(golden, tmp_path):
    meta = json.loads((golden / "trace" / "meta.json").read_text())
    ok, why = _platform_matches(meta)
    if not ok:
        pytest.skip(why)
    steps = meta["steps"]
    cfg = _cfg()  # the golden's command line: model=llama_micro, mb 2, gb 4, warmup 2, a 500-step schedule
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=500))
    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.train import config_hash

    run = run_cfg(cfg, tmp_path, steps=steps, digests=True)
    if config_hash(run) != meta["config_hash"]:  # a stale golden fails, naming what changed; it never skips
        pytest.fail(f"the golden {golden.name} was made with another config: {_config_diff(meta, run)}; "
                    f"regenerate it with the command in references/goldens/README.md")
    cand = run_candidate(cfg, VerifyConfig(steps=steps), tmp_path / "cand", steps, golden / "init.safetensors")
    v = eq.bitwise(golden / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary


def _config_diff(meta: dict, run) -> str:
    from forgetrain.train import hashed_config

    old, new = meta.get("config"), hashed_config(run)
    if old is None:
        return "the golden predates stored configs (meta.json has only its hash)"
    diffs = [f"{g}.{k}: {old.get(g, {}).get(k)!r} -> {new[g].get(k)!r}" for g in new
             for k in sorted(set(old.get(g, {})) | set(new[g])) if old.get(g, {}).get(k) != new[g].get(k)]
    return ", ".join(diffs) or "same settings, another hash function"


def test_config_diff_names_what_changed(tmp_path):
    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.train import hashed_config

    run = run_cfg(_cfg(), tmp_path, steps=8, digests=True)
    meta = {"config": hashed_config(run)}
    meta["config"]["train"]["lr"] = 1.0
    assert _config_diff(meta, run) == f"train.lr: 1.0 -> {run.train.lr!r}"


GOLDEN_COMMAND = ["model=llama_micro", "train.micro_batch_size=2", "train.global_batch_size=4",
                  "train.lr_warmup_steps=2", "verify.steps=8", "tier=bitwise"]  # references/goldens/README.md


def test_documented_golden_command_works(tmp_path):
    """The README's `verify.golden=true` command judges the forged engine against the stored golden and passes."""
    import os
    import subprocess
    import sys

    from forgetrain.verify import GOLDEN_ROOT as root

    assert GOLDENS
    meta = json.loads((GOLDENS[0] / "trace" / "meta.json").read_text())
    ok, why = _platform_matches(meta)
    if not ok:
        pytest.skip(why)
    readme = (root / "README.md").read_text()
    assert " ".join(GOLDEN_COMMAND[:4]) in readme, "the README's golden command changed: update GOLDEN_COMMAND"
    env = dict(os.environ, PYTHONPATH=str(root.parent.parent))
    p = subprocess.run([sys.executable, "-m", "forgetrain.verify", *GOLDEN_COMMAND, "verify.golden=true",
                        f"verify.out_dir={tmp_path / 'v'}"], cwd=tmp_path, env=env, text=True, capture_output=True,
                       timeout=hang_s())
    assert p.returncode == 0, p.stderr[-2000:]
    assert "bitwise  pass" in p.stdout + p.stderr and "reference: the stored golden" in p.stderr


def test_goldens_exist_with_versions():
    assert GOLDENS, "no CPU golden stored under references/goldens/cpu"
    for g in GOLDENS:
        meta = json.loads((g / "trace" / "meta.json").read_text())
        assert meta["side"] == "references/megatron" and "megatron-core" in meta["versions"]
        assert load_file(str(g / "init.safetensors"))
