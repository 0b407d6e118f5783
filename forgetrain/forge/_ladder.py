"""The forge's gates: the ladder process, which judges a candidate without ever importing its code.

``python -m forgetrain.forge._ladder --spec gates/ladder_spec.json --workspace WS --out DIR [--result FILE]``

Tiers are tried strictest first from the spec's ``tiers`` (``forge.ladder_from`` .. ``forge.target_tier``), stopping
at the first that passes; target ``surpass`` tries the short-run tiers (bitwise, tolerance) and then runs
``surpass`` (which carries its own loss_curve verdict). Each engine runs in a process of its own
(docs/forge.md, threat model):

0. the run's secret values are drawn from the spec's ranges (:mod:`forgetrain.forge.secret`; a spec may pin
   ``drawn``): the judge's spec (``OUT/spec.json``) has them, the candidate's process never reads it. The seal's
   re-check of the installed copy (a spec with ``drawn`` and ``reuse``) takes the values, goldens and window of
   the run it re-checks when the operating system isolates the candidate (none of that run's files is visible to
   it), and draws its own otherwise;
1. goldens: the reference's runs the tiers need for those values, made by ``forgetrain.forge._golden`` into
   ``OUT/golden`` after it has cut the data window into ``OUT/_data``, while the first candidate process starts;
2. per tier, the candidate in ``forgetrain.forge._candidate``, isolated by the operating system where it can be
   (:mod:`forgetrain.forge.isolate`): it loads the engine (``WS/engine``, or the spec's installed ``candidate``)
   under the run-time guard as ``scenarios.<name>``, gets its run on stdin once the goldens exist, and writes
   only its trace; the guard's report comes back on a pipe, and a violation rejects the candidate (the result's
   ``rejected``: the escape class, the label, the problems), as does a golden that changed meanwhile;
   A curve tier's (loss_curve, and the one surpass rests on) candidate runs paired: this process rebuilds each
   reference seed's init from the seed and checks it against the golden's sha256 (:func:`curve_inits`), the
   candidate's process runs from each (``OUT/<tier>/init/seed_<N>.safetensors``, read-only) and then its unpaired
   seeds (drawn too), and the verdict takes both (:func:`curve_runs`);
3. the judge's own checks of the trace (:mod:`forgetrain.forge.recheck`: class 5), then the verdict, computed
   here from the traces alone (:func:`forgetrain.verify.judge`); this process imported the judge's code before
   any candidate ran. Surpass's timing is A-B-A across processes (candidate, reference, candidate).

The golden sides use the forge run's private bytecode cache (the loop passes it as ``PYTHONPYCACHEPREFIX``; run
by hand, ``OUT/pycache``); each candidate's process gets a private view of it
(``forgetrain.forge.sandbox.candidate_cache``), compared file by file once the process and everything it started
have ended (this process is their subreaper on Linux): a change rejects the candidate naming the file, and the
harness's cache starts over. Writes the result JSON (``ok``, ``error``, ``rejected``, ``verdicts``,
``strictest_passed``, ``surpassed``, ``target_met``, ``metrics``, ``versions``, ``device``, ``gate``: the drawn
values, the window, the isolation; ``wall_s``) and prints the verdict table. Exit 0 when the target is met, 1 when
not, 3 when the candidate (or a gate) failed to run, 4 when the candidate was rejected.
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
from typing import Callable

from forgetrain.equivalence.registry import TIER_ORDER  # the one tier order (a live view of the registry)
from forgetrain.forge._golden import is_pair, curve_tier_of, golden_location


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
    paired = sorted((d / "candidate").glob("candidate_paired_seed*/trace"))  # a curve tier's first paired run
    cand = _trace_stats(paired[0] if paired else d / "candidate" / "trace")
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

    def __init__(self, spec_file: Path, cand: dict, workspace: Path, out: Path, golden_root: Path, cache: Path,
                 shared: list[str], hide: list[str] = (), data_dir: Path | None = None):
        from forgetrain.forge.workspace import python

        self.spec_file, self.cand, self.ws, self.out, self.golden_root = spec_file, cand, workspace, out, golden_root
        self.py, self.log, self.cache, self.shared = python(), out / "sides.log", cache, shared
        self.data_dir, self.hide = data_dir or out / "_data", list(hide)
        self.on_cpu = json.loads(spec_file.read_text())["run_config"]["hardware"]["device"] == "cpu"

    def golden(self, *extra: str) -> None:
        """Run ``forgetrain.forge._golden`` (the reference only): in this process when the run is on the CPU and
        no timing is asked for (it never runs candidate code, and a process start is saved per ladder run), else
        in a process of its own (a GPU's memory stays the candidate's). Raises RuntimeError when it fails."""
        import subprocess

        from forgetrain.forge import _golden, procs, sandbox

        args = ["--spec", str(self.spec_file), "--out", str(self.out / "_golden_runs"), *extra]
        if self.on_cpu and not extra:
            if _golden.main(args) != 0:
                raise RuntimeError("the reference's side failed; its traceback is in the ladder's log")
            return
        cmd = [self.py, "-m", "forgetrain.forge._golden", *args]
        kids = set(procs.children())
        with open(self.log, "ab") as log:
            rc, _, _ = procs.run_group(cmd, cwd=self.out, env=sandbox.sandbox_env(self.cache, writable=True),
                                       timeout_s=None, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        procs.kill_leftovers(kids)
        if rc != 0:
            raise RuntimeError(f"the reference's side failed (rc={rc}); see {self.log}")

    def _cmd(self, tier: str, d: Path, init: Path | None, init_dir: Path | None = None) -> list[str]:
        c = self.cand
        cmd = [self.py, "-m", "forgetrain.forge._candidate", "--engine-dir", c["dir"], "--package", c["package"],
               "--entry", c["entry"], "--workspace", str(self.ws), "--tier", tier, "--out", str(d),
               "--ladder-dir", str(self.out), "--golden-root", str(self.golden_root),
               "--data-dir", str(self.data_dir), "--judge-cache", str(self.cache)]
        for x in self.shared:
            cmd += ["--shared", x]
        for x in self.hide:
            cmd += ["--hide", x]
        return cmd + (["--init", str(init)] if init else []) + (["--init-dir", str(init_dir)] if init_dir else [])

    def _plan(self, d: Path, init: Path | None, view: Path, init_dir: Path | None = None) -> dict:
        """What the candidate's process sees (:mod:`forgetrain.forge.isolate`): none of the judge's files, the
        reference frameworks, the workspace (but its engine) or the shared caches; writable only ``d`` and its own
        empty scratch dirs (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``$TMPDIR``), which no other process can fill."""
        from forgetrain.forge import isolate
        from forgetrain.forge.runtime_guard import REPO_ROOT, forbidden_package_dirs

        hide = [str(self.out), str(self.golden_root), str(self.cache), str(self.ws), *self.shared,
                *(x for x, _ in forbidden_package_dirs(self.ws)), *self.hide]
        ro = [self.cand["dir"], str(view), str(self.data_dir)] + ([str(init.parent)] if init is not None else []) \
            + ([str(init_dir)] if init_dir is not None else [])
        scratch = ["/tmp", "/var/tmp", "/dev/shm"] + [x for x in [os.environ.get("TMPDIR")] if x]
        return {"hide": hide, "ro": ro, "rw": [str(d)], "scratch": scratch,
                "base": isolate.runtime_paths(str(REPO_ROOT))}

    def candidate(self, tier: str, d: Path, init: Path | None, go: Callable[[], dict],
                  init_dir: Path | None = None) -> dict | None:
        """Run the candidate for ``tier`` into ``d`` (from the init file ``init``, or, for a curve tier's paired
        runs, the judge's rebuilt reference inits in ``init_dir``); ``go()`` (called once its process has started, while it
        imports) returns its run (``run_config``, ``verify``, ``time_steps``), making what that run needs first.
        Returns the ``rejected`` entry when the guard reported a violation (or the goldens or the bytecode cache
        changed under it), else None. Raises CandidateFailed when it raised or died."""
        from forgetrain.forge import isolate, procs, sandbox

        shutil.rmtree(d, ignore_errors=True)  # only what this run writes is judged
        d.mkdir(parents=True)
        if init is not None:
            init.parent.mkdir(parents=True, exist_ok=True)
        if init_dir is not None:
            shutil.rmtree(init_dir, ignore_errors=True)
            init_dir.mkdir(parents=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        view = self.out / "_pycache_candidate"  # the process's private view of the harness's bytecode cache
        view_sig, cache_sig = sandbox.candidate_cache(self.cache, view), sandbox.stat_signature([self.cache])
        kids, marks = set(procs.children()), {}
        cmd = isolate.wrap(self._cmd(tier, d, init, init_dir), self._plan(d, init, view, init_dir))

        def send() -> bytes:
            run = go()  # the reference's side may run now, and add bytecode of its own to the harness's cache
            marks["golden"], marks["cache"] = sandbox.stat_signature([self.golden_root]), \
                sandbox.stat_signature([self.cache])
            return (json.dumps(run) + "\n").encode()

        rc, _, lines = procs.run_reporting(cmd, cwd=d, env=sandbox.sandbox_env(view, writable=False),
                                           log_path=self.log, timeout_s=None, send=send)
        left = procs.kill_leftovers(kids)  # before the checks: nothing the candidate started acts after them
        rep = sandbox.read_report(lines)
        violations = rep["violations"]
        violations += [(3, f"a process the candidate started outlived it ({x}); code the guard never saw could "
                           f"run after its checks (killed)") for x in left]
        if "golden" in marks and sandbox.stat_signature([self.golden_root]) != marks["golden"]:
            violations.append((1, f"the goldens under {self.golden_root} changed while the candidate ran"))
        violations += self._cache_violations(view, view_sig, cache_sig, marks.get("cache"))
        if violations:
            return sandbox.rejection(violations, f"{tier} candidate run")
        if rep["error"]:
            raise CandidateFailed(rep["error"], rep["traceback"] or "")
        if not rep["done"] or rc != 0:
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise CandidateFailed(f"the candidate's process died (rc={rc}) before its checks finished", tail)
        return None

    def _cache_violations(self, view: Path, view_sig: dict, before: dict, mid: dict | None) -> list:
        """The bytecode the candidate's process wrote: any change to its view, to a file the harness's cache held
        before it started, or to the harness's cache after the reference's side finished (that side adds the
        bytecode of what it imports while the candidate starts). A change empties the harness's cache."""
        from forgetrain.forge import sandbox

        now = sandbox.stat_signature([self.cache])
        early = [c for c in sandbox.cache_changes(before, mid if mid is not None else now) if not c.startswith("added ")]
        late = sandbox.cache_changes(mid, now) if mid is not None else []
        changes = [c.replace(str(view), "<candidate's cache>", 1) for c in
                   sandbox.cache_changes(view_sig, sandbox.stat_signature([view]))] + \
            [c.replace(str(self.cache), "<harness's cache>", 1) for c in early + late]
        shutil.rmtree(view, ignore_errors=True)
        if not changes:
            return []
        sandbox.fresh_cache(self.cache)  # nothing of it may be loaded by a later process: it starts over
        return [(3, f"bytecode the candidate's process wrote: {c}") for c in changes[:20]]


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


def candidate_of(spec: dict, workspace: Path) -> dict:
    """Which engine the ladder judges and under which name: the spec's ``candidate`` (an installed copy, the
    seal's re-check), else ``workspace/engine`` as ``scenarios.<package>`` (the name it is installed under,
    ``spec["package"]``; default ``engine``'s template name from ``scenario.engine``)."""
    from forgetrain.forge.workspace import ENGINE_DIR, workspace_entry

    if spec.get("candidate"):
        c = spec["candidate"]
        return {"dir": str(Path(c["dir"]).resolve()), "package": c["package"], "entry": c["entry"]}
    pkg = spec.get("package") or spec["run_config"]["scenario"]["name"]
    return {"dir": str((workspace / ENGINE_DIR).resolve()), "package": f"scenarios.{pkg}",
            "entry": workspace_entry(workspace)}


def shared_caches(spec: dict) -> list[str]:
    """The project's caches a candidate may not touch: the prepared corpora and the CPU peak's dir."""
    from forgetrain.data.prepare import default_cache_dir
    from forgetrain.metrics import cache_dir

    data = spec.get("source_data") or spec["run_config"]["data"]
    return sorted({os.path.abspath(os.path.expanduser(data.get("cache_dir") or default_cache_dir())),
                   os.path.abspath(str(cache_dir()))})


def _replayed(tier: str, cand: Path, refs: list[Path], steps: int) -> dict | None:
    """The ``rejected`` entry (class 5) when the candidate's trace is not a record of the judge's run."""
    from forgetrain.forge import recheck, sandbox

    problems = recheck.trace_problems(cand, refs[0], steps)
    return sandbox.rejection([(5, p) for p in problems], f"{tier} candidate trace") if problems else None


def curve_runs(d: Path, vcfg):
    """The candidate's runs of a curve tier under ``d`` (what ``forgetrain.forge._candidate`` writes there):
    paired, one per reference seed, then unpaired, one per candidate seed, as a ``CurveRuns`` of trace dirs."""
    from forgetrain.equivalence.tiers.loss_curve import CurveRuns

    return CurveRuns(tuple(d / f"candidate_paired_seed{s}" / "trace" for s in vcfg.seeds),
                     tuple(d / f"candidate_seed{u}" / "trace" for u in vcfg.candidate_seeds))


def _curve_replayed(tier: str, runs, rc, vcfg) -> dict | None:
    """The ``rejected`` entry (class 5) when a curve run's trace is not the record of the run the judge asked for:
    each run's config hash is the one of that seed's ``curve_steps``-step run (what the golden of that seed
    carries), computed here."""
    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.forge import recheck, sandbox
    from forgetrain.train import config_hash

    problems = []
    for seed, t in zip([*vcfg.seeds, *vcfg.candidate_seeds], [*runs.paired, *runs.unpaired]):
        want = config_hash(run_cfg(rc, Path("."), steps=vcfg.curve_steps, digests=False, seed=seed))
        problems += [f"{t.parent.name}: {p}" for p in recheck.trace_problems(t, None, vcfg.curve_steps, want)]
    return sandbox.rejection([(5, p) for p in problems], f"{tier} candidate traces") if problems else None


def curve_inits(rc, vcfg, gdir: Path, init_dir: Path) -> None:
    """The judge's own copy of each reference seed's init for the paired runs, made in this process: rebuilt
    from the seed (:func:`forgetrain.equivalence.inits.golden_init`) and checked against the sha256 the golden
    stores, then written as ``init_dir/seed_<N>.safetensors`` (the candidate's process reads it there, read-only).
    Raises RuntimeError when the golden stores no init hashes, ConfigError when a rebuilt init does not match."""
    import dataclasses

    from safetensors.torch import save

    from forgetrain.equivalence.inits import golden_init, golden_init_hashes
    from forgetrain.trace import atomic_write_bytes

    hashes = golden_init_hashes(gdir, list(vcfg.seeds))
    if hashes is None:
        raise RuntimeError(f"the golden {gdir} stores no init hash for some seeds: the paired runs cannot start "
                           f"from its inits")
    for seed in vcfg.seeds:
        state = golden_init(rc, dataclasses.replace(vcfg, init_cache=None), gdir, seed, hashes[seed])
        atomic_write_bytes(init_dir / f"seed_{seed}.safetensors", save(state))
        del state


def run_ladder(spec: dict, workspace: Path, out: Path) -> dict:
    """Run the gates for the candidate (``workspace/engine``, or the spec's installed ``candidate``); returns the
    result dict (never raises for a broken or rejected candidate: that is in the result)."""
    t0 = time.perf_counter()
    res: dict = {"ok": False, "error": None, "rejected": None, "verdicts": [], "strictest_passed": None,
                 "surpassed": None, "target_met": False, "metrics": {}, "tiers_tried": []}
    try:
        _run_tiers(spec, workspace, out, res)
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


def _run_tiers(spec: dict, workspace: Path, out: Path, res: dict) -> None:
    """The body of :func:`run_ladder`: draw the run, make its goldens, run and judge the candidate tier by tier."""
    import forgetrain.equivalence  # noqa: F401 - the judge's code, loaded before any candidate runs
    import forgetrain.verify as fv
    from forgetrain.config import to_run_config
    from forgetrain.equivalence.inits import curve_golden_traces
    from forgetrain.equivalence.verdict import tier_config
    from forgetrain.forge import isolate, secret
    from forgetrain.forge._golden import missing_goldens
    from forgetrain.trace import atomic_write_json
    from forgetrain.train import versions

    out.mkdir(parents=True, exist_ok=True)
    reuse = spec.get("reuse") if spec.get("drawn") and isolate.available()[0] else None
    if reuse:  # the seal's re-check of an isolated run: that run's values, goldens and window, which no candidate saw
        golden_root, data_dir = Path(reuse["golden"]).resolve(), Path(reuse["data"]).resolve()
    else:
        golden_root, data_dir = (out / "golden").resolve(), (out / "_data").resolve()
        shutil.rmtree(golden_root, ignore_errors=True)  # this run's goldens only: its values were drawn just now
    pinned = spec.get("drawn") if reuse or not spec.get("reuse") else None  # a re-check without isolation: fresh
    drawn = pinned or secret.draw(spec["secret"])
    jspec = secret.judge_spec(spec, drawn, data_dir, golden_root)
    rc, vcfg = to_run_config(jspec["run_config"]), fv.VerifyConfig(**jspec["verify"])
    res.update(versions=versions(), gate={"drawn": drawn, "isolation": isolate.status()},
               device={"hardware": rc.hardware.name, "device": rc.hardware.device,
                       "peak_source": rc.hardware.peak_source})
    fv.GOLDEN_ROOT = golden_root  # this process only: goldens live in the ladder run's dir
    spec_file = out / "spec.json"
    atomic_write_json(spec_file, jspec)
    # the forge run's private bytecode cache when the loop started this process; else (the agent's own gate
    # runs, which the loop does not trust anyway) one kept under OUT between runs
    cache = Path(sys.pycache_prefix) if sys.pycache_prefix else out / "pycache"
    cache.mkdir(parents=True, exist_ok=True)
    sides = _Sides(spec_file, candidate_of(spec, workspace), workspace, out, golden_root, cache, shared_caches(jspec),
                   spec.get("hide") or [], data_dir)
    made: dict = {}

    def goldens() -> None:  # 1. the reference's side: the data window and the goldens of the drawn values
        if not made:
            sides.golden()
            if missing_goldens(rc, vcfg, jspec):
                raise RuntimeError(f"the reference's side ran but left goldens missing: "
                                   f"{missing_goldens(rc, vcfg, jspec)}")
            made["peak"] = json.loads((golden_root / "peak.json").read_text()) \
                if (golden_root / "peak.json").is_file() else None
            made["window"] = json.loads((sides.data_dir / "manifest.json").read_text()).get("window")
            res["gate"]["window"] = made["window"]

    def run_for(tier: str, init: Path | None, gdir: Path | None, time_steps: int = 0, init_dir: Path | None = None):
        def go() -> dict:
            goldens()
            if init is not None:
                _link_or_copy(gdir / "init.safetensors", init)
            if init_dir is not None:
                curve_inits(rc, vcfg, gdir, init_dir)
            return {"run_config": secret.candidate_config(jspec, made.get("peak")), "verify": jspec["verify"],
                    "time_steps": time_steps}
        return go

    target = jspec["target_tier"]
    # a speed target's own run judges its curve tier too: the ladder leaves both to it
    tiers = [t for t in jspec["tiers"] if is_pair(t)] if _is_speed(target) else list(jspec["tiers"])
    last_eq, golden_used = None, None
    for tier in tiers:
        res["tiers_tried"].append(tier)
        gdir = golden_location(rc, vcfg, tier)
        short = is_pair(tier)
        init = out / tier / "init" / "init.safetensors" if short else None
        init_dir = None if short else out / tier / "init"
        res["rejected"] = sides.candidate(tier, out / tier / "candidate", init,
                                          run_for(tier, init, gdir, init_dir=init_dir), init_dir=init_dir)
        if res["rejected"]:
            break
        # 3. the verdict, from traces alone
        cand = out / tier / "candidate" / "trace" if short else curve_runs(out / tier / "candidate", vcfg)
        refs = [gdir / "trace"] if short else curve_golden_traces(gdir, vcfg)
        res["rejected"] = _replayed(tier, cand, refs, vcfg.steps) if short else \
            _curve_replayed(tier, cand, rc, vcfg)
        if res["rejected"]:
            break
        oracle = gdir / "oracle_fp32" / "trace"
        verdicts = fv.judge(tier, tier_config(tier, vcfg.reference), refs, cand, out / tier,
                            oracle=oracle if oracle.is_dir() else None)
        res["verdicts"] += [v.to_dict() for v in verdicts]
        last_eq, golden_used = tier, (gdir if short else None)
        if verdicts[-1].passed:
            res["strictest_passed"] = tier
            break
    if _is_speed(target) and not res["rejected"]:
        res["tiers_tried"].append(target)
        _surpass(res, sides, rc, vcfg, out, target, run_for)
    if last_eq is not None and not res["rejected"]:
        res["metrics"].update(_metrics(out, last_eq, golden_used))
    res["target_met"] = not res["rejected"] and target_met(target, res["strictest_passed"], res["surpassed"])


def _surpass(res: dict, sides: _Sides, rc, vcfg, out: Path, speed: str, run_for) -> None:
    """The gate of the speed tier ``speed`` (surpass): the candidate's run of the curve tier it rests on, then A-B-A
    timing (candidate, reference and the tier's peers, candidate), each block in a process of its own; the
    verdicts come from the traces and the step times."""
    import forgetrain.verify as fv
    from forgetrain.equivalence.inits import curve_golden_traces
    from forgetrain.equivalence.verdict import tier_config

    curve = curve_tier_of(speed)
    gdir = golden_location(rc, vcfg, curve)
    d = out / speed
    res["rejected"] = sides.candidate(speed, d / "candidate", None, run_for(speed, None, gdir, init_dir=d / "init"),
                                      init_dir=d / "init")
    if res["rejected"]:
        return
    refs, runs = curve_golden_traces(gdir, vcfg), curve_runs(d / "candidate", vcfg)
    res["rejected"] = _curve_replayed(speed, runs, rc, vcfg)
    if res["rejected"]:
        return
    t_cand = []
    for block in ("a1", "a2"):
        if block == "a2":
            sides.golden("--time-steps", str(vcfg.timing_steps), "--times", str(d / "reference_times.json"))
        res["rejected"] = sides.candidate(speed, d / f"timing_{block}", None,
                                          run_for(speed, None, gdir, time_steps=vcfg.timing_steps))
        if res["rejected"]:
            return
        t_cand += json.loads((d / f"timing_{block}" / "times.json").read_text())
    t_ref = json.loads((d / "reference_times.json").read_text())  # the reference's and the peers' step seconds
    verdicts = fv.judge(speed, tier_config(speed, vcfg.reference), refs, runs, d,
                        times=(t_ref["reference"], t_cand, t_ref["peers"]))
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

    from forgetrain.cli import quiet_libraries
    from forgetrain.forge.procs import become_subreaper, die_with_parent, kill_active
    from forgetrain.trace import atomic_write_json

    signal.signal(signal.SIGTERM, kill_active)  # killed at its time limit: the sides it started go too
    become_subreaper()  # what a side leaves behind, even out of its process group, is re-parented here

    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._ladder", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="ladder spec JSON (gates/ladder_spec.json in a workspace)")
    ap.add_argument("--workspace", default=".", help="workspace dir holding engine/ (default: .)")
    ap.add_argument("--out", required=True, help="output dir for the gate runs")
    ap.add_argument("--result", default=None, help="result JSON path (default OUT/ladder_result.json)")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="the forge process that started this ladder: the ladder and its sides end when it does")
    a = ap.parse_args(argv)
    if a.parent_pid is not None:
        die_with_parent(a.parent_pid)  # SIGTERM -> kill_active: a killed forge leaves no ladder or side running
    quiet_libraries()
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
