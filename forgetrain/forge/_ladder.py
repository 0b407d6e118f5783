"""The forge's gates, run in their own process so a crashing or hanging candidate cannot take the loop down.

``python -m forgetrain.forge._ladder --spec gates/ladder_spec.json --workspace WS --out DIR [--result FILE]``

Loads ``WS/engine/engine.py`` (:func:`forgetrain.forge.workspace.load_engine_class`) and runs
:func:`forgetrain.verify.verify` tier by tier, strictest first, from the spec's ``tiers`` (``forge.ladder_from`` ..
``forge.target_tier``), stopping at the first tier that passes. Target ``surpass`` tries the short-run tiers
(bitwise, tolerance) and then runs ``surpass`` (which carries its own loss_curve verdict).

The reference's short runs are cached as goldens under the spec's ``golden_root`` (the forge run's own dir, never
the repository's ``references/goldens``): the first ladder run of a forge run stores them, later ones reuse them.

Writes the result JSON (``ok``, ``error``, ``verdicts``, ``strictest_passed``, ``surpassed``, ``target_met``,
``metrics``, ``versions``, ``device``, ``wall_s``) and prints the verdict table. Exit 0 when the target is met,
1 when not, 3 when the candidate (or the gate) raised.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from forgetrain.equivalence.registry import TIER_ORDER  # the one tier order (a live view of the registry)


def tiers_to_try(ladder_from: str, target: str) -> list[str]:
    """Tiers tried in order (strictest first) for a target. Raises ValueError on unknown/inconsistent names."""
    for name, t in (("forge.ladder_from", ladder_from), ("forge.target_tier", target)):
        if t not in TIER_ORDER:
            raise ValueError(f"{name}={t} is not a tier; known: {', '.join(TIER_ORDER)}")
    lo, hi = TIER_ORDER.index(ladder_from), TIER_ORDER.index(target)
    if lo > hi:
        raise ValueError(f"forge.ladder_from={ladder_from} is weaker than forge.target_tier={target}")
    return list(TIER_ORDER[lo:hi + 1])


def target_met(target: str, strictest: str | None, surpassed: bool | None) -> bool:
    if target == "surpass":
        return bool(surpassed)
    return strictest is not None and TIER_ORDER.index(strictest) <= TIER_ORDER.index(target)


def _trace_stats(trace_dir: Path) -> dict | None:
    f = trace_dir / "trace.jsonl"
    if not f.exists():
        return None
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    steady = recs[1:] if len(recs) > 1 else recs  # the first step pays one-off costs
    if not steady:
        return None
    med = {k: statistics.median(r[k] for r in steady) for k in ("step_s", "tokens_per_s", "mfu_pct")
           if all(k in r for r in steady)}
    med["steps"], med["timed_steps"] = len(recs), len(steady)
    return med


def _metrics(out: Path, tier: str, golden: Path | None) -> dict:
    d = out / tier
    cand = _trace_stats(d / "candidate" / "trace")
    ref = _trace_stats(d / "reference" / "trace") or (golden and _trace_stats(golden / "trace"))
    m: dict = {}
    if cand:
        m.update({"mfu_pct": cand.get("mfu_pct"), "tokens_per_s": cand.get("tokens_per_s"),
                  "step_s": cand.get("step_s"),
                  "measured_on": f"{tier} gate run: median of the last {cand['timed_steps']} of {cand['steps']} "
                                 f"steps (short run on a shared machine: indicative only)"})
        m["candidate"] = cand
    if ref:
        m["reference"] = ref
        if cand and cand.get("step_s") and ref.get("step_s"):
            m["speed_ratio_ref_over_cand"] = ref["step_s"] / cand["step_s"]
    return m


def run_ladder(spec: dict, workspace: Path, out: Path) -> dict:
    """Run the gates for the candidate in ``workspace/engine``; returns the result dict (never raises for a
    broken candidate: the error is in the result)."""
    t0 = time.perf_counter()
    res: dict = {"ok": False, "error": None, "verdicts": [], "strictest_passed": None, "surpassed": None,
                 "target_met": False, "metrics": {}, "tiers_tried": []}
    try:
        import forgetrain.verify as fv
        from forgetrain.config import to_run_config
        from forgetrain.forge.workspace import load_engine_class
        from forgetrain.train import versions

        rc = to_run_config(spec["run_config"])
        res["versions"] = versions()
        res["device"] = {"hardware": rc.hardware.name, "device": rc.hardware.device,
                         "peak_source": rc.hardware.peak_source}
        golden_root = Path(spec["golden_root"]) if spec.get("golden_root") else None
        if golden_root is not None:
            fv.GOLDEN_ROOT = golden_root  # this process only: goldens live in the forge run's dir
        engine_cls = load_engine_class(workspace / "engine")
        target = spec["target_tier"]
        tiers = [t for t in spec["tiers"] if t not in ("loss_curve", "surpass")] if target == "surpass" \
            else list(spec["tiers"])
        last_eq, golden_used = None, None
        for tier in tiers:
            vcfg = fv.VerifyConfig(**spec["verify"])
            gdir = None
            if tier in ("bitwise", "tolerance") and golden_root is not None:
                gdir = fv.golden_dir(rc, tier)
                have = (gdir / "trace" / "trace.jsonl").exists()
                vcfg = dataclasses.replace(vcfg, golden=have, regenerate=not have)
            res["tiers_tried"].append(tier)
            verdicts = fv.verify(rc, vcfg, tier, out / tier, engine_cls=engine_cls)
            res["verdicts"] += [v.to_dict() for v in verdicts]
            last_eq, golden_used = tier, gdir
            if verdicts[-1].passed:
                res["strictest_passed"] = tier
                break
        if target == "surpass":
            res["tiers_tried"].append("surpass")
            vcfg = fv.VerifyConfig(**spec["verify"])
            verdicts = fv.verify(rc, vcfg, "surpass", out / "surpass", engine_cls=engine_cls)
            res["verdicts"] += [v.to_dict() for v in verdicts]
            lc = next((v for v in verdicts if v.tier == "loss_curve"), None)
            if res["strictest_passed"] is None and lc is not None and lc.passed:
                res["strictest_passed"] = "loss_curve"
            res["surpassed"] = verdicts[-1].passed
            sv = verdicts[-1].evidence
            res["metrics"]["surpass"] = {k: sv.get(k) for k in ("speedup", "noise", "median_ref_step_s",
                                                                 "median_cand_step_s") if k in sv}
        if last_eq is not None:
            res["metrics"].update(_metrics(out, last_eq, golden_used))
        res["target_met"] = target_met(target, res["strictest_passed"], res["surpassed"])
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a broken candidate is a result, not a crash of the gate
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        res["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        res["traceback"] = tb[-4000:]
    res["wall_s"] = time.perf_counter() - t0
    return res


def _table(res: dict) -> str:
    rows = []
    for v in res["verdicts"]:
        fd = v.get("first_divergence")
        where = ""
        if fd:
            where = f"  first divergence: step {fd.get('step')} {fd.get('kind')} " \
                    f"{fd.get('module') or fd.get('tensor') or ''}".rstrip()
        rows.append(f"{v['tier']:<10} {'PASS' if v['passed'] else 'FAIL'}  {v['summary']}{where}")
    if res.get("error"):
        rows.append(f"error: {res['error']}")
    rows.append(f"strictest tier passed: {res.get('strictest_passed') or '-'}; target met: {res['target_met']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from forgetrain.cli import _quiet_libraries
    from forgetrain.trace import atomic_write_json

    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._ladder", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="ladder spec JSON (gates/ladder_spec.json in a workspace)")
    ap.add_argument("--workspace", default=".", help="workspace dir holding engine/ (default: .)")
    ap.add_argument("--out", required=True, help="output dir for the gate runs")
    ap.add_argument("--result", default=None, help="result JSON path (default OUT/ladder_result.json)")
    a = ap.parse_args(argv)
    _quiet_libraries()
    spec = json.loads(Path(a.spec).read_text())
    out = Path(a.out).resolve()
    res = run_ladder(spec, Path(a.workspace).resolve(), out)
    atomic_write_json(Path(a.result) if a.result else out / "ladder_result.json", res)
    print(_table(res), flush=True)
    if res.get("traceback"):
        print(res["traceback"], file=sys.stderr, flush=True)
    return 3 if not res["ok"] else (0 if res["target_met"] else 1)


if __name__ == "__main__":
    sys.exit(main())
