"""The forged engine against the stored golden reference traces (no reference re-run), where the platform matches."""

import dataclasses
import json
import platform

import pytest
import torch
from safetensors.torch import load_file

from forgetrain import equivalence as eq
from forgetrain.verify import GOLDEN_ROOT, VerifyConfig, run_candidate
from tests.test_ladder import _cfg

GOLDENS = sorted((GOLDEN_ROOT / "cpu").glob("llama_tiny_cpu-bitwise-*")) if (GOLDEN_ROOT / "cpu").exists() else []


def _platform_matches(meta: dict) -> tuple[bool, str]:
    v = meta.get("versions", {})
    here = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads()}
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
    from forgetrain.train import config_hash
    from forgetrain.verify import _run_cfg

    if config_hash(_run_cfg(cfg, tmp_path, steps=steps, digests=True)) != meta["config_hash"]:
        pytest.skip("golden config differs from the test config (regenerate the golden)")
    cand = run_candidate(cfg, VerifyConfig(steps=steps), tmp_path / "cand", steps, golden / "init.safetensors")
    v = eq.bitwise(golden / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary


def test_goldens_exist_with_versions():
    assert GOLDENS, "no CPU golden stored under references/goldens/cpu"
    for g in GOLDENS:
        meta = json.loads((g / "trace" / "meta.json").read_text())
        assert meta["side"] == "references/megatron" and "megatron-core" in meta["versions"]
        assert load_file(str(g / "init.safetensors"))
