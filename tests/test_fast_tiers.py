"""Each fast-mode optimisation of the Hopper engine against the Megatron-core reference at the tier it declares.

``scenarios/llama1b_h200/optimisations.yaml`` declares, per optimisation, the weakest tier it may be judged at
(batch-first layout and SDPA: loss_curve; chunked CE, fused AdamW and the Triton kernels: tolerance). Relaxation
is monotonic, so a switch stacked on fast mode needs only the weakest tier of everything switched on; here each
switch is *measured* on CPU in fp32 (llama_micro, micro-batch 2 x grad-accum 2, 4 steps, clipping active, from the
reference's initial weights) and must pass the tolerance tier (conf/tier/tolerance.yaml), which implies every
declared tier. Triton kernels run under the CPU interpreter, each switch in its own process (Triton 3.6's
interpreter keeps state between kernels; ``TRITON_INTERPRET=1`` must be set before megatron imports triton).
Gradient accumulation fusion (``engine.grad_accum_fusion``) is judged with both LM-head paths (chunked CE, whose
dW is formed in the forward, and the plain head); two wrong accumulations of it must be rejected.

The GPU side of the same record (bf16, at scenario shapes) needs the device and is not run here.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgetrain import equivalence as eq
from forgetrain.kernels import switches
from forgetrain.verify import VerifyConfig, run_reference
from tests.helpers import ladder_cfg as _cfg
from tests.limits import hang_s
from tests.switch_helpers import FAST_TIER_STEPS as STEPS, FAST_TIER_SWITCHES as SWITCHES, run_switch

ROOT = Path(__file__).resolve().parent.parent
LADDER = ["bitwise", "tolerance", "loss_curve", "surpass"]  # strictest first


def declared(entries: list[str], kernels: dict) -> str:
    """The weakest tier declared by ``entries`` of optimisations.yaml (an engine lever's by its row in the lever
    table, scenarios/llama1b_h200/levers.py) and by the kernel switch values ``kernels``
    (forgetrain/kernels/switches.py)."""
    from omegaconf import OmegaConf

    from scenarios.llama1b_h200.levers import SPEC

    opts = OmegaConf.load(ROOT / "scenarios" / "llama1b_h200" / "optimisations.yaml").optimisations
    tiers = [SPEC.lever(opts[e].lever).tier if "lever" in opts[e] else opts[e].declared_tier for e in entries]
    return max(tiers + switches.tier_of(kernels), key=LADDER.index)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return run_reference(_cfg(), VerifyConfig(steps=STEPS), tmp_path_factory.mktemp("fast_ref"), STEPS)


def _candidate(name: str, ref: Path, out: Path, **model) -> Path:
    if not name.startswith("triton"):
        run_switch(name, str(ref), str(out), **model)
        return out
    pytest.importorskip("forgetrain.kernels._triton")
    code = f"from tests.switch_helpers import run_switch; run_switch({name!r}, {str(ref)!r}, {str(out)!r})"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=hang_s())
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_switch_passes_its_declared_tier(name, ref, tmp_path):
    want = declared(SWITCHES[name][1], SWITCHES[name][0])
    cand = _candidate(name, ref, tmp_path / name)
    v = eq.tolerance(ref / "trace", cand / "trace", eq.load_tier("tolerance"))
    assert v.passed, f"{name} (declared {want}): {v.summary}"
    assert LADDER.index("tolerance") <= LADDER.index(want)  # tolerance implies the declared tier
    print(f"{name}: passes tolerance (declared {want}): {v.summary}")


def test_switch_gate_rejects_a_wrong_fast_engine(ref, tmp_path):
    """The fast engine with RMSNorm epsilon 1e-4 instead of the model's 1e-5 is rejected, at step 1."""
    cand = tmp_path / "eps"
    run_switch("fast_torch", str(ref), str(cand), norm_epsilon=1e-4)
    v = eq.tolerance(ref / "trace", cand / "trace", eq.load_tier("tolerance"))
    assert not v.passed, v.summary
    assert v.first_divergence is not None and v.first_divergence["step"] == 1, v.first_divergence


def _wrong_accumulation(kind: str):
    """The Hopper engine with a wrong gradient accumulation fusion: ``forgets_overwrite`` never overwrites
    main_grad on the first micro-batch (the last step's gradient leaks into this one); ``unscaled_head`` forms the
    LM head's forward-time dW without the 1 / n of ``(loss / n).backward()``."""
    from scenarios.llama1b_h200.engine import Engine as Hopper

    change = {"forgets_overwrite": {"first": False}, "unscaled_head": {"scale": 1.0}}[kind]

    class Wrong(Hopper):
        def _accum(self, i, n):
            return dataclasses.replace(super()._accum(i, n), **change)

    return Wrong


@pytest.mark.parametrize("kind,step", [("forgets_overwrite", 2), ("unscaled_head", 1)])
def test_tolerance_rejects_a_wrong_grad_accumulation(kind, step, ref, tmp_path):
    """Each wrong accumulation is rejected, at the first step its gradient is wrong (step 1 starts from a zero
    main_grad, so a missing overwrite shows from step 2)."""
    run_switch("grad_accum_fusion", str(ref), str(tmp_path / kind), engine_cls=_wrong_accumulation(kind))
    v = eq.tolerance(ref / "trace", tmp_path / kind / "trace", eq.load_tier("tolerance"))
    assert not v.passed, v.summary
    assert v.first_divergence is not None and v.first_divergence["step"] == step, v.first_divergence
