"""``python -m forgetrain.bench scenario=NAME bench.against=[megatron] [bench.steps=10]``: side-by-side timing.

Every side (the forged engine first, then each reference in ``bench.against``) is built in this one process on
the same initial weights and fed the same real-token micro-batches. After ``bench.warmup`` untimed steps per side,
steps are timed interleaved (A B A B ...), each with CUDA events on the GPU (host timer on CPU), and the median
is reported with its spread (IQR); a side whose IQR exceeds :data:`NOISY_IQR_PCT` percent of its median gets a
``warning:`` line (and ``noisy`` in its row of bench.json). Output: a table of step_s, tokens_per_s, mfu_pct,
mem_gib and each side's speed ratio vs the forged engine, plus ``bench.json`` under Hydra's run directory. Models
too big to hold every side at once are timed in sequential A-B-A blocks (``bench.interleave=never``, or
``auto``'s choice), or with ``bench.interleave=once`` in one block per side, each side built once, timed at both
batches and freed before the next (:func:`once_times`). Every row carries what its side is (``label``,
:func:`side_label`).

The headline rows are the configured global batch, which should be production-like (gradient accumulation >= 8;
one warning line otherwise). With ``bench.single_micro_batch`` (default) every side is timed again at one
micro-batch per step (global batch = micro-batch x DP) and reported beside it; every row carries its
``global_batch_size`` and ``grad_accum``.

With ``bench.profile=true`` one extra, untimed step of each side (after its timed steps, at the headline batch)
runs under ``torch.profiler``: a per-category table (:data:`PROFILE_RULES`; CUDA kernel time on the GPU, self
CPU time of the ops on CPU) is printed and stored under "profile" in bench.json, and the Chrome trace is written
to ``profile_<side>.json`` beside it. Under torchrun every rank runs that step; the table and trace are rank 0's.

MFU comes from ``forgetrain.metrics`` under both of its labelled conventions (``mfu_pct``: PaLM's, attention
without causal halving; ``mfu_causal_pct``: Megatron-LM's causal one) against ``hardware.peak_tflops`` (or a
measured matmul peak on CPU) times the number of devices.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank builds the same sides with the run's parallel layout and feeds
its data-parallel share of each global batch (Megatron's sampler order); a step's time is the slowest rank's
(all-reduce MAX per step, since the step ends when the last rank's collectives do), memory is the largest rank's,
and only rank 0 prints and writes ``bench.json``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from forgetrain.config import RunConfig, grad_accum_steps, to_run_config


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


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _device(cfg: RunConfig) -> torch.device:
    """``cpu``, or this process's GPU (``cuda:LOCAL_RANK`` under torchrun)."""
    import os

    if cfg.hardware.device == "cpu":
        return torch.device("cpu")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")


def _say(*args, **kw) -> None:
    if _world()[0] == 0:
        print(*args, **kw)


def _batches(cfg: RunConfig, n_steps: int) -> list[list[torch.Tensor]]:
    """This rank's micro-batches for ``n_steps`` steps: ``[n_steps][grad_accum]`` of ``[mb, seq + 1]`` int64."""
    from forgetrain.data import TokenWindows, micro_batch, prepare

    data = prepare(cfg.data, progress=False)
    w = TokenWindows(data.train_prefix, cfg.model.seq_length, cfg.train.seed)
    t, p = cfg.train, cfg.parallel
    ga = grad_accum_steps(cfg)
    dp_rank = _world()[0] // p.tensor_parallel_size
    return [[micro_batch(w, s, m, dp_rank, t.micro_batch_size, p.data_parallel_size, t.global_batch_size)
             for m in range(ga)] for s in range(n_steps)]


def reduce_over_ranks(times: dict) -> dict:
    """Per-step MAX of every side's step seconds and MAX of peak memory over the ranks (identity for one process).
    Every rank must call it with the same sides and step counts (a collective)."""
    import torch.distributed as dist

    if _world()[1] == 1:
        return times
    out = dict(times)
    for name, ts in times.items():
        if name.startswith("_") or not ts:
            continue
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = t.tolist()
    mem = times.get("_mem_gib", {})
    if mem:
        names = sorted(mem)
        t = torch.tensor([mem[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["_mem_gib"] = dict(zip(names, t.tolist()))
    if "_forged_blocks" in times:
        t = torch.tensor(times["_forged_blocks"], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["_forged_blocks"] = t.tolist()
    return out


def unavailable_reason(name: str, exc: Exception) -> str:
    """The one-line reason a bench side cannot run in this environment: the ImportError that building it raised
    (e.g. a general framework whose release needs a newer torch), with the torch it met; or the side's own
    :class:`~forgetrain.errors.CannotRunHere` reason (e.g. DeepSpeed's ZeRO-Offload needing more host memory than
    the machine has), as ``<side>: cannot run here: <reason>``. Stored in bench.json under "unavailable" and
    printed in place of its row."""
    from forgetrain.errors import CannotRunHere

    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, CannotRunHere):
        return f"{name}: cannot run here: {first}"
    return f"{name} cannot run here (torch {torch.__version__}): {type(exc).__name__}: {first}"


def side_config(cfg: RunConfig, side_recompute: Optional[str]) -> RunConfig:
    """The config a bench side is built with: ``cfg`` itself, or with ``side_recompute`` (``bench.side_recompute``:
    none | full) as its ``engine.recompute``; under ``none`` the recompute depth (``engine.recompute_num_layers``)
    is dropped too. The forged engine always runs ``cfg``."""
    if side_recompute is None or side_recompute == cfg.engine.recompute:
        return cfg
    rnl = cfg.engine.recompute_num_layers if side_recompute == "full" else None
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute=side_recompute,
                                                               recompute_num_layers=rnl))


# What a candidate may change: how the forged engine runs, never what it trains (the rows' MFU and tokens/s are the
# workload's, computed once from the forged config).
CANDIDATE_GROUPS = ("engine", "kernels")


def candidate_config(obj: dict, candidate, world_size: int = 1) -> Optional[RunConfig]:
    """The run config of ``bench.candidate`` (dotted key -> value, e.g. {"kernels.swiglu": "triton"}) applied to
    ``obj``, the composed config as a plain dict (keys outside RunConfig's groups are ignored). The values are typed
    by the group's schema as a command-line override is (OmegaConf: "yes" is a bool, 1.5 is not an int), then the
    run is validated like any run (:func:`forgetrain.config.validate`: a switch's needs, sealed kernels, memory),
    after the configured run itself, so that a mistake in it is not blamed on the candidate. None when
    ``candidate`` is None or empty. Raises ConfigError for a candidate that is not a dict, a key outside
    :data:`CANDIDATE_GROUPS`, a key the group does not have, a value of the wrong type, or a value the config
    refuses."""
    if candidate is None or (isinstance(candidate, dict) and not candidate):
        return None
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import typing

    from forgetrain.config import validate
    from forgetrain.errors import ConfigError

    if not isinstance(candidate, dict):
        raise ConfigError(f"bench.candidate must be a dict of overrides, e.g. bench.candidate={{kernels.swiglu:triton}}"
                          f" (null or {{}}: no candidate), got {type(candidate).__name__} {candidate!r}")
    hints = typing.get_type_hints(RunConfig)
    schemas = {g: hints[g] for g in CANDIDATE_GROUPS}  # EngineOptions, KernelsConfig
    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    plain = {k: v for k, v in obj.items() if k in run_keys}
    validate(to_run_config(plain), world_size=world_size)  # the configured run first: its own errors, unprefixed
    nodes = {g: OmegaConf.merge(OmegaConf.structured(cls), plain.get(g) or {}) for g, cls in schemas.items()}
    for key, value in candidate.items():
        group, _, name = str(key).partition(".")
        if group not in CANDIDATE_GROUPS or not name or "." in name:
            raise ConfigError(f"bench.candidate key '{key}' must be <group>.<name> with group "
                              f"{' or '.join(CANDIDATE_GROUPS)} (the candidate changes how the engine runs, "
                              f"not the workload)")
        if name not in nodes[group]:
            raise ConfigError(f"bench.candidate key '{key}': {group} has no '{name}' "
                              f"(known: {', '.join(sorted(nodes[group]))})")
        try:
            nodes[group][name] = value
        except OmegaConfBaseException as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"bench.candidate key '{key}': {why}") from None
    rc = to_run_config({**plain, **{g: OmegaConf.to_object(n) for g, n in nodes.items()}})
    try:
        return validate(rc, world_size=world_size)
    except ConfigError as e:
        raise ConfigError(f"bench.candidate: {e}") from None


def _value_text(v) -> str:
    """A candidate value as the command line writes it (true, false, null; the rest as str)."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def side_label(name: str, cfg: Optional[RunConfig] = None) -> str:
    """What side ``name`` is, in words, for the table's legend, each row's "label" and the block lines: the forged
    engine (of ``cfg``'s scenario), the candidate, or a reference's ``bench_label`` (megatron: "Megatron-core
    0.16.1 local spec (no Transformer Engine)"); a reference without one, or one that cannot be imported here, is
    its name."""
    if name in ("forged", "candidate"):
        what = f"forged engine of scenario {cfg.scenario.name}" if cfg is not None else "forged engine"
        return what if name == "forged" else f"{what} with bench.candidate's overrides"
    from forgetrain import registry

    try:
        return getattr(registry.load_engine_class("references", name), "bench_label", name)
    except Exception:  # noqa: BLE001 - unknown here, or its framework cannot be imported: the name says it
        return name


def make_side(name: str, cfg: RunConfig, device: torch.device):
    """Build reference ``name`` as a bench side. A reference that declares ``supports_bench_side`` is built with
    ``bench_side=True``: the timed form a user of that framework runs (references/deepspeed: SDPA attention, no
    gradient snapshot or per-token losses, which only the equivalence harness reads). The bench is the one place
    that says "this engine is being timed"; what that means is each reference's own (its module doc). ``cfg`` is
    the side's config (:func:`side_config`)."""
    from forgetrain import registry

    cls = registry.load_engine_class("references", name)
    if getattr(cls, "supports_bench_side", False):
        return cls(cfg, device, bench_side=True)
    return cls(cfg, device)


def oom_reason(exc: BaseException, stage: str) -> str:
    """Why a bench side ran out of device memory, in one line: where (``stage``: building the engine, or which
    step) and the numbers of torch's CUDA caching allocator message (the request, what PyTorch had allocated, the
    device's capacity; torch's ``c10/cuda/CUDACachingAllocator.cpp`` words it "Tried to allocate X. GPU 0 has a
    total capacity of Y of which Z is free ... Of the allocated memory A is allocated by PyTorch"). Falls back to
    the message's first line when it is worded otherwise. Stored in bench.json under "oom_reason"."""
    msg = str(exc)
    found = {k: re.search(rx, msg) for k, rx in (("asked", r"Tried to allocate ([\d.]+ [KMGT]?i?B)"),
                                                  ("capacity", r"total capacity of ([\d.]+ [KMGT]?i?B)"),
                                                  ("free", r"of which ([\d.]+ [KMGT]?i?B) is free"),
                                                  ("held", r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch"))}
    if found["asked"] and found["held"] and found["capacity"]:
        why = (f"asked for {found['asked'].group(1)} more with {found['held'].group(1)} allocated by PyTorch "
               f"of the device's {found['capacity'].group(1)}"
               + (f" ({found['free'].group(1)} free)" if found["free"] else ""))
    else:
        why = (msg.strip().splitlines() or ["(no message)"])[0][:300]
    return f"out of memory while {stage}: {why}"


def build_sides(cfg: RunConfig, against: list[str], engine_cls=None, unavailable: Optional[dict] = None,
                side_recompute: Optional[str] = None, candidate: Optional[RunConfig] = None) -> dict:
    """{"forged": engine, "candidate": engine (with ``candidate``, :func:`candidate_config`), "<ref>": engine,
    ...}, all loaded with the first reference's (or forged) init. A side
    whose construction raises ImportError or CannotRunHere is left out and, when ``unavailable`` is given, its
    :func:`unavailable_reason` is stored there (side -> line); without it the error propagates. The sides are
    built with :func:`side_config` (``side_recompute``), the forged engine with ``cfg``."""
    from forgetrain import registry
    from forgetrain.errors import CannotRunHere

    device = _device(cfg)
    sides = {}
    init = None
    for name in against:
        torch.manual_seed(cfg.train.seed)
        try:
            eng = make_side(name, side_config(cfg, side_recompute), device)
        except (ImportError, CannotRunHere) as e:
            if unavailable is None:
                raise
            unavailable[name] = unavailable_reason(name, e)
            continue
        if init is None:
            init = eng.export_hf_weights()
        else:
            eng.load_hf_weights(init)
        sides[name] = eng
    torch.manual_seed(cfg.train.seed)
    forged = (engine_cls or registry.resolve_engine(cfg.scenario.engine))(cfg, device)
    if init is not None:
        forged.load_hf_weights(init)
    out = {"forged": forged}
    if candidate is not None:
        torch.manual_seed(cfg.train.seed)
        out["candidate"] = registry.resolve_engine(candidate.scenario.engine)(candidate, device)
        out["candidate"].load_hf_weights(init if init is not None else forged.export_hf_weights())
    return {**out, **sides}


# Profile categories: (category, regex over the lower-cased kernel/op name), first match wins, so the order
# matters: log_softmax is cross-entropy before softmax is attention, cuDNN's sm90 SDPA kernels are attention
# before sm90 is GEMM. Names that match no rule are "other".
PROFILE_RULES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|gloo|c10d|comms|all_?reduce|reduce_?scatter|all_?gather"),
    ("optimizer", r"adam|_foreach|multi_tensor"),
    # gather_log|logsumexp: inductor's kernel of the forged chunked CE (logsumexp form: "..._exp_gather_log_mul_
    # prepare_softmax_online_..." in an H200 profile), which the softmax rule below took for attention
    ("cross-entropy", r"cross_?entropy|nll|log_?softmax|\b_ce_|gather_log|logsumexp"),
    ("norm", r"rms_?norm|layer_?norm"),
    ("attention", r"sdpa|scaled_dot_product|flash|cudnn|efficient_attention|softmax"),
    ("GEMM", r"\b_?(baddbmm|addmm|bmm|mm|matmul)|linear|gemm|cutlass|sm90|nvjet|xmma"),
    ("copies and casts", r"copy|memcpy|memset|\bto\b|(\b|_)cast|contiguous|\bcat\b|catarray"),
)
PROFILE_CATEGORIES = tuple(c for c, _ in PROFILE_RULES) + ("other",)


def classify(name: str) -> str:
    """The :data:`PROFILE_RULES` category of a kernel or op name (first matching rule), else "other"."""
    low = name.lower()
    return next((cat for cat, pattern in PROFILE_RULES if re.search(pattern, low)), "other")


def breakdown(times_us: list[tuple[str, float]], basis: str, step_ms: float) -> dict:
    """Per-category totals of ``(kernel or op name, microseconds)`` pairs: ``{"basis": basis, "step_ms": wall ms
    of the profiled step, "total_ms": sum, "categories": {category: {"ms", "pct"}}}`` with every category of
    :data:`PROFILE_CATEGORIES` in order; pct is of total_ms (0 when nothing was recorded)."""
    ms = dict.fromkeys(PROFILE_CATEGORIES, 0.0)
    for name, us in times_us:
        ms[classify(name)] += us / 1e3
    total = sum(ms.values())
    return {"basis": basis, "step_ms": step_ms, "total_ms": total,
            "categories": {c: {"ms": v, "pct": 100.0 * v / total if total else 0.0} for c, v in ms.items()}}


def _export_trace(prof, path: Path) -> None:
    """``prof.export_chrome_trace`` to ``path`` atomically (a temp name in the same directory, then replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def profile_step(eng, batch: list[torch.Tensor], device: torch.device, trace_path: Optional[Path] = None) -> dict:
    """Run ``eng.train_step(batch)`` (batch: ``[grad_accum]`` of ``[mb, seq + 1]`` int64) once under
    ``torch.profiler`` (CPU activity, plus CUDA on a GPU) and return its :func:`breakdown`: on a GPU by the CUDA
    kernels' device time (summed over streams, which may overlap), on CPU by the ops' self CPU time. Writes the
    Chrome trace to ``trace_path`` atomically when given. Raises what ``train_step`` or the export raises."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with _Timer(device) as tm:  # synchronizes on the GPU, so every kernel lands in the profile
            eng.train_step(batch)
    if trace_path is not None:
        _export_trace(prof, trace_path)
    if cuda:
        pairs = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
        return breakdown(pairs, "CUDA kernel time", tm.s * 1e3)
    pairs = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    return breakdown(pairs, "self CPU time of ops", tm.s * 1e3)


def _profile_side(times: dict, name: str, eng, batch, device, profile_dir: Optional[Path]) -> None:
    """Profile one extra step of side ``name`` into ``times["_profile"]`` (every rank runs it: the step has
    collectives); rank 0 writes ``profile_dir/profile_<name>.json``. Nothing when ``profile_dir`` is None."""
    if profile_dir is None:
        return
    trace = profile_dir / f"profile_{name}.json" if _world()[0] == 0 else None
    times.setdefault("_profile", {})[name] = profile_step(eng, batch, device, trace)


def print_profile(name: str, b: dict) -> None:
    """Print one side's :func:`breakdown` as a table (ms and % per category)."""
    print(f"profile {name}: {b['basis']} per category (one untimed step, wall {b['step_ms']:.1f} ms under the "
          f"profiler)")
    for cat, v in b["categories"].items():
        print(f"  {cat:<18} {v['ms']:>10.2f} ms {v['pct']:>6.1f}%")
    print(f"  {'total':<18} {b['total_ms']:>10.2f} ms {100.0 if b['total_ms'] else 0.0:>6.1f}%")


def time_sides(cfg: RunConfig, sides: dict, steps: int, warmup: int,
               profile_dir: Optional[Path] = None) -> dict[str, list[float]]:
    """Interleaved A/B timing: returns side -> list of step seconds (``steps`` each, after ``warmup``), plus
    ``"_mem_gib"`` (side -> GiB, GPU only) and, with ``profile_dir``, ``"_profile"`` (side -> breakdown of one
    extra untimed step)."""
    device = _device(cfg)
    batches = _batches(cfg, warmup + steps)
    times = {k: [] for k in sides}
    mem = {}
    for i in range(warmup + steps):
        for name, eng in sides.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with _Timer(device) as tm:
                eng.train_step(batches[i])
            if i >= warmup:
                times[name].append(tm.s)
            if device.type == "cuda":
                mem[name] = max(mem.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    times["_mem_gib"] = mem  # type: ignore[assignment]
    times["_info"] = {name: _engine_info(eng) for name, eng in sides.items()}  # type: ignore[assignment]
    for name, eng in sides.items():
        _profile_side(times, name, eng, batches[-1], device, profile_dir)
    return times


def _engine_info(eng) -> dict | None:
    """What an engine says about how it ran (its optional ``bench_info`` dict, e.g. the forged Hopper engine's
    gradient-accumulation GEMM path); stored under "engine_info" in bench.json."""
    return getattr(eng, "bench_info", None)


def _bytes_per_engine(cfg: RunConfig) -> float:
    """The forged engine's estimated step footprint (``forgetrain.memory.estimate``), bytes per GPU."""
    from forgetrain.memory import estimate

    return float(estimate(cfg).total_bytes)


def release_host_cache() -> bool:
    """Give the pinned host memory that torch's caching host allocator keeps after an engine is freed back to the
    system (``torch.accelerator.empty_host_cache``, or ``torch._C._host_emptyCache`` on older CUDA builds). Between
    sequential blocks: the forged optimizer offload pins about 68 GiB for Llama-3-8B, which the allocator would
    otherwise hold while the next side (e.g. DeepSpeed's ZeRO-Offload) needs host memory. True when a release
    function was called."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if fn is None or not torch.cuda.is_available():  # no device: no pinned host cache (and torch would raise)
        return False
    fn()
    return True


def sequential_times(cfg: RunConfig, against: list[str], steps: int, warmup: int, engine_cls=None,
                     profile_dir: Optional[Path] = None, side_recompute: Optional[str] = None,
                     candidate: Optional[RunConfig] = None) -> dict:
    """Blocks A, B, C, ..., A (A = forged; B the ``candidate`` when given, :func:`candidate_config`), one engine
    in memory at a time, for models too big to hold every side at once. The forged engine is timed before and after
    the others; its two blocks' medians bracket any drift of the machine, and the reported spread includes both blocks. With ``profile_dir`` each side's first
    block ends with one profiled, untimed step (:func:`time_sides`)."""
    import gc

    from forgetrain import registry
    from forgetrain.errors import CannotRunHere

    device = _device(cfg)
    batches = _batches(cfg, warmup + steps)
    times: dict = {"_mem_gib": {}}
    init = None
    where = {"stage": ""}  # what the side in hand is doing, for the out-of-memory reason (oom_reason)

    from forgetrain.metrics import mfu_pct, peak_flops

    peak, _ = peak_flops(cfg.hardware)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length

    def block(name, make):
        nonlocal init
        t0 = time.perf_counter()
        torch.manual_seed(cfg.train.seed)
        where["stage"] = "building the engine"
        eng = make()
        t_build = time.perf_counter() - t0
        if init is None:
            init = eng.export_hf_weights()
        else:
            eng.load_hf_weights(init)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times.setdefault("_info", {})[name] = _engine_info(eng)
        out, t_first = _run_steps(eng, batches, warmup, steps, device, where,
                                  f"micro-batch {cfg.train.micro_batch_size} x grad-accum {grad_accum_steps(cfg)}")
        if device.type == "cuda":
            times["_mem_gib"][name] = max(times["_mem_gib"].get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        if name not in times.get("_profile", {}):
            _profile_side(times, name, eng, batches[-1], device, profile_dir)
        med = statistics.median(out)  # this rank's (rank 0 prints; the table reduces over ranks)
        _say(f"[block] {name}: build {t_build:.1f}s, first step {t_first:.1f}s, median step {med:.4f}s, "
             f"{tokens / med:,.0f} tokens/s, MFU (PaLM) {mfu_pct(cfg.model, tokens / med, peak, _world()[1]):.1f}%, "
             f"peak mem {times['_mem_gib'].get(name, 0.0):.1f} GiB", flush=True)
        del eng
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            release_host_cache()
        return out

    forged_cls = engine_cls or registry.resolve_engine(cfg.scenario.engine)
    first = block("forged", lambda: forged_cls(cfg, device))
    if candidate is not None:
        times["candidate"] = block("candidate",
                                   lambda: registry.resolve_engine(candidate.scenario.engine)(candidate, device))
    for name in against:
        try:
            times[name] = block(name, lambda: make_side(name, side_config(cfg, side_recompute), device))
        except torch.cuda.OutOfMemoryError as e:
            times["_oom"] = times.get("_oom", []) + [name]
            times.setdefault("_oom_reason", {})[name] = oom_reason(e, where["stage"])
            del e  # its traceback holds the side's tensors
            gc.collect()
            torch.cuda.empty_cache()
            release_host_cache()
        except (ImportError, CannotRunHere) as e:  # the side cannot run here: one line, the others still run
            times.setdefault("_unavailable", {})[name] = unavailable_reason(name, e)
    last = block("forged", lambda: forged_cls(cfg, device))
    times["forged"] = first + last
    times["_forged_blocks"] = [statistics.median(first), statistics.median(last)]
    return times


ONCE_MODE = "sequential, one block per side (bench.interleave=once)"  # the "mode" of once_times' rows


def _run_steps(eng, batches: list, warmup: int, steps: int, device: torch.device, state: dict,
               what: str) -> tuple[list[float], float]:
    """``warmup`` untimed, then ``steps`` timed ``eng.train_step`` calls on ``batches`` (``[warmup + steps]`` steps
    of ``[grad_accum]`` micro-batches ``[mb, seq + 1]`` int64): (the timed steps' seconds, the first step's seconds).
    ``state["stage"]`` names the step in hand for :func:`oom_reason`; ``what`` is its batch, in words."""
    out, first = [], 0.0
    for i in range(warmup + steps):
        state["stage"] = f"{'warm-up' if i < warmup else 'timed'} step {i + 1} of {warmup + steps} ({what})"
        with _Timer(device) as tm:
            eng.train_step(batches[i])
        if i >= warmup:
            out.append(tm.s)
        if i == 0:
            first = tm.s
    return out, first


def free_device(device: torch.device) -> Optional[float]:
    """After the last reference to an engine is dropped: drop torch.compile's caches (``torch._dynamo.reset``: a
    compiled side's graphs and guards go with it, and the next side compiles with a fresh recompile budget), collect
    the engine, and give the CUDA caching allocator's free blocks and the pinned host cache back
    (:func:`release_host_cache`). Returns the GiB still allocated on the device (what the freed side left
    behind; None on CPU)."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    release_host_cache()
    return torch.cuda.memory_allocated(device) / 2**30


def _build_side(make, cfg: RunConfig, state: dict):
    """``make(cfg)`` from ``train.seed``, then loaded with the first side's exported init (``state["init"]``; the
    first side's own export becomes it)."""
    torch.manual_seed(cfg.train.seed)
    state["stage"] = "building the engine"
    eng = make(cfg)
    if state["init"] is None:
        state["init"] = eng.export_hf_weights()
    else:
        eng.load_hf_weights(state["init"])
    return eng


def _once_block(name: str, make, parts: list, warmup: int, steps: int, device: torch.device, state: dict,
                profile_dir: Optional[Path]) -> None:
    """One side's block of :func:`once_times`: build it once (:func:`_build_side`), then for each ``(times, cfg,
    batches)`` of ``parts`` (the headline, then the single micro-batch) reset the device's peak memory, run the
    steps into ``times[name]`` and record ``times["_mem_gib"][name]`` (GiB, GPU only) and ``times["_info"][name]``;
    a side with ``fixed_grad_accum`` (DeepSpeed) is freed and built again for the second batch. The headline's last
    batch is profiled with ``profile_dir``. Frees the side at the end (:func:`free_device`) and prints its block
    line (rank 0)."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    eng = _build_side(make, parts[0][1], state)
    t_build, notes = time.perf_counter() - t0, []
    for k, (times, cfg, batches) in enumerate(parts):
        state["part"] = k
        if k and getattr(eng, "fixed_grad_accum", False):
            del eng
            free_device(device)
            eng = _build_side(make, cfg, state)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        what = f"micro-batch {cfg.train.micro_batch_size} x grad-accum {grad_accum_steps(cfg)}"
        times[name], first = _run_steps(eng, batches, warmup, steps, device, state, what)
        if cuda:
            times["_mem_gib"][name] = torch.cuda.max_memory_allocated(device) / 2**30
        times["_info"][name] = _engine_info(eng)
        if k == 0:
            _profile_side(times, name, eng, batches[-1], device, profile_dir)
        mem = f", peak mem {times['_mem_gib'][name]:.1f} GiB" if cuda else ""
        notes.append(f"{what}: first step {first:.1f}s, median step {statistics.median(times[name]):.4f}s{mem}")
    del eng
    left = free_device(device)
    if left is not None:
        parts[0][0]["_mem_left_gib"][name] = left
    _say(f"[block] {name} ({side_label(name, parts[0][1])}): build {t_build:.1f}s; " + "; ".join(notes)
         + (f"; {left:.2f} GiB left allocated after freeing it" if left is not None else ""), flush=True)


def once_times(cfg: RunConfig, against: list[str], steps: int, warmup: int, single_cfg: Optional[RunConfig] = None,
               engine_cls=None, profile_dir: Optional[Path] = None, side_recompute: Optional[str] = None,
               candidate: Optional[RunConfig] = None, on_block=None) -> tuple[dict, Optional[dict]]:
    """``bench.interleave=once``: one block per side, in the order forged, candidate, ``against``; each side is built
    once (from the first side's exported init, as in every mode), timed for ``warmup`` + ``steps`` steps at
    ``cfg``'s batch and then, with ``single_cfg`` (:func:`single_micro_batch_config`), at one micro-batch per step
    from the same build, and freed (:func:`free_device`: gc, torch.compile's caches, ``torch.cuda.empty_cache``)
    before the next side is built. The device's peak memory is reset after each build and between the two batches:
    each side's mem_gib is its own peak at that batch. There is no closing forged block (no drift bracket), and only
    one engine is in memory at a time: one call carries many sides at a big shape (five sides of about 40 GiB at
    the 8B proxy on a 139 GiB H200).

    Returns (headline times, single-micro-batch times or None without ``single_cfg``), each like
    :func:`timed_sides`' (side -> step seconds; "_mem_gib", "_info", "_oom", "_oom_reason", "_unavailable"; the
    headline's "_mem_left_gib": GiB still allocated after each side was freed, GPU only; "_profile" with
    ``profile_dir``), not yet reduced over ranks. A side in ``against`` that runs out of memory or cannot run here
    is left out of both with its reason. ``on_block(head, single)`` is called after every side's block."""
    from forgetrain import registry
    from forgetrain.errors import CannotRunHere

    device = _device(cfg)
    head: dict = {"_mem_gib": {}, "_info": {}, "_mem_left_gib": {}}
    one: Optional[dict] = {"_mem_gib": {}, "_info": {}} if single_cfg is not None else None
    feeds = [(head, _batches(cfg, warmup + steps))] + ([(one, _batches(single_cfg, warmup + steps))] if one else [])
    state: dict = {"init": None, "stage": "", "part": 0}
    forged_cls = engine_cls or registry.resolve_engine(cfg.scenario.engine)
    sides = [("forged", lambda c: forged_cls(c, device), cfg, single_cfg)]
    if candidate is not None:
        cand_cls = registry.resolve_engine(candidate.scenario.engine)
        sides.append(("candidate", lambda c: cand_cls(c, device), candidate,
                      single_micro_batch_config(candidate) if one else None))
    sides += [(n, lambda c, n=n: make_side(n, side_config(c, side_recompute), device), cfg, single_cfg)
              for n in against]
    for i, (name, make, c_head, c_one) in enumerate(sides):
        parts = [(t, c, b) for (t, b), c in zip(feeds, (c_head, c_one))]
        state["part"], oom = 0, False
        try:
            _once_block(name, make, parts, warmup, steps, device, state, profile_dir)
        except torch.cuda.OutOfMemoryError as e:
            if i < 1 + (candidate is not None):  # the forged engine or the candidate: no row set without them
                raise
            why = oom_reason(e, state["stage"])
            del e  # its traceback holds the side's tensors
            for times, _ in feeds[state["part"]:]:
                times.pop(name, None)
                times["_oom"] = times.get("_oom", []) + [name]
                times.setdefault("_oom_reason", {})[name] = why
            oom = True
        except (ImportError, CannotRunHere) as e:  # the side cannot run here: one line, the others still run
            if i < 1 + (candidate is not None):
                raise
            for times, _ in feeds:
                times.setdefault("_unavailable", {})[name] = unavailable_reason(name, e)
        if oom:  # outside the handler: the exception and its frames (the side's tensors) are gone now
            free_device(device)
        if on_block is not None:
            on_block(head, one)
    return head, one


def timed_sides(cfg: RunConfig, against: list[str], steps: int, warmup: int, interleave: str = "auto",
                engine_cls=None, profile_dir: Optional[Path] = None,
                side_recompute: Optional[str] = None, candidate: Optional[RunConfig] = None) -> tuple[str, dict]:
    """(mode, side -> step seconds) for the forged engine and ``against``: interleaved A/B when every side fits
    in device memory at once (``interleave=auto``: their estimated footprint under 40% of it) or when asked
    (``always``), one block per side with ``once`` (:func:`once_times`, headline batch only here), else sequential
    A-B-A blocks. Reduced over ranks (a collective under torchrun). With
    ``profile_dir``, ``"_profile"`` holds each side's breakdown of one extra untimed step (:func:`profile_step`).
    A side that cannot be built here (ImportError, or CannotRunHere: e.g. ZeRO-Offload's host memory) is not timed;
    ``"_unavailable"`` maps it to its one-line reason (:func:`unavailable_reason`). ``side_recompute``: the sides'
    activation recompute (:func:`side_config`). ``candidate``: a second forged engine's config
    (:func:`candidate_config`), timed as side "candidate" right after the forged one."""
    from forgetrain.memory import host_memory_bytes

    if interleave == "once":
        head, _ = once_times(cfg, against, steps, warmup, None, engine_cls, profile_dir, side_recompute, candidate)
        return ONCE_MODE, reduce_over_ranks(head)
    # the device's memory, or on CPU the host's (a tiny model's sides always fit there: each estimate carries a
    # fixed 1 GiB workspace, which a fixed 8 GB limit counted as "too big" for three sides)
    capacity = (torch.cuda.get_device_properties(0).total_memory if cfg.hardware.device == "cuda"
                else host_memory_bytes() or 8e9)
    fits = _bytes_per_engine(cfg) * (1 + len(against)) + (_bytes_per_engine(candidate) if candidate else 0) \
        < 0.4 * capacity
    if interleave == "always" or (interleave == "auto" and fits):
        unavailable: dict = {}
        sides = build_sides(cfg, against, engine_cls, unavailable, side_recompute, candidate)
        mode, times = "interleaved", time_sides(cfg, sides, steps, warmup, profile_dir)
        if unavailable:
            times["_unavailable"] = unavailable  # type: ignore[assignment]
    else:
        mode, times = "sequential A-B-A", sequential_times(cfg, against, steps, warmup, engine_cls, profile_dir,
                                                            side_recompute, candidate)
    return mode, reduce_over_ranks(times)


def time_engine(cfg: RunConfig, engine_cls, steps: int, warmup: int = 2) -> list[float]:
    """Step seconds of one engine alone: ``steps`` timed steps after ``warmup`` untimed ones, from the engine's own
    init at ``train.seed`` on the same micro-batches every side gets. One block of the A-B-A timing that the
    forge's surpass gate runs with each engine in a process of its own (``forgetrain.forge._ladder``)."""
    device = _device(cfg)
    batches = _batches(cfg, warmup + steps)
    torch.manual_seed(cfg.train.seed)
    eng = engine_cls(cfg, device)
    out = []
    for i in range(warmup + steps):
        with _Timer(device) as tm:
            eng.train_step(batches[i])
        if i >= warmup:
            out.append(tm.s)
    return out


def side_by_side_step_times(cfg: RunConfig, reference: str, steps: int, engine_cls=None, warmup: int = 2):
    """(reference step seconds, forged step seconds) for the surpass tier, timed in this process: interleaved
    when both engines fit in memory, else in A-B-A blocks (the forged engine's two blocks both count)."""
    _, t = timed_sides(cfg, [reference], steps, warmup, engine_cls=engine_cls)
    if reference not in t:
        from forgetrain.errors import ConfigError

        why = t.get("_unavailable", {}).get(reference)
        raise ConfigError(f"{why}: no speed comparison possible" if why else
                          f"references/{reference} ran out of memory at this shape: no speed comparison possible")
    return t[reference], t["forged"]


# A side whose step times have an interquartile range above this percentage of their median is reported as noisy
# (a ``warning:`` line, ``noisy`` in its row). Rationale: the median's relative standard error is about
# 1.2533 (IQR / 1.349) / (median sqrt(n)) (the surpass tier's large-sample estimate, forgetrain/equivalence/tiers/
# surpass.py); at 10% and the default bench.steps=10 that is 2.9% per side, so the ratio of two such sides is only
# known to about +-8% (95%) -- already more than the 1-6% differences this bench is used to call. Beyond it, the
# table's ratios say little; the cure is an idle machine, more bench.steps, or fewer threads (train.threads=1).
NOISY_IQR_PCT = 10.0


def summarize(cfg: RunConfig, times: dict) -> list[dict]:
    """One row per timed side of ``times`` (side -> step seconds, as from :func:`timed_sides`): median step_s and
    its IQR (s), the IQR and the fastest and slowest step as percentages of the median (``step_s_iqr_pct``,
    ``step_s_min_pct``, ``step_s_max_pct``), ``noisy`` (IQR above :data:`NOISY_IQR_PCT`), tokens_per_s, mfu_pct and mfu_causal_pct (%), mem_gib (GiB; None on CPU), forged_speedup (this
    side's step time / the forged one's), labelled with the config's ``global_batch_size`` (samples) and
    ``grad_accum`` (micro-batches per step per DP rank) and the side's ``label`` (:func:`side_label`). Raises
    KeyError when ``times`` has no "forged" side."""
    from forgetrain.metrics import mfu_metrics, peak_flops

    peak, label = peak_flops(cfg.hardware)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    mem = times.get("_mem_gib", {})
    rows = []
    base = statistics.median(times["forged"])
    for name, ts in times.items():
        if name.startswith("_"):
            continue
        if not ts:
            continue
        q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0], ts[0], ts[0]]
        med = statistics.median(ts)
        iqr_pct = 100 * (q[2] - q[0]) / med
        rows.append({"side": name, "step_s": med, "step_s_iqr": q[2] - q[0], "step_s_iqr_pct": iqr_pct,
                     "step_s_min_pct": 100 * min(ts) / med, "step_s_max_pct": 100 * max(ts) / med,
                     "noisy": iqr_pct > NOISY_IQR_PCT, "tokens_per_s": tokens / med,
                     **mfu_metrics(cfg.model, tokens / med, peak, _world()[1]), "mem_gib": mem.get(name),
                     "forged_speedup": med / base, "n": len(ts), "peak": label, "devices": _world()[1],
                     "label": side_label(name, cfg),
                     "global_batch_size": cfg.train.global_batch_size, "grad_accum": grad_accum_steps(cfg)})
    return rows


def noise_warnings(rows: Optional[list[dict]], title: str) -> list[str]:
    """One ``warning:`` line per row of ``rows`` (from :func:`summarize`; None: no rows) whose step times are noisy
    (``noisy``: IQR above :data:`NOISY_IQR_PCT` percent of the median), naming the row set ``title``, the spread
    and what to do."""
    return [f"warning: noisy timings ({title}, side {r['side']}): step_s IQR {r['step_s_iqr_pct']:.1f}% of the "
            f"median, steps from {r['step_s_min_pct']:.0f}% to {r['step_s_max_pct']:.0f}% of it (above "
            f"{NOISY_IQR_PCT:g}%, forgetrain.bench.NOISY_IQR_PCT: differences of a few % between sides are not "
            f"resolved); rerun on an idle machine, with more bench.steps or train.threads=1" for r in rows or [] if r["noisy"]]


def print_table(rows: list[dict]) -> None:
    """Print ``rows`` (from :func:`summarize`, non-empty) as one table, then what each side is (its ``label``);
    raises IndexError when empty."""
    from forgetrain.metrics import mfu_formula_label

    w = max([12] + [len(r["side"]) for r in rows])
    print(f"{'side':<{w}} {'gbs':>5} {'accum':>5} {'step_s':>9} {'±IQR':>8} {'tokens_per_s':>13} {'mfu_pct':>8} "
          f"{'mfu_causal_pct':>15} {'mem_gib':>8} {'forged x':>9}")
    for r in rows:
        mem = f"{r['mem_gib']:.1f}" if r["mem_gib"] is not None else "-"
        print(f"{r['side']:<{w}} {r['global_batch_size']:>5} {r['grad_accum']:>5} {r['step_s']:>9.4f} "
              f"{r['step_s_iqr']:>8.4f} {r['tokens_per_s']:>13,.0f} {r['mfu_pct']:>8.2f} {r['mfu_causal_pct']:>15.2f} "
              f"{mem:>8} {r['forged_speedup']:>9.2f}")
    print(f"MFU = FLOPs/token x tokens/s / (peak x {rows[0]['devices']} devices); "
          f"{mfu_formula_label(rows[0]['peak'])}")
    for r in rows:
        if r.get("label"):
            print(f"  {r['side']}: {r['label']}")


def check_request(obj: dict) -> None:
    """The bench request of a composed config (``obj["bench"]``), checked by ``forgetrain.cli`` before Hydra
    creates anything, the candidate's config included (:func:`candidate_config`). Raises ConfigError."""
    b = BenchConfig(**obj["bench"])
    _check_bench(b)
    candidate_config(obj, obj["bench"].get("candidate"), int(os.environ.get("WORLD_SIZE", "1")))
    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    check_sides(to_run_config({k: v for k, v in obj.items() if k in run_keys}), list(b.against))


INTERLEAVE_MODES = ("auto", "always", "never", "once")  # bench.interleave (BenchConfig)


def check_sides(rc: RunConfig, against: list) -> None:
    """Each side's own refusal of this run before anything is built: a reference's optional ``check_run(cfg)``
    classmethod (e.g. the torchao float8 sides, on a machine without FP8 GEMMs). Raises ConfigError."""
    from forgetrain import registry

    for name in against:
        check = getattr(registry.load_engine_class("references", name), "check_run", None)
        if check is not None:
            check(rc)


def _check_bench(b: BenchConfig) -> None:
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


def recompute_warnings(rc, against: list, side_recompute: Optional[str] = None) -> list[str]:
    """One ``warning:`` line per side in ``against`` whose engine has no activation recompute
    (``supports_recompute``) while its config (:func:`side_config`: ``engine.recompute`` or ``side_recompute``)
    asks for it: that side stores its activations; or that recomputes every layer (no
    ``supports_recompute_num_layers``) while ``engine.recompute_num_layers`` asks for fewer."""
    from forgetrain import registry

    rc = side_config(rc, side_recompute)
    if rc.engine.recompute == "none":
        return []
    out = []
    rnl = rc.engine.recompute_num_layers
    asked = (f"bench.side_recompute={side_recompute} applies to the sides that implement it"
             if side_recompute is not None else
             f"engine.recompute={rc.engine.recompute} applies to the forged engine and the sides that implement it")
    for n in against:
        cls = registry.load_engine_class("references", n)
        if not getattr(cls, "supports_recompute", False):
            out.append(f"warning: bench side '{n}' has no activation recompute; it runs with its activations stored "
                       f"({asked})")
        elif rnl is not None and not getattr(cls, "supports_recompute_num_layers", False):
            out.append(f"warning: bench side '{n}' recomputes every layer; engine.recompute_num_layers={rnl} "
                       f"applies to the forged engine and the sides that implement it")
    return out


def bench_task(cfg) -> None:
    from omegaconf import OmegaConf

    obj = OmegaConf.to_container(cfg, resolve=True)
    b = BenchConfig(**obj.pop("bench"))
    _check_bench(b)
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
        _bench(rc, b, env.rank, record=cfg, candidate=candidate)


def headline_warning(cfg: RunConfig) -> Optional[str]:
    """The one warning line for a headline that is not production-like (gradient accumulation < 8), suggesting
    the global batch (samples) that gives 8; None when accumulation is >= 8."""
    ga, mb_dp = grad_accum_steps(cfg), cfg.train.micro_batch_size * cfg.parallel.data_parallel_size
    if ga >= 8:
        return None
    return (f"warning: the headline is not production-like (grad_accum {ga} < 8); for a production-like headline "
            f"use train.global_batch_size={8 * mb_dp} (8 x micro-batch {cfg.train.micro_batch_size} x DP "
            f"{cfg.parallel.data_parallel_size})")


def warmup_warning(b: BenchConfig) -> Optional[str]:
    """The warning for ``bench.warmup=0``: each side's first timed step carries its one-time costs (compilation,
    the allocator's first requests), so the side that runs first looks slower; None with a warm-up."""
    if b.warmup > 0:
        return None
    return ("warning: bench.warmup=0: each side's first timed step includes its one-time costs (compilation, "
            "first allocations); use bench.warmup>=1 to compare sides")


def single_micro_batch_config(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with one micro-batch per step: train.global_batch_size = micro-batch x DP."""
    t = cfg.train
    return dataclasses.replace(cfg, train=dataclasses.replace(
        t, global_batch_size=t.micro_batch_size * cfg.parallel.data_parallel_size))


def candidate_line(candidate: dict, times: dict) -> str:
    """One line comparing the candidate's median step with the forged one's (``times`` as from
    :func:`timed_sides`): "candidate {overrides}: step_s 0.9870 vs forged 1.0000 (1.3% faster)"."""
    f, c = statistics.median(times["forged"]), statistics.median(times["candidate"])
    what = ", ".join(f"{k}={_value_text(v)}" for k, v in candidate.items())
    pct = 100 * (f - c) / f
    return (f"candidate {{{what}}}: step_s {c:.4f} vs forged {f:.4f} "
            f"({abs(pct):.1f}% {'faster' if pct >= 0 else 'slower'})")


def fp8_notes(info: dict) -> list[str]:
    """One ``note:`` line per side whose engine info (``bench_info``) says it runs FP8 GEMMs (``engine.fp8``):
    its MFU still counts the model's FLOPs against the peak every side is counted against (on a GPU the bf16 dense
    peak: the convention torchtitan reports its float8 runs under; on CPU a measured matmul rate), so it is not a
    utilisation of an FP8 peak. What applies FP8 is the info's ``fp8_by`` (the torchao sides), else engine.fp8."""
    return [f"note: side '{name}' runs its decoder layers' GEMMs in FP8 "
            f"({i.get('fp8_by') or 'engine.fp8=' + i['fp8']}); its MFU is counted against the same peak as every "
            f"side's (a GPU's bf16 dense peak), not an FP8 peak"
            for name, i in info.items() if i and i.get("fp8", "none") != "none"]


def _report(title: str, cfg: RunConfig, b: BenchConfig, mode: str, times: dict) -> list[dict]:
    """Print one row set (its title, timing line, table, OOMs and forged drift) and return its rows."""
    rows = summarize(cfg, times)
    print(f"{title}: global_batch_size {cfg.train.global_batch_size}, grad_accum {grad_accum_steps(cfg)}; timing: "
          f"{mode}; warm-up {b.warmup}, median of {b.steps} steps per side; tokens/step "
          f"{cfg.train.global_batch_size * cfg.model.seq_length}")
    print_table(rows)
    for name in times.get("_oom", []):
        why = times.get("_oom_reason", {}).get(name)
        print(f"{name}: out of memory at this shape (not timed)" + (f": {why}" if why else ""))
    for line in times.get("_unavailable", {}).values():
        print(f"{line} (not timed)")
    if "_forged_blocks" in times:
        a, c = times["_forged_blocks"]
        print(f"forged drift between its two blocks: {100 * (c - a) / a:+.1f}%")
    if times.get("candidate"):
        print(candidate_line(b.candidate or {}, times))
    for line in fp8_notes(times.get("_info", {})):
        print(line)
    from forgetrain.metrics import implausible_mfu

    if rows and (warn := implausible_mfu(cfg.hardware, max(r["mfu_pct"] for r in rows))):
        print(warn)
    for line in noise_warnings(rows, title):
        print(line)
    return rows


def _bench(rc: RunConfig, b: BenchConfig, rank: int, record=None, candidate: Optional[RunConfig] = None) -> None:
    """Time every side and report (rank 0): the tables, bench.json and, from ``record`` (the composed Hydra config),
    .hydra/config.yaml beside it. ``candidate``: the config of ``b.candidate`` (:func:`candidate_config`).
    bench.json is written once the headline is timed (``"complete": false`` while the one-micro-batch rows are still
    to come; under ``bench.interleave=once`` after every side's block), then again whole: a run killed in between
    keeps what was timed."""
    from forgetrain.train import _out_dir

    out = Path(b.out_dir) if b.out_dir else _out_dir(rc)
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
        rows = _report("headline", rc, b, mode, times)
        for name, info in times.get("_info", {}).items():
            if info:
                print(f"engine info {name}: {info}")
        if wants_single and once is None:
            _write_report(out, rc, b, mode, times, rows, warning, complete=False)
    single = None  # (mode, times) at one micro-batch per step; not timed twice when the headline is that already
    if once is not None and once[1] is not None:
        single = (mode, once[1])
    elif wants_single:
        runnable = [s for s in b.against if s not in times.get("_unavailable", {})]  # not built twice to fail
        single = timed_sides(single_cfg, runnable, b.steps, b.warmup, b.interleave, side_recompute=b.side_recompute,
                             candidate=single_micro_batch_config(candidate) if candidate else None)
    if rank != 0:
        return
    rows_single = _report("single micro-batch", single_cfg, b, *single) if single else None
    if b.single_micro_batch and not single:
        print("single micro-batch: the headline is one micro-batch per step already (not timed twice)")
    for name, prof in times.get("_profile", {}).items():
        print_profile(name, prof)
        print(f"wrote {out / f'profile_{name}.json'}", file=sys.stderr)
    _write_report(out, rc, b, mode, times, rows, warning, complete=True,
                  single_times=single[1] if single else None, rows_single=rows_single)
    if record is not None:
        from forgetrain.train import _record_config

        _record_config(out, record, resume=False)
    print(f"wrote {out / 'bench.json'}", file=sys.stderr)


def _once_pass(rc: RunConfig, b: BenchConfig, out: Path, candidate: Optional[RunConfig],
               single_cfg: Optional[RunConfig]) -> tuple[dict, Optional[dict]]:
    """:func:`once_times` for ``_bench``, reduced over ranks, writing bench.json (rank 0, ``"complete": false``)
    after every side's block, so that a call killed later keeps the sides timed so far."""

    def on_block(head: dict, one: Optional[dict]) -> None:
        head = reduce_over_ranks(head)
        one = reduce_over_ranks(one) if one is not None else None
        if _world()[0] == 0:
            rows_one = summarize(single_cfg, one) if one is not None and one.get("forged") else None
            _write_report(out, rc, b, ONCE_MODE, head, summarize(rc, head), headline_warning(rc), complete=False,
                          single_times=one, rows_single=rows_one)

    head, one = once_times(rc, list(b.against), b.steps, b.warmup, single_cfg,
                           profile_dir=out if b.profile else None, side_recompute=b.side_recompute,
                           candidate=candidate, on_block=on_block)
    return reduce_over_ranks(head), reduce_over_ranks(one) if one is not None else None


def _write_report(out: Path, rc: RunConfig, b: BenchConfig, mode: str, times: dict, rows: list[dict],
                  warning: Optional[str], complete: bool, single_times: Optional[dict] = None,
                  rows_single: Optional[list[dict]] = None) -> None:
    """``<out>/bench.json`` (atomically): the headline ``rows`` and ``times``, the one-micro-batch ``rows_single``
    and ``single_times`` (None: not timed, or not yet when ``complete`` is false), what ran out of memory and why,
    the sides that could not run, profiles, engine info, warnings (noisy sides' included, with the threshold
    ``noisy_iqr_pct``: :data:`NOISY_IQR_PCT`), versions and the command line."""
    from forgetrain.trace import atomic_write_json
    from forgetrain.train import versions

    st = single_times or {}
    atomic_write_json(out / "bench.json", {"rows": rows, "rows_single_micro_batch": rows_single, "mode": mode,
                                           "complete": complete,
                                           "oom": times.get("_oom", []),
                                           "oom_single_micro_batch": st.get("_oom", []),
                                           "oom_reason": times.get("_oom_reason", {}),
                                           "oom_reason_single_micro_batch": st.get("_oom_reason", {}),
                                           "unavailable": times.get("_unavailable", {}),
                                           "profile": times.get("_profile"),
                                           "engine_info": times.get("_info"),
                                           "forged_blocks_s": times.get("_forged_blocks"),
                                           "mem_left_after_free_gib": times.get("_mem_left_gib"),
                                           "side_recompute": b.side_recompute,
                                           "candidate": b.candidate,
                                           "warnings": recompute_warnings(rc, b.against, b.side_recompute)
                                                       + [w for w in (warning, warmup_warning(b)) if w]
                                                       + fp8_notes(times.get("_info") or {})
                                                       + noise_warnings(rows, "headline")
                                                       + noise_warnings(rows_single, "single micro-batch"),
                                           "noisy_iqr_pct": NOISY_IQR_PCT,
                                           "versions": versions(), "scenario": rc.scenario.name,
                                           "date": time.strftime("%Y-%m-%d"), "argv": sys.argv})


def main() -> None:
    from forgetrain.cli import run_hydra

    register()
    run_hydra("bench", bench_task)


if __name__ == "__main__":
    main()
