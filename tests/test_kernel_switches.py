"""Kernel switches (forgetrain/kernels/switches.py): one declaration read by the config, the kernel package, the
switch-matrix tests and the CLI; engines declare what they honour; forged kernels need a current seal.

Each check is fed a wrong input: a switch the engine ignores (the CPU engine, exact mode, fused AdamW on CPU), a
stale seal, a missing seal; the explicit override is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from forgetrain import kernels as kpkg
from forgetrain.config import EngineOptions, KernelsConfig, validate
from forgetrain.equivalence.registry import TIER_ORDER
from forgetrain.errors import ConfigError
from forgetrain.kernels import switches
from scenarios.llama1b_h200.engine import Engine as Hopper
from scenarios.llama_tiny_cpu.engine import Engine as TinyCPU
from tests.helpers import ladder_cfg as _cfg
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent


def _with(kernels: dict, mode: str = "fast", **extra):
    c = _cfg()
    return dataclasses.replace(c, engine=EngineOptions(mode=mode, compile=False),
                               kernels=KernelsConfig(**kernels, **extra))


# ------------------------------------------------------------------------------------ one declaration
def test_everything_reads_the_one_declaration():
    names = [s.name for s in switches.SWITCHES]
    cfg_fields = [f.name for f in dataclasses.fields(KernelsConfig)]
    assert cfg_fields == names + [switches.OVERRIDE]
    assert all(getattr(KernelsConfig(), s.name) == s.default for s in switches.SWITCHES)
    assert kpkg.KERNELS == tuple(s.kernel for s in switches.SWITCHES if s.kernel)
    for s in switches.SWITCHES:
        assert s.default in s.names
        for v in s.values:
            assert v.tier in TIER_ORDER, (s.name, v.name, v.tier)
        if s.kernel:
            assert (ROOT / "forgetrain" / "kernels" / f"{s.kernel}.py").exists()
            assert sum(v.forged for v in s.values) == 1
    # the matrix has every non-default value, and the Hopper fast engine on CPU honours all but fused AdamW
    all_cases = {n for n, _, _ in switches.matrix()}
    cpu_cases = {n for n, _, _ in switches.matrix(Hopper, "fast", "cpu")}
    assert all_cases - cpu_cases == {"fused_adamw"}
    assert {n for n, _, _ in switches.matrix(Hopper, "fast", "cuda")} == all_cases


def test_cli_lists_the_switches():
    p = subprocess.run([sys.executable, "-m", "forgetrain.kernels", "switches"], cwd=ROOT, capture_output=True,
                       text=True, timeout=hang_s())
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == sum(len(s.values) for s in switches.SWITCHES)
    assert "kernels.adamw=fused" in p.stdout and "needs a seal" in p.stdout


# ------------------------------------------------------------------------------------ honoured switches
@pytest.mark.parametrize("engine,kernels,mode,device", [
    (TinyCPU, {"rmsnorm": "triton"}, "fast", "cpu"),          # the CPU engine honours no switch
    (TinyCPU, {"cross_entropy": "chunked"}, "exact", "cpu"),
    (Hopper, {"cross_entropy": "chunked"}, "exact", "cpu"),   # exact mode keeps Megatron's ops
    (Hopper, {"swiglu": "triton"}, "exact", "cuda"),
    (Hopper, {"adamw": "fused"}, "fast", "cpu"),              # torch's fused AdamW runs on CUDA only
])
def test_unhonoured_switch_is_refused(engine, kernels, mode, device):
    name, val = next(iter(kernels.items()))
    label = f"{engine.__module__}:{engine.__qualname__}"  # as validate names it: the scenario's engine string
    with pytest.raises(ConfigError, match=rf"kernels\.{name}={val} is not honoured by engine {label} "
                                          rf"in engine.mode={mode} on {device}"):
        switches.check(KernelsConfig(**kernels), engine, label, mode, device)


def test_honoured_switches_pass():
    switches.check(KernelsConfig(adamw="fused", cross_entropy="chunked"), Hopper, "llama1b_h200", "fast", "cuda")
    switches.check(KernelsConfig(adamw="triton"), Hopper, "llama1b_h200", "exact", "cpu")  # sealed on CPU
    validate(_with({"swiglu": "triton"}), engine_cls=Hopper)
    validate(_with({}, mode="exact"), engine_cls=TinyCPU)  # defaults everywhere: nothing to honour


def test_validate_uses_the_engine_that_runs():
    """Passed engine_cls wins over the scenario's engine (llama_tiny_cpu, which honours nothing)."""
    with pytest.raises(ConfigError, match="not honoured by engine scenarios.llama_tiny_cpu.engine:Engine"):
        validate(_with({"adamw": "triton"}, mode="exact"))
    validate(_with({"adamw": "triton"}, mode="exact"), engine_cls=Hopper)
    with pytest.raises(ConfigError, match="engine.mode=fast is not implemented by engine scenarios.llama_tiny_cpu"):
        validate(_with({"swiglu": "triton"}))  # the tiny engine runs exact mode only
    validate(_with({"swiglu": "triton"}), engine_cls=Hopper)


def test_cli_refuses_an_unhonoured_switch_in_one_line(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "forgetrain", "scenario=llama1b_h200", "hardware=cpu",
                        "model=llama_micro", "engine.mode=exact", "engine.grad_accum_fusion=false",
                        "engine.onepass_optimizer=false", "engine.compile=false", "kernels.adamw=torch",
                        "kernels.swiglu=torch", "kernels.ce_chunk=torch", f"train.out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=hang_s())
    lines = [x for x in p.stderr.strip().splitlines() if x]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[-1].startswith("error: kernels.cross_entropy=chunked is not honoured by engine scenarios.llama1b_h200.engine:Engine in "
                                "engine.mode=exact on cpu"), lines[-1]
    assert not out.exists()


# ------------------------------------------------------------------------------------ seals
def _registry(tmp_path: Path, kernel: str, sha: str | None, device: str = "cpu") -> Path:
    reg = json.loads(switches.REGISTRY_PATH.read_text())
    if sha is None:
        reg["kernels"].pop(kernel, None)
    else:
        reg["kernels"][kernel] = {device: dict(reg["kernels"][kernel]["cpu"], source_sha256=sha)}
    p = tmp_path / "registry.json"
    p.write_text(json.dumps(reg))
    return p


# sealed on the H200 by experiments/kernels/seal_h200.sh (adamw), experiments/swiglu/ab_8b_proxy_h200.sh (swiglu) and
# experiments/ce_chunk/ab_h200.sh (ce_chunk)
CUDA_SEALED = {"adamw", "ce_chunk", "swiglu"}


def test_shipped_triton_kernels_are_sealed_on_cpu_and_only_the_measured_ones_on_cuda():
    for k in switches.kernels():
        assert switches.seal_state(k, "cpu") == "sealed", k
        assert switches.seal_state(k, "cuda") == ("sealed" if k in CUDA_SEALED else "unsealed"), k


def test_stale_seal_is_refused(tmp_path):
    reg = _registry(tmp_path, "swiglu", "0" * 64)
    with pytest.raises(ConfigError, match=r"kernels\.swiglu=triton: kernel swiglu is STALE .* on cpu \(engine "
                                          r"llama1b_h200\).*kernels\.allow_unsealed=true"):
        switches.check(KernelsConfig(swiglu="triton"), Hopper, "llama1b_h200", "fast", "cpu", registry=reg)


def test_missing_seal_is_refused(tmp_path):
    reg = _registry(tmp_path, "rope", None)
    with pytest.raises(ConfigError, match="kernel rope was never sealed on cpu"):
        switches.check(KernelsConfig(rope="triton"), Hopper, "llama1b_h200", "fast", "cpu", registry=reg)
    with pytest.raises(ConfigError, match="kernel rope was never sealed on cuda"):  # the shipped registry
        switches.check(KernelsConfig(rope="triton"), Hopper, "llama1b_h200", "fast", "cuda")


def test_override_accepts_an_unsealed_kernel(tmp_path):
    reg = _registry(tmp_path, "swiglu", "0" * 64)
    switches.check(KernelsConfig(swiglu="triton", allow_unsealed=True), Hopper, "llama1b_h200", "fast", "cpu",
                   registry=reg)
    # the override does not turn an unhonoured switch into a honoured one
    with pytest.raises(ConfigError, match="not honoured"):
        switches.check(KernelsConfig(swiglu="triton", allow_unsealed=True), TinyCPU, "llama_tiny_cpu", "fast",
                       "cpu", registry=reg)


def test_stale_seal_refused_through_validate(tmp_path, monkeypatch):
    monkeypatch.setattr(switches, "REGISTRY_PATH", _registry(tmp_path, "swiglu", "1" * 64))
    with pytest.raises(ConfigError, match="STALE"):
        validate(_with({"swiglu": "triton"}), engine_cls=Hopper)
    validate(_with({"swiglu": "triton"}, allow_unsealed=True), engine_cls=Hopper)


def test_non_forged_values_need_no_seal(tmp_path):
    reg = tmp_path / "empty.json"
    reg.write_text(json.dumps({"format": 1, "kernels": {}}))
    switches.check(KernelsConfig(cross_entropy="chunked", adamw="fused"), Hopper, "llama1b_h200", "fast", "cuda",
                   registry=reg)


def test_compile_with_a_triton_kernel_inside_the_layers_is_refused_on_cpu(tmp_path):
    """Triton's CPU interpreter cannot run inside torch.compile (it crashed minutes into the run): the pair is one
    error line before anything is written; without compile the same kernels run."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "forgetrain", "scenario=llama1b_h200", "hardware=cpu", "model=llama_micro",
                        "train.lr_warmup_steps=1", f"train.out_dir={out}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=hang_s())
    lines = [x for x in p.stderr.strip().splitlines() if x]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[-1].startswith("error: engine.compile=true cannot run Triton kernels on CPU (kernels.swiglu=triton:"), \
        lines[-1]
    assert not out.exists()


def test_cli_runs_a_triton_kernel_on_cpu_without_triton_interpret_set(tmp_path):
    """megatron-core imports Triton before any forged kernel module; the CLI sets TRITON_INTERPRET=1 first when no
    CUDA device is visible, so a Triton kernel switch runs on CPU without the caller setting it."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "forgetrain", "scenario=llama1b_h200", "hardware=cpu", "model=llama_micro",
                        "engine.compile=false", "engine.onepass_optimizer=false", "kernels.adamw=torch",
                        "kernels.ce_chunk=torch", "train.steps=1", "train.lr_warmup_steps=0", "train.threads=1",
                        f"train.out_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=hang_s())
    assert p.returncode == 0, p.stderr[-2000:]
