"""The loss-curve tier: over a long run, the candidate's windowed loss stays inside a band calibrated from >= 3
reference seeds, with no late drift (docs/design.md, "The tiers"; the rule and its sources:
``conf/tier/loss_curve.yaml``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from forgetrain.equivalence.verdict import Verdict, _finite, _fmt, _tier_cfg
from forgetrain.trace import read_trace

def _t_abs_cdf(t: float, nu: int) -> float:
    """P(|T| <= t) for Student's t with integer ``nu`` >= 1 degrees of freedom.

    Closed forms of Abramowitz & Stegun, Handbook of Mathematical Functions, 26.7.3 (odd nu) and 26.7.4 (even
    nu), with theta = atan(t / sqrt(nu)).
    """
    theta = math.atan(t / math.sqrt(nu))
    s, c = math.sin(theta), math.cos(theta)
    if nu % 2 == 1:
        acc = 0.0
        if nu > 1:
            term = acc = c
            for j in range(1, (nu - 3) // 2 + 1):
                term *= c * c * (2 * j) / (2 * j + 1)
                acc += term
        return 2.0 / math.pi * (theta + s * acc)
    term = acc = 1.0
    for j in range(1, (nu - 2) // 2 + 1):
        term *= c * c * (2 * j - 1) / (2 * j)
        acc += term
    return s * acc


def t_quantile(p: float, nu: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with integer ``nu`` >= 1 degrees of freedom.

    Inverts :func:`_t_abs_cdf` by bisection to ~1e-12 relative (scipy is not a dependency). Checked against
    tables: t_2(0.975) = 4.3027, t_4(0.995) = 4.6041, t_1(0.975) = 12.706. Raises ValueError on bad arguments.
    """
    if not (0.5 <= p < 1.0) or int(nu) != nu or nu < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and integer nu >= 1, got p={p}, nu={nu}")
    target = 2.0 * p - 1.0
    lo, hi = 0.0, 1.0
    while _t_abs_cdf(hi, int(nu)) < target:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_abs_cdf(mid, int(nu)) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def _losses(records: list[dict]) -> dict[int, Any]:
    return {int(r["step"]): r.get("loss") for r in records}


def loss_curve(ref_dirs: Sequence[str | Path], cand_dir: str | Path, cfg: Mapping | None = None) -> Verdict:
    """Loss-curve tier: the candidate's smoothed loss stays in the band of the reference seeds, without drift.

    Inputs: ``ref_dirs``, trace directories of the reference run with different ``train.seed`` (>=
    ``min_seeds``, 3 by default); ``cand_dir``, the candidate's trace of the same length; ``cfg`` overrides
    ``conf/tier/loss_curve.yaml``. Losses are per-step mean token cross-entropies in nats.

    Rule (formulas and sources in the yaml): window means of ``window_steps`` steps; per window the reference
    mean ``m_w`` and sample std ``s_w`` over the n seeds; band half-width ``hw_w = max(k s_w, band_floor_rel
    |m_w|, band_floor_abs)`` with ``k = t_{n-1}(1 - band_alpha / (2 W)) sqrt(1 + 1/n)``: a Student-t prediction
    interval for one new run, Bonferroni-corrected over the W windows so that ``band_alpha`` bounds the
    false-fail rate of the whole band check. Every candidate window mean must lie in ``m_w +- hw_w``.
    Drift: ``D`` = candidate's mean over the late windows (last ``late_fraction``) minus the seeds' mean of the
    same; limit = ``min(max(t_{n-1}(1 - drift_alpha/2) sqrt(1 + 1/n) s_L, floors), drift_max_band_fraction *
    mean late hw_w)`` with ``s_L`` the std of the seeds' late means (a prediction interval for the late
    average, valid whatever the correlation between windows; the cap guarantees that a candidate consistently
    half a band off fails). ``|D| <= limit`` (``D <= limit`` when not ``drift_two_sided``).

    Steps compared: those present in every reference run (the shortest reference sets the length). Decision on
    bad input: the verdict FAILS with a clear reason (no exception) for fewer than ``min_seeds`` references,
    identical reference curves (seeds not varied), a non-finite reference loss, fewer than ``min_windows``
    windows, or candidate steps missing / non-finite -- so a ladder always gets a verdict.

    Evidence: the band per window (mean, std, half-width, lo, hi), the candidate's window mean and its position
    ``z = (cand - mean) / half_width`` (|z| <= 1 is in band), the drift statistic and limit, and for
    information the fixed rule "mean over steps of |cand - ref_mean| / ref_mean <= 2.5%" with a note comparing
    it to this verdict. ``first_divergence``: the first window out of band (its first step, with ``ref`` =
    {mean, lo, hi} and ``cand`` = the window mean), else the drift (the first late step).

    Raises FileNotFoundError when a directory has no ``trace.jsonl``; TypeError when ``ref_dirs`` is a single
    path rather than a list.
    """
    cfg = _tier_cfg("loss_curve", cfg)
    if isinstance(ref_dirs, (str, Path)):
        raise TypeError("loss_curve needs a list of reference trace directories (one per seed), not one path")
    ref_dirs = list(ref_dirs)
    n = len(ref_dirs)
    evidence: dict[str, Any] = {"n_seeds": n, "ref_dirs": [str(d) for d in ref_dirs], "config": cfg}

    def fail(reason: str, first: dict | None = None) -> Verdict:
        evidence["reason"] = reason
        return Verdict("loss_curve", False, reason, evidence, first)

    if n < int(cfg["min_seeds"]):
        return fail(f"{n} reference run(s) given; the band needs >= {cfg['min_seeds']} reference seeds")
    refs = [_losses(read_trace(d)[1]) for d in ref_dirs]
    cand = _losses(read_trace(cand_dir)[1])
    steps = sorted(set.intersection(*(set(r) for r in refs)))
    lengths = [len(r) for r in refs]
    evidence["ref_lengths"] = lengths
    if not steps:
        return fail("the reference runs share no steps")
    for i, r in enumerate(refs):
        bad = [s for s in steps if not _finite(r[s])]
        if bad:
            return fail(f"reference seed {i} ({ref_dirs[i]}) has a non-finite loss at step {bad[0]}; "
                        "the band cannot be calibrated")
    R = np.array([[float(r[s]) for s in steps] for r in refs])  # [n, T]
    if np.all(R == R[0]):
        return fail("the reference runs are identical: vary train.seed between them to calibrate a band")
    missing = [s for s in steps if s not in cand]
    if missing:
        return fail(f"candidate trace ends early / lacks {len(missing)} step(s) (first missing: step "
                    f"{missing[0]}; references have {len(steps)})",
                    {"step": missing[0], "kind": "loss", "ref": float(R[:, steps.index(missing[0])].mean()),
                     "cand": None})
    bad = [s for s in steps if not _finite(cand[s])]
    if bad:
        j = steps.index(bad[0])
        return fail(f"candidate loss is non-finite at step {bad[0]}",
                    {"step": bad[0], "kind": "loss", "ref": float(R[:, j].mean()), "cand": cand[bad[0]]})
    c = np.array([float(cand[s]) for s in steps])  # [T]

    win = int(cfg["window_steps"])
    edges = list(range(0, len(steps), win))
    W = len(edges)
    if W < int(cfg["min_windows"]):
        return fail(f"{len(steps)} steps make {W} window(s) of {win}; the tier needs >= {cfg['min_windows']}")
    Rw = np.stack([R[:, e:e + win].mean(axis=1) for e in edges], axis=1)  # [n, W]
    cw = np.array([c[e:e + win].mean() for e in edges])  # [W]
    mw, sw = Rw.mean(axis=0), Rw.std(axis=0, ddof=1)
    floor_rel, floor_abs = float(cfg["band_floor_rel"]), float(cfg["band_floor_abs"])
    band_alpha = float(cfg["band_alpha"])
    t_band = t_quantile(1.0 - band_alpha / (2.0 * W), n - 1)  # Bonferroni over the W windows
    k = t_band * math.sqrt(1.0 + 1.0 / n)
    hw = np.maximum(np.maximum(k * sw, floor_rel * np.abs(mw)), floor_abs)
    z = (cw - mw) / hw
    inside = np.abs(z) <= 1.0

    # Drift: a prediction interval for the candidate's late-window average, from the seeds' late averages.
    n_late = max(1, math.ceil(float(cfg["late_fraction"]) * W))
    late = slice(W - n_late, W)
    late_ref = Rw[:, late].mean(axis=1)  # [n] each seed's late average
    drift = float(cw[late].mean() - late_ref.mean())
    t_drift = t_quantile(1.0 - float(cfg["drift_alpha"]) / 2.0, n - 1)
    mean_late_hw = float(np.mean(hw[late]))
    limit_stat = max(t_drift * math.sqrt(1.0 + 1.0 / n) * float(late_ref.std(ddof=1)),
                     floor_rel * abs(float(late_ref.mean())), floor_abs)
    limit = min(limit_stat, float(cfg["drift_max_band_fraction"]) * mean_late_hw)
    two_sided = bool(cfg["drift_two_sided"])
    drift_ok = (abs(drift) <= limit) if two_sided else (drift <= limit)
    frac = limit / mean_late_hw

    # Fixed 2.5% rule, for information.
    m_t = R.mean(axis=0)
    mrd = float(np.mean(np.abs(c - m_t) / np.abs(m_t)))
    seed_mrd = [float(np.mean(np.abs(R[i] - m_t) / np.abs(m_t))) for i in range(n)]
    fixed = float(cfg["fixed_rule_rel"])

    windows = []
    for w, e in enumerate(edges):
        s0, s1 = steps[e], steps[min(e + win, len(steps)) - 1]
        windows.append({"window": w, "steps": [s0, s1], "ref_mean": float(mw[w]), "ref_std": float(sw[w]),
                        "half_width": float(hw[w]), "lo": float(mw[w] - hw[w]), "hi": float(mw[w] + hw[w]),
                        "cand": float(cw[w]), "z": float(z[w]), "inside": bool(inside[w])})
    passed = bool(inside.all()) and drift_ok
    rel_hw = hw / np.abs(mw)
    evidence.update({
        "steps_compared": len(steps), "window_steps": win, "n_windows": W, "k": k, "t_band": t_band,
        "per_window_alpha": band_alpha / W,
        "windows": windows, "n_outside": int((~inside).sum()), "max_abs_z": float(np.abs(z).max()),
        "band_half_width_rel": {"min": float(rel_hw.min()), "max": float(rel_hw.max())},
        "drift": {"late_windows": n_late, "late_steps": [windows[W - n_late]["steps"][0], steps[-1]],
                  "mean_diff": drift, "limit": limit, "limit_statistical": limit_stat,
                  "ref_late_means": late_ref.tolist(), "band_fraction": frac, "two_sided": two_sided,
                  "passed": drift_ok, "in_band_units": drift / mean_late_hw,
                  "note": f"limit = the smallest consistent late shift this test detects with {n} seeds; "
                          "more seeds shrink it (t quantile and std estimate)"},
        "fixed_rule": {"rule": f"mean |cand - ref_mean| / ref_mean <= {fixed:.1%}", "mean_rel_diff": mrd,
                       "passes": mrd <= fixed, "ref_seeds_mean_rel_diff": seed_mrd},
    })
    evidence["fixed_rule"]["note"] = (
        f"the fixed {fixed:.1%} rule would {'PASS' if mrd <= fixed else 'FAIL'} (candidate mean rel diff "
        f"{mrd:.3%}; the reference seeds themselves sit at {min(seed_mrd):.3%}-{max(seed_mrd):.3%}), while the "
        f"calibrated band (half-width {rel_hw.min():.3%}-{rel_hw.max():.3%} of the loss) "
        f"{'passes' if passed else 'fails'} the candidate" +
        ("; the two disagree" if (mrd <= fixed) != passed else ""))

    first = None
    if not inside.all():
        w = int(np.argmax(~inside))
        first = {"step": windows[w]["steps"][0], "kind": "loss", "window": w, "steps": windows[w]["steps"],
                 "ref": {"mean": windows[w]["ref_mean"], "lo": windows[w]["lo"], "hi": windows[w]["hi"]},
                 "cand": windows[w]["cand"], "z": windows[w]["z"]}
        summary = (f"{int((~inside).sum())}/{W} windows out of band; first: steps {windows[w]['steps'][0]}-"
                   f"{windows[w]['steps'][1]}, cand {_fmt(float(cw[w]))} vs band [{_fmt(windows[w]['lo'])}, "
                   f"{_fmt(windows[w]['hi'])}]")
        if not drift_ok:
            summary += f"; late drift {drift:+.4g} (limit {limit:.4g})"
    elif not drift_ok:
        s0 = windows[W - n_late]["steps"][0]
        first = {"step": s0, "kind": "loss", "window": "late", "steps": [s0, steps[-1]],
                 "ref": float(np.mean(mw[late])), "cand": float(np.mean(cw[late])), "drift": drift,
                 "limit": limit}
        summary = (f"in band, but late drift {drift:+.4g} nats over steps {s0}-{steps[-1]} exceeds "
                   f"{'+-' if two_sided else '+'}{limit:.4g} ({frac:.2f} x band)")
    else:
        summary = (f"{W} windows in band (max |z| {np.abs(z).max():.2f}, n={n} seeds, k={k:.2f}); late drift "
                   f"{drift:+.3g} within {limit:.3g}")
    # How much the band can see: its median half-width relative to the loss. A band as wide as the loss passes
    # nearly anything, so say so (a warning, not a verdict: the drift check still has its own limit).
    med_rel = float(np.median(rel_hw))
    warn_at = float(cfg.get("warn_band_rel", 0.10))
    evidence["band_half_width_rel"]["median"] = med_rel
    summary += f"; band half-width median {med_rel:.1%} of the loss"
    if med_rel > warn_at:
        evidence["band_warning"] = (f"the band's median half-width is {med_rel:.1%} of the loss (> {warn_at:.0%}): "
                                    f"too wide to mean much with {n} seeds; add seeds (verify.seeds) to narrow it")
        summary += f" -- WARNING: too wide to mean much with {n} seeds, add seeds"
    return Verdict("loss_curve", passed, summary, evidence, first)
