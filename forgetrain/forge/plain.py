"""The seal's plain re-check (escape class 6, knowing it is being judged): the installed engine run as a user runs it.

The gate's candidate process and the installed copy's re-check (:func:`forgetrain.forge.seal.reverify`) run under
the sandbox: a guard, an audit hook, private mounts, the forge's ``PYTHON*`` flags, the ladder as the parent, a run
dir under the forge's out dir, no terminal, and the judge's own settings (digests recorded, no checkpoints, no
sample). An engine that reads any of them can be honest only there. :class:`PlainCheck` therefore runs the
installed engine once more as a plain user's process, and compares it with itself as judged:

* a user's project dir (a fresh temporary dir, its name not the forge's) holding the engine installed as
  ``scenarios/<name>/`` by :func:`forgetrain.forge.install.install` (the bytes the re-check judged, checked), a data
  window and init weights; ``python -m forgetrain`` run there through ``sh -c`` (a shell is its parent; its working
  dir first on ``sys.path``, as ``python -m`` puts it, is what makes the package importable, no import machinery of
  the forge's), with the run's settings as Hydra overrides (:func:`user_overrides`) and Hydra's own run dir
  (``outputs/<scenario>/<date>_<time>``); the forge's starting environment without any ``FORGE_*`` variable and
  without the ``PYTHON*`` variables the sandbox sets (:func:`user_env`); no guard, no audit hook, no private
  mounts; a terminal: the command leads a process group of its own (``setsid``) whose controlling terminal is a fresh
  pseudo-terminal, its stdin, stdout and stderr on it (:func:`forgetrain.forge.procs.run_on_terminal`; where none
  can be had it runs without one and the record says so);
* it replays one of the gated re-check's runs of the tier the engine passed (:func:`replay_config`): a pair tier's
  (bitwise, tolerance) one run, a curve tier's (loss_curve, or the one surpass rests on) one of its paired runs, a
  reference seed drawn among the re-check's. Its command carries what the replay needs and nothing a user's
  default run would not: the init weights that run started from, its data window, seed, steps, LR schedule and
  thread count, and the configured run's own settings; not the judge's (``train.digests``, ``train.save``,
  ``train.sample_tokens``, ``train.save_interval``, ``train.overwrite``, ``logger.*``: a user's defaults,
  :data:`JUDGE_ONLY`), except ``train.save=false`` where the checkpoints would not fit the project dir's disk
  (recorded);
* the judge's side (``forgetrain.forge._plain``, a process that never runs candidate code and has loaded its
  modules before the user's run starts) reads the gated run's trace, checks it as the re-check's run (config hash,
  steps) and its init against the golden's, before the user's run, and holds what it compares in its own memory;
  afterwards it compares the user's trace with it by the rule ``plain_replay`` of ``conf/tier/loss_curve.yaml``
  (:func:`replay_rule`): the per-step loss, grad norm and lr to the bit where the run is deterministic on a listed
  device (and a pair tier's final weights, which its gated run exported), else the first steps within the
  tolerance tier's per-step thresholds. An engine that computes differently where it is not judged (another
  package path, no digests, a terminal) does not reproduce its own judged run.

Around the user's run, which nothing guards, the hashed gate set, the forge's bytecode cache, the judge's files of
this check and what the judge reads outside the repository are compared (classes 4, 3, 1 and 8); its process
group is killed when it ends, and any process it started that outlived it (re-parented to the forge, its
subreaper) is killed and rejects it (class 3) before the judge compares anything. The judge's side is not dumpable
(no ptrace attach by the user's run; :func:`forgetrain.forge.procs.no_ptrace`). Any other failure is a problem
naming class 6.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
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


# the settings the judge gives its own runs (forgetrain.equivalence.runs.run_cfg, the forge's spec) and a replay
# does not need: a user's run takes the scenario's defaults for them (replay_config)
JUDGE_ONLY = {"train": ("digests", "sample_tokens", "sample_prompt", "save", "save_interval", "overwrite"),
              "logger": ("name", "plots", "project", "mode")}


def _scenario_base(rc) -> list[str]:
    """``scenario=<name>`` and, where ``rc``'s model is a preset, ``model=<name>`` (chosen as a group, as a user
    chooses it)."""
    from forgetrain.cli import CONF_DIR

    base = [f"scenario={rc.scenario.name}"]
    if (Path(CONF_DIR) / "model" / f"{rc.model.name}.yaml").is_file():
        base.append(f"model={rc.model.name}")
    return base


def user_overrides(rc, engine: str) -> list[str]:
    """The overrides a user passes to ``python -m forgetrain`` for the run ``rc`` of the engine ``engine``
    (``scenarios.<name>.<module>:<Class>``): ``scenario=<name>``, the engine, and every setting that differs from
    what that scenario composes to (the run dir is Hydra's). Raises ConfigError when the composed run would not
    have ``rc``'s config hash."""
    from forgetrain.errors import ConfigError
    from forgetrain.train import config_hash

    base = _scenario_base(rc)
    base.insert(1, f"scenario.engine={_value(engine)}")
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


def replay_rule(rc, gated_steps: int) -> tuple[str, int]:
    """How the plain user run replays a gated run of the configuration ``rc`` (a RunConfig) that is
    ``gated_steps`` steps long: (``"bitwise"``, ``gated_steps``) where the run is deterministic
    (``train.deterministic`` on a device of ``bitwise_devices``), else (``"tolerance"``, the first
    ``tolerance_steps`` steps, at most ``gated_steps``). The rule and its rationale: ``plain_replay`` in
    ``conf/tier/loss_curve.yaml``. Raises ConfigError when that section is missing or malformed."""
    from forgetrain.equivalence.verdict import load_tier
    from forgetrain.errors import ConfigError

    rule = load_tier("loss_curve").get("plain_replay")
    try:
        devices, n = list(rule["bitwise_devices"]), int(rule["tolerance_steps"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"conf/tier/loss_curve.yaml: plain_replay must give bitwise_devices (a list) and "
                          f"tolerance_steps (an integer), got {rule!r}") from None
    if n <= 0:
        raise ConfigError(f"conf/tier/loss_curve.yaml: plain_replay.tolerance_steps must be positive, got {n}")
    if rc.train.deterministic and rc.hardware.device in devices:
        return "bitwise", int(gated_steps)
    return "tolerance", min(n, int(gated_steps))


def user_defaults(rc):
    """The RunConfig a user's ``python -m forgetrain scenario=<name> [model=<preset>]`` composes to."""
    return _composed(_scenario_base(rc))


def replay_config(rc, gated_steps: int, seed: int, steps: int, threads: int | None, root: Path):
    """The RunConfig of a user's run that replays the first ``steps`` steps of a gated run of the seed ``seed``
    (``gated_steps`` steps of the judge's configuration ``rc``, as :func:`forgetrain.equivalence.runs.run_cfg` has
    verify run it: the LR schedule pinned to the whole run's, so fewer steps replay the same learning rates),
    reading the init weights ``root/init.safetensors`` and the data window ``root/data/train``, on ``threads`` CPU
    threads (not hashed; None: torch's default). The settings of :data:`JUDGE_ONLY` are the scenario's defaults
    (:func:`user_defaults`: no digests, checkpoints and the end-of-run sample as a user gets them), and the LR
    decay horizon is left to default where it is the run's own length: a user's command carries what the replay
    needs and nothing else."""
    defaults = user_defaults(rc)
    t = rc.train
    decay = t.lr_decay_steps if t.lr_decay_steps is not None else max(int(t.steps), int(gated_steps))
    user = copy.deepcopy(rc)
    user.train = dataclasses.replace(
        t, steps=int(steps), seed=int(seed), lr_decay_steps=None if decay == int(steps) else decay, out_dir=None,
        resume=False, stop_after=None, threads=threads, init_weights=str(root / "init.safetensors"),
        **{k: getattr(defaults.train, k) for k in JUDGE_ONLY["train"]})
    user.logger = dataclasses.replace(rc.logger, **{k: getattr(defaults.logger, k) for k in JUDGE_ONLY["logger"]})
    user.data = dataclasses.replace(rc.data, path=str(root / "data" / "train"))
    return user


def fit_disk(user, root: Path) -> list[str]:
    """Where the outputs of the user's run ``user`` (a RunConfig; checkpoints and final weights as a user's
    default run writes them) would not fit the disk under ``root`` (:func:`forgetrain.disk.check`), turn off first
    the checkpoints, then the final weights' export, in place. Returns the overrides so added (empty: none)."""
    from forgetrain import disk
    from forgetrain.errors import ConfigError

    added = []
    for field in ("save", "final_params"):
        try:
            disk.check(user, root)
            break
        except ConfigError:
            user.train = dataclasses.replace(user.train, **{field: False})
            added.append(f"train.{field}=false")
    return added


def gated_run(rdir: Path, spec: dict, tier: str, seed: int | None = None) -> tuple[Path, Path]:
    """The trace dir and init file of the re-check's (its ladder run, ``rdir/reverify``) gated run that the user's
    run replays: for a pair tier ``tier``, its one run (``<tier>/candidate/trace``, from ``<tier>/init/
    init.safetensors``); for a curve tier, its paired run of the reference seed ``seed``
    (``candidate/candidate_paired_seed<N>/trace``, from ``init/seed_<N>.safetensors``) under the speed target's dir
    when ``spec``'s target is a speed tier (its run carries the curve tier's), else under the curve tier's own."""
    from forgetrain.equivalence import registry

    if registry.find(tier).kind == registry.PAIR:
        d = rdir / "reverify" / tier
        return d / "candidate" / "trace", d / "init" / "init.safetensors"
    d = curve_dir(rdir, spec, tier)
    return d / "candidate" / f"candidate_paired_seed{seed}" / "trace", d / "init" / f"seed_{seed}.safetensors"


def curve_dir(rdir: Path, spec: dict, tier: str) -> Path:
    """Where the installed copy's re-check (its ladder run, ``rdir/reverify``) wrote the runs of the curve tier
    ``tier`` it passed: the speed target's dir when ``spec``'s target is a speed tier (its run carries the curve
    tier's), else the curve tier's own. The paired runs are ``candidate/candidate_paired_seed<N>/trace``, the inits
    the ladder rebuilt and checked ``init/seed_<N>.safetensors``."""
    from forgetrain.equivalence import registry

    target = spec["target_tier"]
    return rdir / "reverify" / (target if registry.find(target).kind == registry.SPEED else tier)


class PlainCheck:
    """The plain re-check of one round (module docstring). Made before the installed copy's gated re-check, so
    that the judge's side loads its modules while that runs; :meth:`run` then chooses the re-check's run to replay,
    runs the installed engine as a user's process and has it judged; :meth:`close` ends the judge's side and
    removes the user's project dir. ``passed``: the ladder result that met the target; ``name``: the installed
    package's name. Raises RuntimeError when ``passed`` names no pair or curve tier passed."""

    def __init__(self, run, rdir: Path, passed: dict, name: str):
        from forgetrain.equivalence import registry
        from forgetrain.forge import procs, sandbox
        from forgetrain.forge import workspace as wsmod

        self.run_, self.rdir, self.judge, self.root, self.log = run, rdir, None, None, None
        self.tier = tier = passed.get("strictest_passed")
        found = registry.find(tier) if tier else None
        kind = found.kind if found is not None else None
        if kind not in (registry.PAIR, registry.CURVE):
            raise RuntimeError(f"the ladder result that met the target names no pair or curve tier passed "
                               f"(strictest_passed: {tier!r}): there is no run to re-check as a user's")
        self.pair = kind == registry.PAIR
        self.d = d = rdir / "plain"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        self.root = Path(tempfile.mkdtemp())  # the user's project dir
        self.name = name  # the package name the re-check imports it under
        self.engine = f"scenarios.{self.name}.{wsmod.workspace_entry(run.ws)}"
        self.overrides = None
        self.log = open(d / "judge.log", "wb")
        # the judge's side loads its modules now, and waits for the replay's request
        self.judge = procs.start_group(
            [wsmod.python(), "-m", "forgetrain.forge._plain", "--init", str(d / "init.safetensors"), "--out", str(d)],
            cwd=d, env=sandbox.sandbox_env(run.pycache, writable=True), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log)

    def run(self, installed: dict[str, str]) -> tuple[list, dict]:
        """Install the engine (its re-checked files hash as ``installed``) into the user's project dir, run it and
        judge it. Returns (problems as (escape class, what), the record for ``seal.json``). Raises RuntimeError
        when the judge's side fails, ConfigError when the replay cannot be written as a user's command line,
        OSError when the re-check's run it replays cannot be read."""
        from forgetrain.forge import workspace as wsmod
        from forgetrain.forge.install import install

        dest = self.root / "scenarios" / self.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        (dest.parent / "__init__.py").write_text("")
        install(self.run_.out / ".seal_stage", dest, force=True, staged=True)
        if {f: h for f, h in wsmod.file_hashes(dest).items() if f != "SEAL.json"} != installed:
            return [(6, f"the copy installed for the user's run at {dest} does not hash as the re-checked one")], {}
        record = {"run": True, "tier": self.tier, "replay": self._request_replay()}
        return _user_run(self.run_, self.d, self.root, self.judge, self.overrides, record,
                         [Path(record["replay"]["of"])])

    def _request_replay(self) -> dict:
        """Choose the re-check's run to replay (a pair tier's one run; a curve tier's paired run of a reference seed
        drawn among the re-check's), compose the user's command line for it and send the judge's side its request.
        Returns the record's ``replay`` entry: ``of`` (the gated run's trace dir), ``seed``, ``steps`` (of
        ``of_steps``), ``compare``, ``threads``, the overrides kept for the disk (``disk``) and the ``rule``'s
        source."""
        import secrets

        from forgetrain.config import to_run_config
        from forgetrain.equivalence.verdict import load_tier
        from forgetrain.train import config_hash
        from forgetrain.verify import VerifyConfig

        jspec = json.loads((self.rdir / "reverify" / "spec.json").read_text())
        rc, vcfg = to_run_config(jspec["run_config"]), VerifyConfig(**jspec["verify"])
        if self.pair:
            seed, of_steps = int(rc.train.seed), int(vcfg.steps)
        else:
            seed, of_steps = secrets.SystemRandom().choice(list(vcfg.seeds)), int(vcfg.curve_steps)
        gated, init = gated_run(self.rdir, jspec, self.tier, seed)
        meta = json.loads((gated / "meta.json").read_text())
        compare, steps = replay_rule(rc, of_steps)
        threads = rc.train.threads or (meta.get("versions") or {}).get("threads")
        user = replay_config(rc, of_steps, seed, steps, threads, self.root)
        disk = fit_disk(user, self.root)
        self.overrides = user_overrides(user, self.engine)
        req = {"spec": str(self.rdir / "reverify" / "spec.json"), "tier": self.tier, "gated": str(gated),
               "seed": seed, "steps": steps, "compare": compare, "init": str(init), "want_hash": config_hash(user),
               "final_params": bool(user.train.final_params)}
        (self.d / "spec.json").write_text(json.dumps(req))
        self.judge.stdin.write((json.dumps({"replay": req}) + "\n").encode())
        self.judge.stdin.flush()
        return {"of": str(gated), "seed": seed, "steps": steps, "of_steps": of_steps, "compare": compare,
                "threads": threads, "disk": disk,
                "rule": f"conf/tier/loss_curve.yaml plain_replay (version {load_tier('loss_curve')['version']})"}

    def close(self) -> None:
        from forgetrain.forge import procs

        if self.judge is not None:
            procs.kill_group(self.judge)
        if self.log is not None:
            self.log.close()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _user_run(run, d: Path, root: Path, judge, overrides: list[str], record: dict,
              watched: list[Path]) -> tuple[list, dict]:
    """Run the user's command (``overrides``) in ``root`` on a terminal once the judge's side is ready, then have
    it judge the trace. ``record`` (``tier``, ``replay``) gets the run's command, exit status, time, terminal and
    the judge's findings; ``watched``: more of the judge's inputs that the user's run must leave alone (class 1).
    Returns (problems as (escape class, what), the record)."""
    from forgetrain.forge import procs, sandbox
    from forgetrain.forge.workspace import python

    _ready(judge, d, run.opts.ladder_timeout_s)
    shutil.copytree(d / "_data", root / "data")
    shutil.copy2(d / "init.safetensors", root / "init.safetensors")
    cmd = shlex.join([python(), "-m", "forgetrain", *overrides])  # the forge's interpreter, as the user's
    judged = [d / "_data", d / "init.safetensors", d / "spec.json", *watched]
    watched_sig, judge_sig = _watch(run), sandbox.stat_signature(judged)
    procs.become_subreaper()  # what the user's run leaves behind (setsid, a double fork) is re-parented here
    kids = set(procs.children())
    rc, timed_out, secs, terminal = procs.run_on_terminal(["/bin/sh", "-c", f"{cmd}; exit $?"], cwd=root,
                                                          env=user_env(), timeout_s=run.opts.ladder_timeout_s,
                                                          log_path=d / "run.log")
    left = procs.kill_leftovers(kids)  # before the judge compares: nothing of the user's run acts after this
    record.update({"command": f"sh -c '{cmd}; exit $?'", "cwd": "<project>", "rc": rc, "seconds": round(secs, 1),
                   "terminal": terminal})
    problems = [(3, f"a process the installed engine's user run started outlived it ({x}; killed): it could act "
                    f"on what the judge compares it with afterwards") for x in left]
    problems += _watch_problems(run, watched_sig, judged, judge_sig)
    runs = sorted((root / "outputs" / run.scenario).glob("*/trace/trace.jsonl"))
    if problems or rc != 0 or timed_out or not runs:
        judge.stdin.write(b'{"stop": "the user\'s run failed"}\n')
        judge.stdin.flush()
        if not problems:
            tail = (d / "run.log").read_text(errors="replace").replace("\r\n", "\n")[-1500:]
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
    record.update({k: res[k] for k in ("passed", "window", "init_sha256", "replayed") if k in res},
                  verdicts=[{k: v.get(k) for k in ("tier", "passed", "summary", "first_divergence")}
                            for v in res.get("verdicts", [])])
    if res["problems"]:
        return [(int(c), f"the installed engine's user run: {p}") for c, p in res["problems"]], record
    if not res["passed"]:
        bad = next((v for v in res.get("verdicts", []) if not v["passed"]), None)
        why = f"{bad['tier']} {bad['summary']}" if bad else "no verdict"
        step = ((bad or {}).get("first_divergence") or {}).get("step")
        rep = record["replay"]
        which = record["tier"] if record["replay"]["of"].endswith("/candidate/trace") else f"paired {record['tier']}"
        where = f"the re-check's {which} run of seed {rep['seed']}"
        return [(6, f"the installed engine, run as a user's run (python -m forgetrain in a plain process, a shell "
                    f"its parent, {_terminal_words(record['terminal'])}, a user's settings), does not reproduce "
                    f"the gated run it replays ({rep['steps']} of the {rep['of_steps']} steps of {where}, compared "
                    f"{rep['compare']}){'' if step is None else f'; first divergent step {step}'}: {why}. It "
                    f"computes differently where it is not judged")], record
    return [], record


def _terminal_words(terminal: dict) -> str:
    if terminal.get("pty") and terminal.get("controlling"):
        return "a terminal its controlling terminal"
    if terminal.get("pty"):
        return "a terminal its stdin, stdout and stderr (not its controlling terminal)"
    return "no terminal (none could be opened)"


def _ready(judge, d: Path, timeout_s: float) -> None:
    """Wait for the judge's side to print ``ready``. Raises RuntimeError when it fails or takes over ``timeout_s``."""
    import select

    if not select.select([judge.stdout], [], [], timeout_s)[0] or judge.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the judge's side of the plain re-check did not get ready; see {d / 'judge.log'}")
