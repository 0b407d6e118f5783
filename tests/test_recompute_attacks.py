"""Attacks on full activation recompute and per-layer bf16 weights (``scenarios/_llama/recompute.py``) that the
bitwise switch tests of tests/test_recompute.py do not reach.

* The forward and the recompute of a layer must run it in the same autograd state (grad mode on, the same leaves
  requiring grad, the same dtypes): torch picks kernels by that state (SDPA looks at ``requires_grad``; dynamo
  guards on the grad mode, so under ``engine.compile`` a no-grad forward and a grad-mode recompute are two
  compiled graphs, an inference one and a training one). A forward under ``no_grad`` is caught.
* Under ``engine.compile`` the recompute must reproduce the forward's output bit for bit even when dynamo stops
  compiling new variants (its recompile limit: a process that builds several engines reaches it); with a
  no-grad forward the recompute then runs eagerly against a compiled forward and differs by one bf16 ulp.
* The bitwise tier's module probes under recompute record the first micro-batch's output and gradient, the
  same digests as without recompute, at grad-accum 3.
* Per-layer mode keeps no bf16 working copy of a layer alive once that layer's forward or recompute is done;
  a runner that keeps them is caught.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from forgetrain.run.loop import Probe
from scenarios._llama import recompute
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import hopper_cfg as _cfg_for
from tests.helpers import BOTH


def _micro_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 33), generator=g) for _ in range(n)]


def _record_layer_calls(eng: Hopper) -> list[tuple]:
    """Wrap each layer function the runner calls; record (layer, grad mode, x requires grad, weight dtypes and
    requires_grad, output) per call."""
    calls = []
    runner = eng.model.layer_runner
    for i, fn in enumerate(runner._fns):
        def rec(params, x, *args, _fn=fn, _i=i):
            y = _fn(params, x, *args)
            state = (torch.is_grad_enabled(), x.requires_grad,
                     tuple((k, v.dtype, v.requires_grad) for k, v in params.items()))
            calls.append((_i, state, y.detach().clone()))
            return y
        runner._fns[i] = rec
    return calls


def _forward_and_recompute(calls: list[tuple], n_layers: int) -> list[tuple]:
    """Pair each layer's forward call (the first n) with its recompute (the next n, in reverse layer order)."""
    assert len(calls) == 2 * n_layers, [c[:2] for c in calls]
    fwd = {c[0]: c for c in calls[:n_layers]}
    rec = {c[0]: c for c in calls[n_layers:]}
    return [(fwd[i], rec[i]) for i in range(n_layers)]


@pytest.mark.parametrize("mode,engine", [("exact", BOTH), ("fast", {"recompute": "full"}),
                                         ("fast", dict(BOTH, grad_accum_fusion=True))],
                         ids=["exact_per_layer", "fast_resident", "fast_per_layer_fused"])
def test_forward_and_recompute_run_each_layer_in_the_same_autograd_state(mode, engine):
    eng = Hopper(_cfg_for(mode, **engine), "cpu")
    calls = _record_layer_calls(eng)
    eng.train_step(_micro_batches(1))
    for (i, s_fwd, y_fwd), (_, s_rec, y_rec) in _forward_and_recompute(calls, eng.mcfg.num_layers):
        assert s_fwd == s_rec, (i, s_fwd, s_rec)
        assert s_fwd[0], "the layer ran with autograd off"
        assert torch.equal(y_fwd, y_rec), i


def test_recompute_reproduces_the_compiled_forward_past_the_recompile_limit():
    """Dynamo compiles one variant per guard set and runs the rest eagerly once ``recompile_limit`` variants
    exist; at limit 1 the first variant is the forward's. Inductor's graph and eager differ in the last bf16 bit,
    so a recompute that needs a second variant (grad mode on after a no-grad forward) departs from the forward."""
    import torch._dynamo

    cfg = _cfg_for("fast", **BOTH)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, compile=True))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            eng = Hopper(cfg, "cpu")
            calls = _record_layer_calls(eng)
            eng.train_step(_micro_batches(1))
    finally:
        torch._dynamo.reset()
    for (i, _, y_fwd), (_, _, y_rec) in _forward_and_recompute(calls, eng.mcfg.num_layers):
        assert torch.equal(y_fwd, y_rec), (i, float((y_fwd.float() - y_rec.float()).abs().max()))


def _probe_records(engine: dict, ga: int = 3) -> dict:
    eng = Hopper(_cfg_for("exact", **engine), "cpu")
    probe = Probe(eng.module_probes())
    eng.train_step(_micro_batches(ga))
    probe.close()
    return probe.records


def test_module_probes_under_recompute_are_the_first_micro_batch_digests():
    base = _probe_records({})
    assert base and all({"fwd", "grad"} <= set(r) for r in base.values())
    for variant in ({"recompute": "full"}, BOTH, dict(BOTH, recompute_num_layers=1)):
        assert _probe_records(variant) == base, variant


def _live_working_copies(monkeypatch, keep: bool = False):
    """Weak references to every bf16 working copy the runner makes (``keep``: a broken runner that holds on to
    them, as a cache would)."""
    refs, kept = [], []
    orig = recompute.LayerRunner.working_copy

    def tracking(self, w):
        t = orig(self, w)
        refs.append(weakref.ref(t))
        if keep:
            kept.append(t)
        return t

    monkeypatch.setattr(recompute.LayerRunner, "working_copy", tracking)

    def alive() -> int:
        gc.collect()
        return sum(r() is not None for r in refs)
    return refs, alive


@pytest.mark.parametrize("keep", [False, True], ids=["runner", "runner_that_keeps_copies"])
def test_per_layer_working_copies_die_with_their_layer(monkeypatch, keep):
    refs, alive = _live_working_copies(monkeypatch, keep)
    eng = Hopper(_cfg_for("fast", **BOTH), "cpu")
    eng.model.train()
    eng.model.layer_runner.begin_micro_batch(True)
    mb = _micro_batches(1)[0]
    loss, _ = eng.model(mb[:, :-1], mb[:, 1:])
    made = len(refs)
    assert made > 0
    after_forward = alive()  # the graph is alive: only the layers' inputs are held
    loss.backward()
    del loss
    after_backward = alive()
    assert len(refs) > made  # the recompute made its own copies
    if keep:
        assert after_forward == made and after_backward == len(refs)
    else:
        assert after_forward == 0 and after_backward == 0
