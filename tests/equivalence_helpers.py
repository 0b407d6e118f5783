"""Synthetic runs for the equivalence tier tests (tests/test_equivalence.py, tests/test_tier_registry.py): a run
dict of a 2-layer model (records with digests, step-1 module probes, final params) and its trace directory."""

from __future__ import annotations

import math

import torch

from forgetrain.engine import forward_names, hf_param_names
from forgetrain.trace import TraceWriter, tensor_digest

NUM_LAYERS = 2
PARAMS = hf_param_names(NUM_LAYERS)
MODULES = list(forward_names(NUM_LAYERS))


def seeded_tensor(seed: int, shape=(4, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def base_run(n_steps: int = 6, digests: bool = True) -> dict:
    """A synthetic run: records (with digests), step-1 module probes and final params."""
    records = []
    for s in range(1, n_steps + 1):
        rec = {"step": s, "loss": 5.0 / (1 + 0.1 * s) + 1e-3 * math.sin(s), "grad_norm": 1.0 / s + 0.25,
               "lr": 3e-3 * s / 10, "tokens": 2048 * s, "step_s": 0.1}
        if digests:
            rec["digests"] = {
                "per_token_loss": tensor_digest(seeded_tensor(1000 + s, (2, 8))),
                "grads": {n: tensor_digest(seeded_tensor(10_000 * s + i)) for i, n in enumerate(PARAMS)},
                "params": {n: tensor_digest(seeded_tensor(20_000 * s + i)) for i, n in enumerate(PARAMS)},
            }
        records.append(rec)
    modules = {m: {"fwd": tensor_digest(seeded_tensor(30_000 + i)), "fwd_l2": 10.0 + i,
                   "grad": tensor_digest(seeded_tensor(40_000 + i)), "grad_l2": 0.1 * (i + 1)}
               for i, m in enumerate(MODULES)}
    final = {n: seeded_tensor(50_000 + i, (4,) if "norm" in n else (4, 4)) * 0.02 + (1.0 if "norm" in n else 0.0)
             for i, n in enumerate(PARAMS)}
    return {"records": records, "modules": modules, "final": final, "precision": "fp32"}


def write_run(d, run: dict):
    w = TraceWriter(d, {"side": "test", "scenario": "synthetic", "config_hash": "x",
                        "precision": run["precision"], "steps": len(run["records"])})
    for r in run["records"]:
        w.append(r)
    w.flush()
    if run.get("modules") is not None:
        w.write_modules(run["modules"])
    if run.get("final") is not None:
        w.write_final_params(run["final"])
    return d
