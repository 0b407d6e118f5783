"""The surpass tier: an equivalence verdict passed, and the candidate's throughput beats the reference's and the
strongest peer's (``peers`` of ``conf/tier/surpass.yaml``) by more than the measured noise (docs/design.md, "The
tiers"; the rule and its sources: ``conf/tier/surpass.yaml``).
Not an equivalence level itself: :mod:`forgetrain.equivalence.registry` lists it as a ``speed`` tier.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence

import numpy as np

from forgetrain.equivalence.registry import EQUIVALENCE_TIERS
from forgetrain.equivalence.verdict import Verdict, tier_settings


def peers_for(cfg: Mapping | None, fp8: bool) -> list[str]:
    """The peers a candidate must also beat (``peers`` of ``conf/tier/surpass.yaml``, overridden by ``cfg``): the
    ``fp8`` list for a candidate that runs GEMMs in FP8, else the ``default`` one. Raises ConfigError for a
    ``peers`` entry that is not a mapping of lists of reference names."""
    from forgetrain.errors import ConfigError

    peers = tier_settings("surpass", cfg).get("peers") or {}
    if not isinstance(peers, Mapping) or not all(isinstance(v, (list, tuple)) and all(isinstance(n, str) for n in v)
                                                 for v in peers.values()):
        raise ConfigError("conf/tier/surpass.yaml peers: a mapping {default: [names], fp8: [names]}")
    return list(peers.get("fp8" if fp8 else "default") or [])


def _timings(x: Sequence[float], what: str, discard: int) -> np.ndarray:
    a = np.asarray(list(x), dtype=np.float64)[discard:]
    if a.ndim != 1 or not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{what}: step times must be a flat list of finite positive seconds")
    return a


def speed_stats(timings_ref: Sequence[float], timings_cand: Sequence[float], cfg: Mapping | None = None) -> dict:
    """Is the candidate faster than the reference by more than the measured noise? The surpass tier's statistics
    (the rule and its sources: ``conf/tier/surpass.yaml``), also used by the kernel forge's speed gate.

    ``timings_ref`` / ``timings_cand``: seconds (or any one unit) per repetition of the same work, measured side by
    side; ``cfg`` overrides ``conf/tier/surpass.yaml``. Returns the evidence dict: ``n_ref``, ``n_cand``,
    ``config``, and either ``reason`` (fewer than ``min_samples`` timings on a side: no claim) or the medians,
    ``speedup`` = median(ref) / median(cand), ``noise`` (max of the bootstrap and asymptotic estimates),
    ``required_speedup`` = 1 + min_speedup_margin + noise, ``faster_beyond_noise`` (speedup > required), the
    bootstrap interval and relative IQRs. Raises ValueError for non-finite or non-positive timings.
    """
    cfg = tier_settings("surpass", cfg)
    discard = int(cfg["discard_first"])
    a = _timings(timings_ref, "timings_ref", discard)
    b = _timings(timings_cand, "timings_cand", discard)
    evidence: dict[str, Any] = {"n_ref": int(a.size), "n_cand": int(b.size), "config": cfg}
    if min(a.size, b.size) < int(cfg["min_samples"]):
        evidence["reason"] = f"too few timings (ref {a.size}, cand {b.size}); need >= {cfg['min_samples']} per side"
        return evidence
    med_a, med_b = float(np.median(a)), float(np.median(b))
    speedup = med_a / med_b
    conf = float(cfg["confidence"])
    rng = np.random.default_rng(int(cfg["bootstrap_seed"]))
    B = int(cfg["bootstrap_resamples"])
    boot_a = np.median(a[rng.integers(0, a.size, size=(B, a.size))], axis=1)
    boot_b = np.median(b[rng.integers(0, b.size, size=(B, b.size))], axis=1)
    boot = boot_a / boot_b
    lo, hi = (float(q) for q in np.quantile(boot, [(1 - conf) / 2, (1 + conf) / 2]))
    noise_boot = max(0.0, speedup - lo)

    def rel_se(x: np.ndarray, med: float) -> tuple[float, float]:
        iqr = float(np.subtract(*np.percentile(x, [75, 25])))
        return iqr / med, math.sqrt(math.pi / 2) * (iqr / 1.349) / (med * math.sqrt(x.size))

    riqr_a, se_a = rel_se(a, med_a)
    riqr_b, se_b = rel_se(b, med_b)
    z = statistics.NormalDist().inv_cdf((1 + conf) / 2)
    noise_asym = speedup * z * math.sqrt(se_a ** 2 + se_b ** 2)
    noise = max(noise_boot, noise_asym)
    needed = 1.0 + float(cfg["min_speedup_margin"]) + noise
    evidence.update({
        "median_ref_step_s": med_a, "median_cand_step_s": med_b, "speedup": speedup,
        "noise": noise, "noise_bootstrap": noise_boot, "noise_asymptotic": noise_asym,
        "bootstrap_ci": [lo, hi], "confidence": conf, "required_speedup": needed,
        "rel_iqr_ref": riqr_a, "rel_iqr_cand": riqr_b, "faster_beyond_noise": bool(speedup > needed),
    })
    if a.size == b.size:
        evidence["paired_median_ratio"] = float(np.median(a / b))
    return evidence


def surpass(loss_curve_verdict: Verdict, timings_ref: Sequence[float], timings_cand: Sequence[float],
            cfg: Mapping | None = None, timings_peers: Mapping[str, Sequence[float]] | None = None) -> Verdict:
    """Surpass tier: equivalence holds and the candidate is faster by more than the measured noise.

    Inputs: ``loss_curve_verdict``, the equivalence verdict the speed claim rests on (normally
    ``loss_curve``'s; a verdict of any other equivalence tier, e.g. ``bitwise`` or ``tolerance``, over the same run
    is accepted and recorded);
    ``timings_ref`` / ``timings_cand``, per-step wall seconds of the same work per step, measured side by side,
    interleaved A/B, warm; ``cfg`` overrides ``conf/tier/surpass.yaml``; ``timings_peers``, peer name -> its
    per-step seconds of the same work, timed beside the candidate (the caller times :func:`peers_for`'s list).
    Where the yaml declares peers, at least one of them must be timed (else the verdict fails, naming them), and
    the candidate must beat every timed peer by the same rule as the reference.

    Rule (sources in the yaml): speedup ``S = median(ref) / median(cand)`` (a throughput ratio); ``noise =
    max(S - q_lo(S*), S z se)`` where ``S*`` are seeded percentile-bootstrap resamples of the speedup and
    ``se = sqrt(se_ref^2 + se_cand^2)``, ``se = 1.2533 (IQR / 1.349) / (median sqrt(n))`` (large-sample
    standard error of a median, relative); pass iff the equivalence verdict passed and ``S > 1 +
    min_speedup_margin + noise``. Fails (verdict) with fewer than ``min_samples`` timings on either side.

    Evidence: medians (s), speedup, noise (both estimates), the bootstrap interval, relative IQRs, n per side,
    and the paired median ratio when both lists have equal length (information only); under ``peers``, the same
    statistics per peer (its ``speedup`` = median(peer) / median(cand)).

    Raises ValueError when the verdict is not an equivalence verdict (its tier is not in
    :data:`forgetrain.equivalence.registry.EQUIVALENCE_TIERS`), or timings are not finite positive numbers.
    """
    cfg = tier_settings("surpass", cfg)
    if not isinstance(loss_curve_verdict, Verdict) or loss_curve_verdict.tier not in EQUIVALENCE_TIERS:
        raise ValueError(f"surpass needs an equivalence Verdict (one of {', '.join(reversed(EQUIVALENCE_TIERS))})")
    evidence: dict[str, Any] = {"equivalence_tier": loss_curve_verdict.tier,
                                "equivalence_passed": loss_curve_verdict.passed,
                                "equivalence_mode": loss_curve_verdict.evidence.get("mode", "unpaired")}
    evidence.update(speed_stats(timings_ref, timings_cand, cfg))
    if "reason" in evidence:
        return Verdict("surpass", False, evidence["reason"], evidence, None)
    speedup, needed, fast = evidence["speedup"], evidence["required_speedup"], evidence["faster_beyond_noise"]
    noise, a_n, b_n = evidence["noise"], evidence["n_ref"], evidence["n_cand"]
    declared = sorted({n for v in (cfg.get("peers") or {}).values() for n in (v or [])})
    peers = {name: speed_stats(t, timings_cand, cfg) for name, t in sorted((timings_peers or {}).items())}
    evidence["peers"] = peers
    no_peer = (f"no peer timed: the candidate must also beat {' or '.join(declared)} (conf/tier/surpass.yaml "
               f"peers)") if declared and not set(peers) & set(declared) else None
    no_peer = no_peer or next((f"{n}: {st['reason']}" for n, st in peers.items() if "reason" in st), None)
    slow = ([] if fast else ["the reference"]) + [n for n, st in peers.items() if not st.get("faster_beyond_noise")]
    fast = fast and no_peer is None and not slow
    from forgetrain.equivalence import registry

    unpaired_only = (bool(cfg.get("require_paired", True)) and loss_curve_verdict.tier in registry.names(
        registry.CURVE) and "paired" not in evidence["equivalence_mode"].split("+"))
    passed = bool(loss_curve_verdict.passed and fast and not unpaired_only)
    speed = f"speedup {speedup:.3f}x (needs > {needed:.3f}x: noise {noise:.3f}, n={a_n}/{b_n})" + "".join(
        f"; vs {n} {st['speedup']:.3f}x (needs > {st['required_speedup']:.3f}x)" for n, st in peers.items()
        if "reason" not in st)
    if unpaired_only:
        summary = (f"the speed claim rests on the paired {loss_curve_verdict.tier} test, and this verdict was "
                   f"judged unpaired only (require_paired); {speed}")
    elif not loss_curve_verdict.passed:
        summary = f"{loss_curve_verdict.tier} tier failed, so no speed claim counts; {speed}"
    elif no_peer:
        summary = f"{no_peer}; {speed}"
    elif not fast:
        summary = f"not faster beyond noise than {' and '.join(slow)}: {speed}"
    else:
        summary = f"{loss_curve_verdict.tier} holds and {speed}"
    return Verdict("surpass", passed, summary, evidence, None)
