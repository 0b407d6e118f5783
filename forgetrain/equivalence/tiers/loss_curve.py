"""The loss-curve tier: over a long run, the candidate's loss curve is equivalent to the reference's within a
declared margin (paired mode), and its own init and data order stay inside the band of >= 3 reference seeds
(unpaired mode) (docs/design.md, "The tiers"; the rules and their sources: ``conf/tier/loss_curve.yaml``).

Two kinds of candidate run feed it (:class:`CurveRuns`):

* **paired**: for each reference seed s, the candidate started from seed s's reference init weights and read
  seed s's batches. The statistic is the per-seed difference of window means, cand(s, w) - ref(s, w), judged as
  an equivalence test (two one-sided tests): it passes only when the confidence interval of the mean late
  difference lies inside +-delta, and every window's interval inside its own margin. Pairing removes the
  seed-to-seed spread (init and data order) from the comparison, and a noisier candidate gets a wider interval,
  so it finds it *harder* to pass.
* **unpaired**: the candidate from its own init and data order (one run per candidate seed). Each run's window
  means must lie in the reference seeds' prediction band, and the candidates' late means must not differ from
  the references' (a pooled two-sample t test). This checks what pairing hides: the init distribution and the
  data order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from forgetrain.equivalence.verdict import Verdict, is_finite, fmt_num, tier_settings
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


@dataclass(frozen=True)
class CurveRuns:
    """The candidate's runs for a curve tier (trace directories).

    paired: one per reference seed, in the order of ``ref_dirs``: the candidate started from that seed's
        reference init weights and read that seed's batches. Empty: no paired test.
    unpaired: the candidate from its own init and data order, one per candidate seed (verify runs >= 3).
        Empty: no unpaired check.
    """

    paired: tuple = ()
    unpaired: tuple = ()

    @property
    def first(self) -> Path | None:
        """A representative candidate trace (the first paired run, else the first unpaired one), for plots."""
        runs = tuple(self.paired) + tuple(self.unpaired)
        return Path(runs[0]) if runs else None

    @property
    def mode(self) -> str:
        return "+".join(m for m, r in (("paired", self.paired), ("unpaired", self.unpaired)) if r) or "none"


class _Bad(Exception):
    """A verdict-level failure of the inputs: ``reason`` and an optional ``first`` divergence."""

    def __init__(self, reason: str, first: dict | None = None):
        super().__init__(reason)
        self.reason, self.first = reason, first


def _losses(records: list[dict]) -> dict[int, Any]:
    return {int(r["step"]): r.get("loss") for r in records}


def _cand_curve(d, steps: list[int], R: np.ndarray, what: str) -> np.ndarray:
    """The candidate trace ``d``'s losses at ``steps`` ``[T]``. Raises _Bad when steps are missing or
    non-finite."""
    cand = _losses(read_trace(d)[1])
    missing = [s for s in steps if s not in cand]
    if missing:
        raise _Bad(f"{what} trace ends early / lacks {len(missing)} step(s) (first missing: step {missing[0]}; "
                   f"references have {len(steps)})",
                   {"step": missing[0], "kind": "loss", "ref": float(R[:, steps.index(missing[0])].mean()),
                    "cand": None})
    bad = [s for s in steps if not is_finite(cand[s])]
    if bad:
        j = steps.index(bad[0])
        raise _Bad(f"{what} loss is non-finite at step {bad[0]}",
                   {"step": bad[0], "kind": "loss", "ref": float(R[:, j].mean()), "cand": cand[bad[0]]})
    return np.array([float(cand[s]) for s in steps])


def _load(ref_dirs: list, runs: CurveRuns, cfg: dict, evidence: dict):
    """The reference curves ``R [n, T]``, the paired ``P [n, T]`` and unpaired ``U [m, T]`` candidate curves
    (None when absent) and the compared steps. Raises _Bad on any input the verdict cannot be calibrated from."""
    n = len(ref_dirs)
    if n < int(cfg["min_seeds"]):
        raise _Bad(f"{n} reference run(s) given; the band needs >= {cfg['min_seeds']} reference seeds")
    refs = [_losses(read_trace(d)[1]) for d in ref_dirs]
    steps = sorted(set.intersection(*(set(r) for r in refs)))
    evidence["ref_lengths"] = [len(r) for r in refs]
    if not steps:
        raise _Bad("the reference runs share no steps")
    for i, r in enumerate(refs):
        bad = [s for s in steps if not is_finite(r[s])]
        if bad:
            raise _Bad(f"reference seed {i} ({ref_dirs[i]}) has a non-finite loss at step {bad[0]}; "
                       "the band cannot be calibrated")
    R = np.array([[float(r[s]) for s in steps] for r in refs])  # [n, T]
    if np.all(R == R[0]):
        raise _Bad("the reference runs are identical: vary train.seed between them to calibrate a band")
    if runs.paired and len(runs.paired) != n:
        raise _Bad(f"{len(runs.paired)} paired candidate run(s) for {n} reference seeds: pairing needs one "
                   "candidate run per reference seed, in the same order")
    P = np.stack([_cand_curve(d, steps, R, f"paired candidate (seed {i})")
                  for i, d in enumerate(runs.paired)]) if runs.paired else None
    U = np.stack([_cand_curve(d, steps, R, "candidate" if len(runs.unpaired) == 1 else f"unpaired candidate {j}")
                  for j, d in enumerate(runs.unpaired)]) if runs.unpaired else None
    return R, P, U, steps


def _windows(x: np.ndarray, edges: list[int], win: int) -> np.ndarray:
    """Window means of curves ``x [k, T]`` -> ``[k, W]``."""
    return np.stack([x[:, e:e + win].mean(axis=1) for e in edges], axis=1)


def _paired(Rw: np.ndarray, Pw: np.ndarray, late: slice, cfg: dict, spans: list) -> dict:
    """The paired equivalence test (two one-sided tests, Schuirmann 1987) on window means ``Rw, Pw [n, W]``.

    d[s, w] = Pw[s, w] - Rw[s, w]; late difference D_s = mean over the late windows; CI = mean(D) +- t_{n-1}(1 -
    alpha) sd(D) / sqrt(n) (a 1 - 2 alpha interval). Pass iff the CI lies inside +-delta, delta = delta_rel x the
    references' mean late loss, and every window's own CI lies inside +-window_delta_rel x its reference mean.
    """
    pc = cfg["paired"]
    n, W = Rw.shape
    alpha = float(pc["alpha"])
    t = t_quantile(1.0 - alpha, n - 1)
    d = Pw - Rw  # [n, W]
    D = d[:, late].mean(axis=1)  # [n] each seed's late paired difference
    mean, sd = float(D.mean()), float(D.std(ddof=1))
    half = t * sd / math.sqrt(n)
    ref_late = float(Rw[:, late].mean())
    delta = float(pc["delta_rel"]) * abs(ref_late)
    late_ok = -delta < mean - half and mean + half < delta
    dw, sw = d.mean(axis=0), d.std(axis=0, ddof=1)
    hw = t * sw / math.sqrt(n)
    margin_w = float(pc["window_delta_rel"]) * np.abs(Rw.mean(axis=0))
    inside = (np.abs(dw) + hw) < margin_w
    windows = [{"window": w, "steps": spans[w], "ref_mean": float(Rw[:, w].mean()), "mean_diff": float(dw[w]),
                "ci": [float(dw[w] - hw[w]), float(dw[w] + hw[w])], "margin": float(margin_w[w]),
                "inside": bool(inside[w])} for w in range(W)]
    return {
        "passed": bool(late_ok and inside.all()), "n_seeds": n, "alpha": alpha, "t": t,
        "ci_level": 1.0 - 2.0 * alpha, "late_diff_per_seed": D.tolist(), "late_diff_mean": mean,
        "late_diff_sd": sd, "ci": [mean - half, mean + half], "ci_half_width": half, "delta": delta,
        "delta_rel": float(pc["delta_rel"]), "ref_late_mean": ref_late, "late_inside": bool(late_ok),
        "windows": windows, "n_windows_outside": int((~inside).sum()),
        "power": {"detects_nats": delta, "detects_rel": float(pc["delta_rel"]),
                  "passes_within_nats": max(0.0, delta - half),
                  "note": f"a true late shift of delta ({delta:.4g} nats, {float(pc['delta_rel']):.2%}) or more "
                          f"fails with probability >= {1 - alpha:.0%} whatever the noise; this candidate's noise "
                          f"(sd {sd:.3g} nats over {n} seeds) lets it pass only within +-{max(0.0, delta - half):.3g}"},
    }


def _unpaired(Rw: np.ndarray, Uw: np.ndarray, late: slice, cfg: dict, spans: list) -> dict:
    """The unpaired check on window means ``Rw [n, W]`` and ``Uw [m, W]``: every run's window means inside the
    reference seeds' prediction band, and no late difference (pooled two-sample t test).

    Band: ``hw_w = max(k s_w, band_floor_rel |m_w|, band_floor_abs)``, ``k = t_{n-1}(1 - band_alpha / (2 W m))
    sqrt(1 + 1/n)`` (a prediction interval for one new run, Bonferroni over W windows and m runs). Late: D =
    mean(L_cand) - mean(L_ref); limit = ``t_{n+m-2}(1 - drift_alpha/2) s_pooled sqrt(1/n + 1/m)``, floored, capped
    at ``drift_max_band_fraction`` x the mean late half-width. With m = 1 this is the prediction interval of one
    run's late mean (Student 1908; the pooled two-sample t test, e.g. Hahn & Meeker 1991, ch. 4).
    """
    n, W = Rw.shape
    m = Uw.shape[0]
    floor_rel, floor_abs = float(cfg["band_floor_rel"]), float(cfg["band_floor_abs"])
    mw, sw = Rw.mean(axis=0), Rw.std(axis=0, ddof=1)
    t_band = t_quantile(1.0 - float(cfg["band_alpha"]) / (2.0 * W * m), n - 1)
    k = t_band * math.sqrt(1.0 + 1.0 / n)
    hw = np.maximum(np.maximum(k * sw, floor_rel * np.abs(mw)), floor_abs)
    z = (Uw - mw) / hw  # [m, W]
    inside_runs = np.abs(z) <= 1.0
    inside = inside_runs.all(axis=0)
    late_ref, late_cand = Rw[:, late].mean(axis=1), Uw[:, late].mean(axis=1)
    drift = float(late_cand.mean() - late_ref.mean())
    df = n + m - 2
    s_p = math.sqrt(((n - 1) * late_ref.var(ddof=1) + ((m - 1) * late_cand.var(ddof=1) if m > 1 else 0.0)) / df)
    t_drift = t_quantile(1.0 - float(cfg["drift_alpha"]) / 2.0, df)
    mean_late_hw = float(np.mean(hw[late]))
    limit_stat = max(t_drift * s_p * math.sqrt(1.0 / n + 1.0 / m), floor_rel * abs(float(late_ref.mean())),
                     floor_abs)
    limit = min(limit_stat, float(cfg["drift_max_band_fraction"]) * mean_late_hw)
    two_sided = bool(cfg["drift_two_sided"])
    drift_ok = (abs(drift) <= limit) if two_sided else (drift <= limit)
    cw = Uw.mean(axis=0)
    zc = np.abs(z).max(axis=0) * np.sign((cw - mw))
    windows = [{"window": w, "steps": spans[w], "ref_mean": float(mw[w]), "ref_std": float(sw[w]),
                "half_width": float(hw[w]), "lo": float(mw[w] - hw[w]), "hi": float(mw[w] + hw[w]),
                "cand": float(cw[w]), "z": float(zc[w]), "inside": bool(inside[w])} for w in range(W)]
    n_late = late.stop - late.start
    return {
        "passed": bool(inside.all() and drift_ok), "n_runs": m, "k": k, "t_band": t_band,
        "per_window_alpha": float(cfg["band_alpha"]) / (W * m), "windows": windows,
        "n_outside": int((~inside).sum()), "max_abs_z": float(np.abs(z).max()), "hw": hw, "mw": mw, "cw": cw,
        "drift": {"late_windows": n_late, "late_steps": [spans[W - n_late][0], spans[-1][1]],
                  "mean_diff": drift, "limit": limit, "limit_statistical": limit_stat,
                  "ref_late_means": late_ref.tolist(), "cand_late_means": late_cand.tolist(),
                  "band_fraction": limit / mean_late_hw, "two_sided": two_sided, "passed": drift_ok,
                  "in_band_units": drift / mean_late_hw, "df": df,
                  "detects_nats": limit + t_quantile(0.95, df) * s_p * math.sqrt(1.0 / n + 1.0 / m),
                  "note": f"an observed late difference beyond {limit:.4g} nats fails; a true shift of "
                          f"{limit + t_quantile(0.95, df) * s_p * math.sqrt(1.0 / n + 1.0 / m):.4g} nats fails "
                          f"with probability ~95% ({n} reference seeds, {m} candidate run(s))"},
    }


def loss_curve(ref_dirs: Sequence[str | Path], cand: "str | Path | CurveRuns", cfg: Mapping | None = None
               ) -> Verdict:
    """Loss-curve tier: paired equivalence within +-delta, and the unpaired runs inside the reference band.

    Inputs: ``ref_dirs``, trace directories of the reference with different ``train.seed`` (>= ``min_seeds``);
    ``cand``, a :class:`CurveRuns` (paired and/or unpaired candidate traces) or one trace directory (one unpaired
    run); ``cfg`` overrides ``conf/tier/loss_curve.yaml``. Losses are per-step mean token cross-entropies in nats;
    curves are compared as means over windows of ``window_steps`` steps, the last ``late_fraction`` of them
    being the late windows.

    Rules (formulas and sources in the yaml): paired, :func:`_paired` (a two-one-sided-tests equivalence test of
    the mean late paired difference against +-delta, plus each window's interval against its own margin);
    unpaired, :func:`_unpaired` (each run inside the reference seeds' prediction band; the late means by a pooled
    two-sample t test). The verdict passes when every part that was given passes.

    Steps compared: those present in every reference run. Decision on bad input: the verdict FAILS with a clear
    reason (no exception) for fewer than ``min_seeds`` references, identical reference curves, a non-finite
    reference loss, fewer than ``min_windows`` windows, paired runs not one per reference seed, or candidate steps
    missing / non-finite -- so a ladder always gets a verdict.

    Evidence: ``mode``; ``paired`` (per-seed late differences, the CI against +-delta, per-window intervals, the
    power statement); the unpaired band per window (mean, std, half-width, lo, hi, the candidates' mean, z),
    ``drift`` (the two-sample late test) and, for information, the fixed rule "mean |cand - ref_mean| / ref_mean
    <= 2.5%". ``first_divergence``: the first window out of its band or margin, else the late windows.

    Raises FileNotFoundError when a directory has no ``trace.jsonl``; TypeError when ``ref_dirs`` is a single
    path rather than a list, or ``cand`` gives no run at all.
    """
    cfg = tier_settings("loss_curve", cfg)
    if isinstance(ref_dirs, (str, Path)):
        raise TypeError("loss_curve needs a list of reference trace directories (one per seed), not one path")
    runs = cand if isinstance(cand, CurveRuns) else CurveRuns(unpaired=(cand,))
    if not runs.paired and not runs.unpaired:
        raise TypeError("loss_curve needs at least one candidate run (paired or unpaired)")
    ref_dirs = list(ref_dirs)
    evidence: dict[str, Any] = {"n_seeds": len(ref_dirs), "ref_dirs": [str(d) for d in ref_dirs], "config": cfg,
                                "mode": runs.mode, "paired_dirs": [str(d) for d in runs.paired],
                                "unpaired_dirs": [str(d) for d in runs.unpaired]}
    try:
        R, P, U, steps = _load(ref_dirs, runs, cfg, evidence)
        win = int(cfg["window_steps"])
        edges = list(range(0, len(steps), win))
        W = len(edges)
        if W < int(cfg["min_windows"]):
            raise _Bad(f"{len(steps)} steps make {W} window(s) of {win}; the tier needs >= {cfg['min_windows']}")
    except _Bad as b:
        evidence["reason"] = b.reason
        return Verdict("loss_curve", False, b.reason, evidence, b.first)
    spans = [[steps[e], steps[min(e + win, len(steps)) - 1]] for e in edges]
    n_late = max(1, math.ceil(float(cfg["late_fraction"]) * W))
    late = slice(W - n_late, W)
    Rw = _windows(R, edges, win)
    evidence.update({"steps_compared": len(steps), "window_steps": win, "n_windows": W})
    parts, first = [], None
    if P is not None:
        pe = _paired(Rw, _windows(P, edges, win), late, cfg, spans)
        evidence["paired"] = pe
        parts.append(("paired", pe["passed"], _paired_summary(pe)))
        first = first or _paired_first(pe, spans, late)
    if U is not None:
        ue = _unpaired(Rw, _windows(U, edges, win), late, cfg, spans)
        summary_u, first_u = _unpaired_summary(ue, R, U, cfg, evidence)
        parts.append(("unpaired", ue["passed"], summary_u))
        first = first or first_u
    passed = all(ok for _, ok, _ in parts)
    summary = " | ".join(f"{name}: {'pass' if ok else 'FAIL'}, {text}" for name, ok, text in parts)
    return Verdict("loss_curve", passed, summary, evidence, None if passed else first)


def _paired_summary(pe: dict) -> str:
    lo, hi = pe["ci"]
    rel = pe["late_diff_mean"] / abs(pe["ref_late_mean"])
    where = "inside" if pe["late_inside"] else "NOT inside"
    s = (f"late diff {pe['late_diff_mean']:+.4f} nats ({rel:+.2%}), {pe['ci_level']:.0%} CI [{lo:+.4f}, "
         f"{hi:+.4f}] {where} +-{pe['delta']:.4f} ({pe['delta_rel']:.1%}), n={pe['n_seeds']} seeds")
    if pe["n_windows_outside"]:
        w = next(x for x in pe["windows"] if not x["inside"])
        s += (f"; {pe['n_windows_outside']}/{len(pe['windows'])} windows outside their margin (first: steps "
              f"{w['steps'][0]}-{w['steps'][1]}, diff {w['mean_diff']:+.4f}, margin +-{w['margin']:.4f})")
    return s


def _paired_first(pe: dict, spans: list, late: slice) -> dict | None:
    out = next((w for w in pe["windows"] if not w["inside"]), None)
    if out is not None:
        return {"step": out["steps"][0], "kind": "loss", "window": out["window"], "steps": out["steps"],
                "ref": out["ref_mean"], "cand": out["ref_mean"] + out["mean_diff"], "paired_diff": out["mean_diff"],
                "margin": out["margin"]}
    if not pe["late_inside"]:
        s0 = spans[late.start][0]
        return {"step": s0, "kind": "loss", "window": "late", "steps": [s0, spans[-1][1]],
                "ref": pe["ref_late_mean"], "cand": pe["ref_late_mean"] + pe["late_diff_mean"],
                "paired_diff": pe["late_diff_mean"], "ci": pe["ci"], "delta": pe["delta"]}
    return None


def _unpaired_summary(ue: dict, R: np.ndarray, U: np.ndarray, cfg: dict, evidence: dict):
    """The unpaired part's summary and first divergence; moves its band evidence to the top level (the plot and
    the report read ``windows`` there) and adds the fixed rule and the band-width warning."""
    hw, mw, cw = ue.pop("hw"), ue.pop("mw"), ue.pop("cw")
    windows, W, m = ue["windows"], len(ue["windows"]), ue["n_runs"]
    rel_hw = hw / np.abs(mw)
    drift = ue["drift"]
    evidence.update({"windows": windows, "n_outside": ue["n_outside"], "max_abs_z": ue["max_abs_z"],
                     "k": ue["k"], "t_band": ue["t_band"], "per_window_alpha": ue["per_window_alpha"],
                     "drift": drift, "unpaired": {"passed": ue["passed"], "n_runs": m},
                     "band_half_width_rel": {"min": float(rel_hw.min()), "max": float(rel_hw.max()),
                                             "median": float(np.median(rel_hw))}})
    m_t = R.mean(axis=0)
    mrd = float(np.mean(np.abs(U.mean(axis=0) - m_t) / np.abs(m_t)))
    seed_mrd = [float(np.mean(np.abs(R[i] - m_t) / np.abs(m_t))) for i in range(R.shape[0])]
    fixed = float(cfg["fixed_rule_rel"])
    evidence["fixed_rule"] = {
        "rule": f"mean |cand - ref_mean| / ref_mean <= {fixed:.1%}", "mean_rel_diff": mrd, "passes": mrd <= fixed,
        "ref_seeds_mean_rel_diff": seed_mrd,
        "note": f"the fixed {fixed:.1%} rule would {'PASS' if mrd <= fixed else 'FAIL'} (candidate mean rel diff "
                f"{mrd:.3%}; the reference seeds themselves sit at {min(seed_mrd):.3%}-{max(seed_mrd):.3%}), while "
                f"the calibrated band (half-width {rel_hw.min():.3%}-{rel_hw.max():.3%} of the loss) "
                f"{'passes' if ue['passed'] else 'fails'} the candidate"
                + ("; the two disagree" if (mrd <= fixed) != ue["passed"] else "")}
    runs = f"{m} run{'s' if m > 1 else ''}"
    first = None
    if ue["n_outside"]:
        w = next(x for x in windows if not x["inside"])
        first = {"step": w["steps"][0], "kind": "loss", "window": w["window"], "steps": w["steps"],
                 "ref": {"mean": w["ref_mean"], "lo": w["lo"], "hi": w["hi"]}, "cand": w["cand"], "z": w["z"]}
        s = (f"{ue['n_outside']}/{W} windows out of band ({runs}); first: steps {w['steps'][0]}-{w['steps'][1]}, "
             f"cand {fmt_num(w['cand'])} vs band [{fmt_num(w['lo'])}, {fmt_num(w['hi'])}]")
        if not drift["passed"]:
            s += f"; late diff {drift['mean_diff']:+.4g} (limit {drift['limit']:.4g})"
    elif not drift["passed"]:
        s0 = drift["late_steps"][0]
        first = {"step": s0, "kind": "loss", "window": "late", "steps": drift["late_steps"],
                 "ref": float(np.mean(mw[-drift["late_windows"]:])), "cand": float(np.mean(cw[-drift["late_windows"]:])),
                 "drift": drift["mean_diff"], "limit": drift["limit"]}
        s = (f"in band ({runs}), but late diff {drift['mean_diff']:+.4g} nats over steps {s0}-"
             f"{drift['late_steps'][1]} exceeds {'+-' if drift['two_sided'] else '+'}{drift['limit']:.4g} "
             f"({drift['band_fraction']:.2f} x band)")
    else:
        s = (f"{W} windows in band ({runs}, max |z| {ue['max_abs_z']:.2f}, n={R.shape[0]} seeds, k={ue['k']:.2f}); "
             f"late diff {drift['mean_diff']:+.3g} within {drift['limit']:.3g}")
    med_rel = float(np.median(rel_hw))
    warn_at = float(cfg.get("warn_band_rel", 0.10))
    s += f"; band half-width median {med_rel:.1%} of the loss"
    if med_rel > warn_at:
        evidence["band_warning"] = (f"the band's median half-width is {med_rel:.1%} of the loss (> {warn_at:.0%}): "
                                    f"too wide to mean much with {R.shape[0]} seeds; add seeds (verify.seeds) to "
                                    f"narrow it")
        s += f" -- WARNING: too wide to mean much with {R.shape[0]} seeds, add seeds"
    return s, first
