"""``engine.recompute=full`` in the two benchmark baselines: ``references/torch_compile`` (``torch.utils.checkpoint``
per block, non-reentrant) and ``references/torchtitan`` (torchtitan's ``FullAC``: ``checkpoint_wrapper`` on every
block, applied before compile and FSDP2 as ``parallelize_llama`` orders it).

For each baseline, at llama_micro (2 layers) with micro-batch 2 x grad-accum 2, fp32, 3 steps on CPU (eager):

* the losses, grad norms and final weights with recompute are **bitwise** those without it: recompute repeats the
  same ops on the same inputs, and the backward graph is the forward's (non-reentrant checkpoint only regenerates
  the tensors it saved), so no tolerance is needed;
* the recompute really runs: the first block's forward starts twice per micro-batch with recompute (the forward,
  then the recompute in the backward) and once without; a deliberately broken engine that ignores the option is
  caught by the same check;
* ``bench_info`` says which mode ran (for torchtitan it is read from the model's structure), and
  ``python -m forgetrain.bench`` with both baselines writes it into bench.json.

Forward starts are counted with a forward *pre*-hook: ``torch.utils.checkpoint``'s default ``early_stop`` ends a
recompute once every saved tensor is back, before the block returns, so a post-hook would miss it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from references.torch_compile.engine import Engine as TorchCompile
from tests.helpers import ladder_cfg as _ladder_cfg
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def _cfg(recompute: str):
    c = _ladder_cfg()  # llama_micro, micro-batch 2, global batch 4: grad-accum 2 at DP 1; fp32
    return dataclasses.replace(c, engine=dataclasses.replace(c.engine, recompute=recompute))


def _batches(cfg) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    t, m = cfg.train, cfg.model
    return [[torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=g)
             for _ in range(t.global_batch_size // t.micro_batch_size)] for _ in range(STEPS)]


def _torchtitan():
    pytest.importorskip("torchtitan")
    from references.torchtitan.engine import Engine

    return Engine


def _first_block(name: str, eng) -> torch.nn.Module:
    """A module inside decoder block 0 whose forward runs again in the recompute: torch_compile's block itself;
    torchtitan's MLP (through ``module_probes``; the block there is the checkpoint wrapper, called once)."""
    return eng.model.layers[0] if name == "torch_compile" else eng.module_probes()["layers.0.mlp"]


def _train(name: str, engine_cls, recompute: str):
    """(losses, grad norms, final weights, forward starts of block 0 per step, engine, initial weights) over STEPS
    steps, from the engine's own init at train.seed."""
    cfg = _cfg(recompute)
    torch.manual_seed(cfg.train.seed)
    eng = engine_cls(cfg, torch.device("cpu"))
    init = eng.export_hf_weights()
    calls = [0]

    def count(*_):
        calls[0] += 1

    handle = _first_block(name, eng).register_forward_pre_hook(count)
    losses, norms, per_step = [], [], []
    for mbs in _batches(cfg):
        calls[0] = 0
        r = eng.train_step(mbs)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        per_step.append(calls[0])
    handle.remove()
    return losses, norms, eng.export_hf_weights(), per_step, eng, init


def _check_recompute(name: str, engine_cls) -> None:
    """Raises AssertionError unless ``engine_cls`` under recompute=full gives bitwise the recompute=none run and
    really recomputes (2 forward starts of block 0 per micro-batch, against 1 without), with matching bench_info."""
    ga = _cfg("none").train.global_batch_size // _cfg("none").train.micro_batch_size
    base_cls = TorchCompile if name == "torch_compile" else _torchtitan()
    off = _train(name, base_cls, "none")
    on = _train(name, engine_cls, "full")
    assert off[3] == [ga] * STEPS, off[3]
    assert on[3] == [2 * ga] * STEPS, f"block 0 forward starts per step {on[3]}: the recompute did not run"
    assert on[0] == off[0], (on[0], off[0])  # bitwise: float equality of the reported losses
    assert on[1] == off[1], (on[1], off[1])
    assert all(torch.equal(on[2][k], off[2][k]) for k in off[2])
    assert all(not torch.equal(off[2][k], off[5][k]) for k in off[2])  # every weight was updated
    assert off[4].bench_info["recompute"] == "none"
    assert on[4].bench_info["recompute"] == "full"
    assert on[4].bench_info.get("recompute_num_layers") is None  # every block


def test_torch_compile_recompute_is_bitwise_and_runs():
    _check_recompute("torch_compile", TorchCompile)


def test_torchtitan_recompute_is_bitwise_and_runs():
    Engine = _torchtitan()
    _check_recompute("torchtitan", Engine)
    e = Engine(_cfg("full"), torch.device("cpu"))
    # torchtitan's full AC: every block is its checkpoint wrapper, under FSDP2; parameter, checkpoint and
    # optimizer-state names are those of the unwrapped model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    assert all(isinstance(b, CheckpointWrapper) and isinstance(b, FSDPModule) for b in e.model.layers.values())
    plain = Engine(_cfg("none"), torch.device("cpu"))
    assert list(e.state_dict()["model"]) == list(plain.state_dict()["model"])
    assert list(e.state_dict()["optimizer"]) == list(plain.state_dict()["optimizer"])
    assert "_checkpoint_wrapped_module" not in " ".join(e.state_dict()["model"])


@pytest.mark.parametrize("name", ["torch_compile", "torchtitan"])
def test_export_is_a_snapshot(name):
    """The exported weights are copies: training on does not change an earlier export (on CPU at DP=1
    ``.float().cpu()`` of an fp32 parameter returned the parameter itself). The checks above compare an export
    before training with one after."""
    cfg = _cfg("none")
    e = (TorchCompile if name == "torch_compile" else _torchtitan())(cfg, torch.device("cpu"))
    before = e.export_hf_weights()
    kept = {k: v.clone() for k, v in before.items()}
    for mbs in _batches(cfg):
        e.train_step(mbs)
    assert all(torch.equal(before[k], kept[k]) for k in kept)
    after = e.export_hf_weights()
    assert all(not torch.equal(after[k], kept[k]) for k in kept)  # and every weight did move


class _IgnoresOptionTC(TorchCompile):
    """Deliberately broken: reads engine.recompute but never checkpoints."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.model.recompute = False


def _ignores_option_tt():
    Engine = _torchtitan()

    class IgnoresOption(Engine):
        """Deliberately broken: builds the model as if engine.recompute were none, but says full."""

        def _parallelize(self, model):
            cfg = self.cfg
            self.cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute="none"))
            try:
                return super()._parallelize(model)
            finally:
                self.cfg = cfg

        @property
        def bench_info(self):
            return {"recompute": self.cfg.engine.recompute}

    return IgnoresOption


@pytest.mark.parametrize("name", ["torch_compile", "torchtitan"])
def test_check_catches_an_engine_that_ignores_the_option(name):
    broken = _IgnoresOptionTC if name == "torch_compile" else _ignores_option_tt()
    with pytest.raises(AssertionError, match="the recompute did not run"):
        _check_recompute(name, broken)


def test_bad_recompute_value_is_refused():
    from forgetrain.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.recompute must be none|full"):
        TorchCompile(_cfg("selective"), torch.device("cpu"))
    with pytest.raises(ValueError, match="engine.recompute must be none|full"):
        _torchtitan()(_cfg("selective"), torch.device("cpu"))


def test_bench_records_recompute_for_both_baselines(tmp_path):
    """``forgetrain.bench`` with engine.recompute=full on the scenario whose engine supports it, both baselines
    beside it: the run completes and bench.json's engine_info says each baseline recomputed."""
    _torchtitan()
    args = ["scenario=llama1b_h200", "hardware=cpu", "model=llama_micro", "mode=exact",
            "engine.recompute=full", "engine.bf16_weights=resident", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.lr_warmup_steps=1", "train.threads=1", "bench.steps=1",
            "bench.warmup=0", "bench.single_micro_batch=false", "bench.against=[torch_compile,torchtitan]",
            f"bench.out_dir={tmp_path}"]
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *args], cwd=ROOT, text=True,
                       capture_output=True, timeout=hang_s(),
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert {r["side"] for r in res["rows"]} == {"forged", "torch_compile", "torchtitan"}
    assert res["engine_info"]["torch_compile"] == {"recompute": "full", "recompute_num_layers": None,
                                                   "param_dtype": "float32"}
    assert res["engine_info"]["torchtitan"] == {"recompute": "full"}


def test_bench_warns_for_a_side_without_recompute():
    """Megatron-core's local-spec reference has no activation recompute: under engine.recompute=full the bench says
    so in one warning line per such side; sides that implement it, and recompute=none, warn nothing."""
    import dataclasses

    from forgetrain.bench import recompute_warnings
    from forgetrain.config import EngineOptions
    from tests.helpers import ladder_cfg as _cfg

    rc = _cfg()
    on = dataclasses.replace(rc, engine=EngineOptions(recompute="full"))
    lines = recompute_warnings(on, ["megatron", "torch_compile", "torchtitan"])
    assert len(lines) == 1 and lines[0].startswith("warning: bench side 'megatron' has no activation recompute")
    assert recompute_warnings(rc, ["megatron"]) == []
    block = dataclasses.replace(rc, engine=EngineOptions(recompute="full", recompute_num_layers=1))
    lines = recompute_warnings(block, ["torch_compile", "torchtitan"])
    assert lines == ["warning: bench side 'torchtitan' recomputes every layer; engine.recompute_num_layers=1 "
                     "applies to the forged engine and the sides that implement it"]


def test_torch_compile_block_recompute_is_bitwise_and_reruns_only_the_first_blocks():
    """``engine.recompute_num_layers=1`` of 2 blocks: block 0 starts twice per micro-batch, block 1 once, and the
    run is bitwise the run without recompute."""
    cfg = _cfg("full")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute_num_layers=1))
    ga = cfg.train.global_batch_size // cfg.train.micro_batch_size
    runs = {}
    for key, c in (("off", _cfg("none")), ("block", cfg)):
        torch.manual_seed(c.train.seed)
        eng = TorchCompile(c, torch.device("cpu"))
        starts = [0, 0]
        hooks = [eng.model.layers[i].register_forward_pre_hook(lambda *_, i=i: starts.__setitem__(i, starts[i] + 1))
                 for i in range(2)]
        losses = [eng.train_step(mbs).loss for mbs in _batches(c)]
        for h in hooks:
            h.remove()
        runs[key] = (losses, eng.export_hf_weights(), starts, eng.bench_info)
    assert runs["block"][2] == [2 * ga * STEPS, ga * STEPS], runs["block"][2]
    assert runs["block"][0] == runs["off"][0]
    assert all(torch.equal(runs["block"][1][k], runs["off"][1][k]) for k in runs["off"][1])
    assert runs["block"][3] == {"recompute": "full", "recompute_num_layers": 1, "param_dtype": "float32"}
