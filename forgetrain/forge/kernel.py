"""The kernel target of the forge: ``python -m forgetrain.forge kernel=NAME scenario=S agent.command=...``.

The same loop as for engines (brief -> agent -> guard -> gate -> record -> learn -> seal), on one forged kernel of
:mod:`forgetrain.kernels` (a switch of :mod:`forgetrain.kernels.switches` with a forged value):

* **Reference.** The kernel store (``forge.kernel_store``, default ``outputs/forge/kernel_store``) holds, per
  kernel and device type, the last sealed source and its seal, in ``registry.json`` (the format of
  :mod:`forgetrain.kernels.seal`, plus ``timer``, ``speed``, ``e2e`` and ``forge``) and ``sources/``. With no seal
  there, the reference is ``forge.seed_from`` (a kernel ``.py``) or the repository's kernel; round 0 checks it
  against the fp64 oracle, times it and seals it in the store.
* **Workspace** (a git repo): ``kernel/<name>.py`` (the reference's source), ``spec.json`` (the contract: the op
  replaced, inputs, outputs, saved tensors, dtypes, shape grids, the switch and its tier, the reference's
  timings) and ``BRIEF.md``. The agent may change only ``kernel/<name>.py``; any other change rejects and reverts
  the round.
* **Gate** (:mod:`forgetrain.forge._kernel_gate`, a process of its own): fp64 oracle, then speed against the
  reference kernel (the surpass tier's statistics), then the end-to-end tier the switch value declares in
  ``scenario`` (its engine must honour the switch).
* **Seal.** A round that passes all three seals the kernel into the store: it becomes the reference of the next
  run for this kernel and device. A run that never passes leaves the reference in place.
* **Knowledge.** A gate stage that failed in one round and passes in a later one leaves a lesson keyed by kernel
  and device (mechanism, evidence, the diff of the kernel file); briefs of later kernel runs on that device show
  them (``forge.mode=full``; ``goal_only`` briefs carry the goal, the contract and the gate command only).

Out dir (default ``outputs/forge/kernel-<name>/<device>/<mode>``): ``workspace/``, ``gate_spec.json``,
``rounds/<k>/`` (BRIEF.md, agent output, gate/ and gate_result.json), ``forge_log.jsonl``, ``kernel_state.json``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from forgetrain.config import KernelsConfig, RunConfig, validate
from forgetrain.errors import ConfigError
from forgetrain.forge import MODES, AgentConfig, ForgeOptions
from forgetrain.forge import workspace as wsmod
from forgetrain.forge.knowledge import KnowledgeBase, fix_line
from forgetrain.forge.startup import check_agent_command
from forgetrain.kernels import switches
from forgetrain.kernels.switches import file_sha256
from forgetrain.trace import atomic_write_bytes, atomic_write_json

GateFn = Callable[[Path, Path, Path, Path], dict]
KERNEL_DIR = "kernel"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _dev(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


# ---------------------------------------------------------------------------------------------------- the store

class KernelStore:
    """Sealed kernel sources per kernel and device type: ``<root>/registry.json`` + ``<root>/sources/``."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.path = self.root / "registry.json"

    def load(self) -> dict:
        from forgetrain.kernels.seal import load_registry

        try:
            return load_registry(self.path)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def entry(self, kernel: str, device: str) -> dict | None:
        """The current seal of ``kernel`` on ``device``, or None; ConfigError when its source was modified."""
        e = self.load()["kernels"].get(kernel, {}).get(_dev(device))
        if e is None:
            return None
        src = self.root / e["source_file"]
        if not src.exists() or file_sha256(src) != e["source_sha256"]:
            raise ConfigError(f"kernel store {self.root}: the sealed source of {kernel} on {_dev(device)} is missing "
                              f"or modified ({e['source_file']}); restore it or remove the entry")
        return e

    def seal(self, kernel: str, device: str, source: Path, gate: dict, contract: dict, forge: dict) -> dict:
        """Record ``source`` as the reference of ``kernel`` on ``device``; returns the entry."""
        sha = file_sha256(source)
        rel = Path("sources") / f"{kernel}-{_dev(device)}-{sha[:12]}.py"
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, self.root / rel)
        val = gate.get("validation") or {}
        stages = {s["stage"]: s for s in gate.get("stages", [])}
        entry = {"source_sha256": sha, "source_file": str(rel),
                 "sealed_at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
                 "device": gate.get("device"), "device_name": gate.get("device_name"),
                 "versions": gate.get("versions"), "tolerances_version": val.get("tolerances_version"),
                 "contract": contract, "validation": {k: val.get(k) for k in ("shapes", "seed", "cases", "worst")},
                 "timings": gate.get("timings"), "timer": (gate.get("timings") or {}).get("timer"),
                 "speed": stages.get("speed", {}).get("summary"), "e2e": stages.get("e2e", {}).get("summary"),
                 "forge": forge}
        reg = self.load()
        reg["kernels"].setdefault(kernel, {})[_dev(device)] = entry
        atomic_write_json(self.path, reg)
        return entry


# ---------------------------------------------------------------------------------------------------- setup

def _switch(kernel: str):
    sw = next((s for s in switches.SWITCHES if s.kernel == kernel), None)
    if sw is None:
        raise ConfigError(f"unknown kernel '{kernel}'; known: {', '.join(switches.kernels())}")
    return sw, next(v for v in sw.values if v.forged)


def e2e_config(rc: RunConfig, kernel: str, opts: ForgeOptions) -> RunConfig:
    """The scenario run of gate 3: every switch at its default but this kernel's forged value and the values it
    needs (``Switch.needs``, e.g. ``kernels.cross_entropy=chunked`` for ``kernels.ce_chunk``; unsealed allowed:
    the forge judges the candidate itself), ``forge.verify_steps`` steps. ConfigError when the scenario's engine
    does not honour the switch."""
    sw, val = _switch(kernel)
    c = dataclasses.replace(
        rc, kernels=KernelsConfig(**sw.required(val.name), **{sw.name: val.name}, allow_unsealed=True),
        train=dataclasses.replace(rc.train, steps=opts.verify_steps, lr_decay_steps=None, out_dir=None,
                                  lr_warmup_steps=max(0, min(rc.train.lr_warmup_steps, opts.verify_steps - 1)),
                                  sample_tokens=0, resume=False, stop_after=None))
    try:
        validate(c)
    except ConfigError as e:
        raise ConfigError(f"forge kernel={kernel}: scenario={rc.scenario.name} cannot run the kernel end to end: "
                          f"{e}; pick a scenario whose engine honours kernels.{sw.name}={val.name} "
                          f"(e.g. scenario=llama1b_h200)") from None
    return c


def check_request(kernel: str, opts: ForgeOptions, agent: AgentConfig) -> None:
    _switch(kernel)
    if opts.mode not in MODES:
        raise ConfigError(f"forge.mode must be one of {', '.join(MODES)}, got '{opts.mode}'")
    if opts.max_rounds < 0:
        raise ConfigError(f"forge.max_rounds must be >= 0, got {opts.max_rounds}")
    check_agent_command(agent.command)
    if opts.max_rounds > 0 and not (agent.command or "").strip():
        raise ConfigError("set agent.command (docs/forge.md)")
    if opts.resume:
        raise ConfigError("forge.resume is not supported for kernel targets; rerun with forge.overwrite=true")
    if opts.kernel_timer not in ("auto", "cuda", "wall", "fake"):
        raise ConfigError(f"forge.kernel_timer must be auto|cuda|wall|fake, got '{opts.kernel_timer}'")
    if opts.kernel_repeats < 10:
        raise ConfigError(f"forge.kernel_repeats must be >= 10 (the surpass tier's min_samples), got "
                          f"{opts.kernel_repeats}")
    if opts.seed_from and not Path(opts.seed_from).is_file():
        raise ConfigError(f"forge.seed_from={opts.seed_from}: for a kernel target, a kernel .py file")
    if shutil.which("git") is None:
        raise ConfigError("the forge workspace needs git on PATH")


def subprocess_gate(spec: Path, ws: Path, out: Path, result: Path) -> dict:
    """The default gate: ``python -m forgetrain.forge._kernel_gate`` in a process of its own."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(wsmod.REPO_ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
    with open(out / "gate.stdout", "wb") as log:
        subprocess.run([wsmod.python(), "-m", "forgetrain.forge._kernel_gate", "--spec", str(spec), "--workspace",
                        str(ws), "--out", str(out), "--result", str(result)], cwd=out, env=env,
                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    if not result.exists():
        return {"passed": False, "failed_stage": "gate", "stages": [
            {"stage": "gate", "passed": False, "summary": f"the gate process died; see {out / 'gate.stdout'}"}]}
    return json.loads(result.read_text())


# ---------------------------------------------------------------------------------------------------- the brief

def _ms(t: dict | None) -> str:
    if not t or not t.get("cases"):
        return "(no timings)"
    return "; ".join(f"{json.dumps(c['shape'])}: {c.get('cand_ms') or 0:.4g} {t.get('unit', 'ms')}"
                     for c in t["cases"]) + f" (timer: {t.get('timer')})"


def render_brief(ctx: dict) -> str:
    """BRIEF.md of one kernel round. ``ctx``: kernel, device, mode, round, max_rounds, contract, switch, tier,
    scenario, reference (entry), gate_command, agent_timeout_s; full mode also history, last, lessons."""
    c, ref = ctx["contract"], ctx["reference"] or {}
    lines = [f"# Kernel forge brief: `{ctx['kernel']}` on {ctx['device']}, round {ctx['round']}/{ctx['max_rounds']}",
             "", "## Goal", "",
             f"Make `{KERNEL_DIR}/{ctx['kernel']}.py` faster than the current reference kernel (source sha256 "
             f"{str(ref.get('source_sha256'))[:12]}, sealed {ref.get('sealed_at')}) while it stays correct. The "
             "gate, strictest first:",
             f"1. fp64 oracle: forward and backward no worse than the replaced op (`{c['replaces']}`) at the "
             f"{ctx['shapes']} shapes;",
             "2. speed: faster than the reference kernel beyond the measured noise at every bench shape (the surpass "
             "tier's statistics);",
             f"3. end to end: `{ctx['switch']}` in scenario `{ctx['scenario']}` passes the **{ctx['tier']}** tier.",
             "", "## Contract (spec.json has all of it)", "",
             f"- API: `{c['api']}`", f"- replaces: `{c['replaces']}`",
             f"- inputs: `{json.dumps(c['inputs'])}`", f"- outputs: `{json.dumps(c['outputs'])}`",
             f"- saved for backward: `{json.dumps(c['saved'])}`", f"- dtypes: {', '.join(c['dtypes'])}",
             f"- shape grid: `{json.dumps(c['shapes'])}`",
             f"- the bar (reference timings): {_ms(ref.get('timings'))}", "",
             "## Constraints", "",
             f"- Edit only `{KERNEL_DIR}/{ctx['kernel']}.py`; keep its public function names. Any other change "
             "rejects and reverts the round. Scratch files go under `.gate/` (git-ignored).",
             f"- Each round has a time limit of {ctx['agent_timeout_s']:.0f} s.", "",
             "## Gate command", "", "```", ctx["gate_command"], "```", ""]
    if ctx["mode"] == "goal_only":
        return "\n".join(lines)
    lines += ["## Rounds so far", ""]
    hist = ctx.get("history") or []
    lines += ["| round | guard | gate |", "|---|---|---|"] + [
        f"| {r['round']} | {r.get('guard', '-')} | {r.get('gate', '-')} |" for r in hist] if hist else ["(none)"]
    last = ctx.get("last")
    if last:
        lines += ["", f"### Last gate (round {last.get('round')})", ""]
        for s in last.get("stages", []):
            lines.append(f"- **{s['stage']}: {'PASS' if s['passed'] else 'FAIL'}** -- {s['summary']}")
            lines += [f"  - {f}" for f in s.get("failures", [])[:5]]
    lines += ["", f"## Lessons for {ctx['kernel']} on {ctx['device']}", ""]
    for x in ctx.get("lessons") or []:
        lines.append(f"- **{x.get('pitfall')}** (seen {x.get('count', 1)}x)")
        ev = x.get("evidence") or {}
        if ev.get("mechanism"):
            lines.append(f"  - mechanism: {ev['mechanism']}")
        lines.append(f"  - evidence: failed {ev.get('failed')}; passed {ev.get('passed')}")
        lines += [f"  - diff that passed: {fix_line(f)[:400]}" for f in x.get("fixes", [])]
    if not ctx.get("lessons"):
        lines.append("(none recorded yet)")
    return "\n".join(lines + [""])


# ---------------------------------------------------------------------------------------------------- the run

class KernelRun:
    def __init__(self, rc: RunConfig, kernel: str, opts: ForgeOptions, agent: AgentConfig, gate_fn: GateFn | None):
        self.rc, self.kernel, self.opts, self.agent = rc, kernel, opts, agent
        self.device = _dev(rc.hardware.device)
        self.sw, self.val = _switch(kernel)
        self.out = Path(opts.out_dir or Path("outputs") / "forge" / f"kernel-{kernel}" / self.device /
                        opts.mode).resolve()
        self.ws = self.out / "workspace"
        self.rel = f"{KERNEL_DIR}/{kernel}.py"
        self.store = KernelStore(opts.kernel_store or Path("outputs") / "forge" / "kernel_store")
        self.kb = KnowledgeBase(opts.kb_path)
        self.key = f"kernel:{kernel}@{self.device}"
        self.gate_fn = gate_fn or subprocess_gate
        self.e2e = e2e_config(rc, kernel, opts)
        self.records: list[dict] = []
        self.state: dict = {}

    def contract(self) -> dict:
        from forgetrain.kernels import get_spec

        return get_spec(self.kernel).describe()

    def gate_spec(self, ref_source: Path, golden: Path) -> dict:
        timer = self.opts.kernel_timer
        if timer == "auto":
            timer = "cuda" if self.device == "cuda" else "wall"
        return {"kernel": self.kernel, "device": self.device, "shapes": "full" if self.device == "cuda" else "small",
                "timer": timer, "repeats": self.opts.kernel_repeats, "candidate": self.rel, "seed": None,
                "reference_source": str(ref_source),
                "e2e": {"run_config": dataclasses.asdict(self.e2e), "tier": self.val.tier, "steps": self.opts.verify_steps,
                        "switch": f"kernels.{self.sw.name}={self.val.name}", "golden": str(golden)}}

    def gate(self, rdir: Path, spec_path: Path) -> dict:
        res = self.gate_fn(spec_path, self.ws, rdir / "gate", rdir / "gate_result.json")
        atomic_write_json(rdir / "gate_result.json", res)
        return res

    def prepare(self) -> None:
        if (self.out / "kernel_state.json").exists() and not self.opts.overwrite:
            raise ConfigError(f"a kernel forge run exists at {self.out}; rerun with forge.overwrite=true")
        shutil.rmtree(self.out, ignore_errors=True)
        self.out.mkdir(parents=True)
        ref = self.store.entry(self.kernel, self.device)
        if ref is not None:
            src, origin = self.store.root / ref["source_file"], f"kernel store {self.store.root}"
        else:
            src = Path(self.opts.seed_from).resolve() if self.opts.seed_from else \
                switches.KERNEL_DIR / f"{self.kernel}.py"
            origin = str(src)
        self.ref_source = self.out / "reference.py"  # the run's copy: the store may change when this run seals
        shutil.copyfile(src, self.ref_source)
        self.ws.mkdir()
        (self.ws / KERNEL_DIR).mkdir()
        shutil.copyfile(src, self.ws / self.rel)
        contract = self.contract()
        gs = self.gate_spec(self.ref_source, self.out / "golden")
        atomic_write_json(self.out / "gate_spec.json", gs)
        agent_spec = dict(gs, e2e=dict(gs["e2e"], golden=".gate/golden"))
        (self.ws / "spec.json").write_text(json.dumps({"contract": contract, "switch": gs["e2e"]["switch"],
                                                       "tier": self.val.tier, "scenario": self.rc.scenario.name,
                                                       "reference": ref, "gate": agent_spec}, indent=1, default=str))
        (self.ws / ".gitignore").write_text("__pycache__/\n*.pyc\n/.gate/\n")
        (self.ws / "BRIEF.md").write_text("(written by the harness each round)\n")
        wsmod.git(self.ws, "init", "-q")
        wsmod.git(self.ws, "add", "-A")
        wsmod.git(self.ws, "commit", "-q", "-m", f"seed: {self.kernel} from {origin}")
        self.state = {"kernel": self.kernel, "device": self.device, "mode": self.opts.mode, "round": 0,
                      "status": "running", "reference": ref, "reference_origin": origin, "failures": {},
                      "commit": wsmod.git(self.ws, "rev-parse", "HEAD")}
        self.contract_d = contract
        _say(f"[forge] kernel run: {self.kernel} on {self.device} ({self.opts.mode}) -> {self.out}; reference: "
             f"{origin} ({file_sha256(src)[:12]})")

    def save(self) -> None:
        atomic_write_json(self.out / "kernel_state.json", self.state)
        atomic_write_bytes(self.out / "forge_log.jsonl",
                           "".join(json.dumps(r, default=str) + "\n" for r in self.records).encode())

    def baseline(self) -> None:
        """Round 0, when the store has no seal for this kernel and device: the reference must pass the oracle;
        it is timed against itself and sealed in the store as the bar."""
        rdir = self.out / "rounds" / "0"
        rdir.mkdir(parents=True)
        spec = dict(json.loads((self.out / "gate_spec.json").read_text()), stages=["oracle", "speed"])
        atomic_write_json(rdir / "baseline_spec.json", spec)
        res = self.gate(rdir, rdir / "baseline_spec.json")
        oracle = next((s for s in res.get("stages", []) if s["stage"] == "oracle"), None)
        if not oracle or not oracle["passed"]:
            raise ConfigError(f"the reference kernel {self.state['reference_origin']} fails its oracle: "
                              f"{(oracle or {}).get('summary', res)}")
        t = res.get("timings") or {}
        for c in t.get("cases", []):  # timed against itself: the reference's own times are the bar
            c["cand_ms"] = c.get("ref_ms")
        entry = self.store.seal(self.kernel, self.device, self.ref_source, dict(res, timings=t), self.contract_d,
                                {"round": 0, "run": str(self.out), "origin": self.state["reference_origin"],
                                 "note": "baseline: the starting reference, oracle-checked and timed"})
        self.state["reference"] = entry
        self.records.append({"round": 0, "guard": "skipped", "gate": "baseline: reference sealed in the store",
                             "sha256": entry["source_sha256"]})
        self.save()
        _say(f"[forge] round 0: reference {entry['source_sha256'][:12]} oracle-checked and sealed in {self.store.root}")

    def brief_ctx(self, k: int) -> dict:
        (self.ws / ".gate").mkdir(exist_ok=True)  # git-ignored: the agent's copy of the gate's input
        (self.ws / ".gate" / "spec.json").write_text(json.dumps(json.loads((self.ws / "spec.json").read_text())["gate"]))
        gate_cmd = (f"{shlex.quote(wsmod.python())} -m forgetrain.forge._kernel_gate --spec .gate/spec.json "
                    "--workspace . --out .gate/run --result .gate/result.json")
        ctx = {"kernel": self.kernel, "device": self.device, "mode": self.opts.mode, "round": k,
               "max_rounds": self.opts.max_rounds, "contract": self.contract_d, "switch": f"kernels.{self.sw.name}="
               f"{self.val.name}", "tier": self.val.tier, "scenario": self.rc.scenario.name,
               "shapes": "full" if self.device == "cuda" else "small", "reference": self.state["reference"],
               "gate_command": gate_cmd, "agent_timeout_s": self.agent.timeout_s}
        if self.opts.mode == "full":
            ctx.update(history=self.records, last=self.state.get("last_gate"),
                       lessons=self.kb.relevant(scenario=self.key, tiers=[]))
        return ctx

    def learn(self, k: int, res: dict, commit: str) -> list[str]:
        keys, fails = [], self.state["failures"]
        for s in res.get("stages", []):
            st = s["stage"]
            if not s["passed"]:
                fails[st] = {"round": k, "commit": commit, "summary": s["summary"]}
            elif st in fails:
                f = fails.pop(st)
                if self.opts.mode != "full":
                    continue
                diff = wsmod.git(self.ws, "diff", "-U0", f["commit"], commit, "--", self.rel, check=False)
                lines = [x[:160] for x in diff.splitlines() if x[:1] in "+-" and not x.startswith(("+++", "---"))]
                fix = {"files": [self.rel], "lines": lines[:12], "truncated": max(0, len(lines) - 12),
                       "stat": wsmod.git(self.ws, "diff", "--shortstat", f["commit"], commit, check=False)}
                lesson = self.kb.add(
                    tier=f"kernel:{st}", divergence={"kind": st, "module": self.key},
                    pitfall=f"{self.kernel} on {self.device}: the {st} gate failed ({f['summary'][:200]})", fix=fix,
                    evidence={"mechanism": f"the {st} gate moved from failing to passing with the diff below",
                              "failed": f"round {f['round']}: {f['summary']}", "passed": f"round {k}: {s['summary']}",
                              "device_name": res.get("device_name")},
                    scenario=self.key, source=str(self.out))
                keys.append(lesson["key"])
                _say(f"[forge] lesson recorded for {self.key}: {st} gate fixed")
        return keys

    def round(self, k: int) -> bool:
        from forgetrain.forge.procs import run_agent

        t0 = time.monotonic()
        rdir = self.out / "rounds" / str(k)
        rdir.mkdir(parents=True)
        text = render_brief(self.brief_ctx(k))
        (self.ws / "BRIEF.md").write_text(text)
        (rdir / "BRIEF.md").write_text(text)
        pre = wsmod.stage_tree(self.ws)
        head_ref, head = wsmod.git(self.ws, "symbolic-ref", "HEAD"), wsmod.git(self.ws, "rev-parse", "HEAD")
        rec: dict = {"round": k, "mode": self.opts.mode}
        rec.update(run_agent(self.agent, self.ws, self.ws / "BRIEF.md", k, rdir))
        wsmod.restore_head(self.ws, head_ref, head)
        rows = wsmod.changed_paths(self.ws, pre)
        outside = [f"{st} {p}" for st, p in rows if p != self.rel or st != "M"]
        res, passed = None, False
        left = rec.pop("agent_leftovers", None)
        if left:  # it could act while the gate runs: escape class 3, as in the engine forge
            from forgetrain.forge.sandbox import GUARD_LABELS, reason

            wsmod.revert_to(self.ws, pre)
            rec.update(guard=GUARD_LABELS[3], gate="not run (guard)", guard_problems=[
                reason(3, f"a process the agent started outlived its round ({x}; killed)") for x in left])
        elif outside:
            wsmod.revert_to(self.ws, pre)
            rec.update(guard="rejected: edit outside the kernel file", guard_problems=outside,
                       gate="not run (guard)")
        elif not rows:
            rec.update(guard="ok", gate="skipped (no change)")
        else:
            rec["guard"] = "ok"
            res = self.gate(rdir, self.out / "gate_spec.json")
            res["round"] = k
            passed = bool(res.get("passed"))
            rec["gate"] = "PASS" if passed else f"FAIL at {res.get('failed_stage')}: " + next(
                (s["summary"] for s in res.get("stages", []) if not s["passed"]), "")
        commit = wsmod.commit_branch(self.ws, f"round {k}: {rec['gate']}"[:200])
        if res is not None:
            self.state["last_gate"] = res
            rec["lessons"] = self.learn(k, res, commit)
        rec.update(commit=commit, wall_s=round(time.monotonic() - t0, 3))
        if passed:
            entry = self.store.seal(self.kernel, self.device, self.ws / self.rel, res, self.contract_d,
                                    {"round": k, "run": str(self.out), "mode": self.opts.mode,
                                     "replaces_sha256": (self.state["reference"] or {}).get("source_sha256")})
            self.state.update(status="sealed", seal=entry)
            rec["sealed"] = entry["source_sha256"]
            _say(f"[forge] round {k}: sealed {self.kernel} {entry['source_sha256'][:12]} on {self.device}: the "
                 f"reference of the next run")
        self.state.update(round=k, commit=commit)
        self.records.append(rec)
        self.save()
        _say(f"[forge] round {k}/{self.opts.max_rounds} | guard {rec['guard']} | gate {rec['gate']}"[:400])
        return passed

    def run(self) -> dict:
        self.prepare()
        if self.state["reference"] is None:
            self.baseline()
        self.save()
        for k in range(1, self.opts.max_rounds + 1):
            if self.round(k):
                break
        if self.state["status"] != "sealed":
            self.state["status"] = "exhausted"
            _say(f"[forge] {self.kernel} on {self.device}: no round beat the reference; it stays in place")
        self.save()
        return self.state


def forge_kernel(rc: RunConfig, kernel: str, opts: ForgeOptions, agent: AgentConfig, *,
                 gate_fn: GateFn | None = None) -> dict:
    """Run the kernel forge for ``kernel`` on ``rc.hardware.device`` and return the final state (``status``:
    sealed | exhausted; ``seal``: the store entry when sealed). ``gate_fn(spec, workspace, out, result) -> dict``
    replaces the gate process. Raises ConfigError on bad options."""
    check_request(kernel, opts, agent)
    return KernelRun(rc, kernel, opts, agent, gate_fn).run()
