"""The candidate's side of a ladder run, in a process of its own that only writes the candidate's trace.

``python -m forgetrain.forge._candidate --spec SPEC --workspace WS --tier TIER --out DIR --ladder-dir L
[--init F] [--time-steps N] --report-fd FD [--judge-cache C]`` (started by ``forgetrain.forge._ladder``, never by hand).

The harness (torch, ``forgetrain.*``) is imported first; then the run-time guard is installed
(:func:`forgetrain.forge.runtime_guard.install`, reporting on the pipe ``FD``), and only then is ``WS/engine``
loaded, from its ``.py`` source only (:func:`forgetrain.forge.workspace.load_engine_class`). The candidate runs the
way ``TIER`` judges it (:func:`forgetrain.verify.candidate_trace`) from the init weights ``F`` (a copy of the
golden's, outside the golden dir), writing ``DIR/trace/``; with ``--time-steps`` it is timed instead
(:func:`forgetrain.bench.time_engine`, ``DIR/times.json``: one block of surpass's A-B-A). The guard's checks after
the run close the report. No verdict is computed here: the ladder process judges the trace.

Exit 0 when the run finished, 3 when the candidate raised (the error and its traceback are on the report).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path


def _emit(fd: int, obj: dict) -> None:
    import os

    try:
        os.write(fd, (json.dumps(obj, default=str) + "\n").encode())
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._candidate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--tier", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", default=None)
    ap.add_argument("--ladder-dir", required=True, help="the ladder run's dir (the judge's files)")
    ap.add_argument("--time-steps", type=int, default=0)
    ap.add_argument("--report-fd", type=int, required=True)
    ap.add_argument("--judge-cache", default=None, help="the harness's bytecode cache (this process gets a view)")
    a = ap.parse_args(argv)
    fd, finish, status = a.report_fd, None, 0
    try:
        import torch  # noqa: F401 - the harness's imports come before the guard and the candidate

        import forgetrain.bench as bench
        import forgetrain.equivalence  # noqa: F401 - loaded, so that the guard's snapshot covers it
        import forgetrain.kernels  # noqa: F401
        import forgetrain.train  # noqa: F401
        import forgetrain.verify as fv
        from forgetrain.cli import _quiet_libraries
        from forgetrain.config import to_run_config
        from forgetrain.forge import runtime_guard
        from forgetrain.forge.workspace import ENGINE_DIR, load_engine_class, workspace_entry
        from forgetrain.trace import atomic_write_json

        _quiet_libraries()
        spec = json.loads(Path(a.spec).read_text())
        rc, vcfg = to_run_config(spec["run_config"]), fv.VerifyConfig(**spec["verify"])
        ws, out = Path(a.workspace).resolve(), Path(a.out).resolve()
        init = Path(a.init).resolve() if a.init else None
        out.mkdir(parents=True, exist_ok=True)
        from forgetrain.data.prepare import default_cache_dir

        entry = workspace_entry(ws)  # scenario.yaml names the engine class; read before the guard is on
        policy = runtime_guard.build_policy(ws / ENGINE_DIR, out, init, Path(spec["golden_root"]), ws,
                                            Path(a.ladder_dir), rc.data.cache_dir or default_cache_dir(),
                                            Path(a.judge_cache) if a.judge_cache else None)
        finish = runtime_guard.install(policy, fd)
        engine_cls = load_engine_class(ws / ENGINE_DIR, entry=entry)
        # the run's config names the engine it runs: the loaded candidate package, not the scenario's template
        # (whose module this process must not execute)
        rc = dataclasses.replace(rc, scenario=dataclasses.replace(
            rc.scenario, engine=f"{runtime_guard.CANDIDATE_PACKAGE}.{entry}"))
        if a.time_steps:
            atomic_write_json(out / "times.json", bench.time_engine(rc, engine_cls, a.time_steps))
        else:
            fv.candidate_trace(rc, vcfg, a.tier, out, init, engine_cls)
    except BaseException as e:  # noqa: BLE001 - a broken candidate is a result, reported on the pipe
        msg = str(e).strip()
        _emit(fd, {"error": f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}",
                   "traceback": traceback.format_exc()[-4000:]})
        status = 3
    finally:
        if finish is not None:
            finish()
    return status


if __name__ == "__main__":
    sys.exit(main())
