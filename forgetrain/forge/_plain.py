"""The judge's side of the seal's plain re-check (escape class 6): a process that never runs candidate code.

Started by :class:`forgetrain.forge.plain.PlainCheck`, never by hand:
``python -m forgetrain.forge._plain --init FILE --out DIR``. The user's run replays one of the gated runs of the
installed copy's re-check (a pair tier's one run, or a curve tier's paired run of one reference seed). The judge's
modules are imported first; then:

1. one JSON line on stdin, ``{"replay": REQUEST}`` (:func:`prepare_replay`: the re-check's judge spec, the tier,
   the gated run's trace dir and init file, the seed, the steps to replay, ``bitwise`` or ``tolerance``, the config
   hash of the user's run) or ``{"stop": why}``. The gated run's trace is read and checked as the re-check's run
   of that seed, and what is compared (its first steps; a whole bitwise replay of a pair tier's run, its final
   weights too) is kept in this process's memory; the init is checked against the golden's for the seed and
   written to ``FILE``; the window is copied into ``DIR/_data``; then ``ready``;
2. ``{"trace": DIR}`` or ``{"stop": why}``: the user's trace gets the trace checks of :mod:`forgetrain.forge.recheck`
   and is compared with what was kept in memory (:func:`judge_replay`).

Writes ``DIR/plain_result.json`` (``passed``, ``problems``, ``verdicts``, ``window``, ``init_sha256``,
``replayed``). Exit 0 when judged (pass or fail), 3 when the judge's side failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import traceback
from pathlib import Path


def prepare_replay(req: dict, init_file: Path, out: Path) -> dict:
    """Phase 1. ``req``: ``spec`` (the re-check's judge spec: run config, verify options, golden root, data
    window), ``tier`` (the tier the engine passed: a pair tier, whose gated run is its one run of the spec's seed,
    ``verify.steps`` steps with digests; or a curve tier, whose gated runs are its paired runs, ``verify.curve_steps``
    steps from each reference seed's init without digests), ``gated`` (the trace dir of that run of ``seed``),
    ``init`` (the init file that run started from, as its ladder linked or rebuilt it), ``seed``, ``steps`` (how
    many of its steps the user's run replays), ``compare`` (the pair tier it is judged by: ``bitwise`` or
    ``tolerance``), ``want_hash`` (the config hash of the user's run), ``final_params`` (whether the user's run
    exports its final weights; default true). Checks the gated trace as the re-check's run
    of that seed (:func:`forgetrain.forge.recheck.trace_problems`), the init's sha256 against the golden's for the
    seed, and the window's files against its manifest; writes the init to ``init_file`` and the window to
    ``out/_data``. Returns the job :func:`judge_replay` needs: the gated trace's meta and first ``steps`` records,
    and for a whole bitwise replay its ``final.safetensors`` bytes where it has them (held in this process's
    memory from here on), with the request's values. Raises RuntimeError when the gated run, its init or the
    request does not check out, DataError for a damaged window."""
    from safetensors.torch import load, load_file

    import forgetrain.verify as fv
    from forgetrain.config import to_run_config
    from forgetrain.data import integrity
    from forgetrain.equivalence import registry
    from forgetrain.equivalence.inits import golden_init_hashes, init_sha256
    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.forge import recheck
    from forgetrain.forge._golden import golden_location
    from forgetrain.trace import atomic_write_bytes, read_trace
    from forgetrain.train import config_hash

    jspec = json.loads(Path(req["spec"]).read_text())
    rc, vcfg = to_run_config(jspec["run_config"]), fv.VerifyConfig(**jspec["verify"])
    tier, seed, steps, compare = req.get("tier"), int(req["seed"]), int(req["steps"]), req["compare"]
    gated, kind, how = Path(req["gated"]), registry.find(tier or ""), registry.find(compare)
    pair = kind is not None and kind.kind == registry.PAIR
    seeds, of_steps = ([int(rc.train.seed)], vcfg.steps) if pair else ([int(s) for s in vcfg.seeds], vcfg.curve_steps)
    if kind is None or kind.kind not in (registry.PAIR, registry.CURVE) or seed not in seeds or \
            not 0 < steps <= of_steps or how is None or how.kind != registry.PAIR:
        raise RuntimeError(f"a replay of the {tier!r} run of seed {seed} (not a seed of {seeds}?), {steps} steps (of "
                           f"{of_steps}), compared {compare!r}: not a replay of the re-check's runs")
    gated_hash = config_hash(run_cfg(rc, Path("."), steps=of_steps, digests=vcfg.digests) if pair else
                             run_cfg(rc, Path("."), steps=of_steps, digests=False, seed=seed))
    problems = recheck.trace_problems(gated, None, of_steps, gated_hash)
    if problems:
        raise RuntimeError(f"the gated run the replay compares with ({gated}) is not the re-check's {tier} run of "
                           f"seed {seed}: {problems[0]}")
    meta, recs = read_trace(gated)
    fv.GOLDEN_ROOT = Path(jspec["golden_root"])
    gdir = golden_location(rc, vcfg, tier)
    if pair:
        golden_init = gdir / "init.safetensors"
        want = init_sha256(load_file(str(golden_init))) if golden_init.is_file() else None
    else:
        want = (golden_init_hashes(gdir, [seed]) or {}).get(seed)
    blob = Path(req["init"]).read_bytes()
    sha = init_sha256(load(blob))
    if want != sha:
        raise RuntimeError(f"the init {req['init']} ({sha[:12]}) is not the reference's init of seed {seed} that the "
                           f"golden stores ({str(want)[:12]}): the replay would not start where the gated run "
                           f"started")
    final = None
    if pair and compare == "bitwise" and steps == of_steps and req.get("final_params", True) and \
            (gated / "final.safetensors").is_file():
        final = (gated / "final.safetensors").read_bytes()  # the weights the user's run must end with
    atomic_write_bytes(init_file, blob)
    window = Path(jspec["run_config"]["data"]["path"]).parent
    shutil.rmtree(out / "_data", ignore_errors=True)
    shutil.copytree(window, out / "_data", ignore=shutil.ignore_patterns(integrity.STAMP))
    manifest = json.loads((out / "_data" / "manifest.json").read_text())
    integrity.verify(out / "_data", manifest)
    return {"meta": meta, "records": recs[:steps], "final": final, "steps": steps, "compare": compare,
            "want_hash": req["want_hash"], "init_sha256": sha, "window": manifest.get("window"),
            "replayed": {"trace": str(gated), "tier": tier, "config_hash": gated_hash, "seed": seed, "steps": steps,
                         "of_steps": of_steps, "compare": compare, "final_params": final is not None}}


def judge_replay(job: dict, trace: Path, out: Path) -> dict:
    """Phase 2: the user's trace dir ``trace`` against the gated run's steps held in ``job``
    (:func:`prepare_replay`). The trace checks first (its config hash is the user's run's, it holds steps 1..N, its
    saved weights are the ones its digests describe, where it has any), then the judge of ``job["compare"]`` with
    the gated steps, written from memory to ``out/replayed/trace``, as the reference: ``bitwise`` on loss, grad
    norm and lr to the bit (no digests or modules required: a user's default run records none), and on the final
    weights where ``job`` holds the gated run's (``final``: then required of the user's run, which exports them by
    default); ``tolerance`` with ``conf/tier/tolerance.yaml``'s per-step thresholds for the run's precision (final
    weights not required). Returns the result (``passed``, ``problems``, ``verdicts``, ``replayed``). Raises
    FileNotFoundError when ``trace`` has no trace."""
    import forgetrain.verify as fv
    from forgetrain.forge import recheck
    from forgetrain.trace import atomic_write_bytes, atomic_write_json

    problems = recheck.trace_problems(trace, None, job["steps"], job["want_hash"])
    res: dict = {"problems": [[5, p] for p in problems], "replayed": job["replayed"]}
    if not problems:
        ref = out / "replayed" / "trace"
        shutil.rmtree(ref, ignore_errors=True)
        atomic_write_json(ref / "meta.json", job["meta"])
        atomic_write_bytes(ref / "trace.jsonl", "".join(json.dumps(r) + "\n" for r in job["records"]).encode())
        final = job.get("final")
        if final is not None:
            atomic_write_bytes(ref / "final.safetensors", final)
        tier = job["compare"]
        over = {"require_digests": False, "require_modules": False} if tier == "bitwise" else {}
        verdicts = fv.judge(tier, dict(over, require_final_params=final is not None), [ref], trace, out / tier)
        res["verdicts"] = [v.to_dict() for v in verdicts]
    res["passed"] = not problems and bool(res.get("verdicts")) and all(v["passed"] for v in res["verdicts"])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._plain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="where the init weights of the user's run go")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    from forgetrain.forge.procs import no_ptrace

    no_ptrace()  # the user's run, which nothing guards, runs while this process waits: no attaching to it
    try:
        from forgetrain.cli import quiet_libraries
        from forgetrain.trace import atomic_write_json

        quiet_libraries()
        import forgetrain.equivalence  # noqa: F401 - the judge's code, loaded before the user's run
        import forgetrain.verify  # noqa: F401
        from forgetrain.forge import recheck  # noqa: F401

        go = _line()
        if "replay" not in go:
            atomic_write_json(out / "plain_result.json", {"stopped": go.get("stop", "no request")})
            return 0
        job = prepare_replay(go["replay"], Path(a.init), out)
        print("ready", flush=True)
        go = _line()
        if "trace" not in go:
            atomic_write_json(out / "plain_result.json", {"stopped": go.get("stop", "no go")})
            return 0
        res = judge_replay(job, Path(go["trace"]), out)
        res.update(init_sha256=job["init_sha256"], window=job["window"])
        atomic_write_json(out / "plain_result.json", res)
        return 0
    except Exception:  # noqa: BLE001 - the loop reports it
        traceback.print_exc()
        return 3


def _line() -> dict:
    """One JSON object from stdin (an empty dict at its end or for anything else)."""
    got = json.loads(sys.stdin.readline() or "null")
    return got if isinstance(got, dict) else {}


if __name__ == "__main__":
    sys.exit(main())
