"""The candidate's side of a ladder run, in a process of its own that only writes the candidate's trace.

``python -m forgetrain.forge._candidate --engine-dir E --package P --entry M:C --workspace WS --tier TIER --out DIR
--ladder-dir L --golden-root G [--init F | --init-dir I] [--data-dir D] [--shared C ...] [--hide H ...] --report-fd FD
[--judge-cache C]``
(started by ``forgetrain.forge._ladder``, never by hand).

The harness (torch, ``forgetrain.*``) is imported first; then the process is made to look like a user's
``python -m forgetrain.verify`` run (:func:`_as_a_users_run`: ``sys.argv``, ``__main__``, no forge module in
``sys.modules``), the run-time guard is installed (:func:`forgetrain.forge.runtime_guard.install`, reporting on
the pipe ``FD``), and only then is ``E`` loaded, from its ``.py`` source only, as the package ``P`` (the name
the engine is installed under, ``scenarios.NAME``; :func:`forgetrain.forge.workspace.load_engine_class`). The run
itself arrives afterwards, as one JSON line on stdin (``run_config``, ``verify``, ``time_steps``): the judge's
secret values (:mod:`forgetrain.forge.secret`) are never in the process while the engine's modules execute. The
candidate runs the way ``TIER`` judges it (:func:`forgetrain.verify.candidate_trace`) from the init weights ``F``
(a copy of the golden's, outside the golden dir), writing ``DIR/trace/``; for a curve or speed tier with
``--init-dir I`` it makes the runs of :func:`forgetrain.verify.curve_candidate_runs`: paired, one per reference seed
from ``I/seed_<N>.safetensors`` (the judge rebuilt each from its seed and checked it against the golden's hash),
reading that seed's batches (``DIR/candidate_paired_seed<N>/``), then unpaired, one per candidate seed from its
own init (``DIR/candidate_seed<N>/``); with ``time_steps`` it is timed instead
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
import types
from pathlib import Path


def _emit(fd: int, obj: dict) -> None:
    import os

    try:
        os.write(fd, (json.dumps(obj, default=str) + "\n").encode())
    except OSError:
        pass


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._candidate", description=__doc__.split("\n\n")[0])
    for name in ("--engine-dir", "--package", "--entry", "--workspace", "--tier", "--out", "--golden-root"):
        ap.add_argument(name, required=True)
    ap.add_argument("--ladder-dir", required=True, help="the ladder run's dir (the judge's files)")
    ap.add_argument("--init", default=None)
    ap.add_argument("--init-dir", default=None, help="curve tiers: the judge's rebuilt reference inits, "
                                                     "seed_<N>.safetensors per reference seed (read-only)")
    ap.add_argument("--data-dir", default=None, help="the judge's data window (read-only)")
    ap.add_argument("--shared", action="append", default=[], help="a shared cache the candidate may not touch")
    ap.add_argument("--hide", action="append", default=[], help="another of the judge's dirs it may not read")
    ap.add_argument("--report-fd", type=int, required=True)
    ap.add_argument("--judge-cache", default=None, help="the harness's bytecode cache (this process gets a view)")
    return ap.parse_args(argv)


def _as_a_users_run(scenario: str, tier: str) -> None:
    """Make the process's visible state that of ``python -m forgetrain.verify scenario=... tier=...``: its argv,
    its ``__main__``, and no ``forgetrain.forge`` module in ``sys.modules`` (the guard's hook and checks keep their
    own references). What an engine can still observe is listed in docs/forge.md (threat model, class 6)."""
    import forgetrain
    import forgetrain.verify as fv

    argv = [str(Path(fv.__file__)), f"scenario={scenario}", f"tier={tier}"]
    sys.argv[:] = argv
    sys.orig_argv[:] = [sys.executable, "-m", "forgetrain.verify", *argv[1:]]
    main = types.ModuleType("__main__", fv.__doc__)
    main.__file__, main.__spec__ = fv.__file__, fv.__spec__
    sys.modules["__main__"] = main
    for name in [m for m in sys.modules if m == "forgetrain.forge" or m.startswith("forgetrain.forge.")]:
        del sys.modules[name]
    forgetrain.__dict__.pop("forge", None)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    fd, finish, status = a.report_fd, None, 0
    try:
        import torch  # noqa: F401 - the harness's imports come before the guard and the candidate

        import forgetrain.bench as bench
        import forgetrain.equivalence  # noqa: F401 - loaded, so that the guard's snapshot covers it
        import forgetrain.kernels  # noqa: F401
        import forgetrain.train  # noqa: F401
        import forgetrain.verify as fv
        import safetensors.torch  # noqa: F401 - what the trace writer uses, in the snapshot too
        from forgetrain.cli import quiet_libraries
        from forgetrain.config import to_run_config
        from forgetrain.forge import runtime_guard
        from forgetrain.forge.workspace import load_engine_class
        from forgetrain.trace import atomic_write_json

        quiet_libraries()
        out = Path(a.out).resolve()
        init = Path(a.init).resolve() if a.init else Path(a.init_dir).resolve() if a.init_dir else None
        out.mkdir(parents=True, exist_ok=True)
        policy = runtime_guard.build_policy(
            Path(a.engine_dir), out, init, Path(a.golden_root), Path(a.workspace), Path(a.ladder_dir), a.data_dir,
            Path(a.judge_cache) if a.judge_cache else None, shared_caches=tuple(a.shared),
            candidate_package=a.package, hidden=tuple(a.hide))
        _as_a_users_run(a.package.rpartition(".")[2], a.tier)  # before the guard's snapshot of the modules
        finish = runtime_guard.install(policy, fd)
        engine_cls = load_engine_class(Path(a.engine_dir), package=a.package, entry=a.entry)
        go = json.loads(sys.stdin.readline() or "null")  # the run: sent once the engine's modules are loaded
        if not isinstance(go, dict):
            raise RuntimeError("the ladder sent no run (it stopped before the golden was made)")
        rc, vcfg = to_run_config(go["run_config"]), fv.VerifyConfig(**go["verify"])
        # the run's config names the engine it runs: the installed package's name, as a user's config does
        rc = dataclasses.replace(rc, scenario=dataclasses.replace(rc.scenario, engine=f"{a.package}.{a.entry}"))
        if go.get("time_steps"):
            atomic_write_json(out / "times.json", bench.time_engine(rc, engine_cls, int(go["time_steps"])))
        elif a.init_dir:  # a curve tier: paired from each reference seed's init, then the unpaired seeds
            inits = [Path(a.init_dir) / f"seed_{s}.safetensors" for s in vcfg.seeds]
            fv.curve_candidate_runs(rc, vcfg, out, inits, engine_cls)
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
