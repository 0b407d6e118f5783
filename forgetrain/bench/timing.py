"""How ``forgetrain.bench`` times its sides: interleaved A/B steps when every side fits in memory at once,
sequential A-B-A blocks when not, or one block per side (``bench.interleave=once``); the step times are reduced over
the ranks under torchrun."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from forgetrain.bench.profile import profile_side
from forgetrain.bench.sides import (bytes_per_engine, engine_info, build_sides, make_side, oom_reason, side_config,
                                    side_label, single_micro_batch_config, unavailable_reason)
from forgetrain.bench.steps import step_batches, bench_device, say, StepTimer, rank_world
from forgetrain.config import RunConfig, grad_accum_steps
from forgetrain.distributed import free_device, release_host_cache  # noqa: F401 - bench's public names
from forgetrain.levers import spec_of


def reduce_over_ranks(times: dict) -> dict:
    """Per-step MAX of every side's step seconds and MAX of peak memory over the ranks (identity for one process).
    Every rank must call it with the same sides and step counts (a collective)."""
    import torch.distributed as dist

    if rank_world()[1] == 1:
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


def time_sides(cfg: RunConfig, sides: dict, steps: int, warmup: int,
               profile_dir: Optional[Path] = None) -> dict[str, list[float]]:
    """Interleaved A/B timing: returns side -> list of step seconds (``steps`` each, after ``warmup``), plus
    ``"_mem_gib"`` (side -> GiB, GPU only) and, with ``profile_dir``, ``"_profile"`` (side -> breakdown of one
    extra untimed step)."""
    device = bench_device(cfg)
    batches = step_batches(cfg, warmup + steps)
    times = {k: [] for k in sides}
    mem = {}
    for i in range(warmup + steps):
        for name, eng in sides.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with StepTimer(device) as tm:
                eng.train_step(batches[i])
            if i >= warmup:
                times[name].append(tm.s)
            if device.type == "cuda":
                mem[name] = max(mem.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    times["_mem_gib"] = mem  # type: ignore[assignment]
    times["_info"] = {name: engine_info(eng) for name, eng in sides.items()}  # type: ignore[assignment]
    for name, eng in sides.items():
        profile_side(times, name, eng, batches[-1], device, profile_dir)
    return times


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

    device = bench_device(cfg)
    batches = step_batches(cfg, warmup + steps)
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
        times.setdefault("_info", {})[name] = engine_info(eng)
        out, t_first = _run_steps(eng, batches, warmup, steps, device, where,
                                  f"micro-batch {cfg.train.micro_batch_size} x grad-accum {grad_accum_steps(cfg)}")
        if device.type == "cuda":
            times["_mem_gib"][name] = max(times["_mem_gib"].get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        if name not in times.get("_profile", {}):
            profile_side(times, name, eng, batches[-1], device, profile_dir)
        med = statistics.median(out)  # this rank's (rank 0 prints; the table reduces over ranks)
        say(f"[block] {name}: build {t_build:.1f}s, first step {t_first:.1f}s, median step {med:.4f}s, "
             f"{tokens / med:,.0f} tokens/s, MFU (PaLM) {mfu_pct(cfg.model, tokens / med, peak, rank_world()[1]):.1f}%, "
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
        with StepTimer(device) as tm:
            eng.train_step(batches[i])
        if i >= warmup:
            out.append(tm.s)
        if i == 0:
            first = tm.s
    return out, first


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
    a side whose spec declares ``fixed_grad_accum`` (DeepSpeed) is freed and built again for the second batch. The
    headline's last batch is profiled with ``profile_dir``. Frees the side at the end (:func:`free_device`) and
    prints its block line (rank 0)."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    eng = _build_side(make, parts[0][1], state)
    t_build, notes = time.perf_counter() - t0, []
    for k, (times, cfg, batches) in enumerate(parts):
        state["part"] = k
        if k and spec_of(type(eng)).fixed_grad_accum:
            del eng
            free_device(device)
            eng = _build_side(make, cfg, state)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        what = f"micro-batch {cfg.train.micro_batch_size} x grad-accum {grad_accum_steps(cfg)}"
        times[name], first = _run_steps(eng, batches, warmup, steps, device, state, what)
        if cuda:
            times["_mem_gib"][name] = torch.cuda.max_memory_allocated(device) / 2**30
        times["_info"][name] = engine_info(eng)
        if k == 0:
            profile_side(times, name, eng, batches[-1], device, profile_dir)
        mem = f", peak mem {times['_mem_gib'][name]:.1f} GiB" if cuda else ""
        notes.append(f"{what}: first step {first:.1f}s, median step {statistics.median(times[name]):.4f}s{mem}")
    del eng
    left = free_device(device)
    if left is not None:
        parts[0][0]["_mem_left_gib"][name] = left
    say(f"[block] {name} ({side_label(name, parts[0][1])}): build {t_build:.1f}s; " + "; ".join(notes)
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

    device = bench_device(cfg)
    head: dict = {"_mem_gib": {}, "_info": {}, "_mem_left_gib": {}}
    one: Optional[dict] = {"_mem_gib": {}, "_info": {}} if single_cfg is not None else None
    feeds = [(head, step_batches(cfg, warmup + steps))] + ([(one, step_batches(single_cfg, warmup + steps))] if one else [])
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
    fits = bytes_per_engine(cfg) * (1 + len(against)) + (bytes_per_engine(candidate) if candidate else 0) \
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
    device = bench_device(cfg)
    batches = step_batches(cfg, warmup + steps)
    torch.manual_seed(cfg.train.seed)
    eng = engine_cls(cfg, device)
    out = []
    for i in range(warmup + steps):
        with StepTimer(device) as tm:
            eng.train_step(batches[i])
        if i >= warmup:
            out.append(tm.s)
    return out


def side_by_side_step_times(cfg: RunConfig, sides: list[str], steps: int, engine_cls=None,
                            warmup: int = 2) -> dict[str, list[float]]:
    """Step seconds of the forged engine ("forged") and of each reference in ``sides`` (the surpass tier's reference
    and peers), timed in this process: interleaved when every engine fits in memory, else in A-B-A blocks (the
    forged engine's two blocks both count). Raises ConfigError naming a side that cannot run here or ran out of
    memory: no speed comparison is possible without it."""
    _, t = timed_sides(cfg, list(sides), steps, warmup, engine_cls=engine_cls)
    for name in sides:
        if name not in t:
            from forgetrain.errors import ConfigError

            why = t.get("_unavailable", {}).get(name)
            raise ConfigError(f"{why}: no speed comparison possible" if why else
                              f"references/{name} ran out of memory at this shape: no speed comparison possible")
    return {name: t[name] for name in ["forged", *sides]}
