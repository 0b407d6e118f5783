"""The forge's curve gate is the paired loss-curve test: the judge makes the golden (reference seeds drawn after
the agent's round), rebuilds each seed's reference init in its own process and checks it against the golden's
hash, and the candidate runs paired from each (reading that seed's batches) in its isolated process, plus its
unpaired seeds; ``forgetrain.verify.judge`` decides.

One real forge run at llama_micro shapes (80-step curves, the fewest that make the tier's four windows; lr 5e-4,
where the loss still moves with the learning rate): round 1 steps AdamW with 0.9x the scheduled lr, which the
paired test fails (+1.4% late; the unpaired band's three seeds let it pass about as often as not); round 2 restores it and seals, the installed copy re-checked.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from forgetrain.forge.loop import forge
from tests.forge_helpers import agent_for, data_cache, fake_gates, log_of, micro_rc, options  # noqa: F401


@pytest.fixture(scope="module")
def curve_run(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("forge_curve")
    rc = micro_rc()
    rc = dataclasses.replace(rc, train=dataclasses.replace(rc.train, lr=5e-4))
    agent = agent_for(tmp, {1: ["lr_wrong"], 2: ["lr_fix"]}, timeout_s=300.0)
    state = forge(rc, options(tmp, max_rounds=2, target_tier="loss_curve", ladder_from="loss_curve", curve_steps=80),
                  agent, gate_paths=fake_gates(tmp))
    out = tmp / "out"
    return {"state": state, "log": log_of(out), "out": out,
            "results": {k: json.loads((out / "rounds" / str(k) / "ladder_result.json").read_text()) for k in (1, 2)}}


def _verdict(res: dict) -> dict:
    return next(v for v in res["verdicts"] if v["tier"] == "loss_curve")


def test_a_wrong_lr_is_rejected_by_the_paired_gate(curve_run):
    rec, res = curve_run["log"][0], curve_run["results"][1]
    assert rec["round"] == 1 and not rec["goal_met"] and rec["failed_tier"] == "loss_curve", rec
    ev = _verdict(res)["evidence"]
    assert ev["mode"] == "paired+unpaired" and not ev["paired"]["passed"], _verdict(res)["summary"]
    assert ev["paired"]["late_diff_mean"] > 0 and not ev["paired"]["late_inside"]
    assert len(ev["paired_dirs"]) == 3 and len(ev["unpaired_dirs"]) == 3


def test_the_honest_engine_seals_at_the_curve_target_paired(curve_run):
    state, res, out = curve_run["state"], curve_run["results"][2], curve_run["out"]
    assert state["status"] == "sealed" and curve_run["log"][-1]["guard"] == "ok", curve_run["log"][-1]
    v = _verdict(res)
    assert v["passed"] and v["evidence"]["mode"] == "paired+unpaired" and v["evidence"]["paired"]["passed"]
    assert v["evidence"]["paired"]["late_diff_mean"] == 0.0  # the seeded engine is the reference's bitwise mirror
    drawn = res["gate"]["drawn"]
    assert not set(drawn["curve_seeds"]) & set(drawn["candidate_seeds"])  # unpaired seeds drawn, none a reference's
    lad = out / "rounds" / "2" / "ladder" / "loss_curve"
    assert sorted(p.name for p in (lad / "init").iterdir()) == sorted(f"seed_{s}.safetensors"
                                                                       for s in drawn["curve_seeds"])
    assert {p.name for p in (lad / "candidate").iterdir()} >= {f"candidate_paired_seed{s}" for s in drawn["curve_seeds"]} \
        | {f"candidate_seed{u}" for u in drawn["candidate_seeds"]}
    seal = json.loads((out / "sealed" / "seal.json").read_text())
    assert seal["tier"] == "loss_curve" and seal["installed_check"]["passed"]
