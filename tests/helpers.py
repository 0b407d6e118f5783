"""Helpers that several test modules share (fixtures stay in tests/conftest.py). Heavy imports are made inside the
helpers that need them, so importing this module costs nothing."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------ configs

def ladder_cfg(**train):
    """The llama_micro run of the equivalence ladder tests: micro-batch 2 x grad-accum 2, 8 steps, warm-up 2;
    ``train`` overrides ``train.*`` fields."""
    from hydra import compose, initialize_config_dir

    from forgetrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = to_run_config(compose(config_name="config", overrides=["model=llama_micro"]))
    return dataclasses.replace(c, train=dataclasses.replace(
        c.train, micro_batch_size=2, global_batch_size=4, lr_warmup_steps=2, steps=8, **train))


def hopper_cfg(mode: str, precision: str = "bf16", **engine):
    """:func:`ladder_cfg` for the Hopper engine on CPU: vocabulary 256, ``engine.mode=mode`` without compile, the
    chunked CE in fast mode (24-token chunks); ``engine`` overrides ``engine.*`` fields."""
    from forgetrain.config import EngineOptions, KernelsConfig

    c = ladder_cfg(precision=precision)
    m = dataclasses.replace(c.model, vocab_size=256)
    kernels = KernelsConfig(cross_entropy="chunked" if mode == "fast" else "torch")
    return dataclasses.replace(c, model=m, kernels=kernels,
                               engine=EngineOptions(mode=mode, compile=False, ce_chunk_tokens=24, **engine))


def train_hopper(cfg, init: dict, steps: int = 3):
    """``steps`` steps of the Hopper engine on CPU from ``init`` on fixed random micro-batches (2 x [2, 33]):
    (losses, final HF weights, the engine)."""
    import torch

    from scenarios.llama1b_h200.engine import Engine as Hopper

    torch.manual_seed(0)
    mbs = [[torch.randint(0, 256, (2, 33)) for _ in range(2)] for _ in range(steps)]
    eng = Hopper(cfg, "cpu")
    eng.load_hf_weights(init)
    losses = [eng.train_step(m).loss for m in mbs]
    return losses, eng.export_hf_weights(), eng


def same_run(a, b) -> bool:
    """Two :func:`train_hopper` results with equal losses and bitwise equal weights."""
    import torch

    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# ------------------------------------------------------------------------------------------------------ processes

def free_port() -> int:
    """A TCP port that was free a moment ago (torchrun's ``--master-port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_cache(tmp_path_factory) -> str:
    """The data cache the test run shares (``FORGETRAIN_TEST_CACHE``, else one under pytest's base temp)."""
    return os.environ.get("FORGETRAIN_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "ftcache")



# ------------------------------------------------------------------------------------------------------ traces

CURVE_STEPS = 200  # steps of a synthetic loss curve


def curve(seed: int, shift=0.0, diverge_at=None) -> np.ndarray:
    """Synthetic loss: a decaying mean, a per-seed smooth offset, and per-step batch noise (sigma 0.05)."""
    T = CURVE_STEPS
    rng = np.random.default_rng(seed)
    t = np.arange(1, T + 1)
    base = 2.0 + 3.0 * np.exp(-t / 40.0)
    offset = rng.normal(0, 0.01) * (1 + t / T)
    y = base + offset + rng.normal(0, 0.05, T) + shift
    if diverge_at is not None:
        y = y + np.where(t > diverge_at, 0.01 * (t - diverge_at), 0.0)
    return y


def write_curve(d, y):
    """A trace of loss curve ``y`` in directory ``d`` (fp32, grad norm 1, lr 1e-3); returns ``d``."""
    from forgetrain.trace import TraceWriter

    w = TraceWriter(d, {"precision": "fp32", "steps": len(y)})
    for i, v in enumerate(y):
        w.append({"step": i + 1, "loss": float(v), "grad_norm": 1.0, "lr": 1e-3, "tokens": 100 * (i + 1)})
    w.flush()
    return d


def paired(tmp_path, name, shift=0.0, noise=0.0, chaos=0.004, n=4):
    """A paired candidate run per reference seed (``curve(s)`` for seeds 0 .. n-1, as the ``seeds`` fixture of
    tests/test_equivalence.py writes them): that seed's own curve (same init and batches) plus ``shift``,
    run-to-run chaos (per-step sigma ``chaos``) and extra per-step loss noise ``noise``."""
    from forgetrain.equivalence.tiers.loss_curve import CurveRuns

    T = CURVE_STEPS
    rng = np.random.default_rng(abs(hash((name, shift, noise))) % 2**32)
    return CurveRuns(paired=tuple(write_curve(tmp_path / f"{name}_p{s}", curve(s) + shift
                                              + rng.normal(0, chaos, T) + rng.normal(0, noise, T) * (noise > 0))
                                  for s in range(n)))


def perturb(rel: float, steps=None, params=False):
    """A mutation of a run dict (``base_run``'s): loss scaled by 1 + rel and grad norm by 1 - rel (at ``steps``,
    default every step), digests dropped, and with ``params`` the final weights scaled by 1 + rel."""
    def m(run):
        for r in run["records"]:
            if steps is None or r["step"] in steps:
                r["loss"] *= 1 + rel
                r["grad_norm"] *= 1 - rel
            r.pop("digests", None)
        if params:
            run["final"] = {k: (v.double() * (1 + rel)).float() for k, v in run["final"].items()}
    return m


def timings(seed, median, n=20, rel_sd=0.05):
    """``n`` synthetic step times around ``median`` (relative sd ``rel_sd``), reproducible from ``seed``."""
    return list(median * (1 + np.random.default_rng(seed).normal(0, rel_sd, n)))
