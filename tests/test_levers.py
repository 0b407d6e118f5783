"""The engine lever tables (``forgetrain/levers.py``, ``scenarios/llama1b_h200/levers.py``) are the one place a
lever is declared.

The extension point: a lever added to a copy of the Hopper engine's table, and nowhere else, is accepted as a
Hydra override, refused with one line for a wrong type or outside what it needs, reset by the mode presets,
reaches the engine as ``cfg.engine.<name>`` and is listed with its tier. The harness's config code names no lever
of the table, and every optimisations.yaml entry that names a lever names a row of it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import scenarios.llama1b_h200.levers as hopper_levers
from forgetrain import levers, registry
from forgetrain.cli import check_job, compose_config
from forgetrain.config import register_configs, schema, to_run_config
from forgetrain.errors import ConfigError
from scenarios.llama1b_h200.engine import Engine as Hopper
from scenarios.llama_tiny_cpu.engine import Engine as Tiny

ROOT = Path(__file__).resolve().parents[1]
CPU = ["scenario=llama1b_h200", "hardware=cpu", "model=llama_micro", "train.precision=fp32",
       "train.skip_memory_check=true", "train.lr_warmup_steps=1"]


def _fast_only(cfg, reference):
    if cfg.engine.fp8_attention and cfg.engine.mode != "fast":
        return "engine.fp8_attention=true needs engine.mode=fast; drop engine.fp8_attention=true"
    return None


NEW = levers.Lever("fp8_attention", bool, False, "loss_curve", "attention's two products with FP8 operands",
                   exact=False, fast_base=False, needs="engine.mode=fast", rule=_fast_only)


@pytest.fixture
def with_new_lever(monkeypatch):
    """The Hopper table with :data:`NEW` appended (a copy, which the registry hands the harness for the test), the
    ``engine.*`` schema and the mode presets rebuilt from it; everything restored afterwards."""
    specs = registry.lever_specs()
    hopper = next(i for i, s in enumerate(specs) if "fp8" in {lv.name for lv in s.levers})
    spec = dataclasses.replace(specs[hopper], levers=specs[hopper].levers + (NEW,))
    monkeypatch.setattr(registry, "lever_specs", lambda: specs[:hopper] + [spec] + specs[hopper + 1:])
    monkeypatch.setattr(schema, "EngineOptions", schema.engine_options_class())
    register_configs()
    yield spec
    monkeypatch.undo()
    register_configs()


def _rc(overrides):
    return to_run_config(OmegaConf.to_container(compose_config("config", overrides), resolve=True))


def test_a_new_lever_is_one_row_of_the_table(with_new_lever):
    assert _rc(CPU).engine.fp8_attention is False  # the default, from the row
    on = CPU + ["mode=fast_base", "engine.fp8_attention=true"]
    assert check_job("config", on) is None  # accepted and validated
    rc = _rc(on)
    assert rc.engine.fp8_attention is True
    assert Hopper(rc, "cpu").opts.fp8_attention is True  # reaches the engine
    with pytest.raises(ConfigError, match="engine.fp8_attention"):  # the schema's type, from the row
        check_job("config", CPU + ["engine.fp8_attention=maybe"])
    with pytest.raises(ConfigError, match="engine.fp8_attention=true needs engine.mode=fast"):  # its rule
        check_job("config", CPU + ["mode=exact", "engine.fp8_attention=true"])
    presets = schema.mode_presets()  # mode=exact and mode=fast_base reset it, from the row
    assert presets["exact"]["engine"]["fp8_attention"] is False is presets["fast_base"]["engine"]["fp8_attention"]
    row = {r["name"]: r for r in levers.rows(levers.merge(registry.lever_specs()))}["engine.fp8_attention"]
    assert (row["tier"], row["exact"], row["fast_base"]) == ("loss_curve", False, False)  # listed with its tier
    assert "engine.fp8_attention" in levers.table(levers.merge(registry.lever_specs()))


def test_without_the_row_the_override_is_refused():
    register_configs()
    with pytest.raises(ConfigError, match="fp8_attention"):
        check_job("config", CPU + ["engine.fp8_attention=true"])


def test_a_value_outside_the_row_is_refused_in_one_line():
    register_configs()
    with pytest.raises(ConfigError, match=r"^engine.fp8 must be none\|tensorwise, got 'rowwise'$"):
        check_job("config", CPU + ["engine.fp8=rowwise"])


def test_the_harness_config_names_no_lever_of_the_table():
    """The ``engine.*`` schema and its validation reach the levers only through the table."""
    import inspect

    from forgetrain.config import checks

    code = inspect.getsource(checks._check_engine_options) + inspect.getsource(schema.engine_options_class)
    code += inspect.getsource(schema.mode_presets)
    assert not [lv.name for lv in hopper_levers.SPEC.levers if lv.name in code]


def test_optimisations_yaml_names_rows_of_the_table():
    opts = OmegaConf.load(ROOT / "scenarios" / "llama1b_h200" / "optimisations.yaml").optimisations
    names = {lv.name for lv in hopper_levers.SPEC.levers}
    for key, entry in opts.items():
        assert ("lever" in entry) != ("declared_tier" in entry), key  # one place for each tier
        if "lever" in entry:
            assert entry.lever in names, key


def test_capabilities_are_fields_of_the_spec():
    assert levers.spec_of(Hopper) is hopper_levers.SPEC
    assert levers.spec_of(Tiny).modes == ("exact",) and not levers.spec_of(Tiny).recompute

    class Loose:  # capabilities as loose class attributes are not read: the class declares no spec
        supports_recompute = True

    with pytest.raises(ConfigError, match=r"test_levers:.*Loose declares no EngineSpec"):
        levers.spec_of(Loose)


# What the harness once read as loose engine class attributes; each is a field of EngineSpec now.
LOOSE_CAPABILITIES = {"supports_recompute", "supports_recompute_num_layers", "supports_optimizer_offload",
                      "supports_bench_side", "engine_modes", "kernel_switches", "model_features", "bench_only",
                      "fixed_grad_accum"}


def test_every_engine_states_its_capabilities_in_its_spec_alone():
    """No class under references/ or scenarios/ states a capability outside its spec (it would be ignored), and
    every reference that loads here declares a spec with what its module says it implements."""
    import ast

    loose = []
    for top in ("references", "scenarios"):
        for f in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {t.id for st in node.body if isinstance(st, (ast.Assign, ast.AnnAssign))
                             for t in (st.targets if isinstance(st, ast.Assign) else [st.target])
                             if isinstance(t, ast.Name)}
                    loose += [f"{f.relative_to(ROOT)}:{node.name}.{n}" for n in sorted(names & LOOSE_CAPABILITIES)]
    assert not loose, f"capabilities outside the spec: {loose}"
    qwen3 = ("qk_layernorm", "share_embeddings_and_output_weights", "kv_channels")
    want = {"megatron": {"model_features": qwen3 + ("num_experts",)}, "deepspeed": {"recompute": True, "bench_side": True, "fixed_grad_accum": True},
            "torch_compile": {"recompute": True, "recompute_num_layers": True, "bench_only": True},
            "torch_compile_autocast": {"recompute": True, "recompute_num_layers": True, "bench_only": True},
            "torchtitan": {"recompute": True}}  # .ci/run installs deepspeed and torchtitan
    for name, fields in want.items():
        spec = levers.spec_of(registry.load_engine_class("references", name))
        assert spec == levers.EngineSpec(**fields), (name, spec)


def test_a_lever_declares_a_known_tier_and_an_allowed_default():
    with pytest.raises(ValueError, match="tier"):
        levers.Lever("x", bool, False, "fastest", "doc")
    with pytest.raises(ValueError, match="default"):
        levers.Lever("x", str, "c", "bitwise", "doc", values=("a", "b"))
    clash = dataclasses.replace(NEW, default=True)
    with pytest.raises(ValueError, match="declared twice"):
        levers.merge([levers.EngineSpec(levers=(NEW,)), levers.EngineSpec(levers=(clash,))])
