"""What a run is, as its trace and checkpoints record it: the hash of the settings that change the numbers
(:func:`config_hash`, what a golden is keyed by), the engine's own settings, and the versions it ran with."""

from __future__ import annotations

import dataclasses
import platform

import torch

from forgetrain.config import RunConfig
from forgetrain.metrics import cpu_model


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything that changes the numbers (model, train minus logging/io fields, data, parallel): the
    sha256 of :func:`hashed_config`, first 12 hex digits."""
    import hashlib
    import json

    blob = json.dumps(hashed_config(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The settings that differ between two :func:`hashed_config` dicts, as ``"section.key old -> new"`` lines
    (nested sections dotted, sorted by key; a key present on one side only shows ``<absent>`` on the other)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "<absent>"), new.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {a} -> {b}")
    return out


def hashed_config(cfg: RunConfig) -> dict:
    """The settings :func:`config_hash` covers, as a JSON-able dict (traces store it, so a stale golden can name
    what changed)."""
    import json

    t = dataclasses.asdict(cfg.train)
    for k in ("eval_interval", "log_interval", "save_interval", "save", "resume", "overwrite", "stop_after", "out_dir",
              "sample_tokens", "sample_prompt", "threads", "eval_iters", "skip_memory_check",
              "final_params", "skip_disk_check"):
        t.pop(k, None)
    if t.get("init_weights") is None:  # the engine's own init: hashed as before the setting existed
        t.pop("init_weights", None)
    p = dataclasses.asdict(cfg.parallel)
    for k in ("timeout_s", "backend"):  # how ranks talk, not what they compute
        p.pop(k, None)
    m = dataclasses.asdict(cfg.model)
    from forgetrain.levers import MODEL_FEATURES, MOE_FIELDS

    for k, default in MODEL_FEATURES.items():  # off (a Llama): hashed as before these fields existed
        if m.get(k) == default:
            m.pop(k, None)
    if m.get("num_experts") is None:  # dense: the MoE shape fields mean nothing and stay out of the hash
        for k in MOE_FIELDS:
            m.pop(k, None)
    return json.loads(json.dumps({"model": m, "train": t,
                                  "data": dataclasses.asdict(cfg.data), "parallel": p}, default=str))


def engine_settings(cfg: RunConfig) -> dict:
    """How the forged engine computes (``engine.*`` and ``kernels.*``), as a JSON-able dict: kept out of
    :func:`hashed_config` (a golden is the reference's, whatever engine is judged against it) but stored with each
    checkpoint, so a resume with another engine setting (``engine.fp8``, a kernel switch) is named."""
    import json

    return json.loads(json.dumps({"engine": dataclasses.asdict(cfg.engine), "kernels": dataclasses.asdict(cfg.kernels)},
                                 default=str))


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
         "cpu": cpu_model(), "threads": torch.get_num_threads()}
    try:
        from importlib.metadata import version

        v["megatron-core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - optional
        pass
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["gpu"] = torch.cuda.get_device_name()
    return v
