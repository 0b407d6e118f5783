"""experiments/equivalence_power/run.py on CPU: the device script's driver still runs end to end at a tiny shape,
against a golden it makes itself (the CPU scenario on llama_micro, 3 reference seeds, 80 steps: 4 windows).

What it checks is the driver, not the tier's power at a real shape (docs/equivalence_power.md holds that): the
unchanged default passes paired, the bench's plain-PyTorch peer is judged from the same inits and compared with the
default seed by seed, and a request of fewer than 3 seeds is refused before any run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from forgetrain import verify as V
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "experiments" / "equivalence_power" / "run.py"
SHAPE = ["scenario=llama_tiny_cpu", "model=llama_micro", "hardware=cpu", "train.micro_batch_size=4",
         "train.global_batch_size=8", "train.lr_warmup_steps=10", "train.lr=1e-3", "train.min_lr=1e-4",
         "verify.curve_steps=80", "verify.seeds=[1234,1235,1236]", "verify.candidate_seeds=[2234,2235,2236]"]


def _run_module():
    spec = importlib.util.spec_from_file_location("equivalence_power_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_power_driver_runs_and_judges_each_plant(golden_root, tmp_path):
    run = _run_module()
    rc, vcfg = run.compose(SHAPE + ["tier=loss_curve"])
    V.verify(rc, dataclasses.replace(vcfg, make_golden=True), "loss_curve", tmp_path / "g")  # the golden, here
    out = tmp_path / "power"
    assert run.main(["--out", str(out), "--plants", "default,peer_bf16", "--", *SHAPE,
                     f"verify.init_cache={tmp_path}/inits"]) == 0
    rows = {row["plant"]: row for row in json.loads((out / "power.json").read_text())["rows"]}
    assert rows["default"]["passed"], rows["default"]["summary"]
    assert rows["default"]["mode"] == "paired" and len(rows["default"]["late_diff_per_seed"]) == 3
    assert "late_diff_per_seed" in rows["peer_bf16"]  # the peer was judged paired, from the same inits
    assert len(rows["peer_bf16"]["vs_default_per_seed"]) == 3  # and compared with the default seed by seed
    for name in rows:
        assert (out / name / "verdict.json").is_file()


def test_fewer_than_three_seeds_is_refused_before_any_run(tmp_path):
    out = tmp_path / "power"
    r = subprocess.run([sys.executable, str(RUN), "--out", str(out), "--plants", "default", "--seeds", "1234,1235",
                        "--", *SHAPE], cwd=ROOT, capture_output=True, text=True, timeout=hang_s())
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --seeds needs 3 or more of the golden's seeds, got [1234, 1235]"]
    assert not out.exists()


def test_each_peer_plant_is_valid_at_the_gpu_shapes(monkeypatch):
    """A peer plant at the shapes of the device script (scripts/device/shapes.sh: P8, R1B) passes the checks its
    training run makes with its own engine class: the scenario default's levers and forged kernels are the forged
    engine's, so the peer must not inherit them (it did, and its run was refused on the GPU)."""
    import torch

    from forgetrain.config.checks import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run = _run_module()
    sys.path.insert(0, str(RUN.parent))
    try:
        import plants as P
    finally:
        sys.path.remove(str(RUN.parent))
    shapes = {"p8": ["scenario=llama8b_h100", "model.num_layers=4", "train.micro_batch_size=1",
                     "train.global_batch_size=1"],
              "r1b": ["scenario=llama1b_h200", "model.num_layers=8", "train.micro_batch_size=2",
                      "train.global_batch_size=4"]}
    for shape in shapes.values():
        rc, _ = run.compose(shape + ["hardware=h200", "train.deterministic=false", "train.skip_memory_check=true",
                                     "tier=loss_curve", "verify.golden=true"])
        for name in P.PEERS:
            validate(P.run_config(name, rc), world_size=1, engine_cls=P.planted(name, None), reference=False)


def test_the_bf16_grad_accum_plant_builds_and_rounds_only_the_training_gradients():
    """The plant rounds main_grad to bf16 after every weight-gradient accumulation, yet its engine builds: the
    gradient-accumulation path is chosen on the plain op first (the engine's own probe would otherwise see the
    planted rounding and refuse every path, as it did on the GPU)."""
    import torch

    from forgetrain.config import to_run_config  # noqa: F401 - the harness loads before the plant patches
    from scenarios.llama1b_h200 import wgrad

    sys.path.insert(0, str(RUN.parent))
    try:
        import plants as P
    finally:
        sys.path.remove(str(RUN.parent))
    orig_gemm, orig_chosen = wgrad.gemm_accumulate, dict(wgrad._CHOSEN)
    try:
        wgrad._CHOSEN.clear()
        planted = P.planted("bf16_grad_accum", type("Base", (), {"__init__": lambda self, cfg, device: None}))
        planted(None, "cpu")
        assert wgrad._CHOSEN["cpu"][0] == "fp32_upcast" and getattr(wgrad.gemm_accumulate, "planted", False)
        mg = torch.zeros(8, 16)
        dy, x = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
        wgrad.gemm_accumulate(mg, dy, x, False, 1.0, "fp32_upcast")
        assert torch.equal(mg, mg.to(torch.bfloat16).float()) and mg.abs().sum() > 0  # rounded to bf16
    finally:
        wgrad.gemm_accumulate = orig_gemm
        wgrad._CHOSEN.clear()
        wgrad._CHOSEN.update(orig_chosen)
