"""The seal registry: which kernel source passed validation, where, with which stats and timings.

``registry.json`` (next to this file, written atomically with :func:`forgetrain.trace.atomic_write_json`)::

    {"format": 1,
     "kernels": {"<name>": {"<device type: cpu|cuda>": {
         "source_sha256": sha256 of the kernel module's file,  "source_file": path relative to the repo,
         "sealed_at": UTC ISO time, "device": ..., "device_name": ..., "versions": {python, torch, triton, ...},
         "tolerances_version": int, "contract": KernelSpec.describe(),
         "validation": {"shapes", "seed", "cases": [{"shape", "dtype", "ok"}], "worst": {tensor: stats}},
         "timings": bench summary or null (CPU seals have none)}}}}

A seal is STALE when the kernel module's current sha256 differs from the sealed one: the code that passed is no
longer the code that runs. ``seal`` refuses a failing validation report.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from forgetrain.kernels.spec import KernelSpec
from forgetrain.kernels.validate import KernelValidationError, ValidationReport
from forgetrain.trace import atomic_write_json

REGISTRY_PATH = Path(__file__).resolve().with_name("registry.json")
FORMAT = 1
_REPO = Path(__file__).resolve().parents[2]


def source_sha256(spec: KernelSpec) -> str:
    """sha256 (hex) of the bytes of the module file that holds the kernel."""
    return hashlib.sha256(spec.source_path().read_bytes()).hexdigest()


def load_registry(path: str | Path | None = None) -> dict:
    """The registry dict; an empty one when the file does not exist. Raises ValueError on a corrupt file."""
    path = Path(path) if path else REGISTRY_PATH
    if not path.exists():
        return {"format": FORMAT, "kernels": {}}
    try:
        reg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt kernel registry {path}: {e}") from e
    if reg.get("format") != FORMAT:
        raise ValueError(f"kernel registry {path} has format {reg.get('format')}, expected {FORMAT}")
    reg.setdefault("kernels", {})
    return reg


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    try:
        import numpy
        v["numpy"] = numpy.__version__
    except ImportError:
        pass
    import forgetrain
    v["forgetrain"] = forgetrain.__version__
    return v


def _device_type(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def device_name_of(device: str) -> str:
    if _device_type(device) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    from forgetrain.kernels._triton import interpreting
    from forgetrain.metrics import cpu_model

    return f"cpu ({cpu_model()}; " + \
        ("Triton interpreter)" if interpreting() else "no interpreter)")


def _timings_summary(bench_result: dict | None) -> dict | None:
    if not bench_result:
        return None
    cases = []
    for c in bench_result.get("cases", []):
        keep = {"shape": c.get("shape"), "dtype": c.get("dtype"), "speedup": c.get("speedup"), "error": c.get("error")}
        for phase in ("fwd", "fwd_bwd"):
            if c.get(phase):
                keep[phase] = {v: {k: s[k] for k in ("ms", "GBps", "TFLOPs", "frac_of_ceiling", "error") if k in s}
                               for v, s in c[phase].items()}
        cases.append({k: v for k, v in keep.items() if v is not None})
    return {"device_name": bench_result.get("device_name"), "ceilings": bench_result.get("ceilings"),
            "repeats": bench_result.get("repeats"), "cases": cases}


def seal(spec: KernelSpec, report: ValidationReport, bench_result: dict | None = None,
         path: str | Path | None = None) -> dict:
    """Record a passing validation (and optional bench result) for ``spec`` in the registry; returns the entry.

    Raises KernelValidationError when ``report`` did not pass or belongs to another kernel.
    """
    if report.kernel != spec.name:
        raise KernelValidationError(f"report is for kernel '{report.kernel}', not '{spec.name}'")
    if not report.passed:
        first = report.failures[0] if report.failures else "no cases"
        raise KernelValidationError(f"refusing to seal {spec.name}: validation failed ({first})")
    path = Path(path) if path else REGISTRY_PATH
    src = spec.source_path()
    try:
        rel = str(src.relative_to(_REPO))
    except ValueError:
        rel = str(src)
    entry = {
        "source_sha256": source_sha256(spec),
        "source_file": rel,
        "sealed_at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "device": report.device,
        "device_name": device_name_of(report.device),
        "versions": versions(),
        "tolerances_version": report.tolerances_version,
        "contract": spec.describe(),
        "validation": {"shapes": report.shapes, "seed": report.seed,
                       "cases": [{"shape": c.shape, "dtype": c.dtype, "ok": c.ok} for c in report.cases],
                       "worst": report.worst()},
        "timings": _timings_summary(bench_result),
    }
    reg = load_registry(path)
    reg["kernels"].setdefault(spec.name, {})[_device_type(report.device)] = entry
    atomic_write_json(path, reg)
    return entry


def status(spec: KernelSpec, reg: dict) -> dict:
    """``{device type: "sealed" | "STALE"}`` for each seal of ``spec`` in ``reg`` (empty: never sealed)."""
    cur = source_sha256(spec)
    out = {}
    for dev, e in sorted(reg.get("kernels", {}).get(spec.name, {}).items()):
        out[dev] = "sealed" if e.get("source_sha256") == cur else "STALE"
    return out


def list_lines(specs: list[KernelSpec], path: str | Path | None = None) -> list[str]:
    """One line per kernel: name, seal status per device (STALE when the source changed), the replaced op."""
    reg = load_registry(path)
    lines = []
    for spec in specs:
        st = status(spec, reg)
        seals = ", ".join(
            f"{dev}:{s}" + (f"@{reg['kernels'][spec.name][dev]['sealed_at'][:10]}" if s else "")
            for dev, s in st.items()) or "unsealed"
        lines.append(f"{spec.name:<14} {source_sha256(spec)[:12]}  {seals:<44} replaces: {spec.replaces}")
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m forgetrain.kernels list|validate|bench|seal")
