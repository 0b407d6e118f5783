"""The seal: a sealed engine is one whose *installed* copy passed the gate (escape class 6, knowing it is being
judged).

An engine that can tell the gate's run from a user's (its package name, its path, ``sys.argv``, the
environment) can be honest only under the gate. The gate's candidate process therefore imports the engine under
the name it is installed under (``scenarios.<name>``) and looks like a user's ``python -m forgetrain.verify``
run (``forgetrain.forge._candidate``), and before a target reached is accepted, :func:`reverify` installs the
engine where it will live (``forge.install``, else ``<out>/installed/<name>``), with the same checks as
``python -m forgetrain.forge.install``, and runs the same gate again, in fresh processes, on the installed copy:
its own files, its own path, imported as a user's config names it (with the secret values of the run it
re-checks where the operating system isolated that run, fresh ones otherwise), and then once more as a plain
user's process with no sandbox, a user's settings and a terminal (:class:`forgetrain.forge.plain.PlainCheck`: a
replay of one of the re-check's runs, which it must reproduce). Only an engine
whose installed copy passes both is sealed (:func:`seal`); otherwise the round is rejected naming class 6, and a
previous engine at the destination is put back.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from forgetrain.errors import ConfigError
from forgetrain.forge._ladder import TIER_ORDER
from forgetrain.forge import workspace as wsmod
from forgetrain.trace import atomic_write_json


def _say(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def destination(run) -> Path:
    """Where the engine is installed: ``forge.install``, else ``<out>/installed/<package>``."""
    return Path(run.opts.install).resolve() if run.opts.install else run.out / "installed" / run.spec["package"]


def _package_fields(run, eng: Path, tier: str | None) -> dict:
    """The seal record's fields that an installed engine's ``SEAL.json`` holds
    (:func:`forgetrain.forge.install.package_seal`), for the engine files in ``eng`` sealed at ``tier``."""
    return {"scenario": run.scenario, "source_hash": wsmod.source_hash(eng), "files": wsmod.file_hashes(eng),
            "tier": tier, "target_tier": run.opts.target_tier, "record": str(run.out / "sealed" / "seal.json")}


def _stage(run, where: Path, tier: str | None) -> Path:
    """The workspace's engine as a seal dir for :func:`forgetrain.forge.install.install`: ``engine/`` and a
    ``seal.json`` of the fields the final seal will give its ``SEAL.json`` (:func:`_package_fields`, ``tier`` the
    one the re-checks judge), so that the judged copies and the final install hold the same ``SEAL.json``."""
    shutil.rmtree(where, ignore_errors=True)
    shutil.copytree(run.ws / wsmod.ENGINE_DIR, where / wsmod.ENGINE_DIR,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    atomic_write_json(where / "seal.json", _package_fields(run, where / wsmod.ENGINE_DIR, tier))
    return where


def reverify(run, k: int, rdir: Path, passed: dict | None = None) -> list[tuple[int, str]]:
    """Install the workspace's engine at :func:`destination` and run the gate on the installed copy (a ladder run
    of ``run.ladder_fn`` whose spec names it as the ``candidate``). ``passed``: the ladder result that met the
    target; where its candidate was isolated by the operating system, the re-check reuses its drawn values, goldens
    and window (``spec["reuse"]``), which that candidate never saw. When it passes, the same copy runs as a
    user's plain process (:class:`forgetrain.forge.plain.PlainCheck`). Returns the problems, as (escape class,
    what): empty when the installed copy meets the target both ways. On a failure the destination gets back what
    it held."""
    from forgetrain.forge.install import install

    dest = destination(run)
    backup = run.out / ".install_backup"
    shutil.rmtree(backup, ignore_errors=True)
    if dest.exists():
        shutil.copytree(dest, backup, symlinks=True)
    try:
        install(_stage(run, run.out / ".seal_stage", (passed or {}).get("strictest_passed")), dest, force=True,
                staged=True)
    except ConfigError as e:
        return [(7 if "class 7" in str(e) else 6, f"the engine cannot be installed: {e}")]
    installed = _engine_hashes(dest)  # the bytes the re-check judges: the seal vouches for these and no others
    spec = dict(run.spec, candidate={"dir": str(dest), "package": f"scenarios.{dest.name}",
                                     "entry": wsmod.workspace_entry(run.ws)})
    gate = (passed or {}).get("gate") or {}
    src = run.out / "rounds" / str((passed or {}).get("round")) / "ladder"
    if gate.get("drawn") and not str(gate.get("isolation", "none")).startswith("none") and (src / "golden").is_dir():
        spec.update(drawn=gate["drawn"], reuse={"golden": str(src / "golden"), "data": str(src / "_data")})
    spec_path = rdir / "reverify_spec.json"
    atomic_write_json(spec_path, spec)
    plain, plain_rec, res = None, None, {}
    try:
        if getattr(run, "plain_check", True):  # then as a user runs it (forgetrain.forge.plain); it prepares meanwhile
            from forgetrain.forge.plain import PlainCheck

            plain = PlainCheck(run, rdir, passed or {}, dest.name)
        res = run.ladder(k, rdir, spec_path=spec_path, name="reverify")
        problems = _problems(res, dest)
        after = _engine_hashes(dest)
        if after != installed and not problems:
            bad = sorted(f for f in set(after) | set(installed) if after.get(f) != installed.get(f))
            problems = [(3, f"the installed copy at {dest} changed while it was judged ({len(bad)} file(s), first "
                            f"{bad[0]})")]
        if plain is not None and not problems and not res.get("gates_changed"):
            problems, plain_rec = plain.run(installed)
    except (RuntimeError, OSError, ConfigError) as e:  # the user's run could not be composed or judged: no seal
        problems = [(6, f"the installed engine's user run could not be judged: {e}")]
    finally:
        if plain is not None:
            plain.close()
    if res.get("gates_changed"):
        run.state["status"] = "aborted: gates changed"
    if problems:
        shutil.rmtree(dest, ignore_errors=True)
        if backup.exists():
            shutil.copytree(backup, dest, symlinks=True)
    shutil.rmtree(backup, ignore_errors=True)
    run.state["reverify"] = {"round": k, "dest": str(dest), "passed": not problems, "gate": res.get("gate"),
                             "files": installed, "plain": plain_rec}
    return problems


def _engine_hashes(d: Path) -> dict[str, str]:
    return {f: h for f, h in wsmod.file_hashes(d).items() if f != "SEAL.json"}


def _problems(res: dict, dest: Path) -> list[tuple[int, str]]:
    if res.get("gates_changed"):
        return [(int(c), f"{x} (while the installed engine was judged)") for c, x in res["gates_changed"]]
    if res.get("rejected"):
        rej = res["rejected"]
        return [(int(rej["class"]), f"the installed engine at {dest}: {p}") for p in rej["problems"]]
    if res.get("target_met"):
        return []
    why = res.get("error") or next((f"{v['tier']} {v['summary']}" for v in res.get("verdicts", [])
                                    if not v["passed"]), "the target was not met")
    return [(6, f"the installed engine (scenarios.{dest.name} at {dest}), run as a user's run, fails the gate "
                f"that its workspace copy passed: {why}. It computes differently where it is not judged")]


def seal(run) -> Path:
    """Write ``<out>/sealed/`` (``engine/`` + ``seal.json``: source hash, tier, optimisations, metrics, device,
    versions, verdicts, gate config, the installed copy's re-check) from the state of ``run`` (a
    ``forgetrain.forge.loop._Run`` whose last round's installed engine passed :func:`reverify`) and install it
    where ``forge.install`` says. Returns the sealed dir."""
    s, res = run.state, run.state["last_ladder"]
    sd = run.out / "sealed"
    tmp = run.out / ".sealed.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run.ws / wsmod.ENGINE_DIR, tmp / wsmod.ENGINE_DIR,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    judged = (s.get("reverify") or {}).get("files")
    now = wsmod.file_hashes(tmp / wsmod.ENGINE_DIR)
    if judged is not None and now != judged:  # the workspace changed after its installed copy was re-checked
        shutil.rmtree(tmp, ignore_errors=True)
        bad = sorted(f for f in set(now) | set(judged) if now.get(f) != judged.get(f))
        raise ConfigError(f"the workspace's engine changed after its installed copy passed the re-check ({len(bad)} "
                          f"file(s) differ, first {bad[0]}): not sealed; run the forge again to gate it")
    tier, surpassed = res.get("strictest_passed"), res.get("surpassed")
    opt_file = run.ws / wsmod.ENGINE_DIR / "OPTIMISATIONS.json"
    opts_list, opt_note = [], None
    if opt_file.exists():
        try:
            opts_list = json.loads(opt_file.read_text())
            if not isinstance(opts_list, list):
                raise ValueError("not a list")
        except (ValueError, json.JSONDecodeError) as e:
            opts_list, opt_note = [], f"OPTIMISATIONS.json unreadable ({e}); whole engine recorded"
    optimisations = []
    for o in opts_list:
        declared = o.get("tier") if isinstance(o, dict) else None
        holds = declared in TIER_ORDER and tier in TIER_ORDER and TIER_ORDER.index(tier) <= TIER_ORDER.index(declared)
        optimisations.append({"name": o.get("name") if isinstance(o, dict) else str(o),
                              "description": o.get("description", "") if isinstance(o, dict) else "",
                              "declared_tier": declared, "passed_tier": tier, "holds_declared_tier": holds})
    if not optimisations:
        optimisations = [{"name": "engine", "description": "the whole engine", "passed_tier": tier}]
    seal = {**_package_fields(run, tmp / wsmod.ENGINE_DIR, tier), "surpassed": surpassed,
            "target_mfu_pct": run.opts.target_mfu_pct,
            "optimisations": optimisations, "metrics": res.get("metrics") or {},
            "device": res.get("device") or {"hardware": run.rc.hardware.name},
            "versions": res.get("versions") or {},
            "verdicts": [{k: v[k] for k in ("tier", "passed", "summary")} for v in res.get("verdicts", [])],
            "gates": {"spec": run.spec, "tier_configs": wsmod.hash_paths([wsmod.REPO_ROOT / "conf" / "tier"]),
                      "drawn": res.get("gate")},
            "installed_check": s.get("reverify"),
            "forge": {"round": s["round"], "mode": run.opts.mode, "workspace_commit": s["end_commit"],
                      "out_dir": str(run.out), "seed": s.get("seed")},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if opt_note:
        seal["note"] = opt_note
    atomic_write_json(tmp / "seal.json", seal)
    shutil.rmtree(sd, ignore_errors=True)
    tmp.rename(sd)
    wsmod.git(run.ws, "tag", "-f", "sealed", s["end_commit"])
    s["status"], s["seal"] = "sealed", str(sd)
    run._save_state()
    _say(f"[forge] sealed at round {s['round']}: {tier} (source {seal['source_hash'][:12]}) -> {sd}")
    if run.opts.install:  # the copy the re-check judged is there already: this adds SEAL.json beside it
        from forgetrain.forge.install import install

        install(sd, Path(run.opts.install), force=True)
    return sd

