"""Validation of a candidate kernel against its fp64 oracle, side by side with the op it replaces.

For every grid point (shape x dtype) of a :class:`~forgetrain.kernels.spec.KernelSpec`:

1. fresh random inputs (``seed`` recorded in the report; a fresh one from ``os.urandom`` unless given);
2. the candidate runs forward and backward with every buffer it allocates poisoned (NaN for floats, see
   :func:`forgetrain.kernels._triton.poisoned`), so an element the kernel never writes shows up as NaN;
3. the replaced op runs on identical inputs with identical upstream gradients (drawn in the candidate's output
   dtype so all three sides see the same values), and the fp64 oracle runs on exact float64 copies;
4. for each output and each input gradient, both the candidate and the replaced op are scored against the oracle:
   elementwise relative error ``|c - o| / max(|o|, rel_floor * rms(o))`` summarised as mean, P95, max, and the
   signed mean of ``(c - o) / max(...)`` (a bias detector; its standard error is reported too).

The candidate passes a tensor when it has no NaN/Inf at all, has the replaced op's shape and
dtype, and each of its stats is no worse than the replaced op's (``cand <= slack * ref + floor * u``, ``u`` the
unit roundoff of the tensor's dtype; for the signed mean ``|cand| <= slack * |ref| + k * SE(cand) + floor * u``)
with slack, floors and k read from the versioned ``tolerances.yaml`` (its rationale lives there). Where the spec
asks ``bitwise``, the candidate must instead equal the replaced op exactly. Non-in-place candidates must leave
their inputs untouched. A failure names the kernel, the grid point, the tensor and the stat.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Iterable

import torch

from forgetrain.errors import ForgeTrainError
from forgetrain.kernels.spec import KernelSpec, clone_tree, flat, to_fp64, tree_map

TOLERANCES_PATH = Path(__file__).resolve().with_name("tolerances.yaml")
STATS = ("mean", "p95", "max", "signed_mean")


class KernelValidationError(ForgeTrainError):
    """A kernel failed validation (raised by ``seal``; ``validate`` itself returns a report)."""


# ------------------------------------------------------------------------------------------------ tolerances

@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Pass criteria; see tolerances.yaml for the meaning and the rationale of every number."""

    version: int
    rel_floor: float
    slack: dict
    abs_floor_u: dict
    signed_mean_se: float
    per_kernel: dict
    per_tensor: dict = dataclasses.field(default_factory=dict)  # output name -> overrides (for_kernel sets it)

    def _with(self, o: dict) -> "Tolerances":
        return dataclasses.replace(
            self,
            rel_floor=float(o.get("rel_floor", self.rel_floor)),
            slack={**self.slack, **(o.get("slack") or {})},
            abs_floor_u={**self.abs_floor_u, **(o.get("abs_floor_u") or {})},
            signed_mean_se=float(o.get("signed_mean_se", self.signed_mean_se)),
        )

    def for_kernel(self, name: str) -> "Tolerances":
        """The criteria of kernel ``name``: ``per_kernel.<name>`` over the defaults; its ``tensors`` map (output
        name -> the same keys) is kept for :meth:`for_tensor`."""
        o = self.per_kernel.get(name) or {}
        return dataclasses.replace(self._with(o), per_tensor=o.get("tensors") or {})

    def for_tensor(self, name: str) -> "Tolerances":
        """The criteria of one output ``name`` of the kernel chosen by :meth:`for_kernel`."""
        return self._with(self.per_tensor.get(name) or {})


def load_tolerances(path: str | os.PathLike | None = None) -> Tolerances:
    """Read ``tolerances.yaml``. Raises ForgeTrainError when the file is missing or malformed."""
    path = Path(path) if path else TOLERANCES_PATH
    try:
        import yaml
    except ImportError as e:  # pragma: no cover
        raise ForgeTrainError("pyyaml is needed to read kernel tolerances") from e
    try:
        d = yaml.safe_load(path.read_text())
        tol = Tolerances(
            version=int(d["version"]),
            rel_floor=float(d["rel_floor"]),
            slack={k: float(d["slack"][k]) for k in STATS},
            abs_floor_u={k: float(d["abs_floor_u"][k]) for k in STATS},
            signed_mean_se=float(d["signed_mean_se"]),
            per_kernel=d.get("per_kernel") or {},
        )
    except FileNotFoundError as e:
        raise ForgeTrainError(f"kernel tolerances file not found: {path}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ForgeTrainError(f"malformed kernel tolerances file {path}: {e!r}") from e
    return tol


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p, p the significand precision (bf16 8, fp16 11, fp32 24, fp64 53): half an ulp at 1.0."""
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}.get(dtype)
    if p is None:
        raise ValueError(f"no unit roundoff for {dtype}")
    return 2.0 ** -p


# ------------------------------------------------------------------------------------------------ error stats

def kth_quantile(x: torch.Tensor, q: float, direct_max: int = 1 << 22) -> float:
    """The exact ``ceil(q * n)``-th smallest element of 1-D ``x`` (e.g. q=0.95 -> P95).

    ``torch.kthvalue`` on one huge slice runs in a single CUDA block, so for more than ``direct_max`` elements the
    search first narrows the candidates: bucket the values into 4096 equal-width bins, keep the bin holding the
    k-th value, repeat, then ``kthvalue`` on the survivors. Exact, and a few passes over the data.
    """
    n = x.numel()
    k = min(n, max(1, math.ceil(q * n)))
    while x.numel() > direct_max:
        lo, hi = x.min(), x.max()
        if bool(lo == hi):
            return float(lo)
        bins = 4096
        idx = ((x - lo) / (hi - lo) * bins).long().clamp_(0, bins - 1)
        cum = torch.bincount(idx, minlength=bins).cumsum(0)
        b = int(torch.searchsorted(cum, torch.tensor([k], device=cum.device, dtype=cum.dtype))[0])
        k -= int(cum[b - 1]) if b > 0 else 0
        x = x[idx == b]
    return float(torch.kthvalue(x, k).values)


def error_stats(x: torch.Tensor, oracle: torch.Tensor, rel_floor: float) -> dict:
    """Relative-error summary of ``x`` against ``oracle`` (both flattened, compared in float64).

    Returns ``{"n", "nonfinite", "mean", "p95", "max", "signed_mean", "signed_se"}``; the error stats are over the
    elements where ``x`` is finite; ``nonfinite`` counts elements where ``x`` is NaN/Inf but the oracle is finite.
    """
    c = x.detach().reshape(-1).to(torch.float64)
    o = oracle.detach().reshape(-1).to(torch.float64)
    if c.shape != o.shape:
        raise ValueError(f"shape mismatch {tuple(c.shape)} vs oracle {tuple(o.shape)}")
    ofin = torch.isfinite(o)
    cfin = torch.isfinite(c)
    nonfinite = int((~cfin).sum())
    keep = ofin & cfin
    c, o = c[keep], o[keep]
    n = int(c.numel())
    if n == 0:
        return {"n": 0, "nonfinite": nonfinite, "mean": 0.0, "p95": 0.0, "max": 0.0, "signed_mean": 0.0,
                "signed_se": 0.0}
    rms = float(o.square().mean().sqrt())
    scale = o.abs().clamp_min(max(rel_floor * rms, 1e-300))
    signed = (c - o) / scale
    rel = signed.abs()
    return {
        "n": n,
        "nonfinite": nonfinite,
        "mean": float(rel.mean()),
        "p95": kth_quantile(rel, 0.95),
        "max": float(rel.max()),
        "signed_mean": float(signed.mean()),
        "signed_se": float(signed.std() / math.sqrt(n)) if n > 1 else 0.0,
    }


def judge(cand: dict, ref: dict, u: float, tol: Tolerances) -> tuple[list[str], dict]:
    """Names of the stats where ``cand`` is worse than ``ref`` beyond tolerance, and the allowed values."""
    failed, allowed = [], {}
    if cand["nonfinite"]:
        failed.append("nonfinite")
    for s in ("mean", "p95", "max"):
        allowed[s] = tol.slack[s] * ref[s] + tol.abs_floor_u[s] * u
        if not cand[s] <= allowed[s]:
            failed.append(s)
    s = "signed_mean"
    allowed[s] = tol.slack[s] * abs(ref[s]) + tol.signed_mean_se * cand["signed_se"] + tol.abs_floor_u[s] * u
    if not abs(cand[s]) <= allowed[s]:
        failed.append(s)
    return failed, allowed


# ------------------------------------------------------------------------------------------------ reports

@dataclasses.dataclass
class TensorReport:
    name: str
    dtype: str
    cand: dict
    ref: dict
    allowed: dict
    bitwise_frac: float
    failed: list

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclasses.dataclass
class CaseReport:
    shape: dict
    dtype: str
    tensors: list
    failures: list
    special: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclasses.dataclass
class ValidationReport:
    kernel: str
    device: str
    shapes: str
    seed: int
    tolerances_version: int
    bitwise: bool
    cases: list

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.cases) and bool(self.cases)

    @property
    def failures(self) -> list[str]:
        return [f for c in self.cases for f in c.failures]

    def failed_stats(self) -> set[str]:
        """Every failing stat name (mean, p95, max, signed_mean, nonfinite, bitwise, inputs_modified, shape,
        dtype, missing) over all grid points."""
        return {s for c in self.cases for t in c.tensors for s in t.failed} | {s for c in self.cases for s in c.special}

    def worst(self) -> dict:
        """Per tensor name: the worst candidate and replaced-op stats over all grid points."""
        out: dict = {}
        for c in self.cases:
            for t in c.tensors:
                w = out.setdefault(t.name, {"cand": {s: 0.0 for s in STATS}, "ref": {s: 0.0 for s in STATS},
                                            "nonfinite": 0, "ok": True})
                for side in ("cand", "ref"):
                    for s in STATS:
                        v = abs(getattr(t, side)[s])
                        w[side][s] = max(w[side][s], v)
                w["nonfinite"] += t.cand["nonfinite"]
                w["ok"] = w["ok"] and t.ok
        return out

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel, "device": self.device, "shapes": self.shapes, "seed": self.seed,
            "tolerances_version": self.tolerances_version, "bitwise": self.bitwise, "passed": self.passed,
            "failures": self.failures, "worst": self.worst(),
            "cases": [{"shape": c.shape, "dtype": c.dtype, "ok": c.ok, "failures": c.failures, "special": c.special,
                       "tensors": [dataclasses.asdict(t) for t in c.tensors]} for c in self.cases],
        }


# ------------------------------------------------------------------------------------------------ running

def _run_forward(fn, inputs: dict, diff: Iterable[str]):
    inp = clone_tree(inputs)
    for name in diff:
        inp[name].requires_grad_(True)
    outs = fn(inp)
    return inp, outs


def _run_backward(inp: dict, outs: dict, upstream: dict, diff: Iterable[str]) -> dict:
    diff = list(diff)
    if not diff:
        return {}
    ts, gs = [], []
    for name, g in upstream.items():
        o = outs[name]
        if o.requires_grad:
            ts.append(o)
            gs.append(g.to(o.dtype))
    if ts:
        torch.autograd.backward(ts, gs)
    grads = {}
    for name in diff:
        g = inp[name].grad
        grads["d" + name] = g if g is not None else torch.zeros_like(inp[name])
    return grads


def _detach(outs: dict) -> dict:
    return tree_map(lambda t: t.detach(), outs)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                  and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


_INTERP_CHECKED = False


def _check_interpreter() -> None:
    global _INTERP_CHECKED
    if _INTERP_CHECKED:
        return
    try:
        from forgetrain.kernels import _triton
    except ImportError as e:
        raise ForgeTrainError(str(e)) from e
    if _triton.interpreting():
        from forgetrain.kernels import _interp
        _interp.self_check()
    _INTERP_CHECKED = True


def validate(spec: KernelSpec, device: str | torch.device = "cpu", dtypes: Iterable[torch.dtype] | None = None,
             shapes: str | Iterable[dict] = "small", *, seed: int | None = None,
             tolerances: Tolerances | None = None) -> ValidationReport:
    """Validate ``spec.candidate`` forward and backward over a shape grid; see the module docstring.

    ``shapes`` is a grid name of the spec ("small": CPU interpreter sized, "full": scenario sized) or an explicit
    list of shape dicts. Returns a :class:`ValidationReport` (``.passed``, ``.failures``); raises ForgeTrainError
    when the device is unavailable or Triton is missing, KeyError for an unknown grid name.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ForgeTrainError("validate --device cuda: no CUDA device here")
    _check_interpreter()
    tol = (tolerances or load_tolerances()).for_kernel(spec.name)
    grid_name = shapes if isinstance(shapes, str) else "custom"
    grid = spec.grid(shapes) if isinstance(shapes, str) else [dict(s) for s in shapes]
    dtypes = tuple(dtypes) if dtypes else tuple(spec.dtypes)
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    from forgetrain.kernels._triton import poisoned

    cases = []
    for i, shape in enumerate(grid):
        for j, dtype in enumerate(dtypes):
            case_seed = (seed + 7919 * i + 104729 * j) % (2 ** 63)
            cases.append(_validate_case(spec, device, shape, dtype, case_seed, tol, poisoned))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return ValidationReport(kernel=spec.name, device=str(device), shapes=grid_name, seed=seed,
                            tolerances_version=tol.version, bitwise=spec.bitwise, cases=cases)


def _validate_case(spec, device, shape, dtype, case_seed, tol, poisoned) -> CaseReport:
    gen = torch.Generator(device=device).manual_seed(case_seed)
    inputs = spec.make_inputs(dict(shape), dtype, device, gen)
    diff = spec.differentiable
    failures: list[str] = []
    special: list[str] = []
    tag = f"{spec.name}[{_fmt_shape(shape)}, {str(dtype).replace('torch.', '')}]"

    # candidate, poisoned
    with poisoned():
        c_inp, c_out = _run_forward(spec.candidate, inputs, diff)
        ugen = torch.Generator(device=device).manual_seed(case_seed ^ 0x5DEECE66D)
        upstream = {}
        for name in spec.grad_outputs:
            o = c_out[name]
            upstream[name] = torch.randn(o.shape, generator=ugen, device=device, dtype=torch.float32).to(o.dtype)
        c_grads = _run_backward(c_inp, c_out, upstream, diff)
    c_out = _detach(c_out)
    if not spec.inplace:
        c_inputs_after = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in c_inp.items()}
        if not _same(c_inputs_after, inputs):
            failures.append(f"{tag}: inputs_modified (the candidate wrote into its inputs)")
            special.append("inputs_modified")

    # replaced op
    r_inp, r_out = _run_forward(spec.reference, inputs, diff)
    r_grads = _run_backward(r_inp, r_out, upstream, diff)
    r_out = _detach(r_out)

    # oracle in fp64
    o_inp, o_out = _run_forward(spec.oracle, to_fp64(inputs), diff)
    o_grads = _run_backward(o_inp, o_out, {k: v.to(torch.float64) for k, v in upstream.items()}, diff)
    o_out = _detach(o_out)

    sides = {"cand": {**c_out, **c_grads}, "ref": {**r_out, **r_grads}, "oracle": {**o_out, **o_grads}}
    if spec.derived is not None:
        for side, outs in (("cand", c_out), ("ref", r_out), ("oracle", o_out)):
            sides[side].update(spec.derived(inputs, outs))

    tensors = []
    for name in sides["oracle"]:
        o = sides["oracle"][name]
        c = sides["cand"].get(name)
        r = sides["ref"][name]
        if c is None:
            failures.append(f"{tag} {name}: missing (the candidate returned no such output)")
            special.append("missing")
            continue
        c_list = c if isinstance(c, (list, tuple)) else [c]
        r_list = r if isinstance(r, (list, tuple)) else [r]
        if [tuple(t.shape) for t in c_list] != [tuple(t.shape) for t in r_list]:
            failures.append(f"{tag} {name}: shape {[tuple(t.shape) for t in c_list]} != replaced op's "
                            f"{[tuple(t.shape) for t in r_list]}")
            special.append("shape")
            continue
        if [t.dtype for t in c_list] != [t.dtype for t in r_list]:
            failures.append(f"{tag} {name}: dtype {c_list[0].dtype} != replaced op's {r_list[0].dtype}")
            special.append("dtype")
            continue
        cf, rf, of = flat(c), flat(r), flat(o)
        out_dtype = c_list[0].dtype if c_list[0].dtype != torch.float64 else torch.float32
        tt = tol.for_tensor(name)
        cs = error_stats(cf, of, tt.rel_floor)
        rs = error_stats(rf, of, tt.rel_floor)
        u = unit_roundoff(out_dtype)
        failed, allowed = judge(cs, rs, u, tt)
        same = (cf == rf) | (cf.isnan() & rf.isnan())
        bitwise_frac = float(same.double().mean()) if cf.numel() else 1.0
        if spec.bitwise:
            failed = ["nonfinite"] if cs["nonfinite"] else []
            if bitwise_frac != 1.0:
                failed.append("bitwise")
        tr = TensorReport(name=name, dtype=str(out_dtype).replace("torch.", ""), cand=cs, ref=rs,
                          allowed=allowed, bitwise_frac=bitwise_frac, failed=failed)
        tensors.append(tr)
        for s in failed:
            if s == "nonfinite":
                failures.append(f"{tag} {name}: nonfinite ({cs['nonfinite']} NaN/Inf elements; poisoned buffers "
                                f"start as NaN, so these are unwritten or overflowed)")
            elif s == "bitwise":
                failures.append(f"{tag} {name}: bitwise (only {bitwise_frac:.6f} of elements equal the replaced "
                                f"op)")
            else:
                failures.append(f"{tag} {name}: {s} {cs[s]:.3e} > allowed {allowed[s]:.3e} "
                                f"(replaced op {rs[s]:.3e})")
    return CaseReport(shape=dict(shape), dtype=str(dtype).replace("torch.", ""), tensors=tensors,
                      failures=failures, special=special)


def _fmt_shape(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def format_report(rep: ValidationReport) -> str:
    """A short human table: worst stats per tensor over the grid, candidate vs replaced op."""
    lines = [f"{rep.kernel}: {'PASS' if rep.passed else 'FAIL'}  device={rep.device} shapes={rep.shapes} "
             f"cases={len(rep.cases)} seed={rep.seed} tolerances=v{rep.tolerances_version}"]
    lines.append(f"  {'tensor':<14}{'side':<6}{'mean':>11}{'p95':>11}{'max':>11}{'|signed|':>11}")
    for name, w in rep.worst().items():
        for side in ("cand", "ref"):
            s = w[side]
            lines.append(f"  {name if side == 'cand' else '':<14}{side:<6}{s['mean']:>11.3e}{s['p95']:>11.3e}"
                         f"{s['max']:>11.3e}{s['signed_mean']:>11.3e}")
    for f in rep.failures[:20]:
        lines.append(f"  FAIL {f}")
    if len(rep.failures) > 20:
        lines.append(f"  ... {len(rep.failures) - 20} more failures")
    return "\n".join(lines)
