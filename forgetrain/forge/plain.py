"""The seal's plain re-check (escape class 6, knowing it is being judged): the installed engine run as a user runs it.

The gate's candidate process and the installed copy's re-check (:func:`forgetrain.forge.seal.reverify`) run under
the sandbox: a guard, an audit hook, private mounts, the forge's ``PYTHON*`` flags, the ladder as the parent, a run
dir under the forge's out dir. An engine that reads any of them can be honest only there. :class:`PlainCheck`
therefore runs the installed engine once more as a plain user's process, and judges its trace like the ladder:

* freshly drawn secret values (seed, steps, data window; :func:`forgetrain.forge.secret.draw`) and the tier the
  engine passed (a pair tier: bitwise or tolerance);
* a user's project dir (a fresh temporary dir, its name not the forge's) holding the engine installed as
  ``scenarios/<name>/`` by :func:`forgetrain.forge.install.install` (the bytes the re-check judged, checked), the
  data window and the reference's init weights for the drawn seed; ``python -m forgetrain`` run there through
  ``sh -c`` (a shell is its parent; its working dir first on ``sys.path``, as ``python -m`` puts it, is what makes
  the package importable, no import machinery of the forge's), with the run's settings as Hydra overrides
  (:func:`user_overrides`, ``train.init_weights`` among them) and Hydra's own run dir
  (``outputs/<scenario>/<date>_<time>``); the forge's starting environment without any ``FORGE_*`` variable and
  without the ``PYTHON*`` variables the sandbox sets (:func:`user_env`); no guard, no audit hook, no private mounts;
* no golden of those values exists while it runs: the judge's side (``forgetrain.forge._plain``, a process that
  never runs candidate code and has loaded its modules before the user's run starts) makes it afterwards, then
  applies the trace checks of :mod:`forgetrain.forge.recheck` and the tier's judge.

Around the user's run, which nothing guards, the hashed gate set, the forge's bytecode cache, the judge's files of
this check and what the judge reads outside the repository are compared (classes 4, 3, 1 and 8); its process
group is killed when it ends, and any process it started that outlived it (re-parented to the forge, its
subreaper) is killed and rejects it (class 3) before the golden is made. The judge's side is not dumpable (no
ptrace attach by the user's run; :func:`forgetrain.forge.procs.no_ptrace`). Any other failure is a problem naming
class 6.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

# what the sandbox sets in its processes' environments (forgetrain.forge.sandbox.sandbox_env): never in a user's run
SANDBOX_VARS = ("PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")


def user_env(base: dict | None = None) -> dict:
    """A user's environment: ``base`` (default the forge's own, as it started) without ``FORGE_*`` variables and
    without :data:`SANDBOX_VARS`."""
    return {k: v for k, v in (os.environ if base is None else base).items()
            if not k.startswith("FORGE_") and k not in SANDBOX_VARS}


def _value(v) -> str:
    """One Hydra override value: null, true/false, a number, a quoted string, a list."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    s = str(v)
    if re.fullmatch(r"[A-Za-z_/][\w./:@+-]*", s) and s not in ("true", "false", "null", "inf", "nan"):
        return s  # as a user types it
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _composed(overrides: list[str]):
    """The RunConfig ``python -m forgetrain`` composes from ``overrides``. Hydra's global state (set where the forge
    runs under ``python -m forgetrain.forge``) is put back as it was."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from forgetrain.cli import CONF_DIR
    from forgetrain.config import register_configs, to_run_config

    gh, hc = GlobalHydra.instance(), HydraConfig.instance()
    saved, saved_cfg = (gh.hydra if gh.is_initialized() else None), hc.cfg
    gh.clear()
    try:
        register_configs()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        return to_run_config(OmegaConf.to_container(cfg, resolve=True))
    finally:  # Hydra's context may have swapped its singletons for copies: the current ones get the state back
        GlobalHydra.instance().clear()
        if saved is not None:
            GlobalHydra.instance().initialize(saved)
        HydraConfig.instance().cfg = saved_cfg


def user_overrides(rc, engine: str) -> list[str]:
    """The overrides a user passes to ``python -m forgetrain`` for the run ``rc`` of the engine ``engine``
    (``scenarios.<name>.<module>:<Class>``): ``scenario=<name>``, the engine, and every setting that differs from
    what that scenario composes to (the run dir is Hydra's). Raises ConfigError when the composed run would not
    have ``rc``'s config hash."""
    from forgetrain.errors import ConfigError
    from forgetrain.train import config_hash

    from forgetrain.cli import CONF_DIR

    base = [f"scenario={rc.scenario.name}", f"scenario.engine={_value(engine)}"]
    if (Path(CONF_DIR) / "model" / f"{rc.model.name}.yaml").is_file():
        base.append(f"model={rc.model.name}")  # a preset is chosen as a group, as a user chooses it
    composed = _composed(base)
    want = _leaves({k: v for k, v in dataclasses.asdict(rc).items() if k != "scenario"})
    out, keys = list(base), []
    for _ in range(3):  # a setting resolved from others (lr_warmup_steps from steps) may differ only once they are set
        have = _leaves(dataclasses.asdict(composed))
        new = [k for k, v in want.items() if k != "train.out_dir" and have.get(k) != v and k not in keys]
        if not new:
            break
        keys += new
        out = base + [f"{k}={_value(want[k])}" for k in want if k in keys]
        composed = _composed(out)
    if config_hash(composed) != config_hash(rc):
        raise ConfigError("the plain re-check's overrides do not compose to the judged run (config hash differs)")
    return out


def _watch(run) -> dict:
    """What the user's run must leave alone: the hashed gate set, the forge's bytecode cache, what the judge reads
    outside the repository."""
    from forgetrain.forge import bracket, sandbox
    from forgetrain.forge import workspace as wsmod

    return {"gates": wsmod.hash_paths(run.gate_paths + [run.spec_path]), "cache": sandbox.stat_signature([run.pycache]),
            "reads": bracket.signature(run.shared)}


def _watch_problems(run, before: dict, judged: list[Path], judge_sig: dict) -> list[tuple[int, str]]:
    from forgetrain.forge import bracket, sandbox
    from forgetrain.forge import workspace as wsmod

    after = _watch(run)
    out = [(4, f"{x} (while the installed engine ran as a user's run)")
           for x in wsmod.hash_changes(before["gates"], after["gates"])]
    if after["cache"] != before["cache"]:
        sandbox.fresh_cache(run.pycache)
        out.append((3, f"the forge's bytecode cache {run.pycache} changed while the installed engine ran as a "
                       f"user's run"))
    data, code = bracket.changes(before["reads"], after["reads"])
    out += [(8, f"{x} (while the installed engine ran as a user's run)") for x in code]
    if data:
        bracket.discard(list(data))
        out += [(8, f"{row} (a prepared corpus, written while the installed engine ran as a user's run)")
                for rows in data.values() for row in rows[:5]]
    if sandbox.stat_signature(judged) != judge_sig:
        out.append((1, f"the judge's files of the plain re-check ({judged[0].parent}) changed while the user's "
                       f"run ran"))
    return out


class PlainCheck:
    """The plain re-check of one round (module docstring). Made before the installed copy's gated re-check, so
    that the judge's side prepares (imports, the window, the reference's init) while that runs; :meth:`run` then
    runs the installed engine as a user's process and judges it; :meth:`close` ends the judge's side and removes the
    user's project dir. ``passed``: the ladder result that met the target; ``name``: the installed package's
    name; a curve or speed tier is not re-run this way (``skipped`` says so). Raises ConfigError when the judged
    run cannot be written as a user's command line."""

    def __init__(self, run, rdir: Path, passed: dict, name: str):
        from forgetrain.config import to_run_config
        from forgetrain.equivalence import registry
        from forgetrain.equivalence.runs import run_cfg
        from forgetrain.forge import procs, sandbox, secret
        from forgetrain.forge import workspace as wsmod
        from forgetrain.train import config_hash

        self.run_, self.judge, self.root, self.log = run, None, None, None
        self.tier = tier = passed.get("strictest_passed")
        self.skipped = None if tier and registry.find(tier).kind == registry.PAIR else \
            {"run": False, "why": f"the {tier} tier is judged on curves, which this check does not re-run"}
        if self.skipped:
            return
        self.d = d = rdir / "plain"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        self.root = root = Path(tempfile.mkdtemp())  # the user's project dir
        self.drawn = drawn = secret.draw(run.spec["secret"])
        self.name = name  # the package name the re-check imports it under
        jspec = secret.judge_spec(dict(run.spec, tiers=[tier], target_tier=tier), drawn, d / "_data", d / "golden")
        # the run the ladder's candidate makes (forgetrain.verify's settings), from the reference's init, on a copy
        user = run_cfg(to_run_config(jspec["run_config"]), Path("."), steps=int(drawn["steps"]), digests=True)
        user.train = dataclasses.replace(user.train, out_dir=None, init_weights=str(root / "init.safetensors"))
        user.data = dataclasses.replace(user.data, path=str(root / "data" / "train"))
        (d / "spec.json").write_text(json.dumps(jspec))
        self.log = open(d / "judge.log", "wb")
        self.judge = procs.start_group(
            [wsmod.python(), "-m", "forgetrain.forge._plain", "--spec", str(d / "spec.json"), "--init",
             str(d / "init.safetensors"), "--out", str(d), "--want-hash", config_hash(user)], cwd=d,
            env=sandbox.sandbox_env(run.pycache, writable=True), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log)
        try:
            self.overrides = user_overrides(user, f"scenarios.{self.name}.{wsmod.workspace_entry(run.ws)}")
        except BaseException:
            self.close()
            raise

    def run(self, installed: dict[str, str]) -> tuple[list, dict]:
        """Install the engine (its re-checked files hash as ``installed``) into the user's project dir, run it and
        judge it. Returns (problems as (escape class, what), the record for ``seal.json``). Raises RuntimeError
        when the judge's side fails."""
        from forgetrain.forge import workspace as wsmod
        from forgetrain.forge.install import install

        if self.skipped:
            return [], self.skipped
        dest = self.root / "scenarios" / self.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        (dest.parent / "__init__.py").write_text("")
        install(self.run_.out / ".seal_stage", dest, force=True, staged=True)
        if {f: h for f, h in wsmod.file_hashes(dest).items() if f != "SEAL.json"} != installed:
            return [(6, f"the copy installed for the user's run at {dest} does not hash as the re-checked one")], {}
        return _user_run(self.run_, self.d, self.root, self.tier, self.drawn, self.judge, self.overrides)

    def close(self) -> None:
        from forgetrain.forge import procs

        if self.judge is not None:
            procs.kill_group(self.judge)
        if self.log is not None:
            self.log.close()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _user_run(run, d: Path, root: Path, tier: str, drawn: dict, judge, overrides: list[str]) -> tuple[list, dict]:
    from forgetrain.forge import procs, sandbox
    from forgetrain.forge.workspace import python

    _ready(judge, d, run.opts.ladder_timeout_s)
    shutil.copytree(d / "_data", root / "data")
    shutil.copy2(d / "init.safetensors", root / "init.safetensors")
    cmd = shlex.join([python(), "-m", "forgetrain", *overrides])  # the forge's interpreter, as the user's
    judged = [d / "_data", d / "init.safetensors", d / "spec.json"]
    watched, judge_sig = _watch(run), sandbox.stat_signature(judged)
    procs.become_subreaper()  # what the user's run leaves behind (setsid, a double fork) is re-parented here
    kids = set(procs.children())
    t0 = time.monotonic()
    with open(d / "run.log", "wb") as log:
        rc, timed_out, _ = procs.run_group(["/bin/sh", "-c", f"{cmd}; exit $?"], cwd=root, env=user_env(),
                                           timeout_s=run.opts.ladder_timeout_s, stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT)
    left = procs.kill_leftovers(kids)  # before the golden exists: nothing of the user's run acts after this
    record = {"run": True, "tier": tier, "drawn": drawn, "command": f"sh -c '{cmd}; exit $?'", "cwd": "<project>",
              "rc": rc, "seconds": round(time.monotonic() - t0, 1)}
    problems = [(3, f"a process the installed engine's user run started outlived it ({x}; killed): it could act "
                    f"on the golden the judge makes afterwards") for x in left]
    problems += _watch_problems(run, watched, judged, judge_sig)
    runs = sorted((root / "outputs" / run.scenario).glob("*/trace/trace.jsonl"))
    if problems or rc != 0 or timed_out or not runs:
        judge.stdin.write(b'{"stop": "the user\'s run failed"}\n')
        judge.stdin.flush()
        if not problems:
            tail = (d / "run.log").read_text(errors="replace")[-1500:]
            why = "timed out" if timed_out else f"exited {rc}" if rc != 0 else "wrote no trace"
            problems = [(6, f"the installed engine, run as a user's run (python -m forgetrain), {why}; the end of "
                            f"its output: {tail.strip()[-600:]}")]
        return problems, record
    shutil.copytree(runs[-1].parent, d / "trace")
    judge.stdin.write((json.dumps({"trace": str(d / "trace")}) + "\n").encode())
    judge.stdin.flush()
    try:
        judge.wait(timeout=run.opts.ladder_timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the judge's side of the plain re-check timed out; see {d / 'judge.log'}") from None
    res_file = d / "plain_result.json"
    if judge.returncode != 0 or not res_file.is_file():
        raise RuntimeError(f"the judge's side of the plain re-check failed; see {d / 'judge.log'}")
    res = json.loads(res_file.read_text())
    record.update({k: res.get(k) for k in ("passed", "window", "golden_absent_during_run", "init_sha256")},
                  verdicts=[{k: v[k] for k in ("tier", "passed", "summary")} for v in res.get("verdicts", [])])
    if res["problems"]:
        return [(int(c), f"the installed engine's user run: {p}") for c, p in res["problems"]], record
    if not res["passed"]:
        why = next((f"{v['tier']} {v['summary']}" for v in res.get("verdicts", []) if not v["passed"]), "no verdict")
        return [(6, f"the installed engine, run as a user's run (python -m forgetrain in a plain process, a shell "
                    f"its parent, fresh secret values), fails the gate that its judged runs passed: {why}. It "
                    f"computes differently where it is not judged")], record
    return [], record


def _ready(judge, d: Path, timeout_s: float) -> None:
    """Wait for the judge's side to print ``ready``. Raises RuntimeError when it fails or takes over ``timeout_s``."""
    import select

    if not select.select([judge.stdout], [], [], timeout_s)[0] or judge.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the judge's side of the plain re-check did not get ready; see {d / 'judge.log'}")
