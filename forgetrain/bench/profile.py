"""``bench.profile=true``: one extra, untimed step of a side under ``torch.profiler``, its time per category
(:data:`PROFILE_RULES`) and its Chrome trace."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch

from forgetrain.bench.steps import StepTimer, rank_world


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
    """``prof.export_chrome_trace`` to ``path`` atomically (:func:`forgetrain.trace.atomic_write_with`)."""
    from forgetrain.trace import atomic_write_with

    atomic_write_with(path, prof.export_chrome_trace)


def profile_step(eng, batch: list[torch.Tensor], device: torch.device, trace_path: Optional[Path] = None) -> dict:
    """Run ``eng.train_step(batch)`` (batch: ``[grad_accum]`` of ``[mb, seq + 1]`` int64) once under
    ``torch.profiler`` (CPU activity, plus CUDA on a GPU) and return its :func:`breakdown`: on a GPU by the CUDA
    kernels' device time (summed over streams, which may overlap), on CPU by the ops' self CPU time. Writes the
    Chrome trace to ``trace_path`` atomically when given. Raises what ``train_step`` or the export raises."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        with StepTimer(device) as tm:  # synchronizes on the GPU, so every kernel lands in the profile
            eng.train_step(batch)
    if trace_path is not None:
        _export_trace(prof, trace_path)
    if cuda:
        pairs = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
        return breakdown(pairs, "CUDA kernel time", tm.s * 1e3)
    pairs = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    return breakdown(pairs, "self CPU time of ops", tm.s * 1e3)


def profile_side(times: dict, name: str, eng, batch, device, profile_dir: Optional[Path]) -> None:
    """Profile one extra step of side ``name`` into ``times["_profile"]`` (every rank runs it: the step has
    collectives); rank 0 writes ``profile_dir/profile_<name>.json``. Nothing when ``profile_dir`` is None."""
    if profile_dir is None:
        return
    trace = profile_dir / f"profile_{name}.json" if rank_world()[0] == 0 else None
    times.setdefault("_profile", {})[name] = profile_step(eng, batch, device, trace)


def print_profile(name: str, b: dict) -> None:
    """Print one side's :func:`breakdown` as a table (ms and % per category)."""
    print(f"profile {name}: {b['basis']} per category (one untimed step, wall {b['step_ms']:.1f} ms under the "
          f"profiler)")
    for cat, v in b["categories"].items():
        print(f"  {cat:<18} {v['ms']:>10.2f} ms {v['pct']:>6.1f}%")
    print(f"  {'total':<18} {b['total_ms']:>10.2f} ms {100.0 if b['total_ms'] else 0.0:>6.1f}%")
