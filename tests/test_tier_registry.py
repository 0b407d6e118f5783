"""The tier registry is the one list of tiers: every consumer reads it, and a tier added to it reaches them all.

The second half adds a fifth tier, ``consistency``, between tolerance and loss_curve the way docs/design.md says
to (a runner in a module, a ``conf/tier/consistency.yaml``, one registry entry) -- at run time, so that the
repository stays as it is -- and checks that verify, the ladder, the forge's ladder, the report and surpass pick
it up in its place, with loss_curve still an equivalence tier.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from forgetrain import equivalence as eq
from forgetrain import verify as V
from forgetrain.equivalence import registry, verdict
from forgetrain.equivalence import TIER_ORDER as TIER_ORDER_IMPORTED_EARLY
from forgetrain.equivalence.registry import CURVE, PAIR, SPEED, Tier
from forgetrain.errors import ConfigError
from forgetrain.forge import _ladder
from tests.helpers import curve as _curve, paired as _paired, perturb as _perturb, timings as _timings, write_curve as _write_curve
from tests.equivalence_helpers import base_run, write_run

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = ("bitwise", "tolerance", "loss_curve", "surpass")


# ---------------------------------------------------------------------------------------------------- the registry


def test_registry_lists_each_tier_with_its_module_yaml_and_runner():
    assert registry.names() == tuple(eq.TIER_ORDER) == BUILTIN
    assert tuple(eq.EQUIVALENCE_TIERS) == ("bitwise", "tolerance", "loss_curve")
    for t in registry.TIERS:
        assert (ROOT / "forgetrain" / "equivalence" / "tiers" / f"{t.name}.py").is_file(), t
        assert eq.load_tier(t.name)["name"] == t.name
        assert t.judge() is getattr(eq, t.name)  # the runner is the public function of that name
    # every yaml in conf/tier is a registered tier (a tier cannot exist in Hydra but not in the ladder)
    assert sorted(p.stem for p in (ROOT / "conf" / "tier").glob("*.yaml")) == sorted(registry.names())
    assert [registry.find(n).kind for n in BUILTIN] == [PAIR, PAIR, CURVE, SPEED]
    assert registry.find("surpass").rests_on == "loss_curve" and registry.find("tolerance").oracle
    assert registry.find("bitwise").digests and registry.find("nope") is None


def test_registry_rejects_inconsistent_tiers():
    with pytest.raises(ValueError, match="kind"):
        Tier("x", "fast", "m:f")
    with pytest.raises(ValueError, match="module:function"):
        Tier("x", PAIR, "m.f")
    with pytest.raises(ValueError, match="rests_on"):
        Tier("x", SPEED, "m:f")
    with pytest.raises(ValueError, match="oracle"):
        Tier("x", CURVE, "m:f", oracle=True)
    before = list(registry.TIERS)
    with pytest.raises(ValueError, match="twice"):
        registry.register(Tier("bitwise", PAIR, "m:f"))
    with pytest.raises(ValueError, match="no tier 'nope'"):
        registry.register(Tier("x", PAIR, "m:f"), after="nope")
    with pytest.raises(ValueError, match="curve tier before it"):  # a speed tier resting on a pair tier
        registry.register(Tier("x", SPEED, "m:f", rests_on="bitwise"))
    with pytest.raises(ValueError, match="curve tier before it"):  # ... or on a curve tier after it
        registry.register(Tier("x", SPEED, "m:f", rests_on="loss_curve"), before="loss_curve")
    with pytest.raises(ValueError, match="curve tier before it"):  # surpass rests on loss_curve
        registry.unregister("loss_curve")
    assert registry.TIERS == before  # every refusal left the registry as it was


def _tier_literals(path: Path) -> list[int]:
    """Lines of ``path`` holding a tuple / list / set literal of two or more tier names (``__all__`` aside)."""
    tree = ast.parse(path.read_text())
    skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Tuple, ast.List, ast.Set)) and id(n) not in skip
            and len({e.value for e in n.elts if isinstance(e, ast.Constant) and e.value in BUILTIN}) >= 2]


# Files allowed to keep a group of tier-name literals, with their count. Empty: the forge reads the registry's kinds
# too. It may only stay empty.
PENDING: dict[str, int] = {}


def test_no_other_module_lists_tiers():
    """The order and the choice of how to run a tier are not copied anywhere: no code outside the registry
    spells out a group of tier names."""
    found = {}
    for top in ("forgetrain", "scenarios", "references", "scripts"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if rel != "forgetrain/equivalence/registry.py" and (lines := _tier_literals(p)):
                found[rel] = lines
    assert {k: v for k, v in found.items() if len(v) > PENDING.get(k, 0)} == {}, found


def test_the_scan_sees_a_copied_order(tmp_path):
    p = tmp_path / "copy.py"
    p.write_text('ORDER = ("bitwise", "tolerance", "loss_curve", "surpass")\nSHORT = ["bitwise", "tolerance"]\n'
                 '__all__ = ["bitwise", "tolerance"]\n')
    assert _tier_literals(p) == [1, 2]


# ---------------------------------------------------------------------------------------------------- a fifth tier

CONSISTENCY_YAML = """\
# A tier for this test only: the candidate's mean loss over the run within max_rel of the reference's.
name: consistency
version: 1
max_rel: 1.0e-2
"""


def consistency(ref_dir, cand_dir, cfg=None) -> eq.Verdict:
    """The new tier's runner: |mean cand loss - mean ref loss| / |mean ref loss| <= max_rel (from its yaml)."""
    from forgetrain.trace import read_trace

    cfg = verdict.tier_settings("consistency", cfg)
    ref = [r["loss"] for r in read_trace(ref_dir)[1]]
    cand = [r["loss"] for r in read_trace(cand_dir)[1]]
    if len(ref) != len(cand) or not ref:
        return eq.Verdict("consistency", False, f"{len(cand)} candidate steps vs {len(ref)}", {}, None)
    m_ref, m_cand = sum(ref) / len(ref), sum(cand) / len(cand)
    rel = abs(m_cand - m_ref) / abs(m_ref)
    passed = rel <= float(cfg["max_rel"])
    return eq.Verdict("consistency", passed, f"mean loss rel diff {rel:.3g} (max {cfg['max_rel']})",
                      {"rel": rel, "config": cfg}, None)


@pytest.fixture
def fifth_tier(tmp_path, monkeypatch):
    """conf/tier/consistency.yaml (in a copy of conf/tier) and one registry entry after tolerance."""
    conf = tmp_path / "conf_tier"
    shutil.copytree(verdict.TIER_CONF_DIR, conf)
    (conf / "consistency.yaml").write_text(CONSISTENCY_YAML)
    monkeypatch.setattr(verdict, "TIER_CONF_DIR", conf)
    registry.register(Tier("consistency", PAIR, f"{__name__}:consistency"), after="tolerance")
    yield
    registry.unregister("consistency")
    assert registry.names() == BUILTIN


ORDER5 = ["bitwise", "tolerance", "consistency", "loss_curve", "surpass"]


def test_fifth_tier_takes_its_place_in_the_order(fifth_tier):
    assert list(eq.TIER_ORDER) == ORDER5 and eq.TIER_ORDER == ORDER5
    assert list(TIER_ORDER_IMPORTED_EARLY) == ORDER5  # imported before the registration: a live view
    assert list(eq.EQUIVALENCE_TIERS) == ORDER5[:4]  # loss_curve is still an equivalence tier
    assert "loss_curve" in eq.EQUIVALENCE_TIERS and "surpass" not in eq.EQUIVALENCE_TIERS
    # the forge's ladder: which tiers a target tries, and which verdicts meet it
    assert _ladder.tiers_to_try("tolerance", "loss_curve") == ["tolerance", "consistency", "loss_curve"]
    assert _ladder.tiers_to_try("bitwise", "surpass") == ORDER5
    assert _ladder.target_met("loss_curve", "consistency", None)
    assert not _ladder.target_met("tolerance", "consistency", None)


def test_fifth_tier_in_the_ladder_report_and_surpass(fifth_tier, tmp_path):
    run = base_run()
    ref = write_run(tmp_path / "ref", run)
    off = base_run()
    _perturb(1e-3)(off)  # fails bitwise and fp32 tolerance; a 0.1% mean-loss shift passes consistency
    cand = write_run(tmp_path / "cand", off)
    seeds = [_write_curve(tmp_path / f"seed{s}", _curve(s)) for s in range(4)]
    curve = _paired(tmp_path, "curve")  # the candidate from each seed's init and batches
    res = eq.ladder(eq.TIER_ORDER, ref_dir=ref, cand_dir=cand, ref_dirs=seeds, curve_cand_dir=curve,
                    timings_ref=_timings(0, 1.0), timings_cand=_timings(1, 0.7),
                    timings_peers={"torch_compile": _timings(2, 1.0)})
    assert [v.tier for v in res.verdicts] == ORDER5
    assert [v.passed for v in res.verdicts] == [False, False, True, True, True]
    assert res.strictest_passed == "consistency" and res.surpassed is True
    assert res.verdict("surpass").evidence["equivalence_tier"] == "loss_curve"  # still rests on loss_curve
    # given in any order, run strictest first; the new tier's own test: a wrong candidate is rejected
    wrong = base_run()
    _perturb(0.05)(wrong)  # a 5% loss shift
    bad = write_run(tmp_path / "bad", wrong)
    res2 = eq.ladder(["loss_curve", "consistency"], ref_dir=ref, cand_dir=bad, ref_dirs=seeds, curve_cand_dir=curve)
    assert [v.tier for v in res2.verdicts] == ["consistency", "loss_curve"]
    assert not res2.verdicts[0].passed and res2.strictest_passed == "loss_curve"
    # surpass accepts the new tier's verdict as the equivalence it rests on
    sv = eq.surpass(res.verdict("consistency"), _timings(0, 1.0), _timings(1, 0.7),
                    timings_peers={"torch_compile": _timings(2, 1.0)})
    assert sv.passed and sv.evidence["equivalence_tier"] == "consistency"

    out = eq.write_report(res, tmp_path / "report", seeds, curve)
    doc = json.loads(out["verdict"].read_text())
    assert [v["tier"] for v in doc["verdicts"]] == ORDER5 and doc["strictest_passed"] == "consistency"
    table = eq.format_verdict_table(res.verdicts)  # a plain list: the report derives the strictest itself
    assert "strictest equivalence tier passed: consistency; surpass: pass" in table


def test_fifth_tier_through_verify(fifth_tier, tmp_path, monkeypatch):
    """verify runs the new tier as a pair tier (reference and candidate from the same init) from the registry
    entry alone. The runs are synthetic traces here; tests/test_ladder.py runs real engines."""
    from tests.helpers import ladder_cfg as _cfg

    runs = {"cand": base_run()}

    def fake_reference(cfg, vcfg, out, steps, seed=None, final_params=True):
        write_run(out / "trace", base_run())
        (out / "init.safetensors").write_bytes(b"")
        return out

    def fake_candidate(cfg, vcfg, out, steps, init, engine_cls=None, seed=None, final_params=True):
        assert init is not None and init.parent.name == "reference"  # same init as the reference
        write_run(out / "trace", runs["cand"])
        return out

    monkeypatch.setattr(V, "run_reference", fake_reference)
    monkeypatch.setattr(V, "run_candidate", fake_candidate)
    vs = V.verify(_cfg(), V.VerifyConfig(steps=6), "consistency", tmp_path / "ok")
    assert [v.tier for v in vs] == ["consistency"] and vs[0].passed, vs[0].summary
    assert vs[0].evidence["config"]["max_rel"] == 1e-2  # read from its conf/tier/consistency.yaml
    assert json.loads((tmp_path / "ok" / "verdict.json").read_text())["strictest_passed"] == "consistency"
    _perturb(0.05)(runs["cand"])
    vs = V.verify(_cfg(), V.VerifyConfig(steps=6), "consistency", tmp_path / "bad")
    assert not vs[0].passed, vs[0].summary
    with pytest.raises(ConfigError, match="known: bitwise, tolerance, consistency, loss_curve, surpass"):
        V.verify(_cfg(), V.VerifyConfig(steps=6), "nope", tmp_path / "nope")
