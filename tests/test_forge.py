"""The forge loop, driven by scripted agents (tests/forge_agents/): wrong engine -> evidence in the next brief,
fix -> pass and seal, guard rejections, a hung agent, lessons across runs, a crash and a resume.

The tests marked "real ladder" run the actual gates (reference vs candidate, bitwise, llama_micro, 2 steps) in a
subprocess; the others inject a stub ladder so that they exercise the loop alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from forgetrain.errors import ConfigError
from forgetrain.forge import AgentConfig
from forgetrain.forge import workspace as wsmod
from forgetrain.forge.install import install
from forgetrain.forge.knowledge import KnowledgeBase
from forgetrain.forge.loop import forge
from tests.forge_helpers import SCENARIO, StubLadder, agent_for, fake_gates, forge_cli, log_of, micro_rc, options
from tests.forge_helpers import data_cache  # noqa: F401 (a fixture)
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run1(tmp_path_factory, data_cache):
    """Real ladder: round 1 breaks the RMSNorm epsilon, round 2 restores it."""
    tmp = tmp_path_factory.mktemp("forge_run1")
    agent = agent_for(tmp, {1: ["eps_wrong"], 2: ["eps_fix"]})
    t0 = time.time()
    state = forge(micro_rc(), options(tmp, max_rounds=3), agent, gate_paths=fake_gates(tmp))
    return {"tmp": tmp, "out": tmp / "out", "state": state, "wall_s": time.time() - t0}


# ---------------------------------------------------------------------------------------------------- 1, 2 (real)

def test_wrong_engine_failing_tier_and_module_in_next_brief(run1):
    out = run1["out"]
    log = log_of(out)
    r1 = log[0]
    assert r1["round"] == 1 and r1["guard"] == "ok" and r1["failed_tier"] == "bitwise"
    assert r1["first_divergence"]["module"] == "layers.0.input_norm", r1["first_divergence"]
    assert r1["first_divergence"]["step"] == 1
    brief2 = (out / "rounds" / "2" / "BRIEF.md").read_text()
    status = brief2.split("## Ladder status", 1)[1]
    assert "bitwise: FAIL" in status and "layers.0.input_norm" in status and "module_fwd" in status
    assert "step 1" in status
    assert "MFU breakdown" in status


def test_fix_passes_ladder_and_seals(run1):
    out, state = run1["out"], run1["state"]
    assert state["status"] == "sealed" and state["round"] == 2, state["status"]
    log = log_of(out)
    assert [r["round"] for r in log] == [1, 2]
    assert log[1]["strictest_passed"] == "bitwise" and log[1]["goal_met"]
    seal = json.loads((out / "sealed" / "seal.json").read_text())
    assert seal["tier"] == "bitwise" and seal["scenario"] == SCENARIO
    assert seal["source_hash"] == wsmod.source_hash(out / "sealed" / "engine")
    assert seal["optimisations"][0]["passed_tier"] == "bitwise"
    assert seal["versions"].get("torch") and seal["device"]["hardware"] == "cpu"
    assert "self.eps)" in (out / "sealed" / "engine" / "_llama" / "model.py").read_text()
    ws = out / "workspace"
    assert "round 2: PASS bitwise" in wsmod.git(ws, "log", "--format=%s")
    assert wsmod.git(ws, "rev-parse", "sealed") == wsmod.git(ws, "rev-parse", "HEAD")
    # the failing round is kept as a snapshot ref, off the branch
    assert "self.eps * 10.0" in wsmod.git(ws, "show", "refs/forge/rounds/1:engine/_llama/model.py")
    lessons = KnowledgeBase(run1["tmp"] / "kb.jsonl").load()
    assert len(lessons) == 1 and lessons[0]["tier"] == "bitwise"
    assert any("self.eps" in ln for ln in lessons[0]["fixes"][0]["lines"])


# ---------------------------------------------------------------------------------------------------- 6

def test_lesson_from_run1_appears_in_run2_brief(run1, tmp_path):
    kb = run1["tmp"] / "kb.jsonl"
    ladder = StubLadder()
    state = forge(micro_rc(), options(tmp_path, max_rounds=1, kb_path=str(kb)), agent_for(tmp_path, {}),
                  ladder_fn=ladder, gate_paths=fake_gates(tmp_path))
    assert state["status"] == "sealed"
    brief = (tmp_path / "out" / "rounds" / "1" / "BRIEF.md").read_text()
    lessons = brief.split("## Lessons from the knowledge base", 1)[1]
    assert "layers.0.input_norm" in lessons and "self.eps" in lessons
    # the same pitfall learned again merges into the lesson instead of adding one
    before = KnowledgeBase(kb).load()
    KnowledgeBase(kb).add(tier="bitwise", divergence={"kind": "module_fwd", "module": "layers.1.input_norm"},
                          pitfall="again", fix={"files": ["engine/x.py (+1 -1)"]}, evidence={}, scenario="other")
    after = KnowledgeBase(kb).load()
    assert len(after) == len(before) and after[0]["count"] == 2 and "other" in after[0]["scenarios"]


def test_sealed_engine_seeds_next_run_and_installs(run1, tmp_path):
    sealed = run1["out"] / "sealed"
    ladder = StubLadder()
    state = forge(micro_rc(), options(tmp_path, max_rounds=1, seed_from=str(sealed), baseline=True),
                  agent_for(tmp_path, {}), ladder_fn=ladder, gate_paths=fake_gates(tmp_path))
    assert state["status"] == "sealed" and state["round"] == 0 and ladder.calls == 1  # baseline already passes
    assert state["seed"]["seed_from"] == str(sealed / "engine")
    dest = install(sealed, tmp_path / "scenarios" / "forged")
    assert (dest / "engine.py").exists() and (dest / "SEAL.json").exists()
    assert "from ._llama.model import" in (dest / "engine.py").read_text()  # its own copy of the shared parts
    assert (dest / "_llama" / "model.py").is_file()
    (sealed.parent / "tampered").mkdir()
    shutil.copytree(sealed, sealed.parent / "tampered" / "s")
    with open(sealed.parent / "tampered" / "s" / "engine" / "_llama" / "model.py", "a") as f:
        f.write("# edited after sealing\n")
    with pytest.raises(ConfigError, match="does not match its seal"):
        install(sealed.parent / "tampered" / "s", tmp_path / "scenarios" / "x")
    with pytest.raises(ConfigError, match="--force"):
        (dest / "engine.py").write_text("# other engine\n")
        install(sealed, dest)


# ---------------------------------------------------------------------------------------------------- 3, 4

def test_guard_rejects_reference_import(tmp_path):
    ladder = StubLadder()
    state = forge(micro_rc(), options(tmp_path), agent_for(tmp_path, {1: ["megatron_import"]}), ladder_fn=ladder,
                  gate_paths=fake_gates(tmp_path))
    log = log_of(tmp_path / "out")
    assert log[0]["guard"] == "rejected: forbidden import"
    assert any("megatron.core" in p for p in log[0]["guard_problems"])
    assert log[0]["ladder"] == "not run (guard)"
    ws = tmp_path / "out" / "workspace"
    assert "_cheat" not in (ws / "engine" / "engine.py").read_text()  # reverted
    brief2 = (tmp_path / "out" / "rounds" / "2" / "BRIEF.md").read_text()
    assert "rejected" in brief2 and "megatron.core" in brief2
    assert ladder.calls == 1 and state["status"] == "sealed"  # round 2 (no change) runs the first ladder


def test_guard_rejects_writes_to_workspace_gates_and_references(tmp_path):
    ladder = StubLadder()
    agent = agent_for(tmp_path, {1: ["write_gates"], 2: ["engine_comment", "write_references"]})
    state = forge(micro_rc(), options(tmp_path, max_rounds=2), agent, ladder_fn=ladder,
                  gate_paths=fake_gates(tmp_path))
    log = log_of(tmp_path / "out")
    assert [r["guard"] for r in log] == ["rejected: writes outside engine/"] * 2
    assert any("gates/tier/bitwise.yaml" in p for p in log[0]["guard_problems"])
    assert any("references/megatron/helper.py" in p for p in log[1]["guard_problems"])
    ws = tmp_path / "out" / "workspace"
    assert (ws / "gates" / "tier" / "bitwise.yaml").read_text() == (ROOT / "conf" / "tier" / "bitwise.yaml").read_text()
    assert not (ws / "references" / "megatron" / "helper.py").exists()
    assert "harmless edit" not in (ws / "engine" / "engine.py").read_text()  # the whole round is reverted
    assert ladder.calls == 0 and state["status"] == "exhausted"


def test_gate_tampering_outside_workspace_aborts_loudly(tmp_path, capfd):
    gates = fake_gates(tmp_path)
    target = gates[0] / "bitwise.yaml"
    agent = agent_for(tmp_path, {1: [{"op": "append", "path": str(target), "text": "\nrequire_digests: false\n"}]})
    state = forge(micro_rc(), options(tmp_path), agent, ladder_fn=StubLadder(), gate_paths=gates)
    assert state["status"] == "aborted: gates changed"
    log = log_of(tmp_path / "out")
    assert len(log) == 1 and log[0]["guard"] == "rejected: gates changed"
    assert any(str(target) in p for p in log[0]["guard_problems"])
    assert "GATES CHANGED" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="gates changed"):
        forge(micro_rc(), options(tmp_path, resume=True), agent, ladder_fn=StubLadder(), gate_paths=gates)


# ---------------------------------------------------------------------------------------------------- 5

def test_hung_agent_is_killed_and_the_loop_goes_on(tmp_path):
    pidfile = tmp_path / "agent.pid"
    agent = agent_for(tmp_path, {1: ["eps_wrong", {"op": "pidfile", "path": str(pidfile)},
                                     {"op": "sleep", "seconds": 300}], 2: ["eps_fix"]}, timeout_s=3.0)
    ladder = StubLadder()
    t0 = time.time()
    state = forge(micro_rc(), options(tmp_path), agent, ladder_fn=ladder, gate_paths=fake_gates(tmp_path))
    assert time.time() - t0 < 60
    log = log_of(tmp_path / "out")
    assert log[0]["agent_timeout"] is True and log[0]["agent_rc"] is None and log[0]["agent_s"] < 30
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert log[0]["failed_tier"] == "bitwise"  # the partial edits of the killed agent were still judged
    assert log[1]["round"] == 2 and log[1]["agent_timeout"] is False and ladder.calls == 2
    assert "time limit" in (tmp_path / "out" / "rounds" / "2" / "BRIEF.md").read_text()
    assert state["status"] == "sealed"


# ---------------------------------------------------------------------------------------------------- 7 (real, CLI)

def test_crash_mid_run_then_resume_continues_from_round_2(tmp_path, data_cache):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rounds": {"1": ["eps_wrong"], "2": [{"op": "kill_harness"}, "eps_fix"]}}))
    p = forge_cli(tmp_path, plan)
    assert p.returncode == -9, p.stderr[-2000:]  # killed by the agent in the middle of round 2
    out = tmp_path / "out"
    state = json.loads((out / "workspace" / "forge_state.json").read_text())
    assert state["round"] == 1 and state["status"] == "running"
    assert [r["round"] for r in log_of(out)] == [1]
    p = forge_cli(tmp_path, plan, "forge.resume=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming llama_tiny_cpu (full) after round 1" in p.stderr
    assert "round 2/3" in p.stderr and "round 1/3" not in p.stderr
    log = log_of(out)
    assert [r["round"] for r in log] == [1, 2] and log[1]["strictest_passed"] == "bitwise"
    assert "layers.0.input_norm" in (out / "rounds" / "2" / "BRIEF.md").read_text()
    assert json.loads((out / "workspace" / "forge_state.json").read_text())["status"] == "sealed"
    assert "=== forge summary" in p.stderr
    # the run is sealed, but a state read back is not trusted: resuming judges its engine again and seals it again
    p = forge_cli(tmp_path, plan, "forge.resume=true")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "is judged again (round 3, no agent)" in p.stderr
    log = log_of(out)
    assert [r["round"] for r in log] == [1, 2, 3] and log[2]["mode"] == "resumed"
    assert log[2]["strictest_passed"] == "bitwise" and log[2]["agent_rc"] is None
    assert json.loads((out / "workspace" / "forge_state.json").read_text())["status"] == "sealed"


def test_resume_without_a_forge_run_is_one_line_and_writes_nothing(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rounds": {}}))
    p = forge_cli(tmp_path, plan, "forge.resume=true")
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: forge.resume=true but no forge run"), \
        p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------- modes, config

def test_goal_only_brief_and_modes_side_by_side(tmp_path):
    (tmp_path / "kb.jsonl").write_text(json.dumps({"key": "k", "tier": "bitwise", "pitfall": "SECRET LESSON",
                                                   "fixes": [], "scenarios": [SCENARIO]}) + "\n")
    root = tmp_path / "forge" / SCENARIO
    for mode, rounds in (("full", {1: ["eps_wrong"], 2: ["eps_fix"]}), ("goal_only", {1: ["eps_wrong"],
                                                                                        2: ["eps_fix"]})):
        state = forge(micro_rc(), options(tmp_path, mode=mode, out_dir=str(root / mode)),
                      agent_for(tmp_path, rounds, name=mode), ladder_fn=StubLadder(),
                      gate_paths=fake_gates(tmp_path))
        assert state["status"] == "sealed" and state["rounds_to_pass"] == 2
    goal_only = (root / "goal_only" / "rounds" / "2" / "BRIEF.md").read_text()
    full = (root / "full" / "rounds" / "2" / "BRIEF.md").read_text()
    assert "## Goal" in goal_only and "## Final gate command" in goal_only and "forge._ladder" in goal_only
    for absent in ("Ladder status", "layers.0.input_norm", "SECRET LESSON", "Workflow"):
        assert absent not in goal_only
    assert "layers.0.input_norm" in full and "SECRET LESSON" in full
    modes = json.loads((root / "modes.json").read_text())
    assert set(modes) == {"full", "goal_only"}
    assert modes["full"]["rounds_to_pass"] == 2 and modes["goal_only"]["final_mfu_pct"] == 0.25


def test_existing_run_needs_resume_or_overwrite_and_options_are_checked(tmp_path):
    agent = agent_for(tmp_path, {})
    forge(micro_rc(), options(tmp_path, max_rounds=1), agent, ladder_fn=StubLadder(), gate_paths=fake_gates(tmp_path))
    with pytest.raises(ConfigError, match="forge.resume=true"):
        forge(micro_rc(), options(tmp_path, max_rounds=1), agent, ladder_fn=StubLadder())
    with pytest.raises(ConfigError, match="gate config differs"):
        forge(micro_rc(), options(tmp_path, max_rounds=1, resume=True, verify_steps=3), agent, ladder_fn=StubLadder())
    st = forge(micro_rc(), options(tmp_path, max_rounds=1, overwrite=True), agent, ladder_fn=StubLadder(),
               gate_paths=fake_gates(tmp_path))
    assert st["status"] == "sealed"
    with pytest.raises(ConfigError, match="agent.command"):
        forge(micro_rc(), options(tmp_path / "b"), AgentConfig(command=None))
    with pytest.raises(ConfigError, match="target_tier"):
        forge(micro_rc(), options(tmp_path / "c", target_tier="fastest"), agent)
    with pytest.raises(ConfigError, match="forge.mode"):
        forge(micro_rc(), options(tmp_path / "d", mode="lazy"), agent)
    with pytest.raises(ConfigError, match="agent.command must be a shell command"):
        forge(micro_rc(), options(tmp_path / "e"), AgentConfig(command=True))
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("overrides,msg", [
    (["agent.command=true"], "agent.command must be a shell command (a string), got bool True"),
    (["agent.command=echo", "forge.install=/proc/x"], "forge.install=/proc/x cannot be created"),
    (["agent.command=echo", "forge.timing_steps=-3"], "forge.timing_steps must be a positive integer"),
    (["agent.command=echo", "forge.curve_steps=0", "forge.target_tier=loss_curve"],
     "forge.curve_steps must be a positive integer")])
def test_cli_refuses_bad_options_at_start_with_one_line(tmp_path, overrides, msg):
    """Options that a round or the seal would only trip over later are one ``error:`` line at start, exit 2, no
    traceback, nothing written."""
    p = subprocess.run([sys.executable, "-m", "forgetrain.forge", f"scenario={SCENARIO}", *overrides,
                        f"forge.out_dir={tmp_path / 'o'}", f"hydra.run.dir={tmp_path / 'h'}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=hang_s())
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: {msg}"), p.stderr[-1500:]
    assert sorted(x.name for x in tmp_path.iterdir()) == []


@pytest.mark.parametrize("text,what", [("{ not json", "cannot be read (JSONDecodeError"),
                                       ("[1, 2]", "not a JSON object"),
                                       ('{"round": "x", "status": "running", "mode": "full", "end_commit": "a"}',
                                        "its 'round' is not int")])
def test_resume_of_a_corrupt_state_is_one_error_naming_the_file(tmp_path, text, what):
    agent = agent_for(tmp_path, {})
    forge(micro_rc(), options(tmp_path, max_rounds=1), agent, ladder_fn=StubLadder(), gate_paths=fake_gates(tmp_path))
    state = tmp_path / "out" / "workspace" / "forge_state.json"
    state.write_text(text)
    with pytest.raises(ConfigError) as e:
        forge(micro_rc(), options(tmp_path, max_rounds=2, resume=True), agent, ladder_fn=StubLadder(),
              gate_paths=fake_gates(tmp_path))
    assert str(e.value).startswith(str(state)) and what in str(e.value) and "\n" not in str(e.value), e.value


def test_cli_one_line_error_without_agent_command(tmp_path):
    p = subprocess.run([sys.executable, "-m", "forgetrain.forge", f"forge.out_dir={tmp_path / 'o'}",
                        f"hydra.run.dir={tmp_path / 'h'}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=hang_s())
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: set agent.command"), p.stderr[-1500:]


def test_seed_rewrites_scenario_imports_to_relative():
    src = ("import torch\nfrom scenarios.llama_tiny_cpu.model import Llama\n"
           "import scenarios.llama_tiny_cpu.model as mm\nfrom scenarios.other.model import X\n")
    out = wsmod.rewrite_scenario_imports(src, "llama_tiny_cpu")
    assert "from .model import Llama" in out and "from . import model as mm" in out
    assert "from scenarios.other.model import X" in out


def test_seed_rewrites_shared_part_imports_to_relative():
    """Shared parts (scenarios/_llama) become engine/_llama/: imports of them are relative from every depth."""
    src = ("from scenarios._llama import layout, optim\nfrom scenarios._llama.model import Llama\n"
           "def f():\n    from scenarios.llama1b_h200.fast import FastLlama\n")
    out = wsmod.rewrite_scenario_imports(src, "llama1b_h200", ("_llama",))
    assert "from ._llama import layout, optim" in out and "from ._llama.model import Llama" in out
    assert "    from .fast import FastLlama" in out
    inner = wsmod.rewrite_scenario_imports(src, "llama1b_h200", ("_llama",), here=("_llama",))
    assert "from . import layout, optim" in inner and "from .model import Llama" in inner
    assert "from ..fast import FastLlama" in inner


def test_seed_gives_a_reused_engine_its_own_copy(tmp_path):
    """llama8b_h100 names the Hopper engine of scenarios/llama1b_h200: the workspace holds a copy of that package
    and of scenarios/_llama, imports nothing from scenarios/, and its scenario.yaml names the workspace engine."""
    import ast

    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    ws = tmp_path / "ws"
    info = wsmod.seed(ws, "llama8b_h100", None, "megatron", spec)
    assert info["template"].endswith("scenarios/llama1b_h200") and info["shared"] == ["_llama"]
    for f in ["engine.py", "fast.py", "wgrad.py", "_llama/model.py", "_llama/parallel.py", "_llama/optim.py"]:
        assert (ws / "engine" / f).is_file(), f
    for f in (ws / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(m.startswith("scenarios") for m in mods), (f, mods)
    assert OmegaConf.load(ws / "scenario.yaml").scenario.engine == "engine.engine:Engine"
    assert OmegaConf.load(ws / "scenario.yaml").scenario.name == "llama8b_h100"
    cls = wsmod.load_engine_class(ws / "engine", entry=wsmod.workspace_entry(ws))
    from scenarios.llama1b_h200.engine import Engine as Hopper

    assert cls.__module__ == "_forge_candidate.engine" and cls is not Hopper and cls.__name__ == "Engine"


def test_seed_refuses_an_engine_importing_another_scenario(tmp_path, monkeypatch):
    """A template that reaches into another scenario's package cannot be carried into a workspace."""
    pkg = tmp_path / "scenarios" / "borrower"
    pkg.mkdir(parents=True)
    (pkg / "engine.py").write_text("from scenarios.llama1b_h200.engine import Engine\n")
    monkeypatch.setattr(wsmod, "REPO_ROOT", tmp_path)
    with pytest.raises(ConfigError, match="imports scenarios.llama1b_h200, another scenario's package"):
        wsmod.shared_parts("borrower")


def test_agent_command_placeholders(tmp_path):
    from forgetrain.forge.procs import format_agent_command

    cmd = format_agent_command('claude -p "$(cat {brief})" --cwd {workspace} # {round}', tmp_path / "B.md",
                               tmp_path / "ws dir", 3)
    assert f'"$(cat {tmp_path / "B.md"})"' in cmd and f"'{tmp_path / 'ws dir'}'" in cmd and cmd.endswith("# 3")


# ---------------------------------------------------------------------------------------------------- broken candidates

def test_crashing_candidate_and_syntax_error_do_not_stop_the_loop(tmp_path, data_cache):
    """Real ladder subprocess: a candidate that raises at import is an error verdict fed to the next brief; a
    syntax error is caught by the guard without running the ladder."""
    agent = agent_for(tmp_path, {1: [{"op": "append", "path": "engine/engine.py",
                                      "text": "\nraise RuntimeError('boom from the candidate')\n"}],
                                 2: [{"op": "append", "path": "engine/_llama/model.py", "text": "\ndef broken(:\n"}]})
    state = forge(micro_rc(), options(tmp_path, max_rounds=3), agent, gate_paths=fake_gates(tmp_path))
    log = log_of(tmp_path / "out")
    assert log[0]["ladder"] == "error" and "boom from the candidate" in log[0]["ladder_error"]
    assert "boom from the candidate" in (tmp_path / "out" / "rounds" / "2" / "BRIEF.md").read_text()
    assert log[1]["guard"] == "syntax error" and log[1]["ladder"] == "not run (syntax error)"
    assert "SyntaxError" in (tmp_path / "out" / "rounds" / "3" / "BRIEF.md").read_text()
    assert log[2]["guard"] == "syntax error" and state["status"] == "exhausted"  # still broken in round 3


def test_hung_ladder_is_killed(tmp_path, monkeypatch):
    from forgetrain.forge.procs import subprocess_ladder

    fake = tmp_path / "slow_python"
    fake.write_text("#!/bin/sh\nsleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FORGE_PYTHON", str(fake))
    (tmp_path / "r").mkdir()
    t0 = time.time()
    res = subprocess_ladder(tmp_path / "spec.json", tmp_path, tmp_path / "r" / "ladder", 1.0, tmp_path / "r" / "l.log")
    assert time.time() - t0 < 15
    assert res["ok"] is False and res["timeout"] is True and "timed out" in res["error"]


def test_ladder_tier_plan():
    from forgetrain.forge._ladder import target_met, tiers_to_try

    assert tiers_to_try("bitwise", "bitwise") == ["bitwise"]
    assert tiers_to_try("bitwise", "surpass") == ["bitwise", "tolerance", "loss_curve", "surpass"]
    assert tiers_to_try("tolerance", "loss_curve") == ["tolerance", "loss_curve"]
    with pytest.raises(ValueError):
        tiers_to_try("loss_curve", "bitwise")
    assert target_met("tolerance", "bitwise", None) and not target_met("bitwise", "tolerance", None)
    assert not target_met("surpass", "bitwise", False) and target_met("surpass", "loss_curve", True)


def test_agent_commits_are_undone_and_still_judged(tmp_path):
    script = tmp_path / "committer.sh"
    script.write_text("#!/bin/sh\nset -e\necho '# x' >> engine/engine.py\ngit checkout -q -b agent-branch\n"
                      "git -c user.name=a -c user.email=a@b commit -qam 'agent commit'\n")
    script.chmod(0o755)
    ladder = StubLadder()
    forge(micro_rc(), options(tmp_path, max_rounds=1), AgentConfig(command=str(script), timeout_s=hang_s()),
          ladder_fn=ladder, gate_paths=fake_gates(tmp_path))
    ws = tmp_path / "out" / "workspace"
    log = log_of(tmp_path / "out")
    assert "note" in log[0] and log[0]["guard"] == "ok" and ladder.calls == 1
    assert wsmod.git(ws, "symbolic-ref", "HEAD") == "refs/heads/main"
    assert "agent commit" not in wsmod.git(ws, "log", "--format=%s")


_FORGE_STANDIN = r'''
import os, sys, time
from forgetrain.forge import procs, startup
out, pids = sys.argv[1:3]
lock = startup.lock_out_dir(out)
LADDER = """
import json, os, signal, subprocess, sys, time
from forgetrain.forge import procs
signal.signal(signal.SIGTERM, procs.kill_active)
procs.become_subreaper()
procs.die_with_parent(int(sys.argv[1]))
grand = sys.argv[2] + ".grand"
side = procs.start_group([sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen([sys.executable, "
                          "'-c', 'import time; time.sleep(600)'], start_new_session=True); "
                          "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)", grand], cwd=".",
                         env=os.environ)
while not os.path.exists(grand) or not open(grand).read():
    time.sleep(0.05)
open(sys.argv[2], "w").write(json.dumps([os.getpid(), side.pid, int(open(grand).read())]))
time.sleep(600)
"""
procs.start_group([sys.executable, "-c", LADDER, str(os.getpid()), pids], cwd=out, env=os.environ, pass_fds=(lock,))
time.sleep(600)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_forge_takes_its_ladder_and_the_sides_with_it(tmp_path):
    """``kill -9`` of the forge mid-ladder: the ladder gets SIGTERM (``die_with_parent``) and ends its sides, and
    what they left out of their groups, before it exits; the run dir stays locked until then, so a resume cannot
    race with them."""
    from forgetrain.forge import startup

    out, pids = tmp_path / "out", tmp_path / "pids.json"
    out.mkdir()
    forge_p = subprocess.Popen([sys.executable, "-c", _FORGE_STANDIN, str(out), str(pids)],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + hang_s()
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    ladder, side, grand = json.loads(pids.read_text())
    with pytest.raises(ConfigError, match="in use by another process"):
        startup.lock_out_dir(out, wait_s=0.5)
    forge_p.kill()
    forge_p.wait()
    fd = startup.lock_out_dir(out, wait_s=30)  # free once the ladder and what it ended are gone
    os.close(fd)
    for pid in (ladder, side, grand):
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[-1].split()[0] in "ZX", pid
        except FileNotFoundError:
            pass
