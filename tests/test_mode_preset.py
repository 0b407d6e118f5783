"""The mode presets (``mode=exact``, ``mode=fast_base``), derived from the engines' lever tables
(``forgetrain.config.schema.mode_presets``): ``mode=exact`` is the one definition of what exact mode turns off, and
``mode=fast_base`` of the fast base every lever is judged on alone.

Every scenario composed with either preset is a valid config (no lever left on), every kernel switch sits at its
plain default, and every lever the table does not mark ``KEEP`` (the memory layout, bitwise by construction, and
fast-mode knobs exact mode never reads) is at its default. A lever whose preset value is not its default, or a
fast-only lever left at ``KEEP``, fails here.
"""

from __future__ import annotations

import dataclasses

import re

import pytest
from omegaconf import OmegaConf

from forgetrain import registry
from forgetrain.cli import check_job as _check_job, compose_config as _compose
from forgetrain.config import EngineOptions, register_configs, to_run_config
from forgetrain.errors import ConfigError
from forgetrain.kernels import switches
from forgetrain.levers import KEEP, merge, spec_of

# engine options exact mode keeps as the scenario sets them: the memory layout (bitwise tier) and fast-mode-only
# knobs that exact mode never reads; the lever tables mark them KEEP
LAYOUT = {"recompute", "recompute_num_layers", "bf16_weights", "optimizer_offload_fraction", "attention_backend",
          "ce_chunk_tokens"}
TINY_CPU = ["hardware=cpu", "model=llama_micro", "train.precision=fp32", "train.skip_memory_check=true"]


@pytest.fixture(scope="module", autouse=True)
def _schemas():
    register_configs()


def _rc(overrides):
    return to_run_config(OmegaConf.to_container(_compose("config", overrides), resolve=True))


@pytest.mark.parametrize("preset,mode", [("exact", "exact"), ("fast_base", "fast")])
@pytest.mark.parametrize("name", registry.scenarios())
def test_mode_preset_resets_every_lever(name, preset, mode):
    rc = _rc([f"scenario={name}", f"mode={preset}"])
    assert rc.engine.mode == mode
    for f in dataclasses.fields(EngineOptions):
        if f.name not in LAYOUT | {"mode"}:
            assert getattr(rc.engine, f.name) == f.default, (name, f.name)
    for sw in switches.SWITCHES:
        assert getattr(rc.kernels, sw.name) == sw.default, (name, sw.name)


@pytest.mark.parametrize("preset", ["exact", "fast_base"])
@pytest.mark.parametrize("name", registry.scenarios())
def test_mode_preset_validates_for_every_scenario(name, preset):
    overrides = [f"scenario={name}", f"mode={preset}", *TINY_CPU]
    if name == "llama3b_h200":  # its model shape lives in the scenario file: no model preset on the command line
        overrides = [o for o in overrides if not o.startswith("model=")] + ["model.num_layers=2"]
    engine = _rc([f"scenario={name}"]).scenario.engine
    modes = spec_of(registry.resolve_engine(engine)).modes
    if modes is not None and ("fast" if preset == "fast_base" else "exact") not in modes:
        # an engine with one path refuses the other mode in one line (llama_tiny_cpu, the Qwen3 engine: exact only)
        with pytest.raises(ConfigError, match=f"engine.mode=fast is not implemented by engine {re.escape(engine)}"):
            _check_job("config", overrides)
        return
    assert _check_job("config", overrides) is None


def test_without_the_preset_an_exact_run_of_a_fast_default_is_refused():
    # the rejection side: engine.mode=exact alone leaves llama1b_h200's fast-only switches on
    with pytest.raises(ConfigError, match="needs engine.mode=fast.*use mode=exact"):
        _check_job("config", ["scenario=llama1b_h200", "engine.mode=exact", *TINY_CPU])


@pytest.mark.parametrize("preset", ["exact", "fast_base"])
def test_the_presets_follow_the_lever_tables(preset):
    """Only the layout levers keep the scenario's value; every other lever's preset value is its default."""
    table = merge(registry.lever_specs())
    assert {lv.name for lv in table if lv.preset_value(preset) == KEEP} == LAYOUT
    for lv in table:
        if lv.name not in LAYOUT | {"mode"}:
            assert lv.preset_value(preset) == lv.default, (preset, lv.name)


def test_command_line_keys_override_the_preset():
    rc = _rc(["scenario=llama1b_h200", "mode=exact", "kernels.adamw=triton"])
    assert rc.engine.mode == "exact" and rc.kernels.adamw == "triton"
