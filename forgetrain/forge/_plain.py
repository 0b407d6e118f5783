"""The judge's side of the seal's plain re-check (escape class 6): a process that never runs candidate code.

``python -m forgetrain.forge._plain --spec SPEC --init FILE --out DIR`` (started by
:class:`forgetrain.forge.plain.PlainCheck`, never by hand). ``SPEC`` is a judge's spec with freshly drawn values
(:func:`forgetrain.forge.secret.judge_spec`) and one pair tier. In two phases:

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

Writes ``DIR/plain_result.json`` (``passed``, ``problems``, ``verdicts``, ``window``, ``init_sha256``,
``golden_absent_during_run``). Exit 0 when judged (pass or fail), 3 when the judge's side failed.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._plain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--init", required=True, help="where the reference's init for the drawn seed goes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--want-hash", required=True, help="the config hash of the run the user's command describes")
    a = ap.parse_args(argv)
    out = Path(a.out)
    from forgetrain.forge.procs import no_ptrace

    no_ptrace()  # the user's run, which nothing guards, runs while this process waits: no attaching to it
    try:
        from forgetrain.cli import quiet_libraries
        from forgetrain.trace import atomic_write_json

        quiet_libraries()
        jspec = json.loads(Path(a.spec).read_text())
        sha = prepare(jspec, Path(a.init))
        print("ready", flush=True)
        go = json.loads(sys.stdin.readline() or "null")
        if not isinstance(go, dict) or "trace" not in go:
            atomic_write_json(out / "plain_result.json", {"stopped": (go or {}).get("stop", "no go")})
            return 0
        res = judge(jspec, Path(go["trace"]), sha, a.want_hash, out)
        res.update(init_sha256=sha, window=json.loads((Path(jspec["run_config"]["data"]["path"]).parent
                                                       / "manifest.json").read_text()).get("window"))
        atomic_write_json(out / "plain_result.json", res)
        return 0
    except Exception:  # noqa: BLE001 - the loop reports it
        traceback.print_exc()
        return 3


if __name__ == "__main__":
    sys.exit(main())
