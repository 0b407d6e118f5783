"""The Hopper engines (llama1b_h200 / llama8b_h100) at tiny width on CPU: the same code CI can run.

* exact mode, fp32 and bf16 (bf16 weights + fp32 main weights): bitwise against the Megatron-core reference;
* fast mode (batch-first, SDPA, chunked LM-head CE) with each per-op kernel switch (torch | triton under the
  Triton interpreter): a correct loss at step 1 and a falling loss.
"""

import dataclasses

import pytest
import torch

from forgetrain import equivalence as eq
from forgetrain.config import EngineOptions, KernelsConfig
from forgetrain.verify import VerifyConfig, run_candidate, run_reference
from scenarios.llama1b_h200.engine import Engine as Hopper
from scenarios.llama8b_h100.engine import Engine as Hopper8b
from tests.test_ladder import _cfg


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


def test_8b_engine_is_the_hopper_engine():
    assert issubclass(Hopper8b, Hopper)


def _fast(kernels: KernelsConfig, precision="fp32"):
    c = _cfg(precision=precision)
    m = dataclasses.replace(c.model, vocab_size=256)
    return dataclasses.replace(c, model=m, engine=EngineOptions(mode="fast", compile=False, ce_chunk_tokens=24),
                               kernels=kernels)


SWITCHES = {
    "all_torch": KernelsConfig(cross_entropy="torch"),
    "chunked_ce": KernelsConfig(cross_entropy="chunked"),
    "triton_rmsnorm": KernelsConfig(rmsnorm="triton"),
    "triton_swiglu": KernelsConfig(swiglu="triton"),
    "triton_rope": KernelsConfig(rope="triton"),
    "triton_ce": KernelsConfig(cross_entropy="triton"),
    "triton_adamw": KernelsConfig(adamw="triton"),
}


def check_switch(name: str) -> None:
    """Step-1 loss equals the plain fp32 path's, and the loss falls over 6 more steps."""
    torch.manual_seed(0)
    mbs = [torch.randint(0, 256, (2, 33)) for _ in range(2)]
    base = Hopper(_fast(KernelsConfig(), "fp32"), "cpu")
    ref_loss = base.eval_loss(mbs)
    eng = Hopper(_fast(SWITCHES[name]), "cpu")
    eng.load_hf_weights(base.export_hf_weights())
    first = eng.train_step(mbs)
    assert abs(first.loss - ref_loss) < 1e-4 * ref_loss, (first.loss, ref_loss)
    losses = [eng.train_step(mbs).loss for _ in range(6)]
    assert losses[-1] < first.loss - 0.05, losses


@pytest.mark.parametrize("name", sorted(SWITCHES))
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
    p = subprocess.run([sys.executable, "-c", f"import tests.test_hopper_cpu as t; t.check_switch({name!r})"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
