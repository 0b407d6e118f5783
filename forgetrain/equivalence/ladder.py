"""The ladder: run a list of tiers strictest-first over given trace directories and report the strictest
equivalence tier that passed. The order and how each tier is fed come from :mod:`forgetrain.equivalence.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from forgetrain.equivalence import registry
from forgetrain.equivalence.registry import EQUIVALENCE_TIERS, TIER_ORDER
from forgetrain.equivalence.verdict import Verdict

@dataclass
class LadderResult:
    """strictest_passed: the strictest equivalence tier that passed (in :data:`EQUIVALENCE_TIERS` order), or None.
    surpassed: the speed tier's (surpass's) outcome, None when it was not run. verdicts: in the order run."""

    strictest_passed: str | None
    surpassed: bool | None
    verdicts: list[Verdict]

    def verdict(self, tier: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.tier == tier), None)

    def to_dict(self) -> dict:
        return {"strictest_passed": self.strictest_passed, "surpassed": self.surpassed,
                "verdicts": [v.to_dict() for v in self.verdicts]}


def summarize(verdicts: Sequence[Verdict]) -> tuple[str | None, bool | None]:
    """``(strictest_passed, surpassed)`` of a list of verdicts: the first passed verdict of an equivalence tier
    (the list is expected strictest first), and the outcome of the speed tier's verdict (None when absent)."""
    speed = registry.names(registry.SPEED)
    strictest = next((v.tier for v in verdicts if v.tier in EQUIVALENCE_TIERS and v.passed), None)
    sv = next((v for v in verdicts if v.tier in speed), None)
    return strictest, None if sv is None else sv.passed


def ladder(tiers: Sequence[str] = TIER_ORDER, *, ref_dir: str | Path | None = None,
           cand_dir: str | Path | None = None, ref_dirs: Sequence[str | Path] | None = None,
           curve_cand_dir: str | Path | None = None, timings_ref: Sequence[float] | None = None,
           timings_cand: Sequence[float] | None = None, cfgs: Mapping[str, Mapping] | None = None,
           timings_peers: Mapping[str, Sequence[float]] | None = None) -> LadderResult:
    """Run ``tiers`` strictest-first (sorted by :data:`TIER_ORDER`, whatever order they are given in).

    Inputs per tier, by its kind (:mod:`forgetrain.equivalence.registry`): a ``pair`` tier (bitwise, tolerance)
    compares ``ref_dir`` with ``cand_dir`` (a short run); a ``curve`` tier (loss_curve) compares ``ref_dirs``
    (>= 3 seeds) with ``curve_cand_dir`` (default ``cand_dir``; a long run); a ``speed`` tier (surpass) uses this
    ladder's verdict of the tier it rests on and ``timings_ref`` / ``timings_cand`` (step seconds), and
    ``timings_peers`` (peer name -> step seconds; surpass: :func:`forgetrain.equivalence.tiers.surpass.peers_for`).
    ``cfgs`` maps a tier name to its cfg overrides. Every tier is run (a pass does not skip the weaker ones, so
    every verdict carries its evidence); a tier whose inputs are missing gets a failed verdict naming them.

    Returns a :class:`LadderResult`. Raises ValueError on an unknown tier name or a speed tier without the tier
    it rests on (``surpass`` without ``loss_curve``) in ``tiers``.
    """
    unknown = [t for t in tiers if t not in TIER_ORDER]
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown}; known: {list(TIER_ORDER)}")
    order = [registry.find(t) for t in sorted(dict.fromkeys(tiers), key=TIER_ORDER.index)]
    present = {t.name for t in order}
    for t in order:
        if t.rests_on is not None and t.rests_on not in present:
            raise ValueError(f"{t.name} rests on {t.rests_on}: include {t.rests_on} in the ladder's tiers")
    cfgs = cfgs or {}
    curve_cand_dir = curve_cand_dir if curve_cand_dir is not None else cand_dir
    verdicts: list[Verdict] = []

    def missing(tier: str, what: str) -> Verdict:
        return Verdict(tier, False, f"not run: missing input {what}", {"reason": f"missing {what}"}, None)

    for t in order:
        if t.kind == registry.PAIR:
            if ref_dir is None or cand_dir is None:
                v = missing(t.name, "ref_dir/cand_dir")
            else:
                v = t.judge()(ref_dir, cand_dir, cfgs.get(t.name))
        elif t.kind == registry.CURVE:
            if not ref_dirs or curve_cand_dir is None:
                v = missing(t.name, "ref_dirs/curve_cand_dir")
            else:
                v = t.judge()(ref_dirs, curve_cand_dir, cfgs.get(t.name))
        else:
            base = next(x for x in verdicts if x.tier == t.rests_on)
            if timings_ref is None or timings_cand is None:
                v = missing(t.name, "timings_ref/timings_cand")
            else:
                peers = {} if timings_peers is None else {"timings_peers": timings_peers}
                v = t.judge()(base, timings_ref, timings_cand, cfgs.get(t.name), **peers)
        verdicts.append(v)
    return LadderResult(*summarize(verdicts), verdicts)
