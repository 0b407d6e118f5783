"""Measure the loss-curve tier's power against a stored golden: the fast default and planted regressions, each
judged by ``forgetrain.verify``'s own judge (paired against every seed's regenerated reference init, or unpaired
from the candidate's own init), in one process.

    python experiments/equivalence_power/run.py --out DIR --plants default,lr_x0.95:3 [--seeds 1234,1235,1236]
        [--budget-s 560] -- <verify overrides: the golden's shape, e.g. $P8 of scripts/device/shapes.sh>

A plant written ``name:N`` is judged on the first N (>= 3) of the seeds only: a FAIL whose window lies wholly
outside its margin needs no more, while a PASS at the 8B proxy needs 5 (docs/equivalence_power.md). Its row says
which seeds it ran on.

Per plant it writes ``DIR/<plant>/verdict.json`` and ``loss_curves.png``, and after every plant the running
table ``DIR/power.json`` (each mode's smallest detected shift, and each paired plant against ``default`` seed by
seed when both ran: with ``repeat``, that is the noise floor); the golden's ``init.json`` files it records (``verify.pin_init``) are copied to
``DIR/init_json/``. A plant that would not finish inside ``--budget-s`` is skipped and named.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def compose(overrides: list[str]):
    """RunConfig and VerifyConfig of ``python -m forgetrain.verify <overrides>``."""
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    from forgetrain import verify as V
    from forgetrain.cli import precheck_overrides
    from forgetrain.config import to_run_config

    V.register()
    precheck_overrides("verify", overrides)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        obj = OmegaConf.to_container(hcompose(config_name="verify", overrides=overrides), resolve=True)
    vd = obj.pop("verify")
    obj.pop("tier", None)
    return to_run_config(obj), V.VerifyConfig(**vd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--plants", required=True, help="comma-separated names of plants.PLANTS, each optionally :N "
                    "(its first N seeds only)")
    ap.add_argument("--seeds", default=None, help="paired seeds (default: verify.seeds)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop before a plant that would not fit")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    t0 = time.time()

    import plants as P

    from forgetrain import registry
    from forgetrain import verify as V
    from forgetrain.equivalence.inits import curve_golden_traces, golden_init, golden_init_hashes, pin_init
    from forgetrain.equivalence.verdict import tier_config

    rc, vcfg = compose(a.overrides + ["tier=loss_curve", "verify.golden=true"])
    seeds = [int(s) for s in a.seeds.split(",")] if a.seeds else list(vcfg.seeds)
    if len(seeds) < 3:  # the judge's band and interval need >= 3 reference seeds: refuse before any run
        print(f"error: --seeds needs 3 or more of the golden's seeds, got {seeds}", file=sys.stderr)
        return 2
    plan = []
    for spec in a.plants.split(","):
        name, _, n = spec.partition(":")
        if name not in P.PLANTS:
            print(f"error: unknown plant {name!r}; known: {', '.join(P.PLANTS)}", file=sys.stderr)
            return 2
        if n and not (n.isdigit() and 3 <= int(n) <= len(seeds)):
            print(f"error: plant {spec!r}: N must be 3 to {len(seeds)} (the seeds given)", file=sys.stderr)
            return 2
        plan.append((name, seeds[: int(n)] if n else seeds))
    vcfg = dataclasses.replace(vcfg, seeds=seeds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gdir = V.curve_golden_dir(rc, vcfg)
    refs_all = dict(zip(seeds, curve_golden_traces(gdir, vcfg)))
    hashes = golden_init_hashes(gdir, seeds)
    if hashes is None:
        pin_init(rc, vcfg, gdir)
        hashes = golden_init_hashes(gdir, seeds)
        for s in seeds:
            (out / "init_json").mkdir(exist_ok=True)
            shutil.copy2(gdir / f"seed_{s}" / "init.json", out / "init_json" / f"{gdir.name}_seed_{s}.json")
    print(f"[{time.time() - t0:.0f} s] golden {gdir.name}, seeds {seeds}, inits pinned", flush=True)
    tier_cfg = tier_config("loss_curve", vcfg.reference)
    base = registry.resolve_engine(rc.scenario.engine)
    rows, per_run = [], None
    for name, pseeds in plan:
        desc, mode = P.PLANTS[name]
        runs_n = len(pseeds) if mode == "paired" else len(vcfg.candidate_seeds)
        left = a.budget_s - (time.time() - t0)
        if per_run is not None and left < per_run * runs_n + 15:
            rows.append({"plant": name, "skipped": f"{left:.0f} s left, ~{per_run * runs_n:.0f} s needed"})
            print(f"skip {name}: {rows[-1]['skipped']}", flush=True)
            continue
        t1 = time.time()
        inits = [lambda s=s: golden_init(rc, vcfg, gdir, s, hashes[s]) for s in pseeds] if mode == "paired" else None
        vq = dataclasses.replace(vcfg, seeds=pseeds,
                                 candidate_seeds=[] if mode == "paired" else vcfg.candidate_seeds)
        runs = V.curve_candidate_runs(P.run_config(name, rc), vq, out / name, inits, P.planted(name, base))
        v = V.judge("loss_curve", tier_cfg, [refs_all[s] for s in pseeds], runs, out / name)[-1]
        per_run = (time.time() - t1) / runs_n
        row = {"plant": name, "what": desc, "mode": mode, "seeds": pseeds, "passed": v.passed, "summary": v.summary,
               "wall_s": round(time.time() - t1, 1)}
        if "paired" in v.evidence:
            pe = v.evidence["paired"]
            row.update({k: pe[k] for k in ("late_diff_mean", "late_diff_sd", "ci", "delta", "ref_late_mean",
                                           "late_diff_per_seed", "n_windows_outside")})
            row["detects_nats"], row["detects_rel"] = pe["power"]["detects_nats"], pe["power"]["detects_rel"]
            base_row = next((r for r in rows if r["plant"] == "default" and "late_diff_per_seed" in r), None)
            if base_row is not None and name != "default":  # this plant against the default, seed by seed
                by_seed = dict(zip(base_row["seeds"], base_row["late_diff_per_seed"]))
                d = [a - by_seed[s] for a, s in zip(row["late_diff_per_seed"], pseeds) if s in by_seed]
                row["vs_default_per_seed"] = d
                row["vs_default_sd"] = statistics.stdev(d) if len(d) > 1 else None
        else:
            d = v.evidence.get("drift", {})
            row.update({k: d.get(k) for k in ("mean_diff", "limit", "detects_nats", "cand_late_means",
                                              "ref_late_means")})
            row["n_outside"] = v.evidence.get("n_outside")
            row["detects_rel"] = d.get("detects_nats", 0.0) / abs(statistics.mean(d.get("ref_late_means") or [1.0]))
        rows.append(row)
        (out / "power.json").write_text(json.dumps({"golden": gdir.name, "seeds": seeds, "rows": rows}, indent=1))
        for rd in runs.paired + runs.unpaired:  # keep the traces, drop the rest
            shutil.rmtree(Path(rd).parent / "checkpoints", ignore_errors=True)
        print(f"[{time.time() - t0:.0f} s] {name}: {'PASS' if v.passed else 'FAIL'}  {v.summary}", flush=True)
    print("\nplant               mode      result  late diff (nats)  CI / limit                  detects (nats, %)"
          "  vs default (mean, sd)")
    for r in rows:
        if "skipped" in r:
            print(f"{r['plant']:<19} skipped   {r['skipped']}")
            continue
        det = "-" if r.get("detects_nats") is None else f"{r['detects_nats']:.4f} {r['detects_rel']:.2%}"
        if "passed" in r and r.get("ci") is None and r.get("mean_diff") is None:  # refused by the judge
            print(f"{r['plant']:<19} {r['mode']:<9} FAIL    {r['summary']}")
        elif "ci" in r:
            vd = r.get("vs_default_per_seed")
            vs = f"{statistics.mean(vd):+.4f} {r['vs_default_sd'] or 0:.4f}" if vd else "-"
            print(f"{r['plant']:<19} paired    {'PASS' if r['passed'] else 'FAIL'}    {r['late_diff_mean']:+.4f}"
                  f"           [{r['ci'][0]:+.4f}, {r['ci'][1]:+.4f}] vs +-{r['delta']:.4f}  {det}  {vs}")
        else:
            print(f"{r['plant']:<19} unpaired  {'PASS' if r['passed'] else 'FAIL'}    {r['mean_diff']:+.4f}"
                  f"           limit +-{r['limit']:.4f} ({r['n_outside']} windows out)  {det}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
