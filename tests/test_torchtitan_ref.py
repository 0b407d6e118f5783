"""The torchtitan reference (``references/torchtitan``): protocol, its arithmetic against the Megatron reference from
identical weights, the forged engine judged against it, deliberately wrong variants it must reject, and resume.

Needs the ``torchtitan`` extra (torchtitan 0.3.0; see references/torchtitan/README.md for the light install);
skipped without it. Shapes: llama_micro (2 layers, width 64, GQA 4/2), micro-batch 2 x grad-accum 2, clipping
active -- the ``_cfg()`` of tests/test_ladder.py. Numbers quoted in comments were measured on this CPU (2 threads,
torch 2.13+cpu, torchtitan 0.3.0).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

from forgetrain import equivalence as eq  # noqa: E402
from forgetrain.verify import VerifyConfig, run_candidate, run_reference  # noqa: E402
from references.torchtitan.engine import Engine  # noqa: E402
from tests.helpers import ladder_cfg as _cfg  # noqa: E402
from tests.limits import hang_s  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


def _batches(cfg, n_steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    from forgetrain.config import grad_accum_steps

    g = torch.Generator().manual_seed(seed)
    t, m = cfg.train, cfg.model
    return [[torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=g)
             for _ in range(grad_accum_steps(cfg))] for _ in range(n_steps)]


def _run_tt(cfg, out: Path, init: Path | None = None, engine_cls=None, **train_over) -> Path:
    """Train the torchtitan reference (or ``engine_cls``) through the harness, from ``init`` if given."""
    from safetensors.torch import load_file

    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.train import train

    return train(run_cfg(cfg, out, steps=STEPS, digests=True, **train_over), kind="references",
                 engine_name="torchtitan", engine_cls=engine_cls, progress=False, export_init=init is None,
                 init_hf=load_file(str(init)) if init is not None else None)


# ------------------------------------------------------------------------------------------------ the engine
def test_protocol_weights_roundtrip_and_bad_input():
    from forgetrain.engine import TrainEngine, forward_names, hf_param_names

    e = Engine(_cfg(), torch.device("cpu"))
    assert isinstance(e, TrainEngine)
    w = e.export_hf_weights()
    assert list(w) == hf_param_names(2) and all(v.dtype == torch.float32 for v in w.values())
    moved = {k: v + 0.25 for k, v in w.items()}
    e.load_hf_weights(moved)
    back = e.export_hf_weights()
    assert all(torch.equal(back[k], moved[k]) for k in w)  # the exchange is a pure permutation: bit for bit
    bad = dict(moved, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError):
        e.load_hf_weights(bad)
    with pytest.raises(KeyError):
        e.load_hf_weights({k: v for k, v in moved.items() if k != "lm_head.weight"})
    assert list(e.module_probes()) == list(forward_names(2))
    with pytest.raises(RuntimeError):
        e.export_hf_grads()
    with pytest.raises(ValueError):
        e.train_step([torch.zeros(2, 32, dtype=torch.long)] * 2)  # seq_length + 1 expected
    with pytest.raises(ValueError):
        e.train_step([])
    lg = e.logits(torch.zeros(1, 5, dtype=torch.long))
    assert lg.shape == (1, 5, 4096) and lg.dtype == torch.float32
    c = _cfg()
    with pytest.raises(ValueError):
        Engine(dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, tensor_parallel_size=2)),
               torch.device("cpu"))


def test_init_is_torchtitans_recipe_and_deterministic():
    """torchtitan's llama3 init: embedding N(0, 1), LM head truncated N(0, h^-1/2), output projections scaled by
    1/sqrt(2 (layer + 1)), norms at 1; deterministic in train.seed."""
    a = Engine(_cfg(), torch.device("cpu")).export_hf_weights()
    b = Engine(_cfg(), torch.device("cpu")).export_hf_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert abs(float(a["model.embed_tokens.weight"].std()) - 1.0) < 0.02
    assert abs(float(a["lm_head.weight"].std()) - 64 ** -0.5 * 0.986) < 0.01  # +-3 sigma truncation: 0.986 sigma
    assert abs(float(a["model.layers.1.self_attn.o_proj.weight"].std()) - 0.02 / 2) < 0.002
    assert torch.equal(a["model.norm.weight"], torch.ones(64))


def test_step_arithmetic_lr_norm_and_decay_groups():
    """Megatron's lr (update k uses lr_at(k-1), 0 at the first warmup update); the reported norm is torchtitan's
    clip_grad_norm_ of the pre-clip gradients it exports; the RMSNorm weights (and only they) are not decayed."""
    from forgetrain.schedule import lr_for_step

    cfg = _cfg(clip_grad=0.5)  # torchtitan's init gives a pre-clip norm of ~0.73 here: make clipping active
    e = Engine(cfg, torch.device("cpu"))
    groups = [g for opt in e.optimizers.optimizers for g in opt.param_groups]
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]}
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["param_names"]}
    assert no_decay == {n for n, p in e.model.named_parameters() if p.dim() == 1}
    assert decay == {n for n, p in e.model.named_parameters() if p.dim() == 2}
    for k, mbs in enumerate(_batches(cfg, 3), start=1):
        r = e.train_step(mbs)
        assert r.lr == lr_for_step(cfg.train, k - 1)
        g = e.export_hf_grads()
        exact = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
        # torch._foreach_norm in fp32 per tensor, then the norm of the norms: like Megatron's CPU norm, unlike
        # DeepSpeed's fp64 one. Against the fp64 norm it is off by up to 3.5e-5 here (torchtitan's init: the
        # N(0, 1) embedding gives large embedding gradients); against Megatron's own fp32 norm, 1.5e-7.
        assert abs(r.grad_norm - exact) / exact < 1e-4
        assert r.grad_norm > cfg.train.clip_grad  # clipping is active in this config
        assert r.per_token_loss.shape == (2, 2, 32)
        assert abs(r.loss - float(r.per_token_loss.mean())) < 1e-5


def test_torchtitans_own_lr_schedule_differs():
    """Why the engine does not use torchtitan's LRSchedulersContainer: its linear warmup is one update ahead of
    Megatron's (update k <= W uses lr k/W, Megatron lr (k-1)/W: no zero-lr first update, the peak applied twice),
    after which its "virtual stable step" realigns it: the cosine phase, with min_lr_factor = min_lr/lr, agrees to
    ~2e-16. So exactly the W warmup lrs differ (2 of 8 here; 50 of 300 on llama_tiny's default schedule)."""
    import warnings

    from torchtitan.components.optimizer import LRSchedulersContainer

    from forgetrain.schedule import lr_for_step

    t = _cfg().train
    p = torch.nn.Parameter(torch.zeros(1))
    opts = [torch.optim.SGD([p], lr=t.lr)]
    sched = LRSchedulersContainer.Config(warmup_steps=t.lr_warmup_steps, decay_type="cosine",
                                         min_lr_factor=t.min_lr / t.lr).build(optimizers=opts,
                                                                              training_steps=t.steps)
    titan, megatron = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": no optimizer steps here
        for k in range(t.steps):
            titan.append(opts[0].param_groups[0]["lr"])
            megatron.append(lr_for_step(t, k))
            sched.step()
    w = t.lr_warmup_steps
    assert titan[:w] == [t.lr * (k + 1) / w for k in range(w)] and megatron[0] == 0.0
    assert all(abs(a - b) > 0.1 * t.lr / w for a, b in zip(titan[:w], megatron[:w]))
    assert all(abs(a - b) <= 1e-12 * b for a, b in zip(titan[w:], megatron[w:]))


# ------------------------------------------------------------------------------------------------ vs Megatron
@pytest.fixture(scope="module")
def mg(tmp_path_factory):
    """The Megatron reference (its own init, exported) and the torchtitan reference from that init."""
    out = tmp_path_factory.mktemp("tt_vs_mg")
    ref = run_reference(_cfg(), VerifyConfig(steps=STEPS), out / "megatron", STEPS)
    tt = _run_tt(_cfg(), out / "torchtitan", init=ref / "init.safetensors")
    return ref, tt


def test_torchtitan_matches_megatron_at_tolerance(mg):
    """From Megatron's weights: bitwise fails (separate arithmetic, batch-first probes), fp32 tolerance passes under
    conf/tier/tolerance.yaml unchanged. Measured (4 steps): loss max rel 0, grad norm 1.5e-8, final params total
    rel L2 3.7e-8 (thresholds 1e-6, 1e-5, 1e-5); 8 steps (crosscheck, references/torchtitan/README.md): 1.2e-7,
    1.6e-7, 1.9e-7."""
    from forgetrain.trace import read_trace

    ref, tt = mg
    r, c = read_trace(ref / "trace")[1], read_trace(tt / "trace")[1]
    assert abs(r[0]["loss"] - c[0]["loss"]) / r[0]["loss"] < 1e-6  # the same forward from the same weights
    assert not eq.bitwise(ref / "trace", tt / "trace", eq.load_tier("bitwise")).passed
    v = eq.tolerance(ref / "trace", tt / "trace", eq.load_tier("tolerance"))
    assert v.passed, v.summary
    assert v.evidence["final_params"]["total_rel_l2"] < 1e-5


class UnpermutedQK(Engine):
    """Exchanges q/k rows without torchtitan's adapter permutation: rotate-half rows fed to adjacent-pair RoPE.
    Step-1 loss off by 7.3e-6 relative (Megatron's init makes the logits small; threshold 1e-6)."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.adapter._permute = lambda w, *a, **k: w.clone()
        self.adapter._reverse_permute = lambda w, *a, **k: w


class WrongRopeTheta(Engine):
    """RoPE theta 500000 (torchtitan's llama3 flavours' value) instead of the config's 10000. Step-1 loss off by
    4.4e-6 relative."""

    def __init__(self, cfg, device):
        super().__init__(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rotary_base=500000.0)),
                         device)


@pytest.mark.parametrize("variant", [UnpermutedQK, WrongRopeTheta], ids=lambda v: v.__name__)
def test_wrong_torchtitan_variant_is_rejected(variant, mg, tmp_path):
    ref, _ = mg
    bad = _run_tt(_cfg(), tmp_path / "bad", init=ref / "init.safetensors", engine_cls=variant)
    v = eq.tolerance(ref / "trace", bad / "trace", eq.load_tier("tolerance"))
    assert not v.passed, v.summary
    fd = v.first_divergence
    assert fd is not None and fd["step"] == 1 and fd["kind"] == "loss", fd  # visible in the very first forward


# ------------------------------------------------------------------------------------------------ forged vs titan
@pytest.fixture(scope="module")
def tt_ref(tmp_path_factory):
    """The torchtitan reference from its own init: what ``forgetrain.verify verify.reference=torchtitan`` runs."""
    out = tmp_path_factory.mktemp("tt_ref")
    return run_reference(_cfg(), VerifyConfig(reference="torchtitan", steps=STEPS), out, STEPS)


def _cand(tt_ref, tmp_path, engine_cls=None):
    return run_candidate(_cfg(), VerifyConfig(steps=STEPS), tmp_path / "cand", STEPS, tt_ref / "init.safetensors",
                         engine_cls) / "trace"


def test_forged_vs_torchtitan(tt_ref, tmp_path):
    """The forged engine from torchtitan's init passes fp32 tolerance against it (default thresholds)."""
    cand = _cand(tt_ref, tmp_path)
    assert not eq.bitwise(tt_ref / "trace", cand, eq.load_tier("bitwise")).passed
    v = eq.tolerance(tt_ref / "trace", cand, eq.load_tier("tolerance"))
    assert v.passed, v.summary


@pytest.mark.parametrize("mutant", ["MissingScale", "DroppedMicroBatch", "WrongQKVPermutation", "WrongRopeBase"])
def test_torchtitan_comparison_rejects_mutant(mutant, tt_ref, tmp_path):
    import tests.mutants as M

    v = eq.tolerance(tt_ref / "trace", _cand(tt_ref, tmp_path, getattr(M, mutant)), eq.load_tier("tolerance"))
    assert not v.passed, v.summary
    assert v.first_divergence is not None


def test_resume_is_bitwise(tt_ref, tmp_path):
    """Stop after 2 steps, resume from the checkpoint (torchtitan's model + OptimizersContainer state through DCP):
    the same trace as the uninterrupted run, bit for bit (loss, norm, lr, grad and param digests, final params)."""
    for over in ({"stop_after": 2}, {"resume": True}):
        resumed = _run_tt(_cfg(), tmp_path / "resumed", **over)
    verdict = eq.bitwise(tt_ref / "trace", resumed / "trace", eq.load_tier("bitwise"))
    assert verdict.passed, verdict.summary


def test_verify_cli_end_to_end(tmp_path):
    """``python -m forgetrain.verify verify.reference=torchtitan tier=tolerance ...`` runs both sides and passes."""
    cmd = [sys.executable, "-m", "forgetrain.verify", "verify.reference=torchtitan", "tier=tolerance",
           "verify.steps=4", "model=llama_micro", "train.micro_batch_size=2", "train.global_batch_size=4",
           "train.lr_warmup_steps=2", f"verify.out_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_s())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "strictest equivalence tier passed: tolerance" in res.stdout + res.stderr


# ------------------------------------------------------------------------------------------------ DP=2
# One two-rank torchrun launch (gloo, tests/parallel_worker.py): the torchtitan reference at DP=2 (FSDP2 over two
# ranks, its own init) and the forged FSDP2 engine from that init. Same global batch as _cfg() (micro-batch 2 x
# DP 2, no accumulation), 4 steps, 1 thread per rank; the reported loss is the DP mean.
DP2 = ["model=llama_micro", "parallel=fsdp2", "parallel.report_loss=dp_mean", "train.micro_batch_size=2",
       "train.global_batch_size=4", "train.lr_warmup_steps=2", f"train.steps={STEPS}", "train.threads=1"]


@pytest.fixture(scope="module")
def tt_dp2(tmp_path_factory):
    from tests.helpers import session_cache as _cache
    from tests.helpers import Runs, run_jobs

    tmp = tmp_path_factory.mktemp("tt_dp2")
    d = {n: tmp / n for n in ("ref", "cand")}
    jobs = [{"side": "reference", "reference": "torchtitan", "out": str(d["ref"]), "overrides": DP2},
            {"side": "candidate", "out": str(d["cand"]), "init": str(d["ref"] / "init.safetensors"),
             "overrides": DP2}]
    return Runs(d, run_jobs(jobs, tmp, _cache(tmp_path_factory)), 0.0)


def test_torchtitan_dp2_matches_dp1(tt_dp2, tmp_path):
    """torchtitan at DP=2 (FSDP2 sharding, reduce-scatter as a SUM of loss/global-tokens gradients) trains the same
    global batch as DP=1 with 2 accumulation steps: gradients and parameters bit-identical, losses equal; only the
    reported norm differs (sharded per-shard norms: measured 3.8e-5 relative)."""
    from forgetrain.trace import read_trace

    c = _cfg(threads=1)
    dp1 = _run_tt(dataclasses.replace(c, train=dataclasses.replace(c.train, steps=STEPS)), tmp_path / "dp1")
    r1, r2 = read_trace(dp1 / "trace")[1], read_trace(tt_dp2["ref"] / "trace")[1]
    assert len(r1) == len(r2) == STEPS
    for a, b in zip(r1, r2):
        assert a["loss"] == b["loss"] and a["lr"] == b["lr"], (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] < 1e-4
        for key in ("grads", "params"):
            assert a["digests"][key] == b["digests"][key], (a["step"], key)


def test_forged_fsdp2_vs_torchtitan_dp2(tt_dp2):
    v = eq.tolerance(tt_dp2["ref"] / "trace", tt_dp2["cand"] / "trace", eq.load_tier("tolerance"))
    assert v.passed, v.summary
