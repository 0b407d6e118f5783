"""``forgetrain.bench``: side-by-side timing of the forged engine and references (what it does and prints:
``forgetrain/bench/__main__.py``, ``python -m forgetrain.bench --help``).

Pieces: :mod:`.steps` (the step timer, rank, device and batches), :mod:`.sides` (which engines, their configs, how
each is built), :mod:`.profile` (``bench.profile``), :mod:`.timing` (interleaved, A-B-A and one-block timing),
:mod:`.report` (rows, tables, warnings, bench.json). This module holds the Hydra schema (``bench_schema``,
registered by :func:`register`), the request checks, the run and the entry point; it re-exports the pieces' public
names that other modules and the tests use (``forgetrain.bench.timed_sides``, ...).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from forgetrain.bench.profile import PROFILE_CATEGORIES, PROFILE_RULES, breakdown, classify, print_profile, profile_step
from forgetrain.bench.report import (NOISY_IQR_PCT, candidate_line, fp8_notes, headline_warning, noise_warnings,
                                     print_table, report_rows, summarize, warmup_warning, write_report)
from forgetrain.bench.sides import (CANDIDATE_GROUPS, build_sides, bytes_per_engine, candidate_config, check_sides,
                                    make_side, oom_reason, recompute_warnings, side_config, side_label,
                                    single_micro_batch_config, unavailable_reason)
from forgetrain.bench.steps import rank_world
from forgetrain.bench.timing import (ONCE_MODE, free_device, once_times, reduce_over_ranks, release_host_cache,
                                     sequential_times, side_by_side_step_times, time_engine, time_sides, timed_sides)
from forgetrain.config import RunConfig, to_run_config

__all__ = ["BenchConfig", "BenchRunConfig", "CANDIDATE_GROUPS", "INTERLEAVE_MODES", "NOISY_IQR_PCT", "ONCE_MODE",
           "PROFILE_CATEGORIES", "PROFILE_RULES", "bench_task", "breakdown", "build_sides", "bytes_per_engine",
           "candidate_config", "candidate_line", "check_bench", "check_request", "check_sides", "classify",
           "fp8_notes", "free_device", "headline_warning", "main", "make_side", "noise_warnings", "once_times",
           "oom_reason", "print_profile", "print_table", "profile_step", "recompute_warnings", "reduce_over_ranks",
           "register", "release_host_cache", "run_bench", "sequential_times", "side_by_side_step_times",
           "side_config", "side_label", "single_micro_batch_config", "summarize", "time_engine", "time_sides",
           "timed_sides", "unavailable_reason", "warmup_warning"]


@dataclass
class BenchConfig:
    against: list = field(default_factory=lambda: ["megatron"])  # references/<name> to time beside the forged one
    steps: int = 10  # timed steps per side (median)
    warmup: int = 3  # untimed steps per side
    # auto | always | never | once. never: A, B..., A blocks (one engine in memory at a time). once: A, B, C, ...
    # one block per side, each side built once, timed at both batches and freed before the next (once_times)
    interleave: str = "auto"
    single_micro_batch: bool = True  # also time one micro-batch per step (global batch = micro-batch x DP)
    profile: bool = False  # profile one extra step per side: category table + out_dir/profile_<side>.json
    # Activation recompute of the sides in bench.against: none | full. null: engine.recompute, the forged engine's.
    # A forged layout that fits without recompute (e.g. llama8b_h200's optimizer offload) can still be set beside a
    # framework run the way its users fit the card (torch.compile with every block checkpointed).
    side_recompute: Optional[str] = None
    # A second forged engine, the candidate, timed beside the forged one in the same process: {dotted key: value}
    # under engine.* and kernels.* only (the workload stays the same), e.g. bench.candidate={kernels.swiglu:triton}.
    # Its row is "candidate"; its "forged x" is its step time over the forged one's. null: no candidate.
    candidate: Any = None
    out_dir: Optional[str] = None


@dataclass
class BenchRunConfig(RunConfig):
    bench: BenchConfig = field(default_factory=BenchConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    from forgetrain.config import register_configs

    register_configs()
    ConfigStore.instance().store(name="bench_schema", node=BenchRunConfig)


INTERLEAVE_MODES = ("auto", "always", "never", "once")  # bench.interleave (BenchConfig)


def check_request(obj: dict) -> None:
    """The bench request of a composed config (``obj["bench"]``), checked by ``forgetrain.cli`` before Hydra
    creates anything, the candidate's config included (:func:`candidate_config`). Raises ConfigError."""
    b = BenchConfig(**obj["bench"])
    check_bench(b)
    candidate_config(obj, obj["bench"].get("candidate"), int(os.environ.get("WORLD_SIZE", "1")))
    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    check_sides(to_run_config({k: v for k, v in obj.items() if k in run_keys}), list(b.against))


def check_bench(b: BenchConfig) -> None:
    """Raises ConfigError for bench settings that cannot give a median, and for a reference in ``bench.against``
    that is unknown or whose optional framework is not installed."""
    from forgetrain import registry
    from forgetrain.errors import ConfigError

    for name in b.against:
        registry.load_engine_class("references", name)
    dup = sorted({n for n in b.against if list(b.against).count(n) > 1})
    if dup:
        raise ConfigError(f"bench.against names {', '.join(dup)} more than once; list each side once")

    if b.steps < 1:
        raise ConfigError(f"bench.steps must be >= 1 (timed steps per side), got {b.steps}")
    if b.warmup < 0:
        raise ConfigError(f"bench.warmup must be >= 0, got {b.warmup}")
    if b.interleave not in INTERLEAVE_MODES:
        raise ConfigError(f"bench.interleave must be {'|'.join(INTERLEAVE_MODES)}, got '{b.interleave}'")
    if b.side_recompute not in (None, "none", "full"):
        raise ConfigError(f"bench.side_recompute must be none|full|null (null: engine.recompute), "
                          f"got '{b.side_recompute}'")


def bench_task(cfg) -> None:
    from omegaconf import OmegaConf

    obj = OmegaConf.to_container(cfg, resolve=True)
    b = BenchConfig(**obj.pop("bench"))
    check_bench(b)
    rc = to_run_config(obj)
    from forgetrain.config import validate

    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(rc, world_size=world)
    candidate = candidate_config(obj, b.candidate, world)
    check_sides(rc, list(b.against))
    for line in recompute_warnings(rc, b.against, b.side_recompute):
        print(line, file=sys.stderr)
    from forgetrain.distributed import collective_errors, init_distributed

    env = init_distributed(rc.parallel)
    with collective_errors(rc.parallel.timeout_s):
        run_bench(rc, b, env.rank, record=cfg, candidate=candidate)


def run_bench(rc: RunConfig, b: BenchConfig, rank: int, record=None, candidate: Optional[RunConfig] = None) -> None:
    """Time every side and report (rank 0): the tables, bench.json and, from ``record`` (the composed Hydra config),
    .hydra/config.yaml beside it. ``candidate``: the config of ``b.candidate`` (:func:`candidate_config`).
    bench.json is written once the headline is timed (``"complete": false`` while the one-micro-batch rows are still
    to come; under ``bench.interleave=once`` after every side's block), then again whole: a run killed in between
    keeps what was timed."""
    from forgetrain.run.outdir import out_dir

    out = Path(b.out_dir) if b.out_dir else out_dir(rc)
    single_cfg = single_micro_batch_config(rc)
    wants_single = b.single_micro_batch and single_cfg.train.global_batch_size != rc.train.global_batch_size
    once = None  # bench.interleave=once: (headline, single) times from one pass over the sides
    if b.interleave == "once":
        once = _once_pass(rc, b, out, candidate, single_cfg if wants_single else None)
        mode, times = ONCE_MODE, once[0]
    else:
        mode, times = timed_sides(rc, list(b.against), b.steps, b.warmup, b.interleave,
                                  profile_dir=out if b.profile else None, side_recompute=b.side_recompute,
                                  candidate=candidate)
    warning, rows = headline_warning(rc), None
    if rank == 0:
        for line in filter(None, (warning, warmup_warning(b))):
            print(line)
        rows = report_rows("headline", rc, b, mode, times)
        for name, info in times.get("_info", {}).items():
            if info:
                print(f"engine info {name}: {info}")
        if wants_single and once is None:
            write_report(out, rc, b, mode, times, rows, warning, complete=False)
    single = None  # (mode, times) at one micro-batch per step; not timed twice when the headline is that already
    if once is not None and once[1] is not None:
        single = (mode, once[1])
    elif wants_single:
        runnable = [s for s in b.against if s not in times.get("_unavailable", {})]  # not built twice to fail
        single = timed_sides(single_cfg, runnable, b.steps, b.warmup, b.interleave, side_recompute=b.side_recompute,
                             candidate=single_micro_batch_config(candidate) if candidate else None)
    if rank != 0:
        return
    rows_single = report_rows("single micro-batch", single_cfg, b, *single) if single else None
    if b.single_micro_batch and not single:
        print("single micro-batch: the headline is one micro-batch per step already (not timed twice)")
    for name, prof in times.get("_profile", {}).items():
        print_profile(name, prof)
        print(f"wrote {out / f'profile_{name}.json'}", file=sys.stderr)
    write_report(out, rc, b, mode, times, rows, warning, complete=True,
                  single_times=single[1] if single else None, rows_single=rows_single)
    if record is not None:
        from forgetrain.run.outdir import record_config

        record_config(out, record, resume=False)
    print(f"wrote {out / 'bench.json'}", file=sys.stderr)


def _once_pass(rc: RunConfig, b: BenchConfig, out: Path, candidate: Optional[RunConfig],
               single_cfg: Optional[RunConfig]) -> tuple[dict, Optional[dict]]:
    """:func:`once_times` for ``run_bench``, reduced over ranks, writing bench.json (rank 0, ``"complete": false``)
    after every side's block, so that a call killed later keeps the sides timed so far."""

    def on_block(head: dict, one: Optional[dict]) -> None:
        head = reduce_over_ranks(head)
        one = reduce_over_ranks(one) if one is not None else None
        if rank_world()[0] == 0:
            rows_one = summarize(single_cfg, one) if one is not None and one.get("forged") else None
            write_report(out, rc, b, ONCE_MODE, head, summarize(rc, head), headline_warning(rc), complete=False,
                          single_times=one, rows_single=rows_one)

    head, one = once_times(rc, list(b.against), b.steps, b.warmup, single_cfg,
                           profile_dir=out if b.profile else None, side_recompute=b.side_recompute,
                           candidate=candidate, on_block=on_block)
    return reduce_over_ranks(head), reduce_over_ranks(one) if one is not None else None


def main() -> None:
    from forgetrain.cli import run_hydra

    register()
    run_hydra("bench", bench_task)
