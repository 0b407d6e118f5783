"""Full activation recompute and just-in-time bf16 layer weights (``engine.recompute=full``,
``engine.bf16_weights=per_layer``; ``scenarios/_llama/recompute.py``), declared bitwise in
``scenarios/llama1b_h200/optimisations.yaml``.

* exact mode with both switches is bitwise against the Megatron-core reference through the bitwise tier (bf16
  weights with fp32 main weights, micro-batch 2 x grad-accum 2, 3 steps);
* on the engine itself, each switch leaves every loss and every final weight bitwise unchanged, in exact and fast
  mode, with and without gradient accumulation fusion;
* per-layer mode really holds no bf16 copy of the layers and runs the recompute;
* ``engine.recompute_num_layers`` (recompute the first N layers, store the rest) changes no bit either, and reruns
  only those layers;
* three deliberately wrong implementations are caught: a weight cast that truncates instead of rounding to nearest,
  a recompute that adds into ``main_grad`` on the first micro-batch instead of overwriting it, and a stored layer
  that drops its weight gradients;
* bad values and combinations are refused with one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgetrain import equivalence as eq
from forgetrain.config import EngineOptions, KernelsConfig, validate
from forgetrain.errors import ConfigError
from forgetrain.verify import VerifyConfig, run_candidate, run_reference
from scenarios._llama import recompute
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import ladder_cfg as _cfg
from tests.helpers import hopper_cfg as _cfg_for, same_run as _same, train_hopper as _train
from tests.helpers import BOTH, check_resumes_bitwise


def test_exact_mode_with_recompute_and_per_layer_weights_is_bitwise_vs_reference(tmp_path):
    cfg = dataclasses.replace(_cfg(precision="bf16"), engine=EngineOptions(mode="exact", **BOTH),
                              kernels=KernelsConfig())
    validate(cfg, engine_cls=Hopper)
    ref = run_reference(cfg, VerifyConfig(steps=3), tmp_path / "ref", 3)
    cand = run_candidate(cfg, VerifyConfig(steps=3), tmp_path / "cand", 3, ref / "init.safetensors", Hopper)
    v = eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary


@pytest.mark.parametrize("mode,extra", [("exact", {}), ("fast", {}), ("fast", {"grad_accum_fusion": True})],
                         ids=["exact", "fast", "fast_fused"])
def test_switches_change_no_bit(mode, extra):
    init = Hopper(_cfg_for(mode), "cpu").export_hf_weights()
    base = _train(_cfg_for(mode, **extra), init)
    for variant in ({"recompute": "full"}, BOTH):
        got = _train(_cfg_for(mode, **extra, **variant), init)
        assert _same(base, got), (variant, base[0], got[0])


def test_per_layer_mode_holds_no_bf16_layer_copy_and_recomputes(monkeypatch):
    calls, casts = [], []
    orig_run, orig_copy = recompute.LayerRunner.run, recompute.LayerRunner.working_copy

    def counting(self, i, x, weights, args, cast=True):
        calls.append((i, cast, torch.is_grad_enabled(), {w.dtype for w in weights}))
        return orig_run(self, i, x, weights, args, cast)

    def copying(self, w):
        casts.append(w.dtype)
        return orig_copy(self, w)

    monkeypatch.setattr(recompute.LayerRunner, "run", counting)
    monkeypatch.setattr(recompute.LayerRunner, "working_copy", copying)
    cfg = _cfg_for("exact", **BOTH)
    eng = Hopper(cfg, "cpu")
    named = dict(eng.model.named_parameters())
    layer_keys = [k for k in named if k.startswith("layers.")]
    assert layer_keys and all(named[k].dtype == torch.float32 for k in layer_keys)
    assert all(named[k].data_ptr() == eng.main[k].data_ptr() for k in layer_keys)  # the main weight itself
    assert all(named[k].dtype == torch.bfloat16 for k in named if k not in layer_keys)
    eng.train_step([torch.randint(0, 256, (2, 33)) for _ in range(2)])
    n = cfg.model.num_layers
    # per micro-batch: one forward per layer, then one recompute per layer (last layer first), each with autograd
    # on and given the bf16 copies cast from the fp32 main weights
    assert [c[0] for c in calls] == 2 * (list(range(n)) + list(reversed(range(n))))
    assert all(c[1:] == (False, True, {torch.bfloat16}) for c in calls)
    assert len(casts) == len(calls) * len(eng.model.layer_runner.names[0]) and set(casts) == {torch.float32}
    eng.eval_loss([torch.randint(0, 256, (2, 33))])  # without autograd a layer runs once, casting its weights
    assert [c[:3] for c in calls[4 * n:]] == [(i, True, False) for i in range(n)]
    assert calls[-1][3] == {torch.float32}


@pytest.mark.parametrize("mode,extra", [("exact", {}), ("fast", {"grad_accum_fusion": True})], ids=["exact", "fast_fused"])
@pytest.mark.parametrize("layers", [0, 1])
def test_block_recompute_changes_no_bit(mode, extra, layers):
    """``engine.recompute_num_layers``: the stored layers differentiate the same tracked forward the recompute
    reruns, so recomputing some, none or all of the layers gives the same bits."""
    init = Hopper(_cfg_for(mode), "cpu").export_hf_weights()
    base = _train(_cfg_for(mode, **extra), init)
    for variant in ({"recompute": "full"}, BOTH):
        got = _train(_cfg_for(mode, **extra, **variant, recompute_num_layers=layers), init)
        assert _same(base, got), (variant, layers, base[0], got[0])


def test_block_recompute_under_compile_changes_no_bit():
    """Compiled layers: a stored layer keeps the compiled training graph's saved tensors, a recomputed one reruns
    it; the losses and weights equal the compiled run without recompute."""
    import torch._dynamo

    def compiled(**engine):
        c = _cfg_for("fast", **engine)
        return dataclasses.replace(c, engine=dataclasses.replace(c.engine, compile=True))

    init = Hopper(_cfg_for("fast"), "cpu").export_hf_weights()
    torch._dynamo.reset()
    try:
        base = _train(compiled(), init, steps=2)
        got = _train(compiled(**BOTH, recompute_num_layers=1), init, steps=2)
    finally:
        torch._dynamo.reset()
    assert _same(base, got), (base[0], got[0])


def test_block_recompute_reruns_only_the_first_layers(monkeypatch):
    calls = []
    orig_run = recompute.LayerRunner.run

    def counting(self, i, x, weights, args, cast=True):
        calls.append(i)
        return orig_run(self, i, x, weights, args, cast)

    monkeypatch.setattr(recompute.LayerRunner, "run", counting)
    cfg = _cfg_for("exact", **BOTH, recompute_num_layers=1)
    eng = Hopper(cfg, "cpu")
    eng.train_step([torch.randint(0, 256, (2, 33)) for _ in range(2)])
    n = cfg.model.num_layers
    assert n >= 2 and calls == 2 * (list(range(n)) + [0])  # every forward, then the recompute of layer 0 only
    assert eng.bench_info["recompute_num_layers"] == 1


def test_a_stored_layer_that_drops_its_weight_gradients_is_caught(monkeypatch):
    """A stored layer whose backward returns only dx (its weights never learn): the run departs from the
    recomputed one."""
    init = Hopper(_cfg_for("exact"), "cpu").export_hf_weights()
    base = _train(_cfg_for("exact"), init)

    def lazy(ctx, dy):
        y, xd, _ = ctx.graph
        (dx,) = torch.autograd.grad(y, [xd], dy)
        return (None, None, None, dx) + (None,) * ctx.n_weights

    monkeypatch.setattr(recompute._Stored, "backward", staticmethod(lazy))
    assert not _same(base, _train(_cfg_for("exact", **BOTH, recompute_num_layers=1), init))


def test_a_truncating_weight_cast_is_caught(monkeypatch):
    """Round toward zero instead of to nearest: the bf16 working weights differ from the resident copy's."""
    init = Hopper(_cfg_for("exact"), "cpu").export_hf_weights()
    base = _train(_cfg_for("exact"), init)

    def truncate(self, w):
        w = w.detach()
        if self.dtype is None:
            return w
        bits = w.float().contiguous().view(torch.int32) & -65536  # drop the low 16 bits: round toward zero
        return bits.view(torch.float32).to(self.dtype)

    monkeypatch.setattr(recompute.LayerRunner, "working_copy", truncate)
    assert not _same(base, _train(_cfg_for("exact", **BOTH), init))


def test_accumulating_on_the_first_micro_batch_is_caught(monkeypatch):
    """A recompute that always adds into main_grad keeps the previous step's gradient: the run departs."""
    init = Hopper(_cfg_for("fast"), "cpu").export_hf_weights()
    base = _train(_cfg_for("fast"), init)
    monkeypatch.setattr(recompute.LayerRunner, "begin_micro_batch", lambda self, first: setattr(self, "first", False))
    got = _train(_cfg_for("fast", **BOTH), init)
    assert got[0][0] == base[0][0] and not _same(base, got)  # step 1 starts from zeros: only later steps depart


@pytest.mark.parametrize("engine,train,parallel,match", [
    ({"recompute": "selective"}, {}, {}, "engine.recompute must be none|full"),
    ({"bf16_weights": "offload"}, {}, {}, "engine.bf16_weights must be resident|per_layer"),
    ({"recompute_num_layers": 1}, {}, {}, "engine.recompute_num_layers must be an integer"),
    ({"recompute": "full", "recompute_num_layers": -1}, {}, {}, "engine.recompute_num_layers must be an integer"),
    ({"recompute": "full", "recompute_num_layers": 99}, {}, {}, "engine.recompute_num_layers must be an integer"),
    ({"bf16_weights": "per_layer"}, {}, {}, "needs engine.recompute=full"),
    (BOTH, {"precision": "fp32"}, {}, "needs engine.recompute=full"),
    (BOTH, {}, {"zero_stage": 1}, "needs engine.recompute=full"),
])
def test_bad_combinations_are_refused(engine, train, parallel, match):
    c = _cfg_for("exact", **engine)
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, **train),
                            parallel=dataclasses.replace(c.parallel, **parallel))
    with pytest.raises(ConfigError, match=match):
        validate(c, engine_cls=Hopper)


def test_an_engine_without_recompute_refuses_it():
    c = _cfg_for("exact", recompute="full")  # the default scenario's engine is the tiny CPU engine
    c = dataclasses.replace(c, engine=dataclasses.replace(c.engine, mode="exact"))
    with pytest.raises(ConfigError, match="engine.recompute=full is not implemented by engine"):
        validate(c)


def test_an_engine_without_block_recompute_refuses_it():
    """An engine that recomputes every layer but does not declare ``recompute_num_layers`` in its spec would ignore
    the option: it is refused instead."""
    class EveryLayer(Hopper):
        spec = dataclasses.replace(Hopper.spec, recompute_num_layers=False)

    c = _cfg_for("exact", recompute="full", recompute_num_layers=1)
    validate(c, engine_cls=Hopper)
    with pytest.raises(ConfigError, match="engine.recompute_num_layers is not implemented by engine"):
        validate(c, engine_cls=EveryLayer)


def test_a_reference_run_ignores_the_candidate_memory_layout():
    """The tolerance tier's fp32 oracle is a reference run of the candidate's config at fp32: engine.* options do
    not apply to a reference, so per-layer weights must not refuse it."""
    c = _cfg_for("exact", precision="fp32", **BOTH)
    validate(c, reference=True)
    with pytest.raises(ConfigError, match="needs engine.recompute=full"):
        validate(c, engine_cls=Hopper)


def test_per_layer_state_dict_round_trip_resumes_bitwise():
    """The layers' main weights are the model's own parameters in per-layer mode: saving and loading the engine
    state (what the DCP checkpoint holds) must resume to the same bits as an uninterrupted run."""
    check_resumes_bitwise(_cfg_for("fast", **BOTH))
