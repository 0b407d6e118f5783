"""The tolerance tier: per-step relative errors and final-parameter relative L2 errors within per-dtype
thresholds (docs/design.md, "The tiers"; the thresholds and their derivation: ``conf/tier/tolerance.yaml``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from forgetrain.equivalence.verdict import (Verdict, by_step, is_finite, fmt_num, param_order, tier_settings,
                                            trace_length, describe_divergence)
from forgetrain.errors import ConfigError
from forgetrain.trace import read_final_params, read_trace

def _rel_err(r: Any, c: Any, floor: float) -> float:
    """|c - r| / max(|r|, floor); inf when either value is missing or non-finite (so it always fails)."""
    if not (is_finite(r) and is_finite(c)):
        return math.inf
    return abs(c - r) / max(abs(r), floor)


_THRESHOLD_KEY = {"loss": "loss_rtol", "grad_norm": "grad_norm_rtol", "lr": "lr_rtol", "param": "param_rel_l2"}


def _oracle_note(rescued: list[dict], total: dict | None, th: Mapping) -> str:
    """The summary's note when the fp32 oracle decided a pass: per kind, how many values exceeded their direct
    threshold and were judged against the oracle instead, with the worst direct error, e.g. ``grad_norm judged
    against the fp32 oracle at 3 step(s) (direct rel 1.2e-2 > 5e-3)``. Empty when the oracle rescued nothing."""
    parts = []
    for kind in ("loss", "grad_norm", "lr", "param"):
        rows = [r for r in rescued if r["kind"] == kind]
        if rows:
            worst = max(r.get("rel_err_vs_ref", r.get("rel_l2_vs_ref", 0.0)) for r in rows)
            where = f"{len(rows)} tensor(s)" if kind == "param" else f"{len(rows)} step(s)"
            name = "final params" if kind == "param" else kind
            what = "rel L2" if kind == "param" else "rel"
            parts.append(f"{name} judged against the fp32 oracle at {where} (direct {what} {fmt_num(worst)} > "
                         f"{fmt_num(float(th[_THRESHOLD_KEY[kind]]))})")
    if total and total.get("rescued"):
        r = total["rescued"]
        parts.append(f"final params total judged against the fp32 oracle (direct rel L2 {fmt_num(r['total_rel_l2'])} "
                     f"> {fmt_num(r['threshold_total'])})")
    return "; ".join(parts)


def _step_checks(ref: dict, cand: dict, steps: list[int], th: Mapping, floor: float, cfg: Mapping,
                 oracle_dir, evidence: dict) -> tuple[list[dict], dict]:
    """:func:`tolerance`'s per-step checks of loss, grad_norm and lr (and equal tokens): the divergences (each a
    dict with step, kind, ref, cand, rel_err, threshold) and the per-metric evidence. With ``oracle_dir``, an
    exceedance that the fp32 oracle rescues is recorded in ``evidence["oracle"]["rescued"]`` instead."""
    divergences: list[dict] = []
    metrics = (("loss", "loss_rtol"), ("grad_norm", "grad_norm_rtol"), ("lr", "lr_rtol"))
    metric_ev = {}
    per_step = {m: [] for m, _ in metrics}
    oracle = None
    slack = float(cfg.get("oracle_slack", 2.0))
    if oracle_dir is not None:
        oracle, _ = by_step(read_trace(oracle_dir)[1])
        evidence["oracle"] = {"dir": str(oracle_dir), "slack": slack, "rescued": []}
    ref_err_max = {m: 0.0 for m, _ in metrics}
    for s in steps:
        r, c = ref[s], cand.get(s, {})
        if "tokens" in r and "tokens" in c and r["tokens"] != c["tokens"]:
            divergences.append({"step": s, "kind": "tokens", "ref": r["tokens"], "cand": c["tokens"]})
        for m, key in metrics:
            e = _rel_err(r.get(m), c.get(m), floor)
            per_step[m].append(e)
            if oracle is not None and s in oracle:
                o = oracle[s].get(m)
                ref_err_max[m] = max(ref_err_max[m], _rel_err(o, r.get(m), floor))
                if not e <= float(th[key]):
                    e_co = _rel_err(o, c.get(m), floor)
                    if e_co <= max(slack * ref_err_max[m], float(th[key])):
                        evidence["oracle"]["rescued"].append({"step": s, "kind": m, "rel_err_vs_ref": e,
                                                              "cand_err_vs_oracle": e_co,
                                                              "ref_err_vs_oracle_max": ref_err_max[m]})
                        continue
            if not e <= float(th[key]):
                divergences.append({"step": s, "kind": m, "ref": r.get(m), "cand": c.get(m), "rel_err": e,
                                    "threshold": float(th[key])})
    for m, key in metrics:
        errs = per_step[m]
        if errs:
            i = int(np.argmax(errs))
            metric_ev[m] = {"max_rel": errs[i], "mean_rel": float(np.mean(errs)), "worst_step": steps[i],
                            "n_exceeding": sum(not e <= float(th[key]) for e in errs),
                            "threshold": float(th[key])}
    return divergences, metric_ev


def _final_params_check(ref_dir, cand_dir, oracle_dir, cfg: Mapping, th: Mapping, n_total: int, evidence: dict,
                        divergences: list, problems: list) -> dict:
    """:func:`tolerance`'s final-parameter check (fp64 arithmetic): per-tensor and total relative L2 against the
    thresholds, with the fp32 oracle's rescue where given. Appends to ``divergences`` and ``problems``; returns the
    evidence of ``evidence["final_params"]``."""
    floor, slack = float(cfg["denominator_floor"]), float(cfg.get("oracle_slack", 2.0))
    max_steps = cfg.get("max_steps")
    final_ev: dict[str, Any] = {"compared": False}
    if max_steps is not None and n_total > int(max_steps):
        final_ev["reason"] = (f"skipped: the run has {n_total} steps > max_steps={max_steps}, and final params "
                              "reflect every step")
    else:
        rp, cp = read_final_params(ref_dir), read_final_params(cand_dir)
        if rp is None or cp is None:
            final_ev["reason"] = ("neither trace has final.safetensors" if rp is None and cp is None else
                                  f"the {'candidate' if cp is None else 'reference'} has no final.safetensors")
            if cfg["require_final_params"]:
                problems.append(f"final params required (require_final_params) but {final_ev['reason']}")
        else:
            t_th, tot_th = float(th["param_rel_l2"]), float(th["param_rel_l2_total"])
            op = read_final_params(oracle_dir) if oracle_dir is not None else None

            def _rel_l2(x, y):
                x64, y64 = x.double(), y.double()
                return float((y64 - x64).norm()) / max(float(x64.norm()), floor)

            per_tensor, diff2, ref2 = {}, 0.0, 0.0
            for name in param_order(set(rp) | set(cp)):
                a, b = rp.get(name), cp.get(name)
                if a is None or b is None or a.shape != b.shape:
                    e = math.inf
                    per_tensor[name] = e
                    divergences.append({"step": n_total, "kind": "param", "tensor": name, "final": True,
                                        "ref": None if a is None else list(a.shape),
                                        "cand": None if b is None else list(b.shape), "rel_err": e,
                                        "threshold": t_th, "note": "missing tensor or shape mismatch"})
                    continue
                a64, b64 = a.double(), b.double()
                d2, r2 = float((b64 - a64).pow(2).sum()), float(a64.pow(2).sum())
                diff2, ref2 = diff2 + d2, ref2 + r2
                e = math.sqrt(d2) / max(math.sqrt(r2), floor) if math.isfinite(d2) else math.inf
                per_tensor[name] = e
                if not e <= t_th and op is not None and name in op:
                    e_co, e_ro = _rel_l2(op[name], b), _rel_l2(op[name], a)
                    if e_co <= max(slack * e_ro, t_th):
                        evidence["oracle"]["rescued"].append({"tensor": name, "kind": "param",
                                                              "rel_l2_vs_ref": e, "cand_rel_l2_vs_oracle": e_co,
                                                              "ref_rel_l2_vs_oracle": e_ro})
                        continue
                if not e <= t_th:
                    divergences.append({"step": n_total, "kind": "param", "tensor": name, "final": True,
                                        "ref": {"l2": math.sqrt(r2)}, "cand": {"l2": float(b64.norm())},
                                        "rel_err": e, "threshold": t_th})
            total = math.sqrt(diff2) / max(math.sqrt(ref2), floor) if math.isfinite(diff2) else math.inf
            if any(math.isinf(e) for e in per_tensor.values()):
                total = math.inf
            worst = max(per_tensor, key=lambda k: per_tensor[k]) if per_tensor else None
            final_ev = {"compared": True, "n_tensors": len(per_tensor), "total_rel_l2": total,
                        "max_tensor_rel_l2": per_tensor[worst] if worst else None, "worst_tensor": worst,
                        "mean_tensor_rel_l2": float(np.mean(list(per_tensor.values()))) if per_tensor else None,
                        "n_exceeding": sum(not e <= t_th for e in per_tensor.values()),
                        "threshold_tensor": t_th, "threshold_total": tot_th, "per_tensor": per_tensor}
            if not total <= tot_th and op is not None:
                keys = [k for k in rp if k in op and k in cp]
                tot_co = math.sqrt(sum(float((cp[k].double() - op[k].double()).pow(2).sum()) for k in keys)) / \
                    max(math.sqrt(sum(float(op[k].double().pow(2).sum()) for k in keys)), floor)
                tot_ro = math.sqrt(sum(float((rp[k].double() - op[k].double()).pow(2).sum()) for k in keys)) / \
                    max(math.sqrt(sum(float(op[k].double().pow(2).sum()) for k in keys)), floor)
                final_ev["oracle_total"] = {"cand_vs_oracle": tot_co, "ref_vs_oracle": tot_ro}
                if tot_co <= max(slack * tot_ro, tot_th):
                    final_ev["oracle_total"]["rescued"] = {"total_rel_l2": total, "threshold_total": tot_th}
                    total = min(total, tot_th)
            if not total <= tot_th:
                problems.append(f"final params: total rel L2 {fmt_num(total)} > {tot_th:g}")
    return final_ev


def _summary(precision: str, n_steps: int, metric_ev: dict, final_ev: dict, evidence: dict, th: Mapping,
             divergences: list, problems: list) -> str:
    """The one-line summary of a tolerance verdict: the worst errors when it passed, else its first exceedance."""
    first = divergences[0] if divergences else None
    if not divergences and not problems:
        worst_parts = [f"{m} max rel {fmt_num(v['max_rel'])} (step {v['worst_step']})" for m, v in metric_ev.items()
                       if m != "lr"]
        if final_ev.get("compared"):
            worst_parts.append(f"final params rel L2 {fmt_num(final_ev['total_rel_l2'])}")
        summary = f"{precision}: {n_steps} steps within tolerance; " + "; ".join(worst_parts)
        note = _oracle_note(evidence.get("oracle", {}).get("rescued", []), final_ev.get("oracle_total"), th)
        if note:
            summary += f"; {note}"
    elif first is not None:
        rel = (f" rel {fmt_num(first['rel_err'])} > {fmt_num(first['threshold'])}" if "rel_err" in first
               else " (must be equal)")
        summary = f"{precision}: first exceedance {describe_divergence(first)}{rel}; {len(divergences)} exceedance(s)"
        if problems:
            summary += f"; also: {problems[0]}"
    else:
        summary = f"{precision}: {problems[0]}"
    return summary


def tolerance(ref_dir: str | Path, cand_dir: str | Path, cfg: Mapping | None = None,
              oracle_dir: str | Path | None = None) -> Verdict:
    """Tolerance tier: per-step relative errors and final-parameter relative L2 errors within per-dtype thresholds.

    Oracle mode (``oracle_dir``: an fp32 run of the reference from the same weights and batches; used for
    reduced precision). A value that exceeds its direct threshold still passes when the candidate is no further
    from the fp32 oracle than ``oracle_slack`` x the reference's own demonstrated error against it (the running
    max up to that step; for final params, the reference's per-tensor rel L2 vs the oracle). This is the kernel
    forge's criterion -- not worse than the replaced implementation's own error -- applied to whole engines: a
    bf16 candidate that is *more* accurate than the bf16 reference must not fail because the reference drifted.

    Inputs: two trace directories of the same precision (``meta.json`` ``"precision"``: ``fp32`` | ``bf16``, or
    ``cfg.precision``); ``cfg`` overrides ``conf/tier/tolerance.yaml``, which holds the thresholds and the
    derivation of every number (unit roundoff 2^-24 / 2^-8 times a growth factor).

    Per step s (steps 1..max_steps, all by default): ``rel = |cand - ref| / max(|ref|, denominator_floor)`` for
    ``loss`` (nats), ``grad_norm`` and ``lr`` must be <= ``loss_rtol`` / ``grad_norm_rtol`` / ``lr_rtol``;
    ``tokens`` must be equal. A missing or non-finite value has rel = inf. Final params (fp64 arithmetic): per
    tensor ``||c - r|| / ||r||`` <= ``param_rel_l2`` and over all tensors ``sqrt(sum ||c - r||^2) /
    sqrt(sum ||r||^2)`` <= ``param_rel_l2_total``; names and shapes must match.

    Evidence: per metric max/mean rel error, worst step, the number of steps exceeding; per tensor rel L2, the
    worst tensor, the total. ``first_divergence``: the first step exceeding (loss, then grad_norm, then lr),
    else the first tensor (``hf_param_names`` order) exceeding, reported at the last step.

    Fails (verdict, no exception) when precisions differ or are unknown, when the candidate lacks steps, or when
    final params are required and missing. Raises FileNotFoundError without ``trace.jsonl``, ConfigError when
    the yaml has no thresholds for the precision.
    """
    cfg = tier_settings("tolerance", cfg)
    ref_meta, ref_recs = read_trace(ref_dir)
    cand_meta, cand_recs = read_trace(cand_dir)
    problems: list[str] = []
    prec_ref, prec_cand = ref_meta.get("precision"), cand_meta.get("precision")
    precision = cfg.get("precision") or prec_ref
    evidence: dict[str, Any] = {"precision": precision, "precision_meta": {"ref": prec_ref, "cand": prec_cand},
                                "config": cfg}
    if not cfg.get("precision") and prec_ref != prec_cand:
        summary = f"precisions differ (ref {prec_ref}, cand {prec_cand}): not a tolerance comparison"
        return Verdict("tolerance", False, summary, evidence, None)
    if precision is None:
        return Verdict("tolerance", False, "meta.json has no precision and cfg.precision is unset", evidence, None)
    th = (cfg.get("thresholds") or {}).get(precision)
    if th is None:
        raise ConfigError(f"tolerance.yaml has no thresholds for precision {precision!r}")
    evidence["thresholds"] = th
    floor = float(cfg["denominator_floor"])

    ref, _ = by_step(ref_recs)
    cand, _ = by_step(cand_recs)
    steps = sorted(ref)
    max_steps = cfg.get("max_steps")
    if max_steps is not None:
        steps = [s for s in steps if s <= int(max_steps)]
    if not steps:
        problems.append(f"reference trace {ref_dir} has no step records")
    missing = [s for s in steps if s not in cand]
    if missing:
        problems.append(f"candidate lacks {len(missing)} step(s) of the reference (first: step {missing[0]})")
    extra = sorted(s for s in cand if s not in ref and (max_steps is None or s <= int(max_steps)))
    if extra:
        problems.append(f"candidate has {len(extra)} step(s) the reference lacks (first: step {extra[0]})")

    divergences, metric_ev = _step_checks(ref, cand, steps, th, floor, cfg, oracle_dir, evidence)
    evidence["steps_compared"] = len(steps)
    evidence["metrics"] = metric_ev

    n_total = trace_length(ref_recs)
    final_ev = _final_params_check(ref_dir, cand_dir, oracle_dir, cfg, th, n_total, evidence, divergences, problems)
    order = {"tokens": 0, "loss": 1, "grad_norm": 2, "lr": 3, "param": 4}
    divergences.sort(key=lambda d: (d["step"], order[d["kind"]]))  # stable: tensors stay in hf order
    evidence["final_params"] = final_ev
    evidence["problems"] = problems
    evidence["n_divergences"] = len(divergences)
    evidence["divergences"] = divergences[:20]
    first = divergences[0] if divergences else None
    passed = not divergences and not problems
    summary = _summary(precision, len(steps), metric_ev, final_ev, evidence, th, divergences, problems)
    return Verdict("tolerance", passed, summary, evidence, first)
