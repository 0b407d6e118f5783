"""The forge loop: brief -> agent -> guard -> ladder -> record -> learn -> seal, one round at a time.

:func:`forge` is the API (``forgetrain.forge.forge``); ``python -m forgetrain.forge`` calls it from Hydra.

Outputs under ``forge.out_dir`` (default ``outputs/forge/<scenario>/<mode>``)::

    workspace/            the git workspace (see forgetrain.forge.workspace); forge_state.json inside
    ladder_spec.json      what the gates run (the harness's copy; the workspace has a read-only one)
    pycache/              the private bytecode cache of the forge's processes (emptied at every start)
    rounds/<k>/           BRIEF.md, agent.stdout/.stderr, ladder.log, ladder_result.json, ladder/ (gate runs,
                          with their drawn values and the goldens made for them), reverify* (the installed copy's)
    installed/<name>/     the installed copy the seal's re-check judged (without forge.install)
    forge_log.jsonl       one line per round (round 0 is the baseline ladder run on the seeded engine)
    sealed/               engine/ + seal.json once the target is reached
    ../modes.json         per-mode summary (full vs goal_only side by side)

State (``workspace/forge_state.json``, written atomically after every round) holds the last completed round, the
status, the last ladder result and the commit of the engine it describes, so ``forge.resume=true`` continues
after the last completed round: a round interrupted half-way is discarded (the workspace is reset to the last
completed round's commit) and run again.

Invariant: ``state["last_ladder"]`` always describes the engine at ``state["end_commit"]``.

Each round's checks (docs/forge.md, threat model): the guard before the ladder
(:func:`forgetrain.forge.sandbox.guard_round`: imports, bytecode, the content check), the hashed gate set, the
bytecode cache and what the judge reads outside the repository (:mod:`forgetrain.forge.bracket`) around the
agent, the same and the workspace around the ladder, the ladder's own rejection of a candidate that broke the
run-time guard or whose trace is not the judged run's, and, when the target is reached, the installed copy's
re-check (:func:`forgetrain.forge.seal.reverify`). A rejected round is reverted; a changed gate set or package
aborts the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from forgetrain.config import RunConfig, validate
from forgetrain.errors import ConfigError
from forgetrain.forge import MODES, AgentConfig, ForgeOptions
from forgetrain.forge import brief as briefmod
from forgetrain.forge import bracket, report, sandbox, startup
from forgetrain.forge import seal as sealmod
from forgetrain.forge import workspace as wsmod
from forgetrain.forge._ladder import TIER_ORDER, tiers_to_try
from forgetrain.forge.knowledge import KnowledgeBase
from forgetrain.forge.procs import run_agent, subprocess_ladder
from forgetrain.trace import atomic_write_bytes, atomic_write_json

STATE_VERSION = 1
LadderFn = Callable[[Path, Path, Path, float, Path], dict]


# ---------------------------------------------------------------------------------------------------- helpers

def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _first_failure(res: dict | None) -> tuple[str | None, dict | None, str]:
    """(tier, first_divergence, summary) of the first failed verdict of a ladder result."""
    for v in (res or {}).get("verdicts", []):
        if not v["passed"]:
            return v["tier"], v.get("first_divergence"), v["summary"]
    if res and res.get("error"):
        return None, None, res["error"]
    return None, None, ""


def _ladder_text(res: dict | None) -> str:
    if res is None:
        return "-"
    if not res.get("ok"):
        return "timeout" if res.get("timeout") else "error"
    tried = [v["tier"] for v in res.get("verdicts", [])]
    if res.get("target_met"):
        return f"PASS {res.get('strictest_passed')}" + (" +surpass" if res.get("surpassed") else "")
    if res.get("strictest_passed"):
        return f"PASS {res['strictest_passed']} (target not met)"
    return "FAIL " + ",".join(tried)


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.1f}s"


def _shape(rc: RunConfig, opts: ForgeOptions) -> str:
    m, t = rc.model, rc.train
    lo, hi = opts.verify_steps, opts.verify_steps_max or opts.verify_steps + 2
    return (f"model {m.name} (hidden {m.hidden_size}, {m.num_layers} layers, seq {m.seq_length}, vocab "
            f"{m.vocab_size}), micro-batch {t.micro_batch_size}, global batch {t.global_batch_size}, "
            f"{t.precision} on {rc.hardware.device}; each gate run draws its own seed, step count ({lo}-{hi} steps) "
            f"and data window ({opts.gate_window:.0%} of the corpus's documents, starting anywhere) after your "
            f"round, and the judge makes the golden for them: no recorded reference run can match one")


def brief_features(rc: RunConfig) -> list[str]:
    """The model features beyond Llama that ``rc.model`` sets (``model.<name>=<value>``), which the engine must
    implement and declare (:data:`forgetrain.levers.MODEL_FEATURES`; the brief names them)."""
    from forgetrain.levers import EngineSpec, missing_features

    return missing_features(rc.model, EngineSpec())


def _warmup(rc: RunConfig, opts: ForgeOptions) -> int:
    """Warmup clamped below the gate's step count (Megatron's scheduler needs warmup < decay steps)."""
    return max(0, min(rc.train.lr_warmup_steps, opts.verify_steps - 1))


def install_package(rc: RunConfig, opts: ForgeOptions) -> str:
    """The package name the engine is installed under: ``forge.install``'s last component, else the package of
    the scenario's own engine (``scenarios.<package>``). The gates import the candidate under it."""
    if opts.install:
        return Path(opts.install).name
    from forgetrain.registry import engine_spec

    return wsmod.engine_template(rc.scenario.engine or engine_spec(rc.scenario.name))[0]


def build_spec(rc: RunConfig, opts: ForgeOptions, hide: list[str] | None = None) -> dict:
    """The gates' input: the run config (train.steps = forge.verify_steps, warmup clamped to it), the tiers to
    try, the verify options, the ranges the ladder draws each run's secret values from
    (:func:`forgetrain.forge.secret.declare`), the package name the candidate is imported under and the paths its
    process must not see (``hide``: the forge run's dir). Raises ConfigError on bad ranges."""
    from forgetrain.forge import secret

    c = dataclasses.replace(rc, train=dataclasses.replace(
        rc.train, steps=opts.verify_steps, lr_warmup_steps=_warmup(rc, opts),
        lr_decay_steps=None, out_dir=None, resume=False, stop_after=None, sample_tokens=0))
    return {"run_config": dataclasses.asdict(c), "target_tier": opts.target_tier,
            "tiers": tiers_to_try(opts.ladder_from, opts.target_tier),
            "verify": {"reference": opts.reference, "steps": opts.verify_steps, "curve_steps": opts.curve_steps,
                       "timing_steps": opts.timing_steps, "digests": True},
            "secret": secret.declare(opts.verify_steps, opts.verify_steps_max, opts.gate_window),
            "package": install_package(rc, opts), "hide": [str(h) for h in hide or []]}


def check_request(rc: RunConfig, opts: ForgeOptions, agent: AgentConfig) -> None:
    if opts.mode not in MODES:
        raise ConfigError(f"forge.mode must be one of {', '.join(MODES)}, got '{opts.mode}'")
    try:
        tiers_to_try(opts.ladder_from, opts.target_tier)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if opts.max_rounds < 0:
        raise ConfigError(f"forge.max_rounds must be >= 0, got {opts.max_rounds}")
    startup.check_options(opts, agent)
    if opts.max_rounds > 0 and not (agent.command or "").strip():
        raise ConfigError('set agent.command, e.g. agent.command=\'claude -p "$(cat {brief})" '
                          "--permission-mode acceptEdits' (docs/forge.md)")
    if agent.timeout_s <= 0 or opts.ladder_timeout_s <= 0:
        raise ConfigError("agent.timeout_s and forge.ladder_timeout_s must be positive")
    if opts.verify_steps <= 0:
        raise ConfigError(f"forge.verify_steps must be positive, got {opts.verify_steps}")
    if opts.target_mfu_pct is not None and opts.target_mfu_pct <= 0:
        raise ConfigError("forge.target_mfu_pct must be positive (or null)")
    if opts.resume and opts.overwrite:
        raise ConfigError("forge.resume and forge.overwrite exclude each other")
    if shutil.which("git") is None:
        raise ConfigError("the forge workspace needs git on PATH")


def _data_rejection(data: dict[str, list[str]], when: str) -> dict:
    """The rejection (class 8) of a round during which prepared corpora changed; the corpora are removed (each is
    prepared again from its source on next use, so no later run trains on what was written)."""
    bracket.discard(list(data))
    return {"class": 8, "guard": sandbox.GUARD_LABELS[8], "problems": [
        sandbox.reason(8, f"{row} {when}: a prepared corpus the judge reads was written (removed, prepared again "
                          f"from its source on next use)") for rows in data.values() for row in rows[:10]]}


# ---------------------------------------------------------------------------------------------------- the loop

class _Run:
    """One forge run; :func:`forge` is the public entry."""

    def __init__(self, rc: RunConfig, opts: ForgeOptions, agent: AgentConfig, ladder_fn: LadderFn | None,
                 gate_paths: list[Path] | None, import_roots: list[Path] | None = None):
        self.rc, self.opts, self.agent = rc, opts, agent
        self.scenario = rc.scenario.name
        self.out = Path(opts.out_dir or Path("outputs") / "forge" / self.scenario / opts.mode).resolve()
        self.ws = self.out / "workspace"
        self.state_path = self.ws / "forge_state.json"
        self.log_path = self.out / "forge_log.jsonl"
        self.spec_path = self.out / "ladder_spec.json"
        self.pycache = self.out / "pycache"  # the run's private bytecode cache (forgetrain.forge.sandbox)
        self.ladder_fn = ladder_fn  # None: the subprocess ladder, once the run dir is locked (run)
        self.plain_check = ladder_fn is None  # the seal's user run is judged by real gates only (not a stub's)
        self.gate_paths = [Path(p) for p in (gate_paths if gate_paths is not None else sandbox.gate_paths())]
        self.import_roots = [Path(p) for p in (import_roots if import_roots is not None else
                                               sandbox.import_roots() if gate_paths is None else [])]
        self.kb = KnowledgeBase(opts.kb_path)
        from forgetrain.data.prepare import default_cache_dir

        self.shared = [os.path.abspath(os.path.expanduser(rc.data.cache_dir or default_cache_dir()))]
        self.spec = build_spec(rc, opts, [str(self.out)])
        self.state: dict = {}
        self.records: list[dict] = []

    # ------------------------------------------------------------ setup / state
    def prepare(self) -> None:
        exists = self.state_path.exists()
        if exists and not (self.opts.resume or self.opts.overwrite):
            raise ConfigError(f"a forge run exists at {self.out}; rerun with forge.resume=true to continue it or "
                              f"forge.overwrite=true to start over")
        if exists and self.opts.resume:
            self.state = startup.read_state(self.state_path)
            old = json.loads(self.spec_path.read_text()) if self.spec_path.exists() else None
            if old is not None and old != self.spec:
                diff = sorted(k for k in set(old) | set(self.spec) if old.get(k) != self.spec.get(k))
                raise ConfigError(f"the gate config differs from the run being resumed at {self.out} ({', '.join(diff)});"
                                  f" resume with the same overrides, or use forge.overwrite=true")
            if self.state.get("mode") != self.opts.mode:
                raise ConfigError(f"{self.out} holds a forge.mode={self.state.get('mode')} run, not {self.opts.mode}")
            self.records = [r for r in self._read_log() if r["round"] <= self.state["round"]]
            self._write_log()  # drop any line of a round that did not complete
            _say(f"[forge] resuming {self.scenario} ({self.opts.mode}) after round {self.state['round']} "
                 f"(status {self.state['status']})")
            ll = self.state.get("last_ladder")
            if self.state["status"] == "sealed" or not isinstance(ll, (dict, type(None))) or (ll or {}).get(
                    "target_met"):
                # the state lies where the agent can write: a seal or a verdict that met the target, read back, is
                # never trusted; the engine it names is judged (and re-checked, and sealed) again by this process
                self.state.update(last_ladder=None, status="running", rejudge=True)
                _say(f"[forge] the engine of round {self.state['round']} is judged again (round "
                     f"{self.state['round'] + 1}, no agent): a verdict read back from {self.state_path} is not trusted")
            return
        for name in ("workspace", "rounds", "sealed", "golden", "installed"):
            shutil.rmtree(self.out / name, ignore_errors=True)
        for name in ("forge_log.jsonl", "ladder_spec.json"):
            (self.out / name).unlink(missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.spec_path, self.spec)
        tmp_spec = self.out / ".agent_spec.json"
        atomic_write_json(tmp_spec, self.spec)
        info = wsmod.seed(self.ws, self.scenario, self.opts.seed_from, self.opts.reference, tmp_spec,
                          engine=self.rc.scenario.engine)
        tmp_spec.unlink()
        self.state = {"version": STATE_VERSION, "scenario": self.scenario, "mode": self.opts.mode, "round": 0,
                      "status": "running", "seed": info, "end_commit": info["commit"], "last_ladder": None,
                      "baseline_done": False, "failures": {}, "target_met": False,
                      "rounds_to_pass": None, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": 0.0}
        self._save_state()
        _say(f"[forge] new run: {self.scenario} ({self.opts.mode}) -> {self.out}; workspace seeded from "
             f"{info.get('seed_from', info['template'])}")

    def _read_log(self) -> list[dict]:
        if not self.log_path.exists():
            return []
        return [json.loads(x) for x in self.log_path.read_text().splitlines() if x.strip()]

    def _write_log(self) -> None:
        atomic_write_bytes(self.log_path, "".join(json.dumps(r, default=str) + "\n" for r in self.records).encode())

    def _save_state(self) -> None:
        atomic_write_json(self.state_path, self.state)

    def gate_hashes(self) -> dict[str, str]:
        """The hashed gate set's file hashes (class 4): the gate paths, the spec, and every importable file on the
        forge processes' import path outside them (:func:`forgetrain.forge.sandbox.importable_files`: a
        ``sitecustomize.py`` or a module at the repository root), but the run's own dir."""
        files = sandbox.importable_files(self.import_roots, skip=self.gate_paths + [self.out])
        return wsmod.hash_paths(self.gate_paths + [self.spec_path] + files)

    # ------------------------------------------------------------ brief
    def brief_ctx(self, k: int) -> dict:
        s, o = self.state, self.opts
        gate_cmd = (f"{shlex.quote(wsmod.python())} -m forgetrain.forge._ladder --spec gates/ladder_spec.json "
                    "--workspace . --out .gate/run")
        ctx = {"scenario": self.scenario, "description": self.rc.scenario.description, "mode": o.mode, "round": k,
               "max_rounds": o.max_rounds, "target_tier": o.target_tier, "target_mfu_pct": o.target_mfu_pct,
               "tiers": self.spec["tiers"], "reference": o.reference, "gate_command": gate_cmd,
               "shape": _shape(self.rc, o), "agent_timeout_s": self.agent.timeout_s,
               "model_features": brief_features(self.rc)}
        if o.mode == "full":
            ctx["history"] = self.records
            ctx["last_ladder"] = s.get("last_ladder")
            ctx["last_round"] = self.records[-1] if self.records else None
            _, div, _ = _first_failure(s.get("last_ladder"))
            ctx["lessons"] = self.kb.relevant(scenario=self.scenario, tiers=list(TIER_ORDER), divergence=div)
        return ctx

    # ------------------------------------------------------------ one ladder run
    def ladder(self, k: int, rdir: Path, spec_path: Path | None = None, name: str = "ladder",
               reads: dict | None = None) -> dict:
        """Run the ladder on the workspace engine, then check what the ladder's processes must not have changed:
        the gate set and the spec (``gates_changed``: the run aborts, class 4), the interpreter's packages (the
        same, class 8), the prepared corpora (``rejected``, class 8; the corpus is removed) and the workspace (the
        engine judged must be the engine sealed: ``rejected``, class 3)."""
        before, tree = self.gate_hashes(), wsmod.stage_tree(self.ws)
        reads = reads or bracket.signature(self.shared)  # the agent round's closing signature, when it has one
        res = self.ladder_fn(spec_path or self.spec_path, self.ws, rdir / name, self.opts.ladder_timeout_s,
                             rdir / f"{name}.log")
        res["round"] = k
        data, code = bracket.changes(reads, bracket.signature(self.shared))
        res["gates_changed"] = [[4, x] for x in wsmod.hash_changes(before, self.gate_hashes())] + \
            [[8, x] for x in code] or None
        moved = [f"{st} {p}" for st, p in wsmod.changed_paths(self.ws, tree)] + sandbox.unscanned_files(self.ws)
        if data and not res.get("rejected"):
            res["rejected"] = _data_rejection(data, "while the engine was judged")
        if moved and not res.get("rejected"):
            res["rejected"] = {"class": 3, "guard": sandbox.GUARD_LABELS[3], "problems": [
                sandbox.reason(3, f"{x}: the workspace changed while the engine was judged") for x in moved]}
        atomic_write_json(rdir / f"{name}_result.json", res)
        return res

    def _judged(self, k: int, rdir: Path, rec: dict, base: str, reads: dict | None = None) -> tuple[dict | None, list]:
        """(the ladder's result for round ``k``, the (class, file) the ladder changed that the judge reads: the run
        must abort). The result is None, and the round rejected and reverted to ``base``, when the run-time guard
        rejected the candidate."""
        res = self.ladder(k, rdir, reads=reads)
        if res.get("gates_changed"):
            return None, [tuple(x) for x in res["gates_changed"]]
        rej = res.get("rejected")
        if rej:
            wsmod.revert_to(self.ws, base)
            sandbox.remove_unscanned(self.ws)
            rec.update({"guard": rej["guard"], "guard_problems": rej["problems"],
                        "ladder": f"rejected by the run-time guard (class {rej['class']})"})
            return None, []
        return res, []

    def _abort(self, k: int, rec: dict, base: str, tampered: list, when: str, t0: float) -> None:
        """The gates changed: reject the round, stop the run loudly, name the files (``tampered``: (escape class,
        file); class 4 for the hashed gate set, 8 for the interpreter's packages)."""
        wsmod.revert_to(self.ws, base)
        rec.update({"guard": "rejected: gates changed", "ladder": rec.get("ladder") or "not run (gates changed)",
                    "guard_problems": [sandbox.reason(c, f"{x} ({when})") for c, x in tampered]})
        banner = "!" * 100
        _say(f"{banner}\n[forge] GATES CHANGED {when} in round {k}: the ladder can no longer be trusted. The round "
             f"is rejected and the run stops. Restore these files and rerun with forge.overwrite=true:\n"
             + "\n".join(f"  {x}" for _, x in tampered) + f"\n{banner}")
        s = self.state
        s["status"] = "aborted: gates changed"
        s["end_commit"] = wsmod.snapshot(self.ws, f"refs/forge/rounds/{k}", f"round {k}: rejected")
        rec.update({"wall_s": round(time.monotonic() - t0, 3), "commit": s["end_commit"],
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.record(rec)
        self.progress(rec)

    def learn(self, k: int, res: dict, commit: str) -> list[str]:
        """Open failures per tier from this result; lessons for tiers that moved from failing to passing."""
        keys = []
        fails = self.state.setdefault("failures", {})
        for v in res.get("verdicts", []):
            t = v["tier"]
            if not v["passed"]:
                fails[t] = {"round": k, "commit": commit, "divergence": v.get("first_divergence"),
                            "summary": v["summary"]}
            elif t in fails:
                f = fails.pop(t)
                if self.opts.mode != "full":
                    continue
                fix = wsmod.diff_summary(self.ws, f["commit"], commit)
                pitfall = f"{t} failed: {briefmod.describe(f['divergence'])}" if f.get("divergence") \
                    else f"{t} failed: {f['summary']}"
                lesson = self.kb.add(tier=t, divergence=f.get("divergence"), pitfall=pitfall, fix=fix,
                                     evidence={"failed": f"round {f['round']}: {f['summary']}",
                                               "passed": f"round {k}: {v['summary']}"},
                                     scenario=self.scenario, source=str(self.out))
                keys.append(lesson["key"])
                _say(f"[forge] lesson recorded: {pitfall} -> {wsmod.git(self.ws, 'rev-parse', '--short', commit)}")
        return keys

    # ------------------------------------------------------------ rounds
    def record(self, rec: dict) -> None:
        self.records.append(rec)
        self._write_log()
        s = self.state
        s["round"] = rec["round"]
        s["wall_s"] = float(s.get("wall_s", 0.0)) + rec["wall_s"]
        self._save_state()

    def _finish_round(self, k: int, rec: dict, res: dict | None, changed: bool, t0: float, base: str) -> bool:
        """Check the goal (and, when it is reached, the installed engine: :func:`forgetrain.forge.seal.reverify`),
        commit/snapshot, learn, log. A failed re-check rejects the round (class 6) and reverts it to ``base``.
        Returns True when the goal is reached."""
        s = self.state
        new = res is not None and changed
        cur = res if new else (s.get("last_ladder") or {})
        mfu = (cur.get("metrics") or {}).get("mfu_pct")
        goal = bool(cur.get("target_met")) and (self.opts.target_mfu_pct is None or
                                                 (mfu is not None and mfu >= self.opts.target_mfu_pct))
        problems = sealmod.reverify(self, k, self.out / "rounds" / str(k), cur) if goal else []
        if problems:  # the seal's condition: the installed engine passes the same gate again
            goal = False
            wsmod.revert_to(self.ws, base)
            sandbox.remove_unscanned(self.ws)
            s["end_commit"] = wsmod.snapshot(self.ws, f"refs/forge/rounds/{k}", f"round {k}: rejected")
            s["last_ladder"] = None  # the engine now in the workspace is judged again next round
            rec.update({"guard": sandbox.GUARD_LABELS[problems[0][0]],
                        "guard_problems": [sandbox.reason(c, x) for c, x in problems],
                        "ladder": f"{_ladder_text(cur)}; the installed engine failed it"})
        elif new:
            msg = f"round {k}: {_ladder_text(res)}"
            if res.get("strictest_passed"):
                commit = wsmod.commit_branch(self.ws, msg)
                wsmod.git(self.ws, "update-ref", f"refs/forge/rounds/{k}", commit)
            else:
                commit = wsmod.snapshot(self.ws, f"refs/forge/rounds/{k}", msg)
            s["end_commit"], s["last_ladder"] = commit, res
            rec["lessons"] = self.learn(k, res, commit)
        else:  # nothing new to judge: the end state is the previous one (plus the brief)
            s["end_commit"] = wsmod.snapshot(self.ws, f"refs/forge/rounds/{k}", f"round {k}: no engine change")
        tier, div, summ = _first_failure(res)
        rec.update({"ladder": rec.get("ladder") or _ladder_text(res),
                    "tiers_passed": [v["tier"] for v in (res or {}).get("verdicts", []) if v["passed"]],
                    "strictest_passed": (res or {}).get("strictest_passed"),
                    "target_met": bool((res or {}).get("target_met")) and not problems, "goal_met": goal,
                    "failed_tier": tier, "first_divergence": div,
                    "first_divergence_text": briefmod.describe(div) if div else (summ or None),
                    "ladder_error": (res or {}).get("error"), "ladder_s": (res or {}).get("wall_s"),
                    "mfu_pct": mfu if res is not None else None, "commit": s["end_commit"],
                    "wall_s": round(time.monotonic() - t0, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        if goal and s.get("rounds_to_pass") is None:
            s["rounds_to_pass"] = k
        s["target_met"] = goal
        self.record(rec)
        return goal

    def baseline(self, k: int = 0, mode: str = "baseline") -> bool | None:
        """Judge the engine at ``end_commit`` with no agent: round 0 (``baseline``, the seeded engine), or round
        ``k`` after a resume (``mode="resumed"``: the engine of the last completed round, whose verdict the state
        held, judged again since that state is not trusted). Returns True when the goal is reached, None when the
        run must stop (gates changed)."""
        t0 = time.monotonic()
        rdir = self.out / "rounds" / str(k)
        shutil.rmtree(rdir, ignore_errors=True)
        rdir.mkdir(parents=True)
        base = self.state["end_commit"]
        wsmod.revert_to(self.ws, base)
        sandbox.remove_unscanned(self.ws)
        rec = {"round": k, "mode": mode, "agent_rc": None, "agent_timeout": False, "agent_s": 0.0,
               "guard": "skipped", "guard_problems": []}
        res, tampered = self._judged(k, rdir, rec, base)
        if tampered:
            self._abort(k, rec, base, tampered, "while the ladder ran", t0)
            return None
        goal = self._finish_round(k, rec, res, res is not None, t0, base)
        if k == 0:
            self.state["baseline_done"] = True
        self._save_state()
        self.progress(rec)
        return goal

    def round(self, k: int) -> bool | None:
        """One agent round. Returns True when the goal is reached, None when the run must stop (gates changed)."""
        t0 = time.monotonic()
        s = self.state
        rdir = self.out / "rounds" / str(k)
        shutil.rmtree(rdir, ignore_errors=True)
        rdir.mkdir(parents=True)
        wsmod.revert_to(self.ws, s["end_commit"])  # a resumed round starts from the last completed one
        sandbox.remove_unscanned(self.ws)
        text = briefmod.render(self.brief_ctx(k))
        brief = self.ws / "BRIEF.md"
        brief.write_text(text)
        (rdir / "BRIEF.md").write_text(text)
        pre = wsmod.stage_tree(self.ws)
        before, cache = self.gate_hashes(), sandbox.stat_signature([self.pycache])
        reads = bracket.signature(self.shared)
        rec: dict = {"round": k, "mode": self.opts.mode}
        head_ref, head = wsmod.git(self.ws, "symbolic-ref", "HEAD"), wsmod.git(self.ws, "rev-parse", "HEAD")
        rec.update(run_agent(self.agent, self.ws, brief, k, rdir))
        if wsmod.restore_head(self.ws, head_ref, head):  # the branch is the harness's: agent commits are undone
            rec["note"] = "the agent moved the workspace's git HEAD; restored (its edits are judged as usual)"
        # ---- guard
        reads_after = bracket.signature(self.shared)
        data, code = bracket.changes(reads, reads_after)
        tampered = [(4, x) for x in wsmod.hash_changes(before, self.gate_hashes())] + [(8, x) for x in code]
        if tampered:
            self._abort(k, rec, pre, tampered, "during the agent's round", t0)
            return None
        rows = wsmod.changed_paths(self.ws, pre)
        guard, problems = sandbox.guard_round(self.ws, rows)
        if data:  # a corpus the judge reads was written: the round is rejected, the corpus removed
            rej = _data_rejection(data, "during the agent's round")
            guard, problems = rej["guard"], rej["problems"]
        if sandbox.stat_signature([self.pycache]) != cache:  # bytecode planted for the harness's processes
            sandbox.fresh_cache(self.pycache)
            guard, problems = sandbox.GUARD_LABELS[3], [sandbox.reason(3, f"the forge's bytecode cache "
                                                                        f"{self.pycache} changed during the round")]
        left = rec.pop("agent_leftovers", None)
        if left:  # a process the agent left behind could act during the ladder (relay a golden, plant bytecode)
            guard, problems = sandbox.GUARD_LABELS[3], [sandbox.reason(3, f"a process the agent started outlived "
                                                                        f"its round ({x}; killed)") for x in left]
        if guard.startswith("rejected"):
            wsmod.revert_to(self.ws, pre)
            sandbox.remove_unscanned(self.ws)
        rec.update({"guard": guard, "guard_problems": problems})
        changed = guard == "ok" and any(p.startswith(wsmod.EDITABLE_PREFIX) for _, p in rows)
        res = None
        if guard == "syntax error":
            rec["ladder"] = "not run (syntax error)"
            res = {"ok": False, "error": f"SyntaxError: {problems[0]}", "verdicts": [], "target_met": False,
                   "strictest_passed": None}
            changed = True
        elif guard != "ok":
            rec["ladder"] = "not run (guard)"
        elif changed or s.get("last_ladder") is None:
            res, tampered = self._judged(k, rdir, rec, pre, reads_after)
            if tampered:
                self._abort(k, rec, pre, tampered, "while the ladder ran", t0)
                return None
            changed = res is not None
        else:
            rec["ladder"] = "skipped (no change)"
        goal = self._finish_round(k, rec, res, changed, t0, pre)
        self.progress(rec)
        return goal

    def progress(self, r: dict) -> None:
        n = self.opts.max_rounds
        agent = "-" if r["mode"] == "baseline" else ("TIMEOUT " if r.get("agent_timeout") else "") + \
            f"{r.get('agent_s', 0):.1f}s rc={r.get('agent_rc')}"
        div = r.get("first_divergence_text")
        mfu = f" | MFU {r['mfu_pct']:.3f}%" if r.get("mfu_pct") is not None else ""
        _say(f"[forge] round {r['round']}/{n} | agent {agent} | guard {r.get('guard')} | ladder {r.get('ladder')} "
             f"({_fmt_s(r.get('ladder_s'))}){mfu}" + (f" | {div}" if div and not r.get("target_met") else "")
             + f" | {r['wall_s']:.1f}s")

    # ------------------------------------------------------------ seal / summary
    def seal(self) -> Path:
        return sealmod.seal(self)

    # ------------------------------------------------------------ drive
    def run(self) -> dict:
        if self.opts.resume and not self.state_path.exists():  # a mistyped dir: one line, nothing written
            raise ConfigError(f"forge.resume=true but no forge run at {self.out} (no {self.state_path.name}): "
                              f"nothing to resume; drop forge.resume to start one there")
        self.out.mkdir(parents=True, exist_ok=True)
        lock = startup.lock_out_dir(self.out)
        try:
            if self.ladder_fn is None:
                self.ladder_fn = functools.partial(subprocess_ladder, cache_dir=self.pycache, pass_fds=(lock,))
            return self._run()
        finally:
            os.close(lock)

    def _run(self) -> dict:
        self.prepare()
        if not self.rc.data.path:  # the corpus the gates cut their windows from: prepared, and checked, up front
            from forgetrain.data import prepare

            prepare(self.rc.data, progress=False)
        sandbox.fresh_cache(self.pycache)  # empty at every start: nothing written while no harness ran is trusted
        s = self.state  # a sealed run being resumed is "running" again here (prepare: it is judged again)
        if s["status"].startswith("aborted"):
            raise ConfigError(f"this run was {s['status']}; restore the gates and start over with "
                              f"forge.overwrite=true")
        s["status"] = "running"
        goal = False
        if s.pop("rejudge", False):  # a round of its own, without an agent: round k's files stay as they were
            goal = self.baseline(s["round"] + 1, mode="resumed")
        elif self.opts.baseline and not s.get("baseline_done") and s["round"] == 0:
            goal = self.baseline()
        k = s["round"]
        while goal is False and k < self.opts.max_rounds and not s["status"].startswith("aborted"):
            k += 1
            r = self.round(k)
            if r is None:
                break
            goal = r
        if goal:
            self.seal()
        elif not s["status"].startswith("aborted"):
            s["status"] = "exhausted"
            self._save_state()
        report.summary(self)
        report.update_modes(self)
        return s


def forge(rc: RunConfig, opts: ForgeOptions, agent: AgentConfig, *, ladder_fn: LadderFn | None = None,
          gate_paths: list[Path] | None = None, import_roots: list[Path] | None = None) -> dict:
    """Run the forge loop for ``rc.scenario`` and return the final state dict (``status``: sealed | exhausted |
    aborted: gates changed; ``round``; ``last_ladder``; ``seal`` when sealed).

    ``ladder_fn(spec_path, workspace, out_dir, timeout_s, log_path) -> result dict`` replaces the subprocess ladder
    (tests inject stubs); ``gate_paths`` replaces the hashed gate set (default
    :func:`forgetrain.forge.sandbox.gate_paths`: all of the repository's ``forgetrain/``, ``references/``,
    ``conf/``, ``tests/`` and the interpreter's site hooks); the importable files of ``import_roots`` are hashed
    with it (default, with the default gate set: :func:`forgetrain.forge.sandbox.import_roots`, the repository
    root and the ``PYTHONPATH``). Raises ConfigError on bad options, an unreadable state to resume, or a run dir
    another process holds.
    """
    check_request(rc, opts, agent)
    # the scenario's engine is the seed the agent adapts: a model feature it lacks is its task (the brief names
    # it), not a refusal; the candidate's runs check the features against the workspace engine's own spec
    validate(dataclasses.replace(rc, train=dataclasses.replace(
        rc.train, steps=opts.verify_steps, lr_warmup_steps=_warmup(rc, opts))), template=True)
    return _Run(rc, opts, agent, ladder_fn, gate_paths, import_roots).run()
