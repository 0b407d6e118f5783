"""Benchmark a candidate kernel against the op it replaces and against ``torch.compile`` of that op.

Method (the GPU timing rules of docs/device.md):

* CUDA events around every iteration, after ``warmup`` untimed iterations; the reported time is the median of
  ``repeats`` iterations. Before the timed loop a ``torch.cuda._sleep`` keeps the GPU busy while the host
  enqueues, so host launch overhead does not leak into the GPU timings.
* Input sets rotate: enough independent random sets that together they exceed ``rotate_bytes`` (default 128 MB,
  > 2x the H200's ~50 MB L2), so no iteration finds its inputs in L2 left by the previous one.
* ``fwd`` times a training-mode forward (differentiable inputs require grad, so saved tensors are kept as in
  training; one compiled graph serves both timings); ``fwd_bwd`` times forward plus ``torch.autograd.grad`` of
  every differentiable input with random upstream gradients. Kernels without backward (AdamW) get ``fwd`` only,
  under ``no_grad``.
* Throughput: bytes / time for memory-bound kernels against the measured ~4.3 TB/s device-to-device copy
  ceiling, FLOPs / time for compute-bound ones against ~790 TFLOP/s (bf16 8192^3 matmul on the H200, measured
  at 760-794; docs/device.md, "Ceilings measured on the H200"). ``spec.cost`` gives bytes and FLOPs (the replaced op's useful work).
* ``torch.compile(spec.reference)`` failures are caught and reported as ``{"error": ...}``.

On a machine without CUDA, :func:`bench` raises :class:`BenchSkipped` unless ``allow_cpu=True`` (a slow dry run
with wall-clock timers used by the tests to exercise this code path; its numbers mean nothing).
"""

from __future__ import annotations

import math
import statistics
import time
import traceback

import torch

from forgetrain.errors import ForgeTrainError
from forgetrain.kernels.spec import KernelSpec, nbytes, tree_map

CEILINGS = {
    "memory_GBps": 4300.0,   # H200 device-to-device copy (docs/device.md, "Ceilings measured on the H200")
    "compute_TFLOPs": 790.0,  # H200 bf16 8192^3 matmul, same source (760 median of 30, ~794 first products)
    "source": "docs/device.md (Ceilings measured on the H200)",
}


class BenchSkipped(ForgeTrainError):
    """Benchmarks need a CUDA device; raised with a one-line reason."""

    exit_code = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_kernel(step, n_sets: int, warmup: int, repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``repeats`` calls ``step(k)`` (k rotating over the input sets)."""
    for i in range(warmup):
        step(i % n_sets)
    _sync(device)
    if device.type != "cuda":
        out = []
        for i in range(repeats):
            t0 = time.perf_counter()
            step((warmup + i) % n_sets)
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spin so the host runs ahead of the timed launches
    pairs = []
    for i in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step((warmup + i) % n_sets)
        e.record()
        pairs.append((s, e))
    _sync(device)
    return [s.elapsed_time(e) for s, e in pairs]


def _summ(ms: list[float], work: dict, bound: str) -> dict:
    med = statistics.median(ms)
    d = {"ms": med, "ms_min": min(ms), "ms_max": max(ms), "n": len(ms)}
    if bound == "compute" and work.get("flops"):
        tf = work["flops"] / (med * 1e-3) / 1e12
        d.update({"TFLOPs": tf, "frac_of_ceiling": tf / CEILINGS["compute_TFLOPs"]})
    elif work.get("bytes"):
        gb = work["bytes"] / (med * 1e-3) / 1e9
        d.update({"GBps": gb, "frac_of_ceiling": gb / CEILINGS["memory_GBps"]})
    return d


def _variants(spec: KernelSpec, compile_ref: bool) -> dict:
    out = {"candidate": spec.candidate, "reference": spec.reference}
    if compile_ref:
        try:
            out["compiled"] = torch.compile(spec.reference, dynamic=False)
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            out["compiled"] = e
    return out


def bench(spec: KernelSpec, device: str | torch.device = "cuda", shapes: str | list = "bench", dtypes=None, *,
          repeats: int = 20, warmup: int = 5, rotate_bytes: float = 128e6, max_sets: int = 32,
          compile_ref: bool = True, allow_cpu: bool = False, seed: int = 0, log=print, on_case=None) -> dict:
    """Time ``spec``'s candidate, the replaced op and its compiled form over a shape grid.

    Returns ``{"kernel", "device", "device_name", "ceilings", "cases": [{"shape", "dtype", "n_sets",
    "set_bytes", "fwd": {variant: stats | {"error"}}, "fwd_bwd": {...}, "speedup": {...}}]}``.
    ``on_case(result)`` is called after every case (e.g. to save partial results). Raises BenchSkipped when no
    CUDA device is usable (unless ``allow_cpu``).
    """
    device = torch.device(device)
    if device.type != "cuda" and not allow_cpu:
        raise BenchSkipped("bench: skipped: benchmarks need a CUDA device (on the GPU machine: "
                           "docs/kernels.md, 'Seals')")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchSkipped("bench: skipped: --device cuda but torch sees no CUDA device")
    grid = spec.grid(shapes) if isinstance(shapes, str) else list(shapes)
    dtypes = tuple(dtypes) if dtypes else spec.dtypes[:1]
    variants = _variants(spec, compile_ref)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run, timings meaningless)"
    result = {"kernel": spec.name, "device": str(device), "device_name": name, "ceilings": CEILINGS,
              "bound": spec.bound, "repeats": repeats, "warmup": warmup, "rotate_bytes": rotate_bytes,
              "cases": []}
    for shape in grid:
        for dtype in dtypes:
            try:
                case = _bench_case(spec, device, dict(shape), dtype, variants, repeats, warmup, rotate_bytes,
                                   max_sets, seed)
            except torch.OutOfMemoryError as e:
                case = {"shape": dict(shape), "dtype": str(dtype), "error": f"OOM: {e}".splitlines()[0]}
            result["cases"].append(case)
            if log:
                log(format_case(spec.name, case))
            if on_case:
                on_case(result)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return result


def _bench_case(spec, device, shape, dtype, variants, repeats, warmup, rotate_bytes, max_sets, seed) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    first = spec.make_inputs(dict(shape), dtype, device, gen)
    set_bytes = nbytes(first)
    n_sets = int(min(max_sets, max(2, math.ceil(rotate_bytes / max(set_bytes, 1)))))
    sets = [first] + [spec.make_inputs(dict(shape), dtype, device, gen) for _ in range(n_sets - 1)]
    cost = spec.cost(shape, dtype)
    diff = list(spec.differentiable)
    case = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "n_sets": n_sets, "set_bytes": set_bytes,
            "cost": cost, "fwd": {}, "fwd_bwd": {}}

    # upstream gradients, one per set, drawn once from the reference's output shapes / dtypes
    upstream = []
    if diff:
        for s in sets:
            with torch.no_grad():
                outs = spec.reference(s)
            upstream.append({k: torch.randn(outs[k].shape, device=device, generator=gen).to(outs[k].dtype)
                             for k in spec.grad_outputs})
            del outs

    for vname, fn in variants.items():
        if isinstance(fn, Exception):
            err = {"error": f"torch.compile: {type(fn).__name__}: {fn}".splitlines()[0]}
            case["fwd"][vname] = err
            if diff:
                case["fwd_bwd"][vname] = err
            continue
        try:
            if spec.inplace:
                run_sets = [tree_map(lambda t: t.detach().clone(), s) for s in sets]
            else:
                run_sets = []
                for s in sets:
                    ls = dict(s)
                    for k in diff:
                        ls[k] = s[k].detach().requires_grad_(True)
                    run_sets.append(ls)

            def fwd(k, fn=fn, run_sets=run_sets):
                # training-mode forward (graph and saved tensors built, no backward); no_grad for optimizers
                if diff:
                    fn(run_sets[k])
                else:
                    with torch.no_grad():
                        fn(run_sets[k])

            case["fwd"][vname] = _summ(time_kernel(fwd, n_sets, warmup, repeats, device), cost["fwd"], spec.bound)
            if diff:
                def fwd_bwd(k, fn=fn, run_sets=run_sets):
                    outs = fn(run_sets[k])
                    names = list(spec.grad_outputs)
                    torch.autograd.grad([outs[n] for n in names], [run_sets[k][d] for d in diff],
                                        [upstream[k][n] for n in names])

                work = {"bytes": cost["fwd"]["bytes"] + cost["bwd"]["bytes"],
                        "flops": cost["fwd"]["flops"] + cost["bwd"]["flops"]}
                case["fwd_bwd"][vname] = _summ(time_kernel(fwd_bwd, n_sets, warmup, repeats, device), work, spec.bound)
            del run_sets
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' numbers
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            case["fwd"].setdefault(vname, {"error": msg})
            if diff:
                case["fwd_bwd"].setdefault(vname, {"error": msg})
            case.setdefault("tracebacks", {})[vname] = traceback.format_exc()[-2000:]
    case["speedup"] = {}
    for phase in ("fwd", "fwd_bwd"):
        c = case[phase].get("candidate", {}).get("ms")
        if not c:
            continue
        sp = {}
        for other in ("reference", "compiled"):
            o = case[phase].get(other, {}).get("ms")
            if o:
                sp[f"vs_{other}"] = o / c
        case["speedup"][phase] = sp
    return case


def format_case(kernel: str, case: dict) -> str:
    if "error" in case and "fwd" not in case:
        return f"{kernel} {case['shape']}: {case['error']}"
    parts = []
    for phase in ("fwd", "fwd_bwd"):
        if not case.get(phase):
            continue
        cells = []
        for v in ("candidate", "reference", "compiled"):
            st = case[phase].get(v)
            if st is None:
                continue
            if "error" in st:
                cells.append(f"{v}=ERR")
                continue
            thr = f"{st['TFLOPs']:.0f}TF" if "TFLOPs" in st else (f"{st['GBps']:.0f}GB/s" if "GBps" in st else "")
            cells.append(f"{v}={st['ms']:.3f}ms({thr},{100 * st.get('frac_of_ceiling', 0):.0f}%)")
        sp = case.get("speedup", {}).get(phase, {})
        cells.append(" ".join(f"{k}={v:.2f}x" for k, v in sp.items()))
        parts.append(f"{phase}: " + " ".join(cells))
    return f"{kernel} {case['shape']} {case['dtype']} sets={case['n_sets']}: " + " | ".join(parts)
