"""What a test of the Hopper engine's switches runs in a process of its own (Triton 3.6's CPU interpreter keeps
state between kernels in one process; ``TRITON_INTERPRET=1`` must be set before triton is imported), called as
``python -c "from tests.switch_helpers import ...; ..."``, and the switch tables those runs read:

* :data:`FAST_TIER_SWITCHES` and :func:`run_switch` (tests/test_fast_tiers.py);
* :data:`HOPPER_CPU_SWITCHES` and :func:`check_switch` (tests/test_hopper_cpu.py);
* :func:`check_engine_matches_torch` (tests/test_ce_chunk.py);
* :func:`compare_onepass` (tests/test_onepass_optimizer.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from forgetrain import kernels
from forgetrain.config import EngineOptions, KernelsConfig
from forgetrain.kernels import switches
from forgetrain.verify import VerifyConfig, run_candidate
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import fast_cfg, ladder_cfg

# ------------------------------------------------------------------------------------- tests/test_fast_tiers.py

FAST_TIER_STEPS = 4
FAST_BASE = ["batch_first_layout", "sdpa_attention"]
# name -> (kernels.* overrides, the optimisations.yaml entries switched on besides kernel switches)
FAST_TIER_SWITCHES = {
    "fast_torch": ({"cross_entropy": "torch"}, FAST_BASE),
    # every kernel switch value the fast engine honours on CPU, from forgetrain/kernels/switches.py (tier there)
    **{name: (kv, FAST_BASE) for name, kv, _ in switches.matrix(Hopper, "fast", "cpu")},
    "grad_accum_fusion": ({"cross_entropy": "chunked"}, FAST_BASE + ["grad_accum_fusion"]),
    "grad_accum_fusion_torch_ce": ({"cross_entropy": "torch"}, FAST_BASE + ["grad_accum_fusion"]),
    "triton_onepass": ({"adamw": "triton"}, FAST_BASE + ["onepass_optimizer"]),
}
FAST_TIER_ENGINE = {  # name -> engine.* overrides beyond fast mode, for the switches that are engine options
    "grad_accum_fusion": {"grad_accum_fusion": True},
    "grad_accum_fusion_torch_ce": {"grad_accum_fusion": True},
    "triton_onepass": {"onepass_optimizer": True},
}


def run_switch(name: str, ref: str, out: str, engine_cls=None, **model) -> None:
    """Train the fast Hopper engine (or ``engine_cls``) with switch ``name`` from ``ref``'s init for
    FAST_TIER_STEPS steps into ``out``."""
    run_candidate(fast_cfg(FAST_TIER_SWITCHES[name][0], FAST_TIER_ENGINE.get(name), **model),
                  VerifyConfig(steps=FAST_TIER_STEPS), Path(out), FAST_TIER_STEPS, Path(ref) / "init.safetensors",
                  engine_cls or Hopper)


# ------------------------------------------------------------------------------------- tests/test_hopper_cpu.py

def _hopper_fast(kernels: KernelsConfig, precision="fp32"):
    c = ladder_cfg(precision=precision)
    m = dataclasses.replace(c.model, vocab_size=256)
    return dataclasses.replace(c, model=m, engine=EngineOptions(mode="fast", compile=False, ce_chunk_tokens=24),
                               kernels=kernels)


HOPPER_CPU_SWITCHES = {  # every kernel switch value the fast engine honours on CPU (forgetrain/kernels/switches.py)
    "all_torch": KernelsConfig(cross_entropy="torch"),
    **{name: KernelsConfig(**kv) for name, kv, _ in switches.matrix(Hopper, "fast", "cpu")},
}


def check_switch(name: str) -> None:
    """Step-1 loss equals the plain fp32 path's, and the loss falls over 6 more steps."""
    torch.manual_seed(0)
    mbs = [torch.randint(0, 256, (2, 33)) for _ in range(2)]
    base = Hopper(_hopper_fast(KernelsConfig(), "fp32"), "cpu")
    ref_loss = base.eval_loss(mbs)
    eng = Hopper(_hopper_fast(HOPPER_CPU_SWITCHES[name]), "cpu")
    eng.load_hf_weights(base.export_hf_weights())
    first = eng.train_step(mbs)
    assert abs(first.loss - ref_loss) < 1e-4 * ref_loss, (first.loss, ref_loss)
    losses = [eng.train_step(mbs).loss for _ in range(6)]
    assert losses[-1] < first.loss - 0.05, losses


# ---------------------------------------------------------------------------------------- tests/test_ce_chunk.py

def ce_chunk_cfg(ce_chunk: str, cross_entropy: str = "chunked"):
    c = ladder_cfg()
    return dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=256),
                               engine=EngineOptions(mode="fast", compile=False, ce_chunk_tokens=24),
                               kernels=KernelsConfig(cross_entropy=cross_entropy, ce_chunk=ce_chunk))


def check_engine_matches_torch(steps: int = 3) -> None:
    """The Hopper engine (fast, fp32, vocab 256, 24-token chunks) from the same weights, ``kernels.ce_chunk``
    triton vs torch: every step's loss and grad norm within 1e-4 relative (the step-1 bound of the switch tests,
    tests/test_hopper_cpu.py), and the Triton kernel actually ran once per chunk."""
    from scenarios.llama1b_h200.engine import Engine as Hopper

    torch.manual_seed(0)
    mbs = [torch.randint(0, 256, (2, 33)) for _ in range(2)]
    ref = Hopper(ce_chunk_cfg("torch"), "cpu")
    weights = ref.export_hf_weights()
    cand = Hopper(ce_chunk_cfg("triton"), "cpu")
    cand.load_hf_weights(weights)
    calls = []
    real = kernels.ce_chunk
    kernels.ce_chunk = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    try:
        for step in range(1, steps + 1):
            a, b = ref.train_step(mbs), cand.train_step(mbs)
            assert abs(b.loss - a.loss) <= 1e-4 * a.loss, (step, b.loss, a.loss)
            assert abs(b.grad_norm - a.grad_norm) <= 1e-4 * a.grad_norm, (step, b.grad_norm, a.grad_norm)
    finally:
        kernels.ce_chunk = real
    assert len(calls) == steps * len(mbs) * -(-2 * 32 // 24), calls  # every chunk of every micro-batch


# ------------------------------------------------------------------------------ tests/test_onepass_optimizer.py

def _onepass_engine(precision: str, onepass: bool, clip: float):
    from scenarios.llama1b_h200.engine import Engine

    # smaller than llama_micro: the interpreter runs one Python program per 256-element block of every tensor
    c = fast_cfg({"adamw": "triton"}, {"onepass_optimizer": onepass}, vocab_size=256, hidden_size=32,
                 ffn_hidden_size=64, num_layers=1, seq_length=16)
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, precision=precision, clip_grad=clip))
    return Engine(c, "cpu")


def compare_onepass(precision: str, drop_scale: bool = False) -> None:
    """Train both paths 2 steps (micro-batch 2 x grad-accum 2) from one init; print the first difference or 'same'."""
    import torch

    import forgetrain.kernels as K

    if drop_scale:  # a wrong kernel: the clip coefficient never reaches the update
        real = K.adamw_step
        K.adamw_step = lambda *a, grad_scale=None, **k: real(*a, **k)
    a, b = _onepass_engine(precision, False, 1e-3), _onepass_engine(precision, True, 1e-3)
    b.load_hf_weights(a.export_hf_weights())
    g = torch.Generator().manual_seed(0)
    seq, vocab = a.mcfg.seq_length, a.mcfg.vocab_size
    for step in range(2):
        mbs = [torch.randint(0, vocab, (2, seq + 1), generator=g) for _ in range(2)]
        ra, rb = a.train_step(mbs), b.train_step(mbs)
        assert ra.grad_norm > 1e-3 * 10, f"clipping not active: grad norm {ra.grad_norm}"
        if ra.grad_norm != rb.grad_norm or ra.loss != rb.loss:
            print(f"differ at step {step + 1}: grad_norm {ra.grad_norm} vs {rb.grad_norm}, loss {ra.loss} vs {rb.loss}")
            return
        na, nb = a._named(), b._named()
        for k in a.main:
            for what, x, y in (("main", a.main[k], b.main[k]), ("model", na[k].data, nb[k].data),
                               ("exp_avg", a.adam_state[k]["exp_avg"], b.adam_state[k]["exp_avg"]),
                               ("exp_avg_sq", a.adam_state[k]["exp_avg_sq"], b.adam_state[k]["exp_avg_sq"])):
                if not torch.equal(x, y):
                    print(f"differ at step {step + 1}: {what} {k}")
                    return
    print("same")
