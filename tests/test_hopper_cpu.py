"""The Hopper engine (scenarios llama1b_h200 / llama3b_h200 / llama8b_h100) at tiny width on CPU: the same code
CI can run.

* exact mode, fp32 and bf16 (bf16 weights + fp32 main weights): bitwise against the Megatron-core reference;
* fast mode (batch-first, SDPA, chunked LM-head CE) with each per-op kernel switch (torch | triton under the
  Triton interpreter): a correct loss at step 1 and a falling loss.
"""

import dataclasses

import pytest

from forgetrain import equivalence as eq
from forgetrain.config import EngineOptions, KernelsConfig
from forgetrain.verify import VerifyConfig, run_candidate, run_reference
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import ladder_cfg as _cfg
from tests.limits import hang_s
from tests.switch_helpers import HOPPER_CPU_SWITCHES as SWITCHES, check_switch


def _exact(**train):
    c = _cfg(**train)
    return dataclasses.replace(c, engine=EngineOptions(mode="exact"), kernels=KernelsConfig())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_mode_is_bitwise_vs_reference(precision, tmp_path):
    cfg = _exact(precision=precision)
    ref = run_reference(cfg, VerifyConfig(steps=3), tmp_path / "ref", 3)
    cand = run_candidate(cfg, VerifyConfig(steps=3), tmp_path / "cand", 3, ref / "init.safetensors", Hopper)
    v = eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary


# The Triton switches are slow under the CPU interpreter (20-60 s each) and each is already judged at the tolerance
# tier by tests/test_fast_tiers.py; here they run with -m slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "triton" in n else n
                                  for n in sorted(SWITCHES)])
def test_fast_mode_switches_match_exact_at_step1_and_train(name):
    if "triton" not in name:
        check_switch(name)
        return
    pytest.importorskip("forgetrain.kernels._triton")
    # Triton 3.6's CPU interpreter keeps state between different kernels in one process (a second kernel can
    # fail with "Cannot call @triton.jit'd outside of the scope of a kernel"), so each switch runs in its own
    # process. On the GPU no interpreter is involved.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", f"import tests.switch_helpers as t; t.check_switch({name!r})"],
                       cwd=root, capture_output=True, text=True, timeout=hang_s())
    assert p.returncode == 0, p.stderr[-3000:]


# --------------------------------------------------------------------------------------------- DP=2 (gloo)
# One two-rank torchrun launch: the Megatron reference at DP=2 (DDP, grad_reduce_in_fp32; and ZeRO-1, its
# distributed optimizer) and the Hopper engine's exact mode from its init, fp32 and bf16, a ZeRO-1 run saved at
# step 3 and resumed, plus a mutant that skips the 1/DP scaling. The same code path
# runs on NCCL on GPUs (not yet run on more than one: issue 8).
HOPPER_EXACT = ["scenario=llama1b_h200", "hardware=cpu", "model=llama_micro", "mode=exact",
                "train.deterministic=true", "train.micro_batch_size=2", "train.global_batch_size=8",
                "train.lr_warmup_steps=2", "train.steps=6", "parallel=dp2"]


class HopperNoDPScale(Hopper):
    """Sums the DP ranks' gradients instead of averaging them (the 1/DP scaling before the all-reduce dropped)."""

    def _setup_dp_buffer(self):
        super()._setup_dp_buffer()
        finish = self.ddp.finish_grad_sync

        def no_scale():
            self.ddp.grad_data *= float(self.dp_size)  # undo the 1/DP that finish_grad_sync applies
            finish()
        self.ddp.finish_grad_sync = no_scale


@pytest.fixture(scope="module")
def hopper_dp2(tmp_path_factory):
    from tests.helpers import session_cache as _cache
    from tests.helpers import Runs, run_jobs

    tmp = tmp_path_factory.mktemp("hopper_dp2")
    names = [f"{side}{z}_{p}" for side in ("ref", "cand") for z in ("", "_z1") for p in ("fp32", "bf16")]
    d = {n: tmp / n for n in [*names, "no_scale", "cand_z1_part"]}
    jobs = []
    for z, zover in (("", []), ("_z1", ["parallel.zero_stage=1"])):
        for p in ("fp32", "bf16"):
            over = [*HOPPER_EXACT, f"train.precision={p}", *zover]
            jobs += [{"side": "reference", "out": str(d[f"ref{z}_{p}"]), "overrides": over},
                     {"side": "candidate", "out": str(d[f"cand{z}_{p}"]), "overrides": over,
                      "init": str(d[f"ref{z}_{p}"] / "init.safetensors")}]
    z1_bf16 = [*HOPPER_EXACT, "train.precision=bf16", "parallel.zero_stage=1"]
    for part in ({"stop_after": 3}, {"resume": True}):
        jobs.append({"side": "candidate", "out": str(d["cand_z1_part"]), "overrides": z1_bf16,
                     "init": str(d["ref_z1_bf16"] / "init.safetensors"), **part})
    jobs.append({"side": "candidate", "out": str(d["no_scale"]), "overrides": [*HOPPER_EXACT, "train.precision=fp32"],
                 "init": str(d["ref_fp32"] / "init.safetensors"), "engine": "tests.test_hopper_cpu:HopperNoDPScale"})
    return Runs(d, run_jobs(jobs, tmp, _cache(tmp_path_factory)), 0.0)


@pytest.mark.parametrize("zero", ["", "_z1"], ids=["ddp", "zero1"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hopper_dp2_is_bitwise_vs_reference_dp2(hopper_dp2, precision, zero):
    ref, cand = hopper_dp2[f"ref{zero}_{precision}"], hopper_dp2[f"cand{zero}_{precision}"]
    v = eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary


def test_hopper_zero1_resume_is_bitwise(hopper_dp2):
    """ZeRO-1, bf16: saved at step 3 (moments all-gathered into the DP-independent layout), resumed, equal to the
    uninterrupted run."""
    v = eq.bitwise(hopper_dp2["cand_z1_bf16"] / "trace", hopper_dp2["cand_z1_part"] / "trace",
                   eq.load_tier("bitwise"))
    assert v.passed, v.summary


def test_hopper_dp2_bitwise_rejects_missing_dp_scaling(hopper_dp2):
    v = eq.bitwise(hopper_dp2["ref_fp32"] / "trace", hopper_dp2["no_scale"] / "trace", eq.load_tier("bitwise"))
    assert not v.passed
    assert v.first_divergence["step"] == 1 and v.first_divergence["kind"] == "grad", v.first_divergence


def test_hopper_rejects_layouts_it_does_not_implement():
    from forgetrain.errors import ConfigError

    c = _exact()
    for par in ({"tensor_parallel_size": 2}, {"zero_stage": 3}):
        bad = dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, **par))
        with pytest.raises(ConfigError, match="only data parallelism"):
            Hopper(bad, "cpu")
    # its DP buffer reduces once after the last micro-batch: an overlap or a bucket size would be silently ignored
    for par in ({"overlap_grad_reduce": True}, {"bucket_size": 1000}):
        bad = dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, **par))
        with pytest.raises(ConfigError, match="reduces the gradients once, after the last micro-batch"):
            Hopper(bad, "cpu")
