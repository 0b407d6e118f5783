"""Scenarios are one YAML file each: ``scenario.engine`` names the engine class (``module:Class``), resolved by
``forgetrain.registry.resolve_engine`` alone; ``scenario.name`` must be the file's name. Several scenarios share
the Hopper engine without a package of their own (llama3b_h200 is the proof: one file, its shape inside)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from forgetrain import registry
from forgetrain.cli import check_job as _check_job, compose_config as _compose
from forgetrain.config import register_configs, to_run_config
from forgetrain.errors import ConfigError
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
TINY = ["hardware=cpu", "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=176", "model.seq_length=16",
        "engine.compile=false", "kernels.cross_entropy=torch", "kernels.adamw=torch", "train.precision=fp32",
        "kernels.swiglu=torch", "kernels.ce_chunk=torch"]
# llama8b_h200's device-only layout (its default offloads the AdamW moments to host memory instead)
DEVICE_ONLY = ["engine.optimizer_offload_fraction=0", "engine.recompute=full", "engine.bf16_weights=per_layer"]


@pytest.fixture(scope="module", autouse=True)
def _configs():
    register_configs()


def _run_config(overrides: list[str]):
    cfg = _compose("config", overrides)
    return to_run_config(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("name", registry.scenarios())
def test_every_scenario_file_composes_names_itself_and_resolves_its_engine(name):
    # name == stem, engine resolves, values valid (on this CPU machine: hardware=cpu, where torch's fused AdamW,
    # some GPU scenarios' default, is not honoured and validation says so)
    # (the GPU scenarios' full shapes exceed this machine's memory: the host-memory check is tested in test_memory)
    rc = _run_config([f"scenario={name}"])
    cpu_adamw = ["kernels.adamw=torch"] if rc.kernels.adamw == "fused" else []  # the Triton AdamW runs on CPU too
    # Triton's CPU interpreter cannot run inside torch.compile: on CPU a scenario that compiles runs eagerly
    cpu_compile = ["engine.compile=false"] if rc.engine.compile else []
    assert _check_job("config", [f"scenario={name}", "hardware=cpu", *cpu_adamw, *cpu_compile,
                                 "train.skip_memory_check=true"]) is None
    assert rc.scenario.name == name
    assert registry.resolve_engine(rc.scenario.engine) is registry.resolve_engine(registry.engine_spec(name))


def test_scenarios_share_the_hopper_engine_without_packages():
    hopper = registry.resolve_engine("scenarios.llama1b_h200.engine:Engine")
    for name in ("llama1b_h200", "llama3b_h200", "llama8b_h100", "llama8b_h200"):
        assert registry.resolve_engine(_run_config([f"scenario={name}"]).scenario.engine) is hopper
    for name in ("llama8b_h100", "llama3b_h200", "llama8b_h200"):
        assert not (ROOT / "scenarios" / name).exists()
    # composition, not a chain: the Hopper engine subclasses no other engine
    assert hopper.__mro__ == (hopper, object)


@pytest.mark.parametrize("spec,match", [
    ("scenarios.llama1b_h200.engine", "must be \"module.path:ClassName\""),
    ("scenarios.llama1b_h200.engine:", "must be \"module.path:ClassName\""),
    ("scenarios/llama1b_h200/engine.py:Engine", "must be \"module.path:ClassName\""),
    ("scenarios.nope.engine:Engine", "no module 'scenarios.nope'"),
    ("scenarios.llama1b_h200.engine:HopperEngine", "defines no 'HopperEngine'"),
    ("forgetrain.config:SEED_MAX", "is not an engine class: SEED_MAX is not a class"),
    ("forgetrain.config:RunConfig", "is not an engine class: RunConfig lacks init_weights"),
])
def test_resolve_engine_rejects_what_is_not_an_engine(spec, match):
    with pytest.raises(ConfigError, match=match):
        registry.resolve_engine(spec)
    with pytest.raises(ConfigError, match=match):  # and config validation says so before any work
        _check_job("config", ["scenario=llama_tiny_cpu", f"scenario.engine={spec}"])


def test_scenario_name_must_be_the_file_name():
    with pytest.raises(ConfigError, match="scenario.name=llama1b_h200 is not the name of its file, "
                                          "conf/scenario/llama_tiny_cpu.yaml"):
        _check_job("config", ["scenario=llama_tiny_cpu", "scenario.name=llama1b_h200"])


def test_cli_wrong_engine_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "forgetrain", "scenario=llama_tiny_cpu", "train.steps=1",
                        "scenario.engine=scenarios.llama_tiny_cpu.engine:Nope", f"train.out_dir={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=hang_s())
    assert p.returncode == 2, p.stderr[-1500:]
    assert p.stderr.strip().splitlines() == [
        "error: scenario.engine='scenarios.llama_tiny_cpu.engine:Nope': scenarios.llama_tiny_cpu.engine defines "
        "no 'Nope'"], p.stderr[-1500:]
    assert not out.exists()


def test_llama3b_scenario_is_the_3b_shape_and_refuses_a_model_preset():
    m = _run_config(["scenario=llama3b_h200"]).model
    assert (m.name, m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups,
            m.ffn_hidden_size, m.rotary_base) == ("llama3b", 128256, 3072, 28, 24, 8, 8192, 500000.0)
    # same conventions as the 1B preset for everything the 3B card does not change
    one_b = OmegaConf.load(ROOT / "conf" / "model" / "llama1b.yaml")
    assert (m.seq_length, m.norm_epsilon, m.init_method_std) == (one_b.seq_length, one_b.norm_epsilon,
                                                                 one_b.init_method_std)
    with pytest.raises(ConfigError, match="model=llama_micro does not apply: scenario llama3b_h200 sets its own"):
        _check_job("config", ["scenario=llama3b_h200", "model=llama_micro"])


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_llama3b_engine_builds_and_trains_at_a_tiny_shape_on_cpu(mode):
    over = ["scenario=llama3b_h200", *TINY, f"engine.mode={mode}", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.steps=2", "train.lr_warmup_steps=0"]
    _check_job("config", over)
    rc = _run_config(over)
    assert rc.model.num_layers == 2 and rc.model.rotary_base == 500000.0  # the overrides, over the 3B shape
    engine = registry.resolve_engine(rc.scenario.engine)(rc, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, rc.model.vocab_size, (2, rc.model.seq_length + 1), generator=g) for _ in range(2)]
    first = engine.train_step(mbs)
    assert abs(first.loss - math.log(rc.model.vocab_size)) < 0.5, first.loss  # near-uniform at init
    assert math.isfinite(first.grad_norm) and first.grad_norm > 0
    for _ in range(5):
        last = engine.train_step(mbs)
    assert last.loss < first.loss - 0.1, (first.loss, last.loss)
    assert sorted(engine.export_hf_weights()) == sorted(registry.resolve_engine(
        "scenarios.llama_tiny_cpu.engine:Engine")(rc, torch.device("cpu")).export_hf_weights())


@pytest.mark.parametrize("layout", ["default", "device_only"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_llama8b_h200_memory_layouts_train_at_a_tiny_shape_on_cpu(mode, layout):
    """The full-depth 8B scenario's two layouts at a tiny bf16 shape, the loss falling in each: the default (the
    AdamW moments of 65% of the parameters offloaded to host memory, activations stored, resident bf16 weights)
    and the device-only one (recompute, per-layer bf16 weights: the layers hold fp32 weights only)."""
    over = ["scenario=llama8b_h200", *TINY, "train.precision=bf16", f"engine.mode={mode}",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=2", "train.lr_warmup_steps=0",
            f"engine.grad_accum_fusion={mode == 'fast'}",  # exact mode keeps Megatron's bf16 .grad (no fusion)
            f"engine.free_qkv={mode == 'fast'}",  # and Megatron's unfused attention
            *(DEVICE_ONLY if layout == "device_only" else [])]
    _check_job("config", over)
    rc = _run_config(over)
    e = rc.engine
    engine = registry.resolve_engine(rc.scenario.engine)(rc, torch.device("cpu"))
    if layout == "default":
        assert (e.recompute, e.bf16_weights, e.optimizer_offload_fraction) == ("none", "resident", 0.65)
        assert engine.bench_info["optimizer_offload_fraction"] == 0.65
    else:
        assert (e.recompute, e.bf16_weights) == ("full", "per_layer")
        assert {p.dtype for n, p in engine.model.named_parameters() if n.startswith("layers.")} == {torch.float32}
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, rc.model.vocab_size, (2, rc.model.seq_length + 1), generator=g) for _ in range(2)]
    first = engine.train_step(mbs)
    for _ in range(5):
        last = engine.train_step(mbs)
    assert last.loss < first.loss - 0.1, (first.loss, last.loss)


def test_llama8b_h200_refuses_fp32_with_one_line():
    with pytest.raises(ConfigError, match="engine.bf16_weights=per_layer needs engine.recompute=full, "
                                          "train.precision=bf16"):
        _check_job("config", ["scenario=llama8b_h200", *TINY, *DEVICE_ONLY])

