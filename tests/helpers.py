"""Helpers that several test modules share (fixtures stay in tests/conftest.py). Heavy imports are made inside the
helpers that need them, so importing this module costs nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from tests.limits import hang_s

if TYPE_CHECKING:
    from scenarios.llama1b_h200.engine import Engine as Hopper

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


def fast_cfg(kernels: dict, engine: dict | None = None, **model):
    from forgetrain.config import EngineOptions, KernelsConfig

    c = ladder_cfg()
    if model:
        c = dataclasses.replace(c, model=dataclasses.replace(c.model, **model))
    return dataclasses.replace(c, engine=EngineOptions(mode="fast", compile=False, ce_chunk_tokens=24,
                                                       **(engine or {})),
                               kernels=KernelsConfig(**kernels))


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


BOTH = {"recompute": "full", "bf16_weights": "per_layer"}


def check_resumes_bitwise(cfg, resume_cfg=None) -> Hopper:
    """Raises AssertionError unless saving the Hopper engine's state after 2 of 3 steps (what the DCP checkpoint
    holds) and loading it into a fresh engine (built from ``resume_cfg``, default ``cfg``) resumes to the same
    losses and weights as an uninterrupted run. Returns the uninterrupted engine."""
    import torch

    from scenarios.llama1b_h200.engine import Engine as Hopper

    init = Hopper(cfg, "cpu").export_hf_weights()
    torch.manual_seed(1)
    mbs = [[torch.randint(0, 256, (2, 33)) for _ in range(2)] for _ in range(3)]
    whole = Hopper(cfg, "cpu")
    whole.load_hf_weights(init)
    losses = [whole.train_step(m).loss for m in mbs]
    first = Hopper(cfg, "cpu")
    first.load_hf_weights(init)
    head = [first.train_step(m).loss for m in mbs[:2]]

    def clone(x):
        return {k: clone(v) for k, v in x.items()} if isinstance(x, dict) else x.clone()

    resumed = Hopper(resume_cfg or cfg, "cpu")
    resumed.load_state_dict(clone(first.state_dict()))
    tail = [resumed.train_step(mbs[2]).loss]
    assert head + tail == losses
    a, b = whole.export_hf_weights(), resumed.export_hf_weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    return whole


# ------------------------------------------------------------------------------------------------------ the CLI

FAST = ["model=llama_micro", "train.steps=6", "train.lr_warmup_steps=1", "train.micro_batch_size=4",
        "train.global_batch_size=8", "train.eval_interval=3", "train.eval_iters=2", "train.sample_tokens=8",
        "train.save_interval=3"]


def run(args, cwd=None, timeout=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "forgetrain", *args], cwd=cwd or ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout or hang_s())


def records(out: Path):
    return [json.loads(x) for x in (out / "trace" / "trace.jsonl").read_text().splitlines()]


def stand_in_task(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run the training entry point (``run_hydra``) with a task whose one line is ``body`` (``torch``, ``errno``
    imported), out_dir ``tmp_path/run``."""
    code = ("import errno, sys, torch\n"
            "from forgetrain.cli import run_hydra\n"
            "def task(cfg):\n"
            f"    {body}\n"
            "run_hydra('config', task, sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, f"train.out_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                          text=True, capture_output=True, timeout=hang_s())


# ------------------------------------------------------------------------------------------------------ processes

def free_port() -> int:
    """A TCP port that was free a moment ago (torchrun's ``--master-port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_cache(tmp_path_factory) -> str:
    """The data cache the test run shares (``FORGETRAIN_TEST_CACHE``, else one under pytest's base temp)."""
    return os.environ.get("FORGETRAIN_TEST_CACHE") or str(tmp_path_factory.getbasetemp() / "ftcache")


def torchrun_env(cache: str, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), FORGETRAIN_CACHE=cache, OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def torchrun(argv: list[str], env: dict, timeout: float | None = None, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=timeout or hang_s())


def launch_errors(p: subprocess.CompletedProcess) -> str:
    lines = [x for x in p.stderr.splitlines() if "Warning" not in x and not x.startswith("W11")]
    return "\n".join(lines[-60:])


def run_jobs(jobs: list[dict], tmp: Path, cache: str) -> subprocess.CompletedProcess:
    spec = tmp / f"jobs_{len(list(tmp.glob('jobs_*.json')))}.json"
    spec.write_text(json.dumps(jobs))
    return torchrun(["-m", "tests.parallel_worker", str(spec)], torchrun_env(cache))


class Runs(dict):
    """``name -> output dir`` of one launch; indexing a run whose trace is missing fails with the launch's log
    (so one broken job fails its own tests, not the module)."""

    def __init__(self, dirs: dict, proc: subprocess.CompletedProcess, launch_s: float):
        super().__init__(dirs)
        self.proc, self.launch_s = proc, launch_s

    def __getitem__(self, name: str) -> Path:
        out = super().__getitem__(name)
        if not (out / "trace" / "trace.jsonl").exists():
            pytest.fail(f"run {name!r} did not finish (launch rc={self.proc.returncode}):\n{launch_errors(self.proc)}")
        return out


# ------------------------------------------------------------------------------------------------------ data

WORDS = ("thou art more lovely and more temperate rough winds do shake the darling buds of may "
         "café naïve — “quoted” ✓ 🌹 tab\there").split(" ")


def paragraphs(n: int, seed: int = 0, lines: int = 8) -> list[str]:
    """``n`` distinct paragraphs of ``lines`` lines (~75 characters each), with non-ASCII text."""
    rng = np.random.RandomState(seed)
    return [f"P{i}. " + "\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(lines)) for i in range(n)]


def write_dataset(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        b.add_document(d, [len(d)])
    b.finalize(f"{prefix}.idx")



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
