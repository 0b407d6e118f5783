"""What verify leaves on disk, and the loss-curve golden (reference seed curves stored once, judged many times)."""

import dataclasses
import json

import pytest

from forgetrain import equivalence as eq
from forgetrain import verify as V
from forgetrain.errors import ConfigError
from tests.helpers import ladder_cfg as _cfg

STEPS = 24


def _curve_cfg():
    c = _cfg()
    return dataclasses.replace(c, train=dataclasses.replace(
        c.train, micro_batch_size=2, global_batch_size=4, lr_warmup_steps=3, steps=STEPS))


def _tier():
    t = dict(eq.load_tier("loss_curve"))
    t.update(window_steps=6, min_windows=4)  # 4 windows of 6 steps: the tier's machinery at a CPU-test length
    return t


def _vcfg(**kw):
    return V.VerifyConfig(curve_steps=STEPS, **kw)


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_loss_curve_verify_leaves_no_checkpoint(tmp_path):
    V.verify(_curve_cfg(), _vcfg(), "loss_curve", tmp_path, tier_cfg=_tier())
    files = _files(tmp_path)
    assert not [f for f in files if "checkpoints" in f or ".tmp" in f], files
    assert not [f for f in files if f.endswith(".safetensors")], files  # no final params: the tier reads losses
    assert (tmp_path / "verdict.json").is_file()


def test_resume_gate_deletes_its_checkpoint(tmp_path):
    cfg = _cfg()
    ref = V.run_reference(cfg, V.VerifyConfig(steps=4), tmp_path / "ref", 4)
    cand = V.run_candidate(cfg, V.VerifyConfig(steps=4, resume_at=2), tmp_path / "cand", 4, ref / "init.safetensors")
    assert not (cand / "checkpoints").exists()
    assert not (ref / "checkpoints").exists()
    assert eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise")).passed


def test_loss_curve_golden_round_trip(golden_root, tmp_path):
    cfg, tier = _curve_cfg(), _tier()
    # made seed by seed: two seeds first, a third later, in processes of their own
    assert V.verify(cfg, _vcfg(make_golden=True, seeds=[1234, 1235]), "loss_curve", tmp_path / "g1",
                    tier_cfg=tier) == []
    with pytest.raises(ConfigError, match=r"no loss-curve golden for seeds \[1236\]"):
        V.verify(cfg, _vcfg(golden=True), "loss_curve", tmp_path / "x", tier_cfg=tier)
    V.verify(cfg, _vcfg(make_golden=True, seeds=[1236]), "loss_curve", tmp_path / "g2", tier_cfg=tier)
    gdir = V.curve_golden_dir(cfg, _vcfg())
    assert sorted(d.name for d in gdir.iterdir()) == ["seed_1234", "seed_1235", "seed_1236"]
    assert not [f for f in _files(gdir) if f.endswith(".safetensors")]
    # judged against the golden (no reference re-run) = judged against live reference runs
    live = V.verify(cfg, _vcfg(), "loss_curve", tmp_path / "live", tier_cfg=tier)[-1]
    stored = V.verify(cfg, _vcfg(golden=True), "loss_curve", tmp_path / "stored", tier_cfg=tier)[-1]
    assert not any((tmp_path / "stored").glob("reference_seed*"))
    assert stored.passed == live.passed
    assert stored.evidence["drift"] == live.evidence["drift"]
    # the same golden serves another seed-free change only if the run's config is the same: a new lr is new
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=cfg.train.lr / 2))
    assert V.curve_golden_dir(other, _vcfg()) != gdir
    assert V.curve_golden_dir(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=7)), _vcfg()) == gdir


def test_loss_curve_golden_rejects_a_damaged_seed(golden_root, tmp_path):
    cfg, tier = _curve_cfg(), _tier()
    V.verify(cfg, _vcfg(make_golden=True), "loss_curve", tmp_path / "g", tier_cfg=tier)
    t = V.curve_golden_dir(cfg, _vcfg()) / "seed_1235" / "trace" / "trace.jsonl"
    t.write_text("\n".join(t.read_text().splitlines()[:-3]) + "\n")  # a truncated curve
    with pytest.raises(ConfigError, match="seed_1235.*not a 24-step run"):
        V.verify(cfg, _vcfg(golden=True), "loss_curve", tmp_path / "x", tier_cfg=tier)
    json.loads((t.parent / "meta.json").read_text())  # the rest stays readable


def test_tolerance_golden_below_fp32_stores_its_oracle(golden_root, tmp_path):
    """The fp32 oracle run is part of a bf16 tolerance golden, so judging against the golden runs no reference
    code at all (the forge's judge never runs an engine)."""
    cfg = _cfg(precision="bf16")
    v = V.VerifyConfig(steps=3, digests=False)
    assert V.verify(cfg, dataclasses.replace(v, make_golden=True), "tolerance", tmp_path / "g") == []
    gdir = V.golden_dir(cfg, "tolerance")
    assert (gdir / "oracle_fp32" / "trace" / "trace.jsonl").is_file() and (gdir / "init.safetensors").is_file()
    stored = V.verify(cfg, dataclasses.replace(v, golden=True), "tolerance", tmp_path / "s")[-1]
    assert not (tmp_path / "s" / "oracle_fp32").exists() and not (tmp_path / "s" / "reference").exists()
    assert stored.passed, stored.summary
    # an fp32 tolerance golden needs no oracle
    V.verify(_cfg(), V.VerifyConfig(steps=3, make_golden=True), "tolerance", tmp_path / "g32")
    assert not (V.golden_dir(_cfg(), "tolerance") / "oracle_fp32").exists()
