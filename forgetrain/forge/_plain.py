"""The judge's side of the seal's plain re-check (escape class 6): a process that never runs candidate code.

Started by :class:`forgetrain.forge.plain.PlainCheck`, never by hand, in one of two modes.

``python -m forgetrain.forge._plain --spec SPEC --init FILE --out DIR --want-hash H``: a pair tier. ``SPEC`` is a
judge's spec with freshly drawn values (:func:`forgetrain.forge.secret.judge_spec`) and one pair tier. In two phases:

1. before the user's run: the data window is cut into the dir the spec's ``data.path`` names
   (:func:`forgetrain.forge.secret.build_window`; the user's run reads a copy, the golden this one), and the
   reference's init for the drawn seed is written to ``FILE`` (:func:`forgetrain.equivalence.inits.reference_init`: the
   weights alone, no step taken, nothing of the trajectory a golden holds). The judge's modules are imported,
   then ``ready`` is printed on stdout;
2. one JSON line on stdin, ``{"trace": DIR}`` (the user's run's trace, finished) or ``{"stop": why}``: only then
   is the golden for those values made (:func:`forgetrain.verify.verify` with ``make_golden``, into the spec's
   ``golden_root``, which did not exist until now), its init checked against ``FILE``'s, and the trace judged:
   the trace checks of :mod:`forgetrain.forge.recheck` (the config hash of the run the user's command describes,
   the steps, the saved weights), then :func:`forgetrain.verify.judge` with the tier's config.

``python -m forgetrain.forge._plain --replay --init FILE --out DIR``: a curve tier, whose user run replays one of
the paired runs of the installed copy's gated re-check. The judge's modules are imported first; then:

1. one JSON line on stdin, ``{"replay": REQUEST}`` (:func:`prepare_replay`: the re-check's judge spec, the gated
   run's trace dir and init file, the seed, the steps to replay, ``bitwise`` or ``tolerance``, the config hash of
   the user's run) or ``{"stop": why}``. The gated run's trace is read and checked as the re-check's run of that
   seed, and its first steps are kept in this process's memory; the init is checked against the golden's sha256
   for the seed and written to ``FILE``; the window is copied into ``DIR/_data``; then ``ready``;
2. ``{"trace": DIR}`` or ``{"stop": why}``: the user's trace gets the trace checks of :mod:`forgetrain.forge.recheck`
   and is compared with the steps kept in memory (:func:`judge_replay`).

Writes ``DIR/plain_result.json`` (``passed``, ``problems``, ``verdicts``, ``window``, ``init_sha256``; a pair
tier's ``golden_absent_during_run``, a replay's ``replayed``). Exit 0 when judged (pass or fail), 3 when the
judge's side failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import traceback
from pathlib import Path


def prepare(jspec: dict, init_file: Path) -> str:
    """Phase 1: the window and the reference's init for the drawn seed; returns the init's sha256."""
    from safetensors.torch import save

    import forgetrain.equivalence  # noqa: F401 - the judge's code, loaded before the user's run
    import forgetrain.verify as fv
    from forgetrain.config import to_run_config
    from forgetrain.equivalence.inits import init_sha256, reference_init
    from forgetrain.forge import recheck  # noqa: F401
    from forgetrain.forge.secret import build_window
    from forgetrain.trace import atomic_write_bytes

    build_window(jspec, Path(jspec["run_config"]["data"]["path"]).parent)
    rc, vcfg = to_run_config(jspec["run_config"]), fv.VerifyConfig(**jspec["verify"])
    state = reference_init(rc, vcfg, rc.train.seed)
    atomic_write_bytes(init_file, save(state))
    return init_sha256(state)


def judge(jspec: dict, trace: Path, init_sha: str, want_hash: str, out: Path) -> dict:
    """Phase 2: the golden of the drawn values (made now), then the trace checks and the verdict."""
    import forgetrain.verify as fv
    from forgetrain.config import to_run_config
    from forgetrain.equivalence.inits import init_sha256
    from forgetrain.equivalence.verdict import tier_config
    from forgetrain.forge import recheck
    from forgetrain.forge._golden import golden_location

    rc, vcfg = to_run_config(jspec["run_config"]), fv.VerifyConfig(**jspec["verify"])
    tier = jspec["tiers"][0]
    fv.GOLDEN_ROOT = Path(jspec["golden_root"])
    gdir = golden_location(rc, vcfg, tier)
    res: dict = {"golden_absent_during_run": not Path(jspec["golden_root"]).exists(), "tier": tier}
    fv.verify(rc, dataclasses.replace(vcfg, make_golden=True), tier, out / "_reference")
    shutil.rmtree(out / "_reference", ignore_errors=True)
    from safetensors.torch import load_file

    got = init_sha256(load_file(str(gdir / "init.safetensors")))
    if got != init_sha:
        raise RuntimeError(f"the reference's run of seed {rc.train.seed} started from weights {got[:12]}, not the "
                           f"init the user's run was given ({init_sha[:12]}): the judge cannot compare them")
    problems = recheck.trace_problems(trace, None, vcfg.steps, want_hash)
    res["problems"] = [[5, p] for p in problems]
    if not problems:
        oracle = gdir / "oracle_fp32" / "trace"
        verdicts = fv.judge(tier, tier_config(tier, vcfg.reference), [gdir / "trace"], trace, out / tier,
                            oracle=oracle if oracle.is_dir() else None)
        res["verdicts"] = [v.to_dict() for v in verdicts]
    res["passed"] = not problems and all(v["passed"] for v in res.get("verdicts", [])) and bool(res.get("verdicts"))
    return res


def prepare_replay(req: dict, init_file: Path, out: Path) -> dict:
    """Phase 1 of a curve tier's replay. ``req``: ``spec`` (the re-check's judge spec: run config, verify options,
    golden root, data window), ``gated`` (the trace dir of its paired run of ``seed``), ``init`` (the init file that
    run started from, as its ladder rebuilt it), ``seed``, ``steps`` (how many of its steps the user's run replays),
    ``compare`` (the pair tier it is judged by: ``bitwise`` or ``tolerance``), ``want_hash`` (the config hash of the
    user's run). Checks the gated trace as the re-check's ``curve_steps``-step run of that seed
    (:func:`forgetrain.forge.recheck.trace_problems`), the init's sha256 against the one the golden stores for the
    seed, and the window's files against its manifest; writes the init to ``init_file`` and the window to
    ``out/_data``. Returns the job :func:`judge_replay` needs: the gated trace's meta and first ``steps`` records
    (held in this process's memory from here on), with the request's values. Raises RuntimeError when the gated
    run, its init or the request does not check out, DataError for a damaged window."""
    from safetensors.torch import load

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
    seed, steps, compare, gated = int(req["seed"]), int(req["steps"]), req["compare"], Path(req["gated"])
    how = registry.find(compare)
    if seed not in [int(s) for s in vcfg.seeds] or not 0 < steps <= vcfg.curve_steps or how is None or \
            how.kind != registry.PAIR:
        raise RuntimeError(f"a replay of seed {seed} (not a reference seed of {vcfg.seeds}?), {steps} steps (of "
                           f"{vcfg.curve_steps}), compared {compare!r}: not a replay of the re-check's runs")
    gated_hash = config_hash(run_cfg(rc, Path("."), steps=vcfg.curve_steps, digests=False, seed=seed))
    problems = recheck.trace_problems(gated, None, vcfg.curve_steps, gated_hash)
    if problems:
        raise RuntimeError(f"the gated run the replay compares with ({gated}) is not the re-check's run of seed "
                           f"{seed}: {problems[0]}")
    meta, recs = read_trace(gated)
    fv.GOLDEN_ROOT = Path(jspec["golden_root"])
    hashes = golden_init_hashes(golden_location(rc, vcfg, "loss_curve"), [seed]) or {}
    blob = Path(req["init"]).read_bytes()
    sha = init_sha256(load(blob))
    if hashes.get(seed) != sha:
        raise RuntimeError(f"the init {req['init']} ({sha[:12]}) is not the reference's init of seed {seed} that the "
                           f"golden stores ({str(hashes.get(seed))[:12]}): the replay would not start where the "
                           f"gated run started")
    atomic_write_bytes(init_file, blob)
    window = Path(jspec["run_config"]["data"]["path"]).parent
    shutil.rmtree(out / "_data", ignore_errors=True)
    shutil.copytree(window, out / "_data", ignore=shutil.ignore_patterns(integrity.STAMP))
    manifest = json.loads((out / "_data" / "manifest.json").read_text())
    integrity.verify(out / "_data", manifest)
    return {"meta": meta, "records": recs[:steps], "steps": steps, "compare": compare, "want_hash": req["want_hash"],
            "init_sha256": sha, "window": manifest.get("window"),
            "replayed": {"trace": str(gated), "config_hash": gated_hash, "seed": seed, "steps": steps,
                         "of_steps": vcfg.curve_steps, "compare": compare}}


def judge_replay(job: dict, trace: Path, out: Path) -> dict:
    """Phase 2 of a curve tier's replay: the user's trace dir ``trace`` against the gated run's first steps held in
    ``job`` (:func:`prepare_replay`). The trace checks first (its config hash is the user's run's, it holds steps
    1..N, its saved weights are the ones its digests describe, where it has any), then the judge of
    ``job["compare"]`` with the gated steps, written from memory to ``out/replayed/trace``, as the reference:
    ``bitwise`` on loss, grad norm and lr to the bit (no digests, modules or final weights required: a curve run
    records none), ``tolerance`` with ``conf/tier/tolerance.yaml``'s per-step thresholds for the run's precision
    (final weights not required). Returns the result (``passed``, ``problems``, ``verdicts``, ``replayed``).
    Raises FileNotFoundError when ``trace`` has no trace."""
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
        tier = job["compare"]
        over = {"require_digests": False, "require_modules": False} if tier == "bitwise" else {}
        verdicts = fv.judge(tier, dict(over, require_final_params=False), [ref], trace, out / tier)
        res["verdicts"] = [v.to_dict() for v in verdicts]
    res["passed"] = not problems and bool(res.get("verdicts")) and all(v["passed"] for v in res["verdicts"])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._plain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=None, help="a pair tier: the judge's spec with freshly drawn values")
    ap.add_argument("--init", required=True, help="where the init weights of the user's run go")
    ap.add_argument("--out", required=True)
    ap.add_argument("--want-hash", default=None, help="a pair tier: the config hash of the run the user's command "
                                                      "describes")
    ap.add_argument("--replay", action="store_true", help="a curve tier: replay one of the re-check's paired runs "
                                                          "(the request comes as the first line on stdin)")
    a = ap.parse_args(argv)
    if (a.spec or a.want_hash) if a.replay else not (a.spec and a.want_hash):
        ap.error("give --spec and --want-hash (a pair tier), or --replay (a curve tier)")
    out = Path(a.out)
    from forgetrain.forge.procs import no_ptrace

    no_ptrace()  # the user's run, which nothing guards, runs while this process waits: no attaching to it
    try:
        from forgetrain.cli import quiet_libraries
        from forgetrain.trace import atomic_write_json

        quiet_libraries()
        if a.replay:
            import forgetrain.equivalence  # noqa: F401 - the judge's code, loaded before the user's run
            import forgetrain.verify  # noqa: F401
            from forgetrain.forge import recheck  # noqa: F401

            go = _line()
            if "replay" not in go:
                atomic_write_json(out / "plain_result.json", {"stopped": go.get("stop", "no request")})
                return 0
            job = prepare_replay(go["replay"], Path(a.init), out)
        else:
            jspec = json.loads(Path(a.spec).read_text())
            sha = prepare(jspec, Path(a.init))
        print("ready", flush=True)
        go = _line()
        if "trace" not in go:
            atomic_write_json(out / "plain_result.json", {"stopped": go.get("stop", "no go")})
            return 0
        if a.replay:
            res = judge_replay(job, Path(go["trace"]), out)
            res.update(init_sha256=job["init_sha256"], window=job["window"])
        else:
            res = judge(jspec, Path(go["trace"]), sha, a.want_hash, out)
            res.update(init_sha256=sha, window=json.loads((Path(jspec["run_config"]["data"]["path"]).parent
                                                           / "manifest.json").read_text()).get("window"))
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
