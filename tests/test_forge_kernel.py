"""The kernel target of the forge (forgetrain/forge/kernel.py, gate forgetrain/forge/_kernel_gate.py) on CPU.

A scripted agent (tests/forge_agents/scripted_agent.py) edits swiglu's kernel file; the real gate runs: the fp64
oracle under the Triton interpreter, the speed gate with the tests' fake timer (``# forge-fake-ms: X`` in the
source), the end-to-end tolerance tier in llama1b_h200's fast engine at llama_micro shape against Megatron-core.

One chain, two runs: run A (wrong kernel -> rejected by the oracle; fixed and faster -> sealed, lesson written);
run B (the sealed kernel is the reference and the lesson is in the brief; a slower kernel -> rejected by the speed
gate; an edit outside the kernel file -> rejected; the reference stays).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgetrain.config import EngineOptions, ScenarioConfig
from forgetrain.errors import ConfigError
from forgetrain.forge import AgentConfig, ForgeOptions
from forgetrain.forge._kernel_gate import fake_samples
from forgetrain.forge.kernel import forge_kernel, render_brief
from forgetrain.forge.knowledge import KnowledgeBase
from forgetrain.kernels.switches import KERNEL_DIR, file_sha256
from tests.helpers import ladder_cfg as _cfg
from tests.limits import hang_s

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "forge_agents" / "scripted_agent.py"


def _rc(scenario="llama1b_h200"):
    c = _cfg()
    from forgetrain.registry import engine_spec

    return dataclasses.replace(c, scenario=ScenarioConfig(name=scenario, engine=engine_spec(scenario)),
                               engine=EngineOptions(mode="fast", compile=False, ce_chunk_tokens=24))


def _plan(tmp: Path, name: str, rounds: dict) -> AgentConfig:
    p = tmp / f"{name}.json"
    p.write_text(json.dumps({"rounds": rounds}))
    return AgentConfig(command=f"{sys.executable} {AGENT} {p}", timeout_s=hang_s())


def _opts(tmp: Path, out: str, rounds: int, **kw) -> ForgeOptions:
    return ForgeOptions(max_rounds=rounds, out_dir=str(tmp / out), kernel_store=str(tmp / "store"),
                        kb_path=str(tmp / "kb.jsonl"), kernel_timer="fake", kernel_repeats=20, verify_steps=2, **kw)


def test_fake_timer_and_speed_statistics():
    """The speed gate's input: equal fake times are not faster beyond noise, half the time is."""
    from forgetrain.equivalence.tiers.surpass import speed_stats

    ref = "x = 1\n"
    assert not speed_stats(fake_samples(ref, 20), fake_samples(ref + " ", 20))["faster_beyond_noise"]
    assert speed_stats(fake_samples(ref, 20), fake_samples(ref + "# forge-fake-ms: 0.5\n", 20))["faster_beyond_noise"]
    assert not speed_stats(fake_samples(ref, 20), fake_samples(ref + "# forge-fake-ms: 2\n", 20))["faster_beyond_noise"]


def test_kernel_forge_chain(tmp_path):
    repo_sha = file_sha256(KERNEL_DIR / "swiglu.py")
    # ---- run A: baseline seals the repository's kernel; wrong -> oracle; fixed + faster -> sealed, lesson
    agent = _plan(tmp_path, "a", {"1": ["kernel_swiglu_wrong"], "2": ["kernel_swiglu_fix_faster"]})
    st = forge_kernel(_rc(), "swiglu", _opts(tmp_path, "a", 3), agent)
    log = [json.loads(x) for x in (tmp_path / "a" / "forge_log.jsonl").read_text().splitlines()]
    assert log[0]["round"] == 0 and log[0]["sha256"] == repo_sha
    assert log[1]["gate"].startswith("FAIL at oracle"), log[1]
    assert log[2]["gate"] == "PASS", log[2]
    assert st["status"] == "sealed" and st["round"] == 2
    res = json.loads((tmp_path / "a" / "rounds" / "2" / "gate_result.json").read_text())
    assert [s["stage"] for s in res["stages"]] == ["oracle", "speed", "e2e"] and res["passed"]
    assert "tolerance in llama1b_h200" in res["stages"][2]["summary"]
    sealed = st["seal"]["source_sha256"]
    assert sealed == file_sha256(tmp_path / "a" / "workspace" / "kernel" / "swiglu.py") != repo_sha
    reg = json.loads((tmp_path / "store" / "registry.json").read_text())
    entry = reg["kernels"]["swiglu"]["cpu"]
    assert entry["source_sha256"] == sealed and entry["timings"]["timer"] == "fake"
    assert entry["validation"]["cases"] and all(c["ok"] for c in entry["validation"]["cases"])
    assert entry["device_name"].startswith("cpu") and entry["versions"]["triton"]
    lessons = KnowledgeBase(tmp_path / "kb.jsonl").load()
    assert len(lessons) == 1 and lessons[0]["scenarios"] == ["kernel:swiglu@cpu"]
    assert lessons[0]["tier"] == "kernel:oracle" and any("tl.sigmoid" in x for x in lessons[0]["fixes"][0]["lines"])
    assert (tmp_path / "a" / "workspace" / "kernel").is_dir()
    assert sorted(p.name for p in (tmp_path / "a" / "workspace").iterdir() if p.name not in (".git", ".gate")) == \
        [".gitignore", "BRIEF.md", "kernel", "spec.json"]

    # ---- run B: the sealed kernel is the reference; slower -> speed gate; outside edit -> rejected
    agent = _plan(tmp_path, "b", {"1": ["kernel_swiglu_slower"], "2": ["kernel_edit_outside"]})
    st = forge_kernel(_rc(), "swiglu", _opts(tmp_path, "b", 2), agent)
    brief = (tmp_path / "b" / "rounds" / "1" / "BRIEF.md").read_text()
    assert sealed[:12] in brief and "the oracle gate failed" in brief and "tl.sigmoid" in brief
    log = [json.loads(x) for x in (tmp_path / "b" / "forge_log.jsonl").read_text().splitlines()]
    assert log[0]["round"] == 1 and log[0]["gate"].startswith("FAIL at speed"), log[0]
    assert log[1]["guard"] == "rejected: edit outside the kernel file" and "M spec.json" in log[1]["guard_problems"]
    assert st["status"] == "exhausted"
    reg = json.loads((tmp_path / "store" / "registry.json").read_text())
    assert reg["kernels"]["swiglu"]["cpu"]["source_sha256"] == sealed  # the reference stays in place
    ws = tmp_path / "b" / "workspace"
    assert "forge-fake-ms: 0.1" not in (ws / "kernel" / "swiglu.py").read_text()  # the rejected round reverted
    assert '"tier": "tolerance"' in (ws / "spec.json").read_text()


def _stub_gate(spec, ws, out, result):
    return {"passed": False, "failed_stage": "oracle", "device": "cpu",
            "stages": [{"stage": "oracle", "passed": False, "summary": "stub"}],
            "validation": {"cases": []}, "timings": {"timer": "fake", "cases": []}}


def test_goal_only_brief_has_goal_contract_and_gate_only(tmp_path):
    store = tmp_path / "store"
    (store / "sources").mkdir(parents=True)
    src = store / "sources" / "swiglu-cpu-x.py"
    src.write_text((KERNEL_DIR / "swiglu.py").read_text())
    (store / "registry.json").write_text(json.dumps({"format": 1, "kernels": {"swiglu": {"cpu": {
        "source_sha256": file_sha256(src), "source_file": "sources/swiglu-cpu-x.py", "sealed_at": "t",
        "timings": {"timer": "fake", "unit": "ms", "cases": [{"shape": {"tokens": 1}, "cand_ms": 1.0}]}}}}}))
    kb = KnowledgeBase(tmp_path / "kb.jsonl")
    kb.add(tier="kernel:oracle", divergence={"kind": "oracle", "module": "kernel:swiglu@cpu"}, pitfall="PITFALL-X",
           fix={"files": []}, evidence={}, scenario="kernel:swiglu@cpu")
    for mode in ("goal_only", "full"):
        agent = _plan(tmp_path, mode, {"1": [{"op": "append", "path": "kernel/swiglu.py", "text": "# x\n"}]})
        forge_kernel(_rc(), "swiglu", _opts(tmp_path, mode, 1, mode=mode), agent, gate_fn=_stub_gate)
        brief = (tmp_path / mode / "rounds" / "1" / "BRIEF.md").read_text()
        for must in ("## Goal", "replaces: `F.silu(gate) * up`", "saved for backward", "dtypes: bfloat16",
                     "shape grid", "the bar (reference timings)", "## Gate command", "kernels.swiglu=triton"):
            assert must in brief, (mode, must)
        assert ("PITFALL-X" in brief) == (mode == "full")
        assert ("## Rounds so far" in brief) == (mode == "full")


@pytest.mark.parametrize("kernel,scenario,match", [
    ("nope", "llama1b_h200", "unknown kernel 'nope'"),
    # the tiny engine runs exact mode only (its spec's modes), so the kernel's fast-mode run is refused at its mode
    ("swiglu", "llama_tiny_cpu", "scenario=llama_tiny_cpu cannot run the kernel end to end: engine.mode=fast is not "
                                 "implemented by engine scenarios.llama_tiny_cpu.engine:Engine .*pick a scenario whose "
                                 "engine honours kernels.swiglu=triton"),
])
def test_bad_kernel_target_is_refused(tmp_path, kernel, scenario, match):
    with pytest.raises(ConfigError, match=match):
        forge_kernel(_rc(scenario), kernel, _opts(tmp_path, "x", 0), AgentConfig())
    assert not (tmp_path / "x").exists()


def test_cli_kernel_target_bad_input_is_one_line(tmp_path):
    """Refused before Hydra starts: nothing is written, not even Hydra's run directory under the working dir."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "forgetrain.forge", "kernel=nope", "forge.max_rounds=0",
                        f"forge.out_dir={tmp_path / 'o'}"], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=hang_s())
    lines = [x for x in p.stderr.strip().splitlines() if x]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines == [lines[-1]] and lines[-1].startswith("error: unknown kernel 'nope'"), lines
    assert not (tmp_path / "o").exists() and list(cwd.iterdir()) == []
