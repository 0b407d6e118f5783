"""The stored H200 loss-curve goldens stay reachable from the shapes the device scripts judge at.

A golden's directory name carries :func:`forgetrain.train.config_hash` of the reference run. A new config field
that does not change the numbers (``train.skip_memory_check`` once did) must stay out of the hash, or every
stored golden silently becomes "no golden for these seeds" and costs GPU time to remake. The shapes are read from
``scripts/device/shapes.sh``, the one place the device calls take them from.
"""
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def _shape(var: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f". scripts/device/shapes.sh; echo ${var}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return out.split()


def _curve_dir(overrides: list[str]) -> Path:
    from forgetrain import verify as V
    from forgetrain.config import to_run_config

    V.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="verify", overrides=overrides + ["tier=loss_curve"])
    obj = OmegaConf.to_container(cfg, resolve=True)
    vd = obj.pop("verify")
    obj.pop("tier")
    return V.curve_golden_dir(to_run_config(obj), V.VerifyConfig(**vd))


@pytest.mark.parametrize("var,seeds", [("L", 5), ("R1B", 5), ("P8", 5)])
def test_stored_h200_golden_is_found(var, seeds):
    d = _curve_dir(_shape(var))
    stored = sorted(p.name for p in d.glob("seed_*"))
    assert len(stored) >= seeds, f"{var}: {d} holds {stored}; a config field changed the golden hash"


def test_io_only_field_stays_out_of_the_hash():
    import dataclasses

    from forgetrain.train import config_hash

    from forgetrain import verify as V
    from forgetrain.config import to_run_config

    V.register()

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="verify", overrides=_shape("L") + ["tier=loss_curve"])
    obj = OmegaConf.to_container(cfg, resolve=True)
    obj.pop("verify"), obj.pop("tier")
    rc = to_run_config(obj)
    for io_only in ({"skip_memory_check": True}, {"final_params": False}, {"skip_disk_check": True}):
        flipped = dataclasses.replace(rc, train=dataclasses.replace(rc.train, **io_only))
        assert config_hash(rc) == config_hash(flipped), io_only
    changed = dataclasses.replace(rc, train=dataclasses.replace(rc.train, lr=rc.train.lr * 2))
    assert config_hash(rc) != config_hash(changed)  # a numeric field still moves it


def _bitwise_dir(overrides: list[str]) -> Path:
    from forgetrain import verify as V
    from forgetrain.config import to_run_config

    V.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="verify", overrides=overrides)
    obj = OmegaConf.to_container(cfg, resolve=True)
    obj.pop("verify")
    tier = obj.pop("tier")
    return V.golden_dir(to_run_config(obj), tier["name"])


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_stored_h200_bitwise_golden_is_found(precision):
    """The bitwise goldens made by experiments/bitwise/goldens_h200.sh are found from its shape G."""
    d = _bitwise_dir(_shape("G") + [f"train.precision={precision}"])
    assert (d / "trace").is_dir() and (d / "init.safetensors").is_file(), \
        f"{d} is missing; a config field changed the golden hash"
