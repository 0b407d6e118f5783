"""The forge's gates: the ladder process, which judges a candidate without ever importing its code.

``python -m forgetrain.forge._ladder --spec gates/ladder_spec.json --workspace WS --out DIR [--result FILE]``

Tiers are tried strictest first from the spec's ``tiers`` (``forge.ladder_from`` .. ``forge.target_tier``), stopping
at the first that passes; target ``surpass`` tries the short-run tiers (bitwise, tolerance) and then runs
``surpass`` (which carries its own loss_curve verdict). Each engine runs in a process of its own
(docs/forge.md, threat model):

1. goldens first: the reference's runs that the tiers need, made by ``forgetrain.forge._golden`` when the spec's
   ``golden_root`` (the forge run's own dir, never the repository's ``references/goldens``) lacks them;
2. per tier, the candidate in ``forgetrain.forge._candidate``: it loads ``WS/engine`` under the run-time guard and
   writes only its trace; the guard's report comes back on a pipe, and a violation rejects the candidate (the
   result's ``rejected``: the escape class, the label, the problems), as does a golden that changed meanwhile;
3. the verdict, computed here from the traces alone (:func:`forgetrain.verify.judge`); this process imported the
   judge's code before any candidate ran. Surpass's timing is A-B-A across processes (candidate, reference,
   candidate).

The golden sides use the forge run's private bytecode cache (the loop passes it as ``PYTHONPYCACHEPREFIX``; run
by hand, ``OUT/pycache``); each candidate's process gets a private view of it
(``forgetrain.forge.sandbox.candidate_cache``), compared file by file once the process and everything it started
have ended (this process is their subreaper on Linux): a change rejects the candidate naming the file, and the
harness's cache starts over. Writes the result JSON (``ok``, ``error``, ``rejected``, ``verdicts``,
``strictest_passed``, ``surpassed``, ``target_met``, ``metrics``, ``versions``, ``device``, ``wall_s``) and prints
the verdict table. Exit 0 when the target is met, 1 when not, 3 when the candidate (or a
gate) failed to run, 4 when the candidate was rejected.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

from forgetrain.equivalence.registry import TIER_ORDER  # the one tier order (a live view of the registry)
from forgetrain.forge._golden import _is_pair, curve_tier_of, golden_location


def tiers_to_try(ladder_from: str, target: str) -> list[str]:
    """Tiers tried in order (strictest first) for a target. Raises ValueError on unknown/inconsistent names."""
    for name, t in (("forge.ladder_from", ladder_from), ("forge.target_tier", target)):
        if t not in TIER_ORDER:
            raise ValueError(f"{name}={t} is not a tier; known: {', '.join(TIER_ORDER)}")
    lo, hi = TIER_ORDER.index(ladder_from), TIER_ORDER.index(target)
    if lo > hi:
        raise ValueError(f"forge.ladder_from={ladder_from} is weaker than forge.target_tier={target}")
    return list(TIER_ORDER[lo:hi + 1])


def _is_speed(tier: str) -> bool:
    from forgetrain.equivalence import registry

    return registry.find(tier).kind == registry.SPEED


def target_met(target: str, strictest: str | None, surpassed: bool | None) -> bool:
    if _is_speed(target):
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


class CandidateFailed(RuntimeError):
    """The candidate's process raised or died; ``tb`` is its traceback (or the log's tail)."""

    def __init__(self, msg: str, tb: str = ""):
        super().__init__(msg)
        self.tb = tb


class _Sides:
    """Starts the golden and candidate processes of one ladder run and reads their reports."""

    def __init__(self, spec_file: Path, workspace: Path, out: Path, golden_root: Path, cache: Path):
        from forgetrain.forge.workspace import python

        self.spec_file, self.ws, self.out, self.golden_root = spec_file, workspace, out, golden_root
        self.py, self.log, self.cache = python(), out / "sides.log", cache

    def golden(self, *extra: str) -> None:
        """Run ``forgetrain.forge._golden`` (the reference only). Raises RuntimeError when it fails."""
        import subprocess

        from forgetrain.forge import procs, sandbox

        cmd = [self.py, "-m", "forgetrain.forge._golden", "--spec", str(self.spec_file),
               "--out", str(self.out / "_golden"), *extra]
        kids = set(procs.children())
        with open(self.log, "ab") as log:
            rc, _, _ = procs.run_group(cmd, cwd=self.out, env=sandbox.sandbox_env(self.cache, writable=True),
                                       timeout_s=None, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        procs.kill_leftovers(kids)
        if rc != 0:
            raise RuntimeError(f"the reference's side failed (rc={rc}); see {self.log}")

    def candidate(self, tier: str, d: Path, init: Path | None, time_steps: int = 0) -> dict | None:
        """Run the candidate for ``tier`` into ``d``. Returns the ``rejected`` entry when the guard reported a
        violation (or the goldens or the bytecode cache changed under it), else None. Raises CandidateFailed when
        it raised or died."""
        from forgetrain.forge import procs, sandbox

        shutil.rmtree(d, ignore_errors=True)  # only what this run writes is judged
        d.mkdir(parents=True)
        cmd = [self.py, "-m", "forgetrain.forge._candidate", "--spec", str(self.spec_file), "--workspace",
               str(self.ws), "--tier", tier, "--out", str(d), "--ladder-dir", str(self.out)] + \
            (["--init", str(init)] if init else []) + \
            (["--time-steps", str(time_steps)] if time_steps else [])
        view = self.out / "_pycache_candidate"  # the process's private view of the harness's bytecode cache
        view_sig, cache_sig = sandbox.candidate_cache(self.cache, view), sandbox.stat_signature([self.cache])
        golden, kids = sandbox.stat_signature([self.golden_root]), set(procs.children())
        rc, _, lines = procs.run_reporting(cmd + ["--judge-cache", str(self.cache)], cwd=d,
                                           env=sandbox.sandbox_env(view, writable=False), log_path=self.log,
                                           timeout_s=None)
        left = procs.kill_leftovers(kids)  # before the checks: nothing the candidate started acts after them
        rep = sandbox.read_report(lines)
        violations = rep["violations"]
        violations += [(3, f"a process the candidate started outlived it ({x}); code the guard never saw could "
                           f"run after its checks (killed)") for x in left]
        if sandbox.stat_signature([self.golden_root]) != golden:
            violations.append((1, f"the goldens under {self.golden_root} changed while the candidate ran"))
        changes = [c.replace(str(view), "<candidate's cache>", 1) for c in
                   sandbox.cache_changes(view_sig, sandbox.stat_signature([view]))] + \
            [c.replace(str(self.cache), "<harness's cache>", 1) for c in
             sandbox.cache_changes(cache_sig, sandbox.stat_signature([self.cache]))]
        shutil.rmtree(view, ignore_errors=True)
        if changes:  # nothing of it may be loaded by a later process: the harness's cache starts over
            sandbox.fresh_cache(self.cache)
            violations += [(3, f"bytecode the candidate's process wrote: {c}") for c in changes[:20]]
        if violations:
            return sandbox.rejection(violations, f"{tier} candidate run")
        if rep["error"]:
            raise CandidateFailed(rep["error"], rep["traceback"] or "")
        if not rep["done"] or rc != 0:
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise CandidateFailed(f"the candidate's process died (rc={rc}) before its checks finished", tail)
        return None


def _link_or_copy(src: Path, dst: Path) -> Path:
    """``dst`` as a hard link to ``src`` (a copy across file systems); the candidate reads its init from there,
    never from the golden dir."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def run_ladder(spec: dict, workspace: Path, out: Path) -> dict:
    """Run the gates for the candidate in ``workspace/engine``; returns the result dict (never raises for a
    broken or rejected candidate: that is in the result)."""
    t0 = time.perf_counter()
    res: dict = {"ok": False, "error": None, "rejected": None, "verdicts": [], "strictest_passed": None,
                 "surpassed": None, "target_met": False, "metrics": {}, "tiers_tried": []}
    try:
        import forgetrain.equivalence  # noqa: F401 - the judge's code, loaded before any candidate runs
        import forgetrain.verify as fv
        from forgetrain.config import to_run_config
        from forgetrain.errors import ConfigError
        from forgetrain.forge._golden import missing_goldens
        from forgetrain.trace import atomic_write_json
        from forgetrain.train import versions

        rc, vcfg = to_run_config(spec["run_config"]), fv.VerifyConfig(**spec["verify"])
        res["versions"] = versions()
        res["device"] = {"hardware": rc.hardware.name, "device": rc.hardware.device,
                         "peak_source": rc.hardware.peak_source}
        if not spec.get("golden_root"):
            raise ConfigError("the ladder spec names no golden_root")
        golden_root = Path(spec["golden_root"]).resolve()
        fv.GOLDEN_ROOT = golden_root  # this process only: goldens live in the forge run's dir
        out.mkdir(parents=True, exist_ok=True)
        spec_file = out / "spec.json"
        atomic_write_json(spec_file, dict(spec, golden_root=str(golden_root)))
        # the forge run's private bytecode cache when the loop started this process; else (the agent's own gate
        # runs, which the loop does not trust anyway) one kept under OUT between runs
        cache = Path(sys.pycache_prefix) if sys.pycache_prefix else out / "pycache"
        cache.mkdir(parents=True, exist_ok=True)
        sides = _Sides(spec_file, workspace, out, golden_root, cache)
        if missing_goldens(rc, vcfg, spec):  # 1. goldens first, by a process that runs only the reference
            sides.golden()
            if missing_goldens(rc, vcfg, spec):
                raise RuntimeError(f"the reference's side ran but left goldens missing: {missing_goldens(rc, vcfg, spec)}")
        target = spec["target_tier"]
        # a speed target's own run judges its curve tier too: the ladder leaves both to it
        tiers = [t for t in spec["tiers"] if _is_pair(t)] if _is_speed(target) else list(spec["tiers"])
        last_eq, golden_used = None, None
        for tier in tiers:
            res["tiers_tried"].append(tier)
            gdir = golden_location(rc, vcfg, tier)
            short = _is_pair(tier)
            init = _link_or_copy(gdir / "init.safetensors", out / tier / "init.safetensors") if short else None
            res["rejected"] = sides.candidate(tier, out / tier / "candidate", init)  # 2. the candidate
            if res["rejected"]:
                break
            cand = out / tier / "candidate" / "trace"  # 3. the verdict, from traces alone
            refs = [gdir / "trace"] if short else fv._curve_golden_traces(gdir, vcfg)
            oracle = gdir / "oracle_fp32" / "trace"
            verdicts = fv.judge(tier, fv.tier_config(tier, vcfg.reference), refs, cand, out / tier,
                                oracle=oracle if oracle.is_dir() else None)
            res["verdicts"] += [v.to_dict() for v in verdicts]
            last_eq, golden_used = tier, (gdir if short else None)
            if verdicts[-1].passed:
                res["strictest_passed"] = tier
                break
        if _is_speed(target) and not res["rejected"]:
            res["tiers_tried"].append(target)
            _surpass(res, sides, rc, vcfg, out, target)
        if last_eq is not None and not res["rejected"]:
            res["metrics"].update(_metrics(out, last_eq, golden_used))
        res["target_met"] = not res["rejected"] and target_met(target, res["strictest_passed"], res["surpassed"])
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a broken candidate is a result, not a crash of the gate
        if isinstance(e, KeyboardInterrupt):
            raise
        msg = str(e).strip()
        res["error"] = f"{msg}" if isinstance(e, CandidateFailed) else \
            f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
        res["traceback"] = (e.tb if isinstance(e, CandidateFailed) else traceback.format_exc())[-4000:]
    res["wall_s"] = time.perf_counter() - t0
    return res


def _surpass(res: dict, sides: _Sides, rc, vcfg, out: Path, speed: str) -> None:
    """The gate of the speed tier ``speed`` (surpass): the candidate's run of the curve tier it rests on, then A-B-A
    timing (candidate, reference, candidate), each block in a process of its own; the verdicts come from the
    traces and the step times."""
    import forgetrain.verify as fv

    curve = curve_tier_of(speed)
    gdir = golden_location(rc, vcfg, curve)
    d = out / speed
    res["rejected"] = sides.candidate(speed, d / "candidate", None)
    if res["rejected"]:
        return
    t_cand = []
    for block in ("a1", "a2"):
        if block == "a2":
            sides.golden("--time-steps", str(vcfg.timing_steps), "--times", str(d / "reference_times.json"))
        res["rejected"] = sides.candidate(speed, d / f"timing_{block}", None, time_steps=vcfg.timing_steps)
        if res["rejected"]:
            return
        t_cand += json.loads((d / f"timing_{block}" / "times.json").read_text())
    t_ref = json.loads((d / "reference_times.json").read_text())
    verdicts = fv.judge(speed, fv.tier_config(speed, vcfg.reference), fv._curve_golden_traces(gdir, vcfg),
                        d / "candidate" / "trace", d, times=(t_ref, t_cand))
    res["verdicts"] += [v.to_dict() for v in verdicts]
    lc = next((v for v in verdicts if v.tier == curve), None)
    if res["strictest_passed"] is None and lc is not None and lc.passed:
        res["strictest_passed"] = curve
    res["surpassed"] = verdicts[-1].passed
    sv = verdicts[-1].evidence
    res["metrics"][speed] = {k: sv.get(k) for k in ("speedup", "noise", "median_ref_step_s",
                                                         "median_cand_step_s") if k in sv}


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
    if res.get("rejected"):
        rows.append(f"REJECTED ({res['rejected']['guard']}):")
        rows += [f"  {p}" for p in res["rejected"]["problems"]]
    rows.append(f"strictest tier passed: {res.get('strictest_passed') or '-'}; target met: {res['target_met']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import signal

    from forgetrain.cli import _quiet_libraries
    from forgetrain.forge.procs import become_subreaper, kill_active
    from forgetrain.trace import atomic_write_json

    signal.signal(signal.SIGTERM, kill_active)  # killed at its time limit: the sides it started go too
    become_subreaper()  # what a side leaves behind, even out of its process group, is re-parented here

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
    return 3 if not res["ok"] else 4 if res.get("rejected") else (0 if res["target_met"] else 1)


if __name__ == "__main__":
    sys.exit(main())
