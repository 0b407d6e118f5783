"""Equivalence tiers on synthetic trace directories: each tier passes what it should and FAILS what it must."""

from __future__ import annotations

import copy
import io
import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from forgetrain.equivalence.tiers.loss_curve import CurveRuns
from forgetrain.equivalence import (TIER_ORDER, Verdict, bitwise, ladder, load_tier, loss_curve,
                                    print_verdict_table, surpass, t_quantile, tolerance, write_report)
from forgetrain.errors import ConfigError
from forgetrain.trace import tensor_digest
from tests.equivalence_helpers import MODULES, PARAMS, base_run, seeded_tensor as _tensor, write_run
from tests.helpers import curve as _curve, paired as _paired, perturb as _perturb, timings as _timings, write_curve as _write_curve


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def pair(tmp_path):
    """(ref_dir, make_cand): make_cand(mutator) writes a mutated copy of the reference run as the candidate."""
    run = base_run()
    ref = write_run(tmp_path / "ref", run)

    def make_cand(mutate=None, name="cand", base=None):
        c = copy.deepcopy(base or run)
        if mutate is not None:
            mutate(c)
        return write_run(tmp_path / name, c)

    return ref, make_cand


def _bad(seed=7):
    return tensor_digest(_tensor(999_999 + seed))


# ---------------------------------------------------------------------------------------------------- bitwise


def test_bitwise_identical_passes(pair):
    ref, make = pair
    v = bitwise(ref, make())
    assert v.passed and v.first_divergence is None
    assert v.evidence["digests"]["compared"] and v.evidence["digests"]["steps_compared"] == 6
    assert v.evidence["modules"]["compared"] and v.evidence["final_params"]["compared"]
    json.dumps(v.to_dict())  # evidence is JSON-serialisable


def test_bitwise_one_ulp_loss_fails_at_that_step(pair):
    ref, make = pair

    def m(run):
        r = run["records"][3]
        r["loss"] = math.nextafter(r["loss"], math.inf)

    v = bitwise(ref, make(m))
    assert not v.passed
    fd = v.first_divergence
    assert fd["step"] == 4 and fd["kind"] == "loss" and fd["cand"] - fd["ref"] > 0
    assert "step 4 loss" in v.summary


def test_bitwise_candidate_without_any_reference_probe_is_named(pair):
    """A candidate whose modules.json shares no module with the reference's (a fused fast-mode engine judged at
    bitwise) fails, and the summary says why in words instead of only 'cand None'."""
    ref, make = pair

    def m(run):
        run["modules"] = {"fused_block": {"fwd": _bad(1), "fwd_l2": 1.0, "grad": _bad(2), "grad_l2": 1.0}}

    v = bitwise(ref, make(m))
    assert not v.passed
    assert f"the candidate recorded none of the reference's {len(MODULES)} module probes" in v.summary
    assert "mode=exact" in v.summary


@pytest.mark.parametrize("key", ["grad_norm", "lr"])
def test_bitwise_scalar_fields(pair, key):
    ref, make = pair

    def m(run):
        run["records"][1][key] = math.nextafter(run["records"][1][key], 0.0)

    v = bitwise(ref, make(m))
    assert not v.passed and v.first_divergence["step"] == 2 and v.first_divergence["kind"] == key


def test_bitwise_nan_never_passes(pair):
    ref, make = pair
    run = base_run()
    run["records"][2]["loss"] = float("nan")
    ref_nan = write_run(ref.parent / "ref_nan", run)
    cand_nan = make(lambda r: r["records"][2].__setitem__("loss", float("nan")))
    v = bitwise(ref_nan, cand_nan)
    assert not v.passed and v.first_divergence["step"] == 3 and v.first_divergence["kind"] == "loss"


def test_bitwise_grad_digest_names_first_tensor_in_backward_order(pair):
    """Parameter gradients are produced from lm_head back to the embedding: the first one the backward got wrong
    is the latest in forward order (the earlier ones may only have inherited it)."""
    ref, make = pair
    late, early = "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"

    def m(run):
        dg = run["records"][2]["digests"]
        dg["grads"][late] = _bad(1)
        dg["grads"][early] = _bad(2)
        dg["params"]["model.embed_tokens.weight"] = _bad(3)  # the update that follows differs too
        run["records"][4]["digests"]["per_token_loss"] = _bad(4)  # and later steps

    v = bitwise(ref, make(m))
    assert not v.passed
    fd = v.first_divergence
    assert (fd["step"], fd["kind"], fd["tensor"]) == (3, "grad", late)
    assert fd["ref"] != fd["cand"]
    assert v.evidence["mismatch_counts"] == {"grad": 2, "param": 1, "per_token_loss": 1}


def test_bitwise_per_token_loss_digest_precedes_grads(pair):
    ref, make = pair

    def m(run):
        run["records"][0]["digests"]["per_token_loss"] = _bad(5)
        run["records"][0]["digests"]["grads"]["model.embed_tokens.weight"] = _bad(6)

    fd = bitwise(ref, make(m)).first_divergence
    assert (fd["step"], fd["kind"]) == (1, "per_token_loss")


def test_bitwise_missing_tensor_digest_is_a_mismatch(pair):
    ref, make = pair
    v = bitwise(ref, make(lambda r: r["records"][1]["digests"]["params"].pop("lm_head.weight")))
    fd = v.first_divergence
    assert not v.passed and fd["tensor"] == "lm_head.weight" and fd["cand"] is None


def test_bitwise_module_fwd_names_first_module(pair):
    ref, make = pair
    first = MODULES.index("layers.0.mlp")

    def m(run):  # a forward divergence at layers.0.mlp propagates to every later module
        for i, name in enumerate(MODULES):
            if i >= first:
                run["modules"][name]["fwd"] = _bad(100 + i)
                run["modules"][name]["fwd_l2"] += 1e-3

    v = bitwise(ref, make(m))
    assert not v.passed
    fd = v.first_divergence
    assert (fd["kind"], fd["module"], fd["step"]) == ("module_fwd", "layers.0.mlp", 1)
    assert fd["ref"]["l2"] == 10.0 + first and fd["cand"]["l2"] == pytest.approx(10.0 + first + 1e-3)
    assert v.evidence["modules"]["fwd_mismatches"] == MODULES[first:]


def test_bitwise_module_grad_reports_both_orders(pair):
    ref, make = pair
    origin = MODULES.index("layers.1.self_attention")

    def m(run):  # a backward-only bug at layers.1.self_attention reaches every earlier module's grad
        for i, name in enumerate(MODULES):
            if i <= origin:
                run["modules"][name]["grad"] = _bad(200 + i)

    v = bitwise(ref, make(m))
    ev = v.evidence["modules"]
    fd = v.first_divergence
    assert not v.passed and fd["kind"] == "module_grad"
    assert fd["module"] == "layers.1.self_attention"  # the first the backward got wrong, not the embedding
    assert fd["produced_by"] == "layers.1.pre_mlp_norm"  # the backward that computed that output gradient
    assert ev["first_grad_mismatch_backward_order"] == "layers.1.self_attention"
    assert ev["first_grad_mismatch_forward_order"] == "embedding"
    assert ev["fwd_mismatches"] == []


def test_bitwise_a_wrong_loss_gradient_is_named_at_the_output_layer(pair):
    """An unscaled gradient accumulation (every gradient x2, the loss itself unchanged) enters at the loss's own
    backward: every module and parameter gradient differs, and the verdict names the output layer, produced by
    the loss -- not the embedding, the first in forward order."""
    ref, make = pair

    def m(run):
        for i, name in enumerate(MODULES):
            run["modules"][name]["grad"] = _bad(300 + i)
            run["modules"][name]["grad_l2"] *= 2
        for s, rec in enumerate(run["records"]):
            rec["grad_norm"] *= 2
            rec["digests"]["grads"] = {n: _bad(1000 * s + i) for i, n in enumerate(PARAMS)}

    fd = bitwise(ref, make(m)).first_divergence
    assert (fd["step"], fd["kind"], fd["module"], fd["produced_by"]) == (1, "module_grad", "output_layer", "loss")
    assert fd["cand"]["l2"] == 2 * fd["ref"]["l2"]


def _with_clipped(run: dict) -> dict:
    """``run`` with each step's clipped gradients recorded (here the pre-clip digests: no clip applied)."""
    for rec in run["records"]:
        rec["digests"]["clipped_grads"] = dict(rec["digests"]["grads"])
    return run


def test_bitwise_clipped_grads_name_the_clip(tmp_path):
    """A wrong clip (pre-clip grads and grad norm equal) is named at the clipped gradients of its step, in backward
    order, before the params it moves; a wrong grad norm at that step still comes first."""
    ref = write_run(tmp_path / "ref", _with_clipped(base_run()))
    run = _with_clipped(base_run())
    for n in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        run["records"][1]["digests"]["clipped_grads"][n] = _bad(11)
    run["records"][1]["digests"]["params"]["model.embed_tokens.weight"] = _bad(12)
    v = bitwise(ref, write_run(tmp_path / "cand", run))
    fd = v.first_divergence
    assert (fd["step"], fd["kind"], fd["tensor"]) == (2, "clipped_grad", "lm_head.weight"), fd
    assert v.evidence["mismatch_counts"] == {"clipped_grad": 2, "param": 1}
    assert v.evidence["digests"]["clipped_grads_steps"] == 6
    run["records"][1]["grad_norm"] += 1e-9
    fd = bitwise(ref, write_run(tmp_path / "cand2", run)).first_divergence
    assert (fd["step"], fd["kind"]) == (2, "grad_norm")


def test_bitwise_clipped_grads_on_one_side_only_are_not_required(tmp_path):
    """A golden recorded before clipped gradients were traced still judges a candidate that records them."""
    ref = write_run(tmp_path / "ref", base_run())
    v = bitwise(ref, write_run(tmp_path / "cand", _with_clipped(base_run())))
    assert v.passed, v.summary
    assert v.evidence["digests"]["clipped_grads_steps"] == 0
    assert v.evidence["digests"]["one_sided_steps"] == {"clipped_grads": 6}
    assert "clipped grads" not in v.summary


def test_harness_clipped_grads_are_the_engines_own_or_derived_as_megatron_clips():
    """forgetrain.train.clipped_grads: an engine's export_hf_clipped_grads() when it has them; else (None, or no
    such method, e.g. the Megatron reference) pre-clip x clip_grad / (grad_norm + 1e-6), only when that is < 1."""
    from forgetrain.train import clipped_grads

    pre = {"w": torch.tensor([2.0, -1.0, 0.5])}

    class NoExport:
        pass

    class Own:
        def export_hf_clipped_grads(self):
            return {"w": torch.zeros(3)}

    class NotKept:
        def export_hf_clipped_grads(self):
            return None

    for eng in (NoExport(), NotKept()):
        assert torch.equal(clipped_grads(eng, pre, 4.0, 1.0)["w"], pre["w"] * (1.0 / (4.0 + 1e-6)))
        assert clipped_grads(eng, pre, 0.5, 1.0) is pre  # coefficient >= 1: nothing clipped
        assert clipped_grads(eng, pre, 4.0, 0.0) is pre  # train.clip_grad=0: clipping off
        assert clipped_grads(eng, pre, float("nan"), 1.0) is pre  # Megatron's `coeff < 1.0` is false for NaN
    assert torch.equal(clipped_grads(Own(), pre, 4.0, 1.0)["w"], torch.zeros(3))


def test_bitwise_final_params_one_ulp(pair):
    ref, make = pair
    name = "model.layers.1.post_attention_layernorm.weight"

    def m(run):
        t = run["final"][name].clone()
        t[2] = torch.nextafter(t[2], torch.tensor(2.0))
        run["final"][name] = t

    v = bitwise(ref, make(m))
    fd = v.first_divergence
    assert not v.passed and fd["tensor"] == name and fd["kind"] == "param" and fd["step"] == 6
    assert 0 < fd["max_abs_diff"] < 1e-6
    assert v.evidence["final_params"]["max_abs_diff"] == fd["max_abs_diff"]


def test_bitwise_step_count_differs(pair):
    ref, make = pair
    v = bitwise(ref, make(lambda r: r["records"].pop()))
    assert not v.passed and v.first_divergence["step"] == 6 and v.first_divergence["cand"] is None


def test_bitwise_digests_required_or_reported(tmp_path):
    ref = write_run(tmp_path / "ref", base_run(digests=False))
    cand = write_run(tmp_path / "cand", base_run(digests=False))
    v = bitwise(ref, cand)  # bitwise.yaml requires digests
    assert not v.passed and "digests required" in v.summary and "train.digests=true" in v.summary
    v = bitwise(ref, cand, {"require_digests": False})
    assert v.passed and not v.evidence["digests"]["compared"] and "digests NOT compared" in v.summary


def test_bitwise_accepts_hydra_node_and_checks_name(pair):
    ref, make = pair
    node = OmegaConf.create(load_tier("bitwise"))
    assert bitwise(ref, make(), node.copy()).passed
    with pytest.raises(ConfigError):
        bitwise(ref, make(), OmegaConf.create(load_tier("tolerance")))
    with pytest.raises(ConfigError):
        load_tier("no_such_tier")


# ---------------------------------------------------------------------------------------------------- tolerance


def test_tolerance_fp32_accepts_1e8_rejects_1e3(pair):
    ref, make = pair
    v = tolerance(ref, make(_perturb(1e-8, params=True), "small"))
    assert v.passed, v.summary
    assert v.evidence["metrics"]["loss"]["max_rel"] == pytest.approx(1e-8, rel=1e-3)
    assert tolerance(ref, make()).evidence["metrics"]["loss"]["max_rel"] == 0.0

    v = tolerance(ref, make(_perturb(1e-3, steps={3}), "big"))
    assert not v.passed
    fd = v.first_divergence
    assert (fd["step"], fd["kind"]) == (3, "loss") and fd["rel_err"] > fd["threshold"]
    assert v.evidence["metrics"]["grad_norm"]["worst_step"] == 3

    v = tolerance(ref, make(_perturb(1e-3, steps=set(), params=True), "params"))
    assert not v.passed and v.first_divergence["kind"] == "param"
    assert v.first_divergence["tensor"] == PARAMS[0]  # first tensor in forward order
    assert v.evidence["final_params"]["total_rel_l2"] == pytest.approx(1e-3, rel=1e-3)


def test_tolerance_bf16_is_looser(tmp_path):
    th = load_tier("tolerance")["thresholds"]
    for k in th["fp32"]:
        if k != "lr_rtol":
            assert th["bf16"][k] > 100 * th["fp32"][k]
    run = base_run()
    run["precision"] = "bf16"
    ref = write_run(tmp_path / "ref", run)
    cand = copy.deepcopy(run)
    _perturb(1e-3, params=True)(cand)
    v = tolerance(ref, write_run(tmp_path / "ok", cand))
    assert v.passed and v.evidence["precision"] == "bf16"
    cand = copy.deepcopy(run)
    _perturb(5e-2, steps={2})(cand)
    v = tolerance(ref, write_run(tmp_path / "bad", cand))
    assert not v.passed and v.first_divergence["step"] == 2


def test_tolerance_summary_says_when_the_fp32_oracle_decided(tmp_path):
    """A bf16 reference that drifted from its fp32 oracle in grad norm at step 3, a candidate that stayed on the
    oracle: it passes, and the summary says that the grad norm was judged against the oracle, with the direct
    error and threshold (a plain ``pass`` hid it)."""
    oracle = base_run()
    ref, cand = copy.deepcopy(oracle), copy.deepcopy(oracle)
    for r in (ref, cand):
        r["precision"] = "bf16"
    ref["records"][2]["grad_norm"] *= 1.04
    v = tolerance(write_run(tmp_path / "ref", ref), write_run(tmp_path / "cand", cand),
                  oracle_dir=write_run(tmp_path / "oracle", oracle))
    assert v.passed, v.summary
    assert "grad_norm judged against the fp32 oracle at 1 step(s) (direct rel 0.0384615 > 0.02)" in v.summary, \
        v.summary
    assert "loss judged" not in v.summary and "final params judged" not in v.summary
    # the same pair without a drift: the oracle decided nothing, the summary says nothing of it
    v = tolerance(write_run(tmp_path / "ref2", cand), write_run(tmp_path / "cand2", cand),
                  oracle_dir=write_run(tmp_path / "oracle2", oracle))
    assert v.passed and "oracle" not in v.summary, v.summary


def test_tolerance_rejects_lr_tokens_nan_and_precision_mismatch(pair):
    ref, make = pair

    def lr(run):
        run["records"][0]["lr"] *= 1 + 1e-6

    assert tolerance(ref, make(lr, "lr")).first_divergence["kind"] == "lr"
    assert tolerance(ref, make(lambda r: r["records"][1].__setitem__("tokens", 1), "tok")).first_divergence[
        "kind"] == "tokens"
    v = tolerance(ref, make(lambda r: r["records"][4].__setitem__("grad_norm", float("nan")), "nan"))
    assert not v.passed and v.first_divergence["step"] == 5 and math.isinf(v.first_divergence["rel_err"])
    v = tolerance(ref, make(lambda r: r.__setitem__("precision", "bf16"), "bf16"))
    assert not v.passed and "precisions differ" in v.summary


def test_tolerance_rejects_different_step_counts(pair):
    ref, make = pair
    v = tolerance(ref, make(lambda r: r["records"].pop(), "short"))
    assert not v.passed and v.first_divergence["step"] == 6 and "lacks 1 step" in v.summary

    def longer(run):
        run["records"].append(dict(run["records"][-1], step=7))

    v = tolerance(ref, make(longer, "long"))
    assert not v.passed and "step(s) the reference lacks" in v.summary


def test_tolerance_requires_final_params(pair):
    ref, make = pair
    v = tolerance(ref, make(lambda r: r.__setitem__("final", None), "nofinal"))
    assert not v.passed and "final params required" in v.summary
    assert tolerance(ref, make(lambda r: r.__setitem__("final", None), "nofinal2"),
                     {"require_final_params": False}).passed


def test_tolerance_max_steps_skips_final_params(pair):
    ref, make = pair
    v = tolerance(ref, make(_perturb(1e-3, steps={6}, params=True), "late"), {"max_steps": 5})
    assert v.passed and not v.evidence["final_params"]["compared"]
    assert "max_steps" in v.evidence["final_params"]["reason"]


# ---------------------------------------------------------------------------------------------------- loss curve

T = 200


@pytest.fixture
def seeds(tmp_path):
    """Four reference seeds (>= 3 required). Seeds 0-2 alone happen to agree unusually closely late in the run,
    which makes a 3-seed drift limit tight (a 2-dof std is that variable); the 3-seed case is checked below."""
    return [_write_curve(tmp_path / f"ref{s}", _curve(s)) for s in range(4)]


def test_paired_passes_an_equivalent_candidate_and_fails_a_shift_of_one_percent(seeds, tmp_path):
    """The paired test's power needs no calibration: delta (1% of the late loss, ~0.02 nats here) or more fails,
    whatever the noise; the same shift sits deep inside the unpaired band (seed-to-seed spread)."""
    ok = loss_curve(seeds, _paired(tmp_path, "ok"))
    pe = ok.evidence["paired"]
    assert ok.passed and pe["late_inside"] and pe["n_windows_outside"] == 0, ok.summary
    assert pe["delta"] == pytest.approx(0.01 * pe["ref_late_mean"]) and pe["power"]["detects_rel"] == 0.01
    assert pe["ci"][0] < pe["late_diff_mean"] < pe["ci"][1] and "CI" in ok.summary
    shift = 1.2 * pe["delta"]
    bad = loss_curve(seeds, _paired(tmp_path, "bad", shift=shift))
    assert not bad.passed and "NOT inside" in bad.summary and bad.first_divergence["window"] == "late"
    unpaired = loss_curve(seeds, _write_curve(tmp_path / "u", _curve(10) + shift))
    assert unpaired.passed, unpaired.summary  # the band cannot see it
    both = loss_curve(seeds, CurveRuns(paired=_paired(tmp_path, "b2", shift=shift).paired,
                                       unpaired=(tmp_path / "u",)))
    assert not both.passed and both.evidence["mode"] == "paired+unpaired"
    assert "paired: FAIL" in both.summary and "unpaired: pass" in both.summary


def test_paired_noise_makes_passing_harder(seeds, tmp_path):
    """A candidate with added loss noise never passes where the honest one fails: its interval only widens."""
    delta = 0.01 * 2.0
    outcomes = []
    for i, f in enumerate([0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.1]):
        honest = loss_curve(seeds, _paired(tmp_path, f"h{i}", shift=f * delta)).passed
        noisy = loss_curve(seeds, _paired(tmp_path, f"n{i}", shift=f * delta, noise=0.08)).passed
        assert honest or not noisy, f"noisy passed a shift of {f} delta that the honest one failed"
        outcomes.append((honest, noisy))
    assert (True, False) in outcomes  # somewhere the noise alone costs the pass


def test_paired_runs_must_match_the_reference_seeds(seeds, tmp_path):
    v = loss_curve(seeds, _paired(tmp_path, "three", n=3))
    assert not v.passed and "one candidate run per reference seed" in v.summary
    with pytest.raises(TypeError):
        loss_curve(seeds, CurveRuns())


def test_paired_window_margin_catches_a_mid_run_departure(seeds, tmp_path):
    """A candidate that departs mid-run and closes up again passes the late test but fails its windows."""
    bump = np.where((np.arange(1, T + 1) > 60) & (np.arange(1, T + 1) <= 100), 0.1, 0.0)
    runs = CurveRuns(paired=tuple(_write_curve(tmp_path / f"bump{s}", _curve(s) + bump) for s in range(4)))
    v = loss_curve(seeds, runs)
    assert not v.passed and v.evidence["paired"]["late_inside"] and "windows outside their margin" in v.summary
    assert v.first_divergence["steps"][0] == 61


def test_loss_curve_accepts_same_distribution(seeds, tmp_path):
    for s in range(10, 20):
        v = loss_curve(seeds, _write_curve(tmp_path / f"cand{s}", _curve(s)))
        assert v.passed, v.summary
    ev = v.evidence
    assert ev["n_windows"] == 10 and len(ev["windows"]) == 10
    assert ev["k"] == pytest.approx(t_quantile(1 - 0.01 / 20, 3) * math.sqrt(1 + 1 / 4))
    assert all(w["lo"] < w["cand"] < w["hi"] for w in ev["windows"])
    assert ev["fixed_rule"]["passes"] and "2.5%" in ev["fixed_rule"]["note"]
    assert 0 < ev["drift"]["limit"] <= 0.5 * np.mean([w["half_width"] for w in ev["windows"][-3:]])
    json.dumps(v.to_dict())


def test_loss_curve_rejects_consistent_drift_inside_band(seeds, tmp_path):
    ok = loss_curve(seeds, _write_curve(tmp_path / "ok", _curve(10)))
    late = ok.evidence["windows"][-3:]  # late_fraction 0.25 of 10 windows
    limit, d_ok = ok.evidence["drift"]["limit"], ok.evidence["drift"]["mean_diff"]
    room = min(w["half_width"] * (1 - abs(w["z"])) for w in late)  # shift that keeps every window in band
    assert limit + abs(d_ok) < room
    delta = 0.5 * (limit + abs(d_ok) + room)
    t = np.arange(1, T + 1)
    for sign in (+1, -1):  # consistently worse, and (two-sided by default) consistently better
        y = _curve(10) + sign * delta * (t > 140)
        v = loss_curve(seeds, _write_curve(tmp_path / f"shift{sign}", y))
        assert not v.passed, v.summary
        assert v.evidence["n_outside"] == 0 and not v.evidence["drift"]["passed"]
        fd = v.first_divergence
        assert fd["window"] == "late" and fd["step"] == 141 and sign * fd["drift"] > limit
        assert "late diff" in v.summary
    assert loss_curve(seeds, tmp_path / "shift-1", {"drift_two_sided": False}).passed


def test_loss_curve_rejects_divergence(seeds, tmp_path):
    v = loss_curve(seeds, _write_curve(tmp_path / "div", _curve(10, diverge_at=100)))
    assert not v.passed and v.evidence["n_outside"] > 0
    fd = v.first_divergence
    assert fd["kind"] == "loss" and 100 <= fd["step"] <= 181 and fd["cand"] > fd["ref"]["hi"]


def test_loss_curve_rejects_bad_inputs(seeds, tmp_path):
    cand = _write_curve(tmp_path / "cand", _curve(10))
    v = loss_curve(seeds[:2], cand)
    assert not v.passed and ">= 3" in v.summary
    assert loss_curve(seeds[:3], _write_curve(tmp_path / "cand11", _curve(11))).passed
    same = [_write_curve(tmp_path / f"same{i}", _curve(0)) for i in range(3)]
    assert "identical" in loss_curve(same, cand).summary
    short = loss_curve(seeds, _write_curve(tmp_path / "short", _curve(10)[:150]))
    assert not short.passed and short.first_divergence["step"] == 151
    y = _curve(10)
    y[40] = float("inf")
    v = loss_curve(seeds, _write_curve(tmp_path / "inf", y))
    assert not v.passed and v.first_divergence["step"] == 41
    with pytest.raises(TypeError):
        loss_curve(seeds[0], cand)


def test_t_quantile_matches_tables():
    assert t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-4)
    assert t_quantile(0.995, 4) == pytest.approx(4.6041, abs=1e-4)
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile(0.975, 30) == pytest.approx(2.0423, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile(0.3, 2)


# ---------------------------------------------------------------------------------------------------- surpass


PASS = Verdict("loss_curve", True, "ok", {"mode": "paired+unpaired"})
FAIL = Verdict("loss_curve", False, "drift", {"mode": "paired+unpaired"})
UNPAIRED_PASS = Verdict("loss_curve", True, "ok", {"mode": "unpaired"})
PEER = {"torch_compile": _timings(2, 1.0)}  # the strongest peer, as slow as the reference here


def test_surpass_rests_on_the_paired_test():
    """A loss-curve pass judged unpaired only (its band passes shifts of several percent) carries no speed claim,
    however fast the candidate; a pair tier's verdict is paired by construction."""
    v = surpass(UNPAIRED_PASS, _timings(0, 1.0), _timings(1, 0.7))
    assert not v.passed and "unpaired only" in v.summary
    assert surpass(Verdict("tolerance", True, "ok"), _timings(0, 1.0), _timings(1, 0.7), timings_peers=PEER).passed
    assert surpass(UNPAIRED_PASS, _timings(0, 1.0), _timings(1, 0.7), {"require_paired": False}, PEER).passed


def test_surpass_accepts_clear_speedup():
    v = surpass(PASS, _timings(0, 1.0), _timings(1, 0.7), timings_peers=PEER)
    assert v.passed, v.summary
    ev = v.evidence
    assert ev["speedup"] == pytest.approx(1 / 0.7, rel=0.05) and ev["n_ref"] == ev["n_cand"] == 20
    assert ev["speedup"] > ev["required_speedup"] == 1 + ev["noise"]


def test_surpass_rejects_failed_equivalence():
    v = surpass(FAIL, _timings(0, 1.0), _timings(1, 0.5))
    assert not v.passed and v.evidence["faster_beyond_noise"] and "failed" in v.summary


def test_surpass_rejects_speedup_within_noise():
    v = surpass(PASS, _timings(0, 1.0), _timings(1, 0.99), timings_peers=PEER)
    assert not v.passed and "not faster beyond noise than the reference and torch_compile" in v.summary, v.summary
    assert v.evidence["noise"] > abs(v.evidence["speedup"] - 1)
    assert not surpass(PASS, _timings(0, 1.0), _timings(1, 1.3)).passed  # slower


def test_surpass_must_beat_the_strongest_peer_too():
    """The product's surpass: faster than the reference AND the strongest peer of the candidate's precision
    (``peers`` of conf/tier/surpass.yaml), each beyond its noise. A candidate 1.4x the reference but level with the
    peer is rejected, naming the peer; one with no peer timed is rejected, naming the peers it must beat."""
    level = surpass(PASS, _timings(0, 1.0), _timings(1, 0.7), timings_peers={"torch_compile": _timings(2, 0.7)})
    assert not level.passed and "not faster beyond noise than torch_compile:" in level.summary, level.summary
    assert level.evidence["speedup"] > level.evidence["required_speedup"]  # the reference alone would pass it
    assert level.evidence["peers"]["torch_compile"]["faster_beyond_noise"] is False
    none = surpass(PASS, _timings(0, 1.0), _timings(1, 0.7))
    assert not none.passed and "no peer timed" in none.summary and "torch_compile" in none.summary
    few = surpass(PASS, _timings(0, 1.0), _timings(1, 0.7), timings_peers={"torch_compile": [1.0] * 5})
    assert not few.passed and "torch_compile: too few" in few.summary
    assert surpass(PASS, _timings(0, 1.0), _timings(1, 0.7), {"peers": {"default": [], "fp8": []}}).passed


def test_surpass_peers_follow_the_candidates_precision():
    """An FP8 candidate is compared with FP8 training (torchao), every other with the plain-PyTorch script; a
    malformed ``peers`` is one ConfigError."""
    from forgetrain.equivalence.tiers.surpass import peers_for
    from forgetrain.errors import ConfigError

    assert peers_for(None, fp8=False) == ["torch_compile"]
    assert peers_for(None, fp8=True) == ["torchao_float8_tensorwise"]
    assert peers_for({"peers": {"default": []}}, fp8=False) == []
    with pytest.raises(ConfigError, match="peers"):
        peers_for({"peers": {"default": "torch_compile"}}, fp8=False)


def test_surpass_refuses_a_peer_that_cannot_run_here_before_any_run(tmp_path):
    """An FP8 candidate's peer is torchao's float8 training: where it cannot run (no torchao, or no FP8 GEMMs on
    this machine) ``verify tier=surpass`` stops before any run with one ``error:`` line naming it, and writes
    nothing."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT
    from tests.limits import hang_s

    out = tmp_path / "v"
    r = subprocess.run([sys.executable, "-m", "forgetrain.verify", "scenario=llama1b_h200", "hardware=cpu",
                        "model=llama_micro", "engine.compile=false", "engine.fp8=tensorwise", "tier=surpass",
                        "verify.seeds=[1,2,3]", f"verify.out_dir={out}"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=hang_s(), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and "torchao" in lines[0], lines
    assert not out.exists()


def test_surpass_input_checks():
    assert "too few" in surpass(PASS, [1.0] * 5, [0.5] * 5).summary
    with pytest.raises(ValueError):
        surpass(Verdict("surpass", True, ""), [1.0] * 20, [0.5] * 20)
    with pytest.raises(ValueError):
        surpass(PASS, [1.0] * 19 + [-1.0], [0.5] * 20)


# ---------------------------------------------------------------------------------------------------- ladder, report


def test_ladder_reports_strictest_tier(pair, seeds, tmp_path):
    ref, make = pair
    res = ladder(["tolerance", "bitwise"], ref_dir=ref, cand_dir=make())
    assert [v.tier for v in res.verdicts] == ["bitwise", "tolerance"] and res.strictest_passed == "bitwise"
    res = ladder(["bitwise", "tolerance"], ref_dir=ref, cand_dir=make(_perturb(1e-8), "small"))
    assert res.strictest_passed == "tolerance" and not res.verdict("bitwise").passed

    curve = _paired(tmp_path, "ladder")
    res = ladder(TIER_ORDER, ref_dir=ref, cand_dir=make(_perturb(1e-3), "big"), ref_dirs=seeds,
                 curve_cand_dir=curve, timings_ref=_timings(0, 1.0), timings_cand=_timings(1, 0.7),
                 timings_peers=PEER)
    assert res.strictest_passed == "loss_curve" and res.surpassed is True
    res = ladder(["loss_curve", "surpass"], ref_dirs=seeds, curve_cand_dir=curve)
    assert res.strictest_passed == "loss_curve" and res.surpassed is False
    assert "missing input" in res.verdict("surpass").summary
    one = _write_curve(tmp_path / "one", _curve(10))  # one unpaired run: equivalent, but no speed claim rests on it
    res = ladder(["loss_curve", "surpass"], ref_dirs=seeds, curve_cand_dir=one, timings_ref=_timings(0, 1.0),
                 timings_cand=_timings(1, 0.7), timings_peers=PEER)
    assert res.strictest_passed == "loss_curve" and res.surpassed is False
    with pytest.raises(ValueError):
        ladder(["surpass"])
    with pytest.raises(ValueError):
        ladder(["nope"])


def test_write_report_and_table(pair, seeds, tmp_path):
    ref, make = pair
    curve = _write_curve(tmp_path / "curve", _curve(10, diverge_at=120))
    res = ladder(TIER_ORDER, ref_dir=ref, cand_dir=make(_perturb(1e-3, steps={2}), "bad"), ref_dirs=seeds,
                 curve_cand_dir=curve, timings_ref=_timings(0, 1.0), timings_cand=_timings(1, 0.7))
    out = tmp_path / "report"
    paths = write_report(res, out, seeds, curve)
    doc = json.loads(paths["verdict"].read_text(),
                     parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert [v["tier"] for v in doc["verdicts"]] == list(TIER_ORDER)
    assert doc["strictest_passed"] is None and doc["all_passed"] is False
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A single reference with NaN in the evidence still gives strict JSON and a plot.
    v = bitwise(ref, make(lambda r: r["records"][2].__setitem__("loss", float("nan")), "nan"))
    paths = write_report([v], tmp_path / "report2", ref, tmp_path / "nan")
    assert "NaN" in paths["verdict"].read_text() and paths["plot"].exists()

    buf = io.StringIO()
    text = print_verdict_table(res, file=buf)
    assert buf.getvalue().strip() == text
    lines = text.splitlines()
    vs = list(res.verdicts) if hasattr(res, "verdicts") else list(res)
    clipped = [v for v in vs if len(v.summary) > 72]  # printed again in full below the footer
    assert lines[0].split()[:2] == ["tier", "result"] and len(lines) == 2 + 4 + 1 + len(clipped)
    assert "FAIL" in lines[2] and "step 2 loss" in lines[2] and "step 2 loss" in lines[3]
    assert lines[6].startswith("strictest equivalence tier passed: none")
    assert lines[7:] == [f"{v.tier}: {v.summary}" for v in clipped] and clipped


def test_every_tier_yaml_is_versioned():
    for name in TIER_ORDER:
        cfg = load_tier(name)
        assert cfg["name"] == name and cfg["version"] >= 1


def test_loss_curve_warns_when_the_band_is_too_wide(tmp_path):
    """Seeds that disagree by ~5% of the loss give a band that could not see a 10% shift: the verdict says so
    (a warning in the summary and the evidence); close seeds give no warning. The threshold is warn_band_rel."""
    close = [_write_curve(tmp_path / f"c{s}", _curve(s)) for s in range(6)]
    v = loss_curve(close, _write_curve(tmp_path / "cand_c", _curve(10)))
    assert "band_warning" not in v.evidence and "WARNING" not in v.summary, v.summary
    assert v.evidence["band_half_width_rel"]["median"] < 0.10
    wide = [_write_curve(tmp_path / f"w{s}", _curve(s) * (1 + 0.05 * (s - 1.5))) for s in range(4)]
    v = loss_curve(wide, _write_curve(tmp_path / "cand_w", _curve(10)))
    assert v.evidence["band_half_width_rel"]["median"] > 0.10
    assert "too wide" in v.evidence["band_warning"] and "WARNING: too wide" in v.summary
    from forgetrain.equivalence.report import format_verdict_table

    assert v.summary in format_verdict_table([v])  # printed in full, not clipped
