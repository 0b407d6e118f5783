"""Config composition for every group option, and the up-front validate pass."""

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from forgetrain.config import RunConfig, register_configs, to_run_config, validate
from forgetrain.errors import ConfigError
from tests.limits import hang_s

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ["scenario", "model", "train", "data", "parallel", "hardware", "logger"]


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(config_name="config", overrides=()):
    register_configs()
    if config_name != "config":
        import importlib

        importlib.import_module(f"forgetrain.{config_name}").register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes(group):
    for opt in _options(group):
        cfg = _compose(overrides=[f"{group}={opt}"])
        rc = to_run_config(cfg)
        assert isinstance(rc, RunConfig)


@pytest.mark.parametrize("name", ["verify", "bench", "forge"])
def test_entry_point_configs_compose(name):
    cfg = _compose(name)
    assert cfg.scenario.name == "llama_tiny_cpu"


@pytest.mark.parametrize("tier", _options("tier"))
def test_every_tier_composes(tier):
    cfg = _compose("verify", [f"tier={tier}"])
    assert cfg.tier.name == tier


def test_default_config_is_valid():
    validate(to_run_config(_compose()))


def _bad(**changes):
    rc = to_run_config(_compose())
    for path, value in changes.items():
        group, key = path.split("__")
        setattr(rc, group, dataclasses.replace(getattr(rc, group), **{key: value}))
    with pytest.raises(ConfigError) as e:
        validate(rc)
    return str(e.value)


def test_heads_must_divide_hidden():
    assert "does not divide model.hidden_size" in _bad(model__num_attention_heads=7)


def test_groups_must_divide_heads():
    assert "num_query_groups" in _bad(model__num_query_groups=3)


def test_global_batch_multiple_of_micro_times_dp():
    assert "global_batch_size" in _bad(train__global_batch_size=12, train__micro_batch_size=8)


def test_unknown_scenario_lists_known():
    msg = _bad(scenario__name="nope")
    assert "llama_tiny_cpu" in msg and "nope" in msg


def test_layout_must_match_world_size():
    assert "world size" in _bad(parallel__data_parallel_size=2)


def test_unknown_key_rejected_by_schema():
    with pytest.raises(Exception, match="foo"):
        _compose(overrides=["train.foo=1"])


def test_grad_accum_fusion_is_a_fast_mode_switch():
    assert "engine.grad_accum_fusion=true needs engine.mode=fast" in _bad(engine__grad_accum_fusion=True)
    rc = to_run_config(_compose(overrides=["scenario=llama1b_h200", "mode=fast_base", "engine.grad_accum_fusion=true",
                                           "hardware=cpu", "model=llama_micro", "train.lr_warmup_steps=1"]))
    assert validate(rc).engine.grad_accum_fusion is True


def test_an_engine_refuses_a_mode_it_does_not_run():
    """llama_tiny_cpu has one (exact) path: engine.mode=fast is refused in one line, not silently ignored."""
    assert "engine.mode=fast is not implemented by engine scenarios.llama_tiny_cpu" in _bad(engine__mode="fast")


def test_readme_documents_every_forgetrain_environment_variable():
    """Every ``FORGETRAIN_*`` variable the package reads is a row of the README's environment table, which names
    the files that read it (``FORGETRAIN_CACHE`` was read in three places and documented in none)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    read = {m for f in (root / "forgetrain").rglob("*.py") for m in re.findall(r"FORGETRAIN_[A-Z_]+", f.read_text())}
    readme = (root / "README.md").read_text()
    table = readme.split("### Environment variables", 1)[1].split("\n## ", 1)[0] if "### Environment variables" in \
        readme else ""
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(FORGETRAIN_[A-Z_]+)[^`]*` \| ([^|]+)\|", table, re.M)}
    assert read and read <= set(rows), sorted(read - set(rows))
    for var in read:  # the row names each file that reads it
        readers = {str(f.relative_to(root)) for f in (root / "forgetrain").rglob("*.py")
                   if re.search(r"environ[^\n]{0,12}[\"']" + var + r"[\"']", f.read_text())}
        assert all(r in rows[var] for r in readers), (var, readers, rows[var])


def test_quiet_libraries_keeps_the_users_own_future_warnings():
    """The CLI silences the libraries' FutureWarnings only: one attributed to megatron, deepspeed or torch is
    hidden, the user's own (a scenario module, a script) still shows (every FutureWarning was ignored)."""
    import subprocess
    import sys

    code = ("import warnings\nfrom forgetrain.cli import quiet_libraries\nquiet_libraries()\n"
            "for mod in ('megatron.core.tensor_parallel.layers', 'deepspeed.runtime.engine', 'torch.amp', "
            "'scenarios.my_engine', '__main__'):\n"
            "    warnings.warn_explicit(f'deprecated in {mod}', FutureWarning, mod.replace('.', '/') + '.py', 1, "
            "module=mod)\n")
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=hang_s(), cwd=root,
                       env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr
    shown = [ln for ln in p.stderr.splitlines() if "FutureWarning" in ln]
    assert len(shown) == 2 and "scenarios.my_engine" in shown[0] and "__main__" in shown[1], p.stderr


def test_every_yaml_file_of_the_project_parses():
    """A YAML file that does not parse fails only the tests that happen to read it (an unquoted ``N: `` inside an
    optimisations.yaml value once did); this reads them all."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    files = [p for d in ("conf", "scenarios", "references", ".ci") for p in (root / d).rglob("*.y*ml")
             if "goldens" not in p.parts]
    assert any(p.name == "optimisations.yaml" for p in files)
    for p in files:
        yaml.safe_load(p.read_text())
