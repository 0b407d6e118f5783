"""The forge loop's test helpers (tests/test_forge.py, tests/test_forge_curve.py, tests/test_forge_sandbox.py,
tests/test_forge_seal.py): the llama_micro run config, a scripted agent (tests/forge_agents/), forge options, a
private copy of the gate files, a stub ladder, the forge log, the shared data cache (a fixture) and the forge CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from forgetrain.config import ModelConfig, RunConfig, ScenarioConfig, TrainConfig
from forgetrain.forge import AgentConfig, ForgeOptions
from tests.helpers import ROOT
from tests.limits import hang_s

AGENT = ROOT / "tests" / "forge_agents" / "scripted_agent.py"
SCENARIO = "llama_tiny_cpu"


def micro_rc() -> RunConfig:
    m = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "llama_micro.yaml"))
    return RunConfig(scenario=ScenarioConfig(name=SCENARIO), model=ModelConfig(**m),
                     train=TrainConfig(micro_batch_size=2, global_batch_size=4, threads=1))


def agent_for(tmp: Path, rounds: dict, timeout_s: float | None = None, name: str = "plan") -> AgentConfig:
    plan = tmp / f"{name}.json"
    plan.write_text(json.dumps({"rounds": {str(k): v for k, v in rounds.items()}}))
    return AgentConfig(command=f"{sys.executable} {AGENT} {plan}", timeout_s=timeout_s or hang_s())


def options(tmp: Path, **kw) -> ForgeOptions:
    base = dict(max_rounds=2, target_tier="bitwise", verify_steps=2, baseline=False, out_dir=str(tmp / "out"),
                kb_path=str(tmp / "kb.jsonl"), ladder_timeout_s=hang_s())
    base.update(kw)
    return ForgeOptions(**base)


def fake_gates(tmp: Path) -> list[Path]:
    """A private copy of the gate files to hash (the real repo may be edited by others while tests run)."""
    d = tmp / "gates_hashed"
    shutil.copytree(ROOT / "conf" / "tier", d, dirs_exist_ok=True)
    return [d]


class StubLadder:
    """Fails bitwise (RMSNorm divergence) while the engine scales eps; passes otherwise. Counts its calls: the
    rounds' ladder runs (``calls``) and the seal's re-check of the installed engine (``reverify_calls``)."""

    def __init__(self):
        self.calls = self.reverify_calls = 0

    def __call__(self, spec_path, ws, out, timeout_s, log_path):
        if Path(out).name == "reverify":
            self.reverify_calls += 1
        else:
            self.calls += 1
        wrong = "self.eps * 10.0" in (ws / "engine" / "_llama" / "model.py").read_text()
        div = {"step": 1, "kind": "module_fwd", "module": "layers.0.input_norm", "ref": {"l2": 63.2},
               "cand": {"l2": 57.2}}
        v = {"tier": "bitwise", "passed": not wrong, "evidence": {},
             "summary": "first divergence: step 1 module_fwd layers.0.input_norm" if wrong else "bit-identical",
             "first_divergence": div if wrong else None}
        return {"ok": True, "error": None, "verdicts": [v], "strictest_passed": None if wrong else "bitwise",
                "surpassed": None, "target_met": not wrong, "metrics": {"mfu_pct": 0.25}, "wall_s": 0.01}


def log_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "forge_log.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """The test run's shared data cache (the same one conftest's autouse fixture points at)."""
    cache = os.environ.get("FORGETRAIN_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "ftcache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGETRAIN_CACHE", cache)
        yield cache


def forge_cli(tmp: Path, plan: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "forgetrain.forge", f"scenario={SCENARIO}", "model=llama_micro",
           "train.micro_batch_size=2", "train.global_batch_size=4", "train.threads=1",
           f"agent.command={sys.executable} {AGENT} {plan}", f"agent.timeout_s={hang_s():.0f}", "forge.max_rounds=3",
           "forge.baseline=false", "forge.verify_steps=2", f"forge.out_dir={tmp / 'out'}",
           f"forge.kb_path={tmp / 'kb.jsonl'}", f"hydra.run.dir={tmp / 'hydra'}", *extra]
    return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=hang_s())
