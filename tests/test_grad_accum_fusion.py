"""Gradient accumulation fusion of the fast Hopper engine (``engine.grad_accum_fusion``, scenarios/llama1b_h200/
wgrad.py) on CPU: the GEMM-path probe, the fp32 main_grad against the unfused path's (eager and compiled), the
switch's validation, bf16 against Megatron-core and DP=2 (DDP and ZeRO-1, fp32) against Megatron-core's DP=2, at
the tolerance tier.
Its tolerance verdict at DP=1 and the rejection of wrong accumulations are in tests/test_fast_tiers.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forgetrain import equivalence as eq
from forgetrain.config import EngineOptions, KernelsConfig
from scenarios.llama1b_h200 import wgrad
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import ladder_cfg as _cfg
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------ the GEMM path probe
def _upcast(mg, dy, x, overwrite, alpha):
    wgrad.gemm_accumulate(mg, dy, x, overwrite, alpha, "fp32_upcast")


def _raises(mg, dy, x, overwrite, alpha):
    raise RuntimeError("no kernel for this backend\nsecond line")


def _bf16_rounded(mg, dy, x, overwrite, alpha):  # the unfused arithmetic: a bf16 dW, then an fp32 add
    part = (wgrad._flat(dy).t() @ wgrad._flat(x)).float() * alpha
    mg.copy_(part) if overwrite else mg.add_(part)


def _ignores_overwrite(mg, dy, x, overwrite, alpha):  # accumulates onto the stale (NaN) contents
    wgrad.gemm_accumulate(mg, dy, x, False, alpha, "fp32_upcast")


def test_probe_picks_the_first_path_that_runs_and_is_right():
    path, rejected = wgrad.probe_path("cpu", {"raises": _raises, "bf16": _bf16_rounded,
                                              "stale": _ignores_overwrite, "good": _upcast, "later": _upcast})
    assert path == "good"
    assert list(rejected) == ["raises", "bf16", "stale"]
    assert rejected["raises"] == "RuntimeError: no kernel for this backend"
    assert rejected["bf16"].startswith("wrong result") and rejected["stale"].startswith("wrong result")


def test_probe_raises_when_no_path_works():
    with pytest.raises(RuntimeError, match="no gradient-accumulation path works"):
        wgrad.probe_path("cpu", {"raises": _raises, "bf16": _bf16_rounded})


def test_probe_on_cpu_is_the_fp32_upcast():
    assert wgrad.probe_path("cpu") == ("fp32_upcast", {})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_accumulate_overwrites_then_accumulates(dtype):
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(2, 5, 6, generator=g).to(dtype), torch.randn(2, 5, 4, generator=g).to(dtype)
    mg = torch.full((6, 4), float("nan"))
    wgrad.gemm_accumulate(mg, dy, x, True, 0.25, "fp32_upcast")
    wgrad.gemm_accumulate(mg, dy, x, False, 1.0, "fp32_upcast")
    want = 1.25 * (dy.reshape(-1, 6).double().t() @ x.reshape(-1, 4).double())
    torch.testing.assert_close(mg.double(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="unknown gradient-accumulation path 'nope'"):
        wgrad.gemm_accumulate(mg, dy, x, False, 1.0, "nope")


# ----------------------------------------------------------------------- main_grad: fused equals unfused (fp32)
def _engine(fusion: bool, ce: str, compile_: bool = False, precision: str = "fp32") -> Hopper:
    c = _cfg(precision=precision)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=256),
                            engine=EngineOptions(mode="fast", compile=compile_, ce_chunk_tokens=24,
                                                 grad_accum_fusion=fusion),
                            kernels=KernelsConfig(cross_entropy=ce))
    return Hopper(c, "cpu")


def _main_grads_after_steps(fusion: bool, ce: str, compile_: bool, init=None, steps: int = 2):
    """main_grad (cloned) after each of ``steps`` steps of 3 micro-batches (different batches per step)."""
    eng = _engine(fusion, ce, compile_)
    if init is not None:
        eng.load_hf_weights(init)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        eng.train_step([torch.randint(0, 256, (2, 33), generator=g) for _ in range(3)])
        out.append({k: v.clone() for k, v in eng.main_grad.items()})
    return eng, out


@pytest.mark.parametrize("ce,compile_", [("chunked", False), ("torch", False), ("chunked", True)],
                         ids=["chunked_ce", "torch_ce", "chunked_ce_compiled"])
def test_fused_main_grad_equals_unfused_in_fp32(ce, compile_):
    """After each of two steps (so the first micro-batch's overwrite of the last step's gradient is exercised)
    every fp32 main_grad equals the unfused path's within fp32 rounding (rel 1e-5 of the tensor's max); the fused
    weights never get an autograd .grad, the norm weights keep that path."""
    base, want = _main_grads_after_steps(False, ce, compile_)
    eng, got = _main_grads_after_steps(True, ce, compile_, init=_engine(False, ce).export_hf_weights())
    assert eng.grad_accum_path == "fp32_upcast" and base.grad_accum_path is None
    assert sorted(eng._fused) == sorted(k for k in eng.main if eng.main[k].dim() == 2)
    assert all(p.grad is None for p in eng.model.parameters())
    for step, (w, g) in enumerate(zip(want, got), 1):
        for k in w:
            err = float((g[k] - w[k]).abs().max() / w[k].abs().max())
            assert err < 1e-5, (step, k, err)


def test_fused_main_grad_is_the_sum_over_micro_batches_of_loss_over_n():
    """Megatron's meaning, checked directly: main_grad == sum_i grad(loss_i / n) (fp32, one step, 3 micro-batches,
    each micro-batch's gradient by autograd on the unfused fast model)."""
    eng = _engine(True, "chunked")
    ref = _engine(False, "chunked")
    ref.load_hf_weights(eng.export_hf_weights())
    g = torch.Generator().manual_seed(3)
    mbs = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(3)]
    want = {k: torch.zeros_like(v) for k, v in ref.main.items()}
    named = dict(ref.model.named_parameters())
    for mb in mbs:
        loss, _ = ref.model(mb[:, :-1], mb[:, 1:])
        (loss / len(mbs)).backward()
        for k in want:
            want[k] += named[k].grad
            named[k].grad = None
    eng.train_step(mbs)
    for k, w in want.items():
        torch.testing.assert_close(eng.main_grad[k], w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


def test_a_stray_autograd_grad_on_a_fused_weight_is_an_error():
    eng = _engine(True, "chunked")
    eng._accum = lambda i, n: None  # the model then runs unfused: every weight gets a .grad
    with pytest.raises(RuntimeError, match="fused or per-layer weights got an autograd .grad"):
        eng.train_step([torch.randint(0, 256, (2, 33))])


def test_triton_ce_keeps_the_lm_head_on_autograd():
    """``kernels.cross_entropy=triton`` computes the LM head's dW inside its kernel: that weight is not routed
    (its .grad is added as before), every other matrix is."""
    c = _cfg()
    c = dataclasses.replace(c, engine=EngineOptions(mode="fast", compile=False, grad_accum_fusion=True),
                            kernels=KernelsConfig(cross_entropy="triton"))
    eng = Hopper(c, "cpu")
    assert "output_layer.weight" not in eng._fused and "embedding.weight" in eng._fused
    assert len(eng._fused) == 1 + 4 * c.model.num_layers  # the embedding and four matrices per block


def test_bench_info_names_the_path():
    rest = {"recompute": "none", "recompute_num_layers": None, "optimizer_offload_fraction": 0.0,
            "fp8": "none", "fp8_lm_head": False}
    assert _engine(True, "torch", precision="bf16").bench_info == {"grad_accum_fusion": "fp32_upcast",
                                                                   "bf16_weights": "resident", **rest}
    assert _engine(False, "torch").bench_info == {"grad_accum_fusion": None, "bf16_weights": None, **rest}


def test_fused_bf16_passes_tolerance_vs_reference(tmp_path):
    """bf16 (bf16 weights, fp32 main weights), where fusion changes the arithmetic (no bf16 rounding of each
    micro-batch's weight gradient): the fused fast engine with the chunked LM-head CE against Megatron-core at
    the tolerance tier (llama_micro, micro-batch 2 x grad-accum 2, 4 steps)."""
    from forgetrain.verify import VerifyConfig, run_candidate, run_reference

    c = _cfg(precision="bf16")
    ref = run_reference(c, VerifyConfig(steps=4), tmp_path / "ref", 4)
    fused = dataclasses.replace(c, engine=EngineOptions(mode="fast", compile=False, ce_chunk_tokens=24,
                                                        grad_accum_fusion=True),
                                kernels=KernelsConfig(cross_entropy="chunked"))
    cand = run_candidate(fused, VerifyConfig(steps=4), tmp_path / "cand", 4, ref / "init.safetensors", Hopper)
    v = eq.tolerance(ref / "trace", cand / "trace", eq.load_tier("tolerance"))
    assert v.passed, v.summary


# ------------------------------------------------------------------------------------------- the switch itself
def test_exact_mode_rejects_the_switch(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "forgetrain", "scenario=llama1b_h200", "hardware=cpu",
                        "model=llama_micro", "engine.mode=exact", "engine.grad_accum_fusion=true",
                        f"train.out_dir={out}"], cwd=ROOT, text=True, capture_output=True, timeout=hang_s())
    lines = [x for x in p.stderr.strip().splitlines() if x]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[-1].startswith("error: engine.grad_accum_fusion=true needs engine.mode=fast"), lines[-1]
    assert not out.exists()


# ---------------------------------------------------------------------- DP=2: DDP and ZeRO-1 (gloo, torchrun)
FUSED_DP2 = ["scenario=llama1b_h200", "hardware=cpu", "model=llama_micro", "train.deterministic=true",
             "train.micro_batch_size=2", "train.global_batch_size=8", "train.lr_warmup_steps=2", "train.steps=4",
             "parallel=dp2", "train.precision=fp32", "kernels.adamw=torch", "kernels.cross_entropy=chunked",
             "engine.compile=false", "engine.ce_chunk_tokens=24", "engine.onepass_optimizer=false"]


@pytest.fixture(scope="module")
def fused_dp2(tmp_path_factory):
    from tests.helpers import session_cache as _cache
    from tests.helpers import Runs, run_jobs

    tmp = tmp_path_factory.mktemp("fused_dp2")
    d = {n: tmp / n for n in ("ref", "ref_z1", "fused", "fused_z1", "stale_z1")}
    jobs = []
    for z, zover in (("", []), ("_z1", ["parallel.zero_stage=1"])):
        jobs += [{"side": "reference", "out": str(d[f"ref{z}"]), "overrides": ["mode=exact", *FUSED_DP2,
                                                                               *zover]},
                 {"side": "candidate", "out": str(d[f"fused{z}"]), "init": str(d[f"ref{z}"] / "init.safetensors"),
                  "overrides": [*FUSED_DP2, "engine.mode=fast", "engine.grad_accum_fusion=true", *zover]}]
    jobs.append({"side": "candidate", "out": str(d["stale_z1"]), "init": str(d["ref_z1"] / "init.safetensors"),
                 "overrides": [*FUSED_DP2, "engine.mode=fast", "engine.grad_accum_fusion=true",
                               "parallel.zero_stage=1"], "engine": "tests.test_grad_accum_fusion:ForgetsOverwrite"})
    return Runs(d, run_jobs(jobs, tmp, _cache(tmp_path_factory)), 0.0)


class ForgetsOverwrite(Hopper):
    """Never overwrites main_grad on the first micro-batch: under DP the last step's reduced gradient leaks in."""

    def _accum(self, i, n):
        return dataclasses.replace(super()._accum(i, n), first=False)


@pytest.mark.parametrize("zero", ["", "_z1"], ids=["ddp", "zero1"])
def test_fused_dp2_passes_tolerance_vs_reference_dp2(fused_dp2, zero):
    v = eq.tolerance(fused_dp2[f"ref{zero}"] / "trace", fused_dp2[f"fused{zero}"] / "trace",
                     eq.load_tier("tolerance"))
    assert v.passed, v.summary


def test_fused_dp2_tolerance_rejects_a_missing_overwrite(fused_dp2):
    v = eq.tolerance(fused_dp2["ref_z1"] / "trace", fused_dp2["stale_z1"] / "trace", eq.load_tier("tolerance"))
    assert not v.passed and v.first_divergence["step"] == 2, v.summary
