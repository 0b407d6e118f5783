"""The kernel forge's gate: ``python -m forgetrain.forge._kernel_gate --spec S --workspace W --out O --result R``.

Judges the kernel file of a kernel-forge workspace (:mod:`forgetrain.forge.kernel`), strictest first, each stage
in a process of its own (Triton's CPU interpreter keeps state between kernels in one process, and the reference
golden is made in a process that never loaded the candidate):

1. ``oracle``: :func:`forgetrain.kernels.validate.validate` of the candidate against the fp64 oracle, no worse
   than the replaced op. The contract (inputs, oracle, replaced op, shape grid) comes from the repository's
   kernel module, never from the workspace: only the candidate's public function (the switch's first ``api``
   name) is taken from the kernel file. Shapes ``small`` on CPU (Triton interpreter), ``full`` on CUDA.
2. ``speed``: at every bench shape (``small`` on CPU) the candidate and the current reference kernel (the last
   sealed source) run forward + backward, interleaved in blocks; each block's median is one sample.
   :func:`forgetrain.equivalence.tiers.surpass.speed_stats` (the surpass tier's statistics) must find the
   candidate faster beyond the noise at every shape. Timers: ``cuda`` (CUDA events, :func:`forgetrain.kernels.
   bench.time_kernel`), ``wall`` (perf_counter) and ``fake`` (tests only: each source's ``# forge-fake-ms: X`` line,
   default 1.0, with 1 % seeded noise; nothing runs).
3. ``e2e``: the scenario engine that honours the switch trains ``steps`` steps from the reference's initial
   weights with ``kernels.<op>=<forged value>``, the candidate file standing in for the repository's kernel
   module, and is judged at the tier the switch value declares (:mod:`forgetrain.kernels.switches`) against the
   reference golden (stage ``golden``, made once per run).

The result JSON: ``{"passed", "failed_stage", "stages": [{"stage", "passed", "summary", ...}], "validation",
"timings", "device", "versions"}``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

STAGES = ("oracle", "speed", "e2e")
FAKE_RE = re.compile(r"^#\s*forge-fake-ms:\s*([0-9.eE+-]+)\s*$", re.M)


def _load(path: Path, modname: str):
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    spec.loader.exec_module(mod)
    return mod


def _contract(spec: dict):
    """(trusted kernel module, switch) from the repository."""
    from forgetrain.kernels import switches

    sw = next(s for s in switches.SWITCHES if s.kernel == spec["kernel"])
    return importlib.import_module(f"forgetrain.kernels.{spec['kernel']}"), sw


def _candidate_spec(trusted, sw, path: Path, modname: str):
    import dataclasses

    mod = _load(path, modname)
    fn = getattr(mod, sw.api[0], None)
    if not callable(fn):
        raise AttributeError(f"{path.name} defines no function {sw.api[0]} (the kernel's public API)")
    return dataclasses.replace(trusted.SPEC, candidate=trusted.candidate_from(fn))


# ------------------------------------------------------------------------------------------------ stages

def stage_oracle(spec: dict, ws: Path, out: Path) -> dict:
    from forgetrain.kernels.validate import validate

    trusted, sw = _contract(spec)
    cand = _candidate_spec(trusted, sw, ws / spec["candidate"], "_forge_kernel_candidate")
    rep = validate(cand, spec["device"], shapes=spec["shapes"], seed=spec.get("seed"))
    first = rep.failures[0] if rep.failures else ""
    summary = (f"fp64 oracle: {len(rep.cases)} cases at {spec['shapes']} shapes, no worse than the replaced op"
               if rep.passed else f"fp64 oracle: {first}")
    return {"stage": "oracle", "passed": bool(rep.passed), "summary": summary,
            "failures": list(rep.failures)[:10],
            "validation": {"shapes": rep.shapes, "seed": rep.seed, "tolerances_version": rep.tolerances_version,
                           "cases": [{"shape": c.shape, "dtype": c.dtype, "ok": c.ok} for c in rep.cases],
                           "worst": rep.worst()}}


def fake_samples(source: str, n: int) -> list[float]:
    """Tests' timer: ``n`` timings (ms) around the source's ``# forge-fake-ms: X`` (1.0 when absent), 1 % noise
    seeded by the source's hash."""
    import numpy as np

    m = FAKE_RE.search(source)
    ms = float(m.group(1)) if m else 1.0
    rng = np.random.default_rng(int(hashlib.sha256(source.encode()).hexdigest()[:8], 16))
    return [float(x) for x in ms * (1.0 + 0.01 * np.abs(rng.standard_normal(n)))]


def _measured_samples(spec: dict, trusted, sw, ws: Path, shape: dict) -> tuple[list, list]:
    import statistics

    import torch

    from forgetrain.kernels.bench import time_kernel

    device = torch.device(spec["device"])
    cand = _candidate_spec(trusted, sw, ws / spec["candidate"], "_forge_kernel_candidate")
    ref = _candidate_spec(trusted, sw, Path(spec["reference_source"]), "_forge_kernel_reference")
    dtype = trusted.SPEC.dtypes[0]
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = trusted.SPEC.make_inputs(dict(shape), dtype, device, gen)
    diff = list(trusted.SPEC.differentiable)
    with torch.no_grad():
        outs = trusted.SPEC.reference(inputs)
    up = {k: torch.randn(outs[k].shape, device=device, generator=gen).to(outs[k].dtype)
          for k in trusted.SPEC.grad_outputs}

    def step_of(s):
        def step(_k):
            inp = dict(inputs)
            if not diff:
                with torch.no_grad():
                    s.candidate({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()})
                return
            for d in diff:
                inp[d] = inputs[d].detach().requires_grad_(True)
            o = s.candidate(inp)
            torch.autograd.grad([o[n] for n in up], [inp[d] for d in diff], [up[n] for n in up])
        return step

    c_step, r_step = step_of(cand), step_of(ref)
    c_ms, r_ms = [], []
    for i in range(int(spec["repeats"])):  # interleaved blocks: drift hits both sides alike
        warm = 3 if i == 0 else 0
        r_ms.append(statistics.median(time_kernel(r_step, 1, warm, 5, device)))
        c_ms.append(statistics.median(time_kernel(c_step, 1, warm, 5, device)))
    return r_ms, c_ms


def stage_speed(spec: dict, ws: Path, out: Path) -> dict:
    from forgetrain.equivalence.tiers.surpass import speed_stats

    trusted, sw = _contract(spec)
    grid = trusted.SPEC.grid("bench" if spec["device"] == "cuda" else "small")
    cand_src = (ws / spec["candidate"]).read_text()
    ref_src = Path(spec["reference_source"]).read_text()
    cases, ok = [], True
    for shape in grid:
        if spec["timer"] == "fake":
            r, c = fake_samples(ref_src, spec["repeats"]), fake_samples(cand_src, spec["repeats"])
        else:
            r, c = _measured_samples(spec, trusted, sw, ws, shape)
        st = speed_stats(r, c)
        fast = bool(st.get("faster_beyond_noise"))
        ok = ok and fast
        cases.append({"shape": shape, "ref_ms": st.get("median_ref_step_s"), "cand_ms": st.get("median_cand_step_s"),
                      "speedup": st.get("speedup"), "required_speedup": st.get("required_speedup"),
                      "noise": st.get("noise"), "faster_beyond_noise": fast, "reason": st.get("reason"),
                      "n": [st["n_ref"], st["n_cand"]]})
    worst = min(cases, key=lambda x: x["speedup"] or 0.0)
    summary = (f"{'faster' if ok else 'not faster'} than the reference kernel beyond noise at "
               f"{sum(c['faster_beyond_noise'] for c in cases)}/{len(cases)} shapes; worst {worst['shape']}: "
               f"speedup {worst['speedup'] or 0:.3f}x (needs > {worst['required_speedup'] or 0:.3f}x)")
    return {"stage": "speed", "passed": ok, "summary": summary, "timer": spec["timer"],
            "timings": {"timer": spec["timer"], "unit": "ms", "cases": cases}}


def _e2e_cfg(spec: dict):
    from forgetrain.config import to_run_config

    return to_run_config(spec["e2e"]["run_config"])


def stage_golden(spec: dict, ws: Path, out: Path) -> dict:
    """The reference's run (and, in reduced precision, its fp32 oracle run) from which gate 3 judges."""
    from forgetrain.verify import VerifyConfig, reference_oracle, run_reference

    e = spec["e2e"]
    gdir, cfg, vcfg = Path(e["golden"]), _e2e_cfg(spec), VerifyConfig(steps=e["steps"])
    run_reference(cfg, vcfg, gdir, e["steps"])
    reference_oracle(cfg, vcfg, gdir / "oracle", e["steps"], gdir / "init.safetensors")
    return {"stage": "golden", "passed": (gdir / "trace").is_dir(), "summary": f"reference golden in {gdir}"}


def stage_e2e(spec: dict, ws: Path, out: Path) -> dict:
    from forgetrain import registry
    from forgetrain.equivalence import load_tier
    from forgetrain.verify import VerifyConfig, judge, run_candidate

    e = spec["e2e"]
    # the candidate stands in for the repository's kernel module before any engine imports it
    _load(ws / spec["candidate"], f"forgetrain.kernels.{spec['kernel']}")
    cfg = _e2e_cfg(spec)
    gdir = Path(e["golden"])
    cand = run_candidate(cfg, VerifyConfig(steps=e["steps"]), out / "e2e_cand", e["steps"],
                         gdir / "init.safetensors", registry.resolve_engine(cfg.scenario.engine))
    oracle = gdir / "oracle" / "trace"
    v = judge(e["tier"], dict(load_tier(e["tier"])), [gdir / "trace"], cand / "trace",
              oracle=oracle if oracle.is_dir() else None)[0]
    return {"stage": "e2e", "passed": bool(v.passed), "summary": f"{e['tier']} in {cfg.scenario.name} "
            f"({e['switch']}): {v.summary}", "tier": e["tier"], "first_divergence": v.first_divergence}


RUN = {"oracle": stage_oracle, "speed": stage_speed, "golden": stage_golden, "e2e": stage_e2e}


# ------------------------------------------------------------------------------------------------ orchestration

def _stage_process(stage: str, args, env: dict) -> dict:
    res = Path(args.out) / f"{stage}.json"
    res.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "forgetrain.forge._kernel_gate", "--spec", args.spec, "--workspace",
           args.workspace, "--out", args.out, "--result", str(res), "--stage", stage]
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    with open(Path(args.out) / "gate.log", "a") as log:
        log.write(f"== {stage} (rc {p.returncode})\n{p.stdout}{p.stderr}\n")
    if res.exists():
        return json.loads(res.read_text())
    return {"stage": stage, "passed": False, "summary": f"the {stage} stage crashed (rc {p.returncode})",
            "traceback": (p.stderr or "")[-3000:]}


def orchestrate(args) -> dict:
    spec = json.loads(Path(args.spec).read_text())
    env = dict(os.environ)
    if spec["device"] == "cpu":
        env["TRITON_INTERPRET"] = "1"
    stages: list = []
    result = {"passed": False, "failed_stage": None, "device": spec["device"], "kernel": spec["kernel"],
              "stages": stages}
    t0 = time.monotonic()
    for stage in spec.get("stages") or STAGES:
        if stage == "e2e" and not (Path(spec["e2e"]["golden"]) / "trace").is_dir():
            g = _stage_process("golden", args, env)
            if not g["passed"]:
                stages.append(dict(g, stage="e2e", summary=f"reference golden failed: {g['summary']}"))
                result["failed_stage"] = "e2e"
                break
        t1 = time.monotonic()
        if stage == "speed" and spec["timer"] == "fake":  # nothing of the candidate runs: no process needed
            r = stage_speed(spec, Path(args.workspace).resolve(), Path(args.out))
        else:
            r = _stage_process(stage, args, env)
        r["wall_s"] = round(time.monotonic() - t1, 3)
        stages.append(r)
        for k in ("validation", "timings"):
            if k in r:
                result[k] = r.pop(k)
        if not r["passed"]:
            result["failed_stage"] = stage
            break
    else:
        result["passed"] = True
    result["wall_s"] = round(time.monotonic() - t0, 3)
    from forgetrain.kernels.seal import device_name_of, versions

    os.environ.update({k: v for k, v in env.items() if k == "TRITON_INTERPRET"})
    result["device_name"] = device_name_of(spec["device"])
    result["versions"] = versions()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._kernel_gate")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--stage", choices=tuple(RUN), default=None)
    args = ap.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage is None:
        res = orchestrate(args)
    else:
        spec = json.loads(Path(args.spec).read_text())
        try:
            res = RUN[args.stage](spec, Path(args.workspace).resolve(), Path(args.out))
        except Exception as e:  # noqa: BLE001 - a crashing candidate fails its stage, with the traceback
            res = {"stage": args.stage, "passed": False, "summary": f"{type(e).__name__}: {e}".splitlines()[0],
                   "traceback": traceback.format_exc()[-3000:]}
    from forgetrain.trace import atomic_write_json

    atomic_write_json(Path(args.result), res)
    print(json.dumps({k: res.get(k) for k in ("passed", "failed_stage", "summary")}))
    return 0 if res.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
