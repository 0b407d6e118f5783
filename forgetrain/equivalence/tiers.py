"""The equivalence tiers (docs/design.md, "The tiers"): compare a candidate trace with the reference's.

Every tier reads trace directories (see :mod:`forgetrain.trace`) and returns a :class:`Verdict`. Strictest first:

* :func:`bitwise`    -- every step's loss, grad norm and lr equal (``==``); per-step digests of the per-token
  losses, every gradient and every parameter equal; module and final-parameter tensors equal when present.
* :func:`tolerance`  -- per-step relative error of loss / grad norm / lr and the final parameters' relative L2
  error within per-dtype thresholds (``conf/tier/tolerance.yaml``).
* :func:`loss_curve` -- the candidate's windowed loss stays inside a band calibrated from >= 3 reference seeds,
  with no late drift.
* :func:`surpass`    -- an equivalence verdict passed, and the candidate's throughput beats the reference's by
  more than the measured noise.

:func:`ladder` runs a list of tiers strictest-first and reports the strictest equivalence tier that passed.
Thresholds never live here: each tier's are in ``conf/tier/<name>.yaml`` with their rationale, loaded by
:func:`load_tier`; a caller's ``cfg`` (for instance Hydra's ``cfg.tier``) overrides them key by key.

A verdict's ``first_divergence`` is ``None`` or a dict with at least ``step``, ``kind`` (one of ``loss``,
``grad_norm``, ``lr``, ``tokens``, ``per_token_loss``, ``param``, ``grad``, ``module_fwd``, ``module_grad``),
``ref`` and ``cand``, plus ``tensor`` (parameter name) or ``module`` (neutral module name) where one applies.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from forgetrain.engine import forward_names, hf_param_names
from forgetrain.errors import ConfigError
from forgetrain.trace import read_final_params, read_modules, read_trace

TIER_ORDER = ("bitwise", "tolerance", "loss_curve", "surpass")
"""Every tier, strictest first. ``surpass`` is not an equivalence level: it is ``loss_curve`` plus speed."""

EQUIVALENCE_TIERS = TIER_ORDER[:3]

REPO_ROOT = Path(__file__).resolve().parents[2]
TIER_CONF_DIR = REPO_ROOT / "conf" / "tier"

DIVERGENCE_KINDS = ("tokens", "loss", "grad_norm", "lr", "per_token_loss", "param", "grad", "module_fwd",
                    "module_grad")


# ----------------------------------------------------------------------------------------------------------------
# Verdict and config
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """The outcome of one tier.

    tier: the tier's name (``bitwise`` | ``tolerance`` | ``loss_curve`` | ``surpass``).
    passed: whether the candidate passed.
    summary: one line a person can act on (the reason when failed).
    evidence: JSON-serialisable dict of the numbers behind the verdict (non-finite floats may appear; the report
        writer turns them into strings).
    first_divergence: ``None`` or the first point where the candidate left the reference (see module docstring).
    """

    tier: str
    passed: bool
    summary: str
    evidence: dict = field(default_factory=dict)
    first_divergence: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def load_tier(name: str) -> dict:
    """Return ``conf/tier/<name>.yaml`` as a plain dict (read with OmegaConf, interpolations resolved).

    Raises ConfigError when the file does not exist or its ``name`` field differs from ``name``.
    """
    from omegaconf import OmegaConf

    path = TIER_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in TIER_CONF_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown tier {name!r}: no {path} (known: {known})")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(cfg, dict) or cfg.get("name") != name:
        raise ConfigError(f"{path}: expected a mapping with name: {name}")
    return cfg


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, Mapping) else v
    return out


def _tier_cfg(name: str, cfg: Any) -> dict:
    """The tier's yaml, overridden key by key (recursively) by ``cfg`` (a dict or an OmegaConf node, or None)."""
    base = load_tier(name)
    if cfg is None:
        return base
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"tier config for {name} must be a mapping, got {type(cfg).__name__}")
    if cfg.get("name", name) != name:
        raise ConfigError(f"tier config is for {cfg.get('name')!r}, not {name!r}")
    return _merge(base, cfg)


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _num_layers(names: Iterable[str]) -> int:
    idx = [int(m.group(1)) for n in names if (m := _LAYER_RE.search(n))]
    return max(idx) + 1 if idx else 0


def _ordered(names: Iterable[str], canonical: Callable[[int], Iterable[str]]) -> list[str]:
    """``names`` in canonical forward order (layer count inferred from the names); unknown names last, sorted."""
    names = set(names)
    canon = [n for n in canonical(_num_layers(names)) if n in names]
    return canon + sorted(names - set(canon))


def _param_order(names: Iterable[str]) -> list[str]:
    return _ordered(names, hf_param_names)


def _module_order(names: Iterable[str]) -> list[str]:
    return _ordered(names, lambda n: list(forward_names(n)))


def _by_step(records: list[dict]) -> tuple[dict[int, dict], list[int]]:
    """Records keyed by step, and the steps that occur more than once."""
    out: dict[int, dict] = {}
    dup = []
    for r in records:
        s = int(r["step"])
        if s in out:
            dup.append(s)
        out[s] = r
    return out, dup


def _isnum(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return _isnum(x) and math.isfinite(x)


def _exact_equal(a: Any, b: Any) -> bool:
    """Python ``==`` on two numbers; NaN (never equal to itself) and missing values never pass."""
    return _isnum(a) and _isnum(b) and a == b


def _trace_length(records: list[dict]) -> int:
    return max((int(r["step"]) for r in records), default=0)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}" if abs(x) >= 1e-3 or x == 0 or not math.isfinite(x) else f"{x:.3e}"
    return str(x)


def describe_divergence(d: dict | None) -> str:
    """One short line for a ``first_divergence`` dict (``-`` when None), used in summaries and the table."""
    if not d:
        return "-"
    where = d.get("tensor") or d.get("module") or ""
    out = f"step {d.get('step')} {d.get('kind')}" + (f" {where}" if where else "")
    ref, cand = d.get("ref"), d.get("cand")
    if isinstance(ref, dict) and "l2" in ref:
        ref = ref["l2"]
    if isinstance(cand, dict) and "l2" in cand:
        cand = cand["l2"]
    if isinstance(ref, dict) and "mean" in ref:
        ref = ref["mean"]
    if _isnum(ref) or _isnum(cand) or ref is None or cand is None:
        r, c = _fmt(ref), _fmt(cand)
        if r == c and ref != cand:  # e.g. 1 ulp apart: show every digit
            r, c = repr(ref), repr(cand)
        out += f" (ref {r}, cand {c})"
    elif isinstance(ref, str) and isinstance(cand, str):
        out += f" (digest {ref[:8]} != {cand[:8]})"
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tier 1: bitwise
# ----------------------------------------------------------------------------------------------------------------

# Order of checks within one step: the order the quantities are produced in that step. Module probes exist for
# step 1 only (modules.json). Final params (final.safetensors) come after the last step's per-step params.
_BITWISE_RANK = {"tokens": 0, "module_fwd": 1, "per_token_loss": 2, "loss": 3, "module_grad": 4, "grad": 5,
                 "grad_norm": 6, "lr": 7, "param": 8, "final_param": 9}
_DIGEST_KINDS = ("per_token_loss", "grads", "params")


def bitwise(ref_dir: str | Path, cand_dir: str | Path, cfg: Mapping | None = None) -> Verdict:
    """Bitwise tier: the candidate's trace equals the reference's to the bit.

    Inputs: two trace directories; ``cfg`` overrides ``conf/tier/bitwise.yaml`` (``require_digests``,
    ``require_modules``, ``require_final_params``, ``max_reported_mismatches``).

    Checks, each must hold:

    * the same set of steps (no duplicate step records);
    * per step: ``loss``, ``grad_norm`` and ``lr`` equal with Python ``float ==`` (a NaN or a missing value never
      passes), ``tokens`` equal when both sides record it;
    * per step, when both sides recorded digests: ``per_token_loss``, every ``grads[name]`` and every
      ``params[name]`` digest equal (a name present on one side only is a mismatch). With
      ``require_digests`` (default, see the yaml for why) a step lacking any of the three on either side fails
      the tier with that reason;
    * ``modules.json`` (step-1 probes) when both sides have it: every module's ``fwd`` and ``grad`` digest;
    * ``final.safetensors`` when both sides have it: every tensor ``torch.equal`` (same names, shapes, dtypes).

    ``first_divergence`` is the first mismatch by step, then within a step in the order the step produces
    things: tokens, module forwards (``forward_names`` order), per-token losses, loss, module grads, grads
    (``hf_param_names`` order), grad norm, lr, params; final params count as after the last step (their
    ``step`` is the last step, and ``note`` says per-step digests would localise it). Module gradients are
    reported in forward order like everything else; since backward runs in reverse, the evidence also names
    the first mismatching module in backward order (where a backward-only bug shows first). Magnitudes are
    attached where they exist: ``fwd_l2``/``grad_l2`` for modules, ``max_abs_diff`` for final params.

    Raises FileNotFoundError when either directory has no ``trace.jsonl``; ConfigError on a bad cfg.
    """
    cfg = _tier_cfg("bitwise", cfg)
    ref_meta, ref_recs = read_trace(ref_dir)
    cand_meta, cand_recs = read_trace(cand_dir)
    ref, ref_dup = _by_step(ref_recs)
    cand, cand_dup = _by_step(cand_recs)
    problems: list[str] = []
    mismatches: list[tuple[tuple, dict]] = []  # (sort key, divergence dict)

    def add(step: int, kind: str, ref_v: Any, cand_v: Any, order: int = 0, rank: str | None = None, **extra):
        d = {"step": step, "kind": kind, **extra, "ref": ref_v, "cand": cand_v}
        mismatches.append(((step, _BITWISE_RANK[rank or kind], order), d))

    if ref_dup or cand_dup:
        problems.append(f"duplicate step records (ref {sorted(set(ref_dup))[:5]}, cand {sorted(set(cand_dup))[:5]})")
    steps = sorted(set(ref) | set(cand))
    if not ref:
        problems.append(f"reference trace {ref_dir} has no step records")

    digest_steps = 0
    one_sided: dict[str, int] = {}
    missing_required: dict[str, list[int]] = {"ref": [], "cand": []}
    for s in steps:
        r, c = ref.get(s), cand.get(s)
        if r is None or c is None:
            add(s, "loss", None if r is None else r.get("loss"), None if c is None else c.get("loss"),
                note=f"step {s} missing from the {'reference' if r is None else 'candidate'} trace")
            continue
        if "tokens" in r and "tokens" in c and r["tokens"] != c["tokens"]:
            add(s, "tokens", r["tokens"], c["tokens"])
        for key in ("loss", "grad_norm", "lr"):
            if not _exact_equal(r.get(key), c.get(key)):
                add(s, key, r.get(key), c.get(key))
        rd, cd = r.get("digests") or {}, c.get("digests") or {}
        if cfg["require_digests"]:
            for side, dd in (("ref", rd), ("cand", cd)):
                if any(not dd.get(k) for k in _DIGEST_KINDS):
                    missing_required[side].append(s)
        compared_here = False
        if rd.get("per_token_loss") and cd.get("per_token_loss"):
            compared_here = True
            if rd["per_token_loss"] != cd["per_token_loss"]:
                add(s, "per_token_loss", rd["per_token_loss"], cd["per_token_loss"])
        elif rd.get("per_token_loss") or cd.get("per_token_loss"):
            one_sided["per_token_loss"] = one_sided.get("per_token_loss", 0) + 1
        for dkey, kind in (("grads", "grad"), ("params", "param")):
            rg, cg = rd.get(dkey), cd.get(dkey)
            if rg and cg:
                compared_here = True
                for j, name in enumerate(_param_order(set(rg) | set(cg))):
                    if rg.get(name) != cg.get(name):
                        add(s, kind, rg.get(name), cg.get(name), order=j, tensor=name)
            elif rg or cg:
                one_sided[dkey] = one_sided.get(dkey, 0) + 1
        digest_steps += compared_here

    for side, lst in missing_required.items():
        if lst:
            who = "reference" if side == "ref" else "candidate"
            problems.append(f"digests required (require_digests) but the {who}"
                            f" lacks per_token_loss/grads/params digests at {len(lst)} step(s) (first: step "
                            f"{lst[0]}); record them with train.digests=true")
    digests_ev = {"compared": digest_steps > 0, "steps_compared": digest_steps, "steps_total": len(steps),
                  "one_sided_steps": one_sided, "required": bool(cfg["require_digests"])}
    if digest_steps == 0:
        digests_ev["reason"] = "neither trace has digests" if not one_sided else "only one trace has digests"

    # modules.json: step-1 probes.
    modules_ev: dict[str, Any] = {"compared": False}
    rm, cm = read_modules(ref_dir), read_modules(cand_dir)
    if rm is not None and cm is not None:
        names = _module_order(set(rm) | set(cm))
        fwd_bad, grad_bad = [], []
        for j, name in enumerate(names):
            re_, ce = rm.get(name) or {}, cm.get(name) or {}
            for key, kind, lst in (("fwd", "module_fwd", fwd_bad), ("grad", "module_grad", grad_bad)):
                if name not in rm or name not in cm or re_.get(key) != ce.get(key):
                    lst.append(name)
                    add(1, kind, {"digest": re_.get(key), "l2": re_.get(f"{key}_l2")} if name in rm else None,
                        {"digest": ce.get(key), "l2": ce.get(f"{key}_l2")} if name in cm else None,
                        order=j, module=name)
        modules_ev = {"compared": True, "n_modules": len(names), "fwd_mismatches": fwd_bad,
                      "grad_mismatches": grad_bad,
                      "first_fwd_mismatch": fwd_bad[0] if fwd_bad else None,
                      "first_grad_mismatch_forward_order": grad_bad[0] if grad_bad else None,
                      "first_grad_mismatch_backward_order": grad_bad[-1] if grad_bad else None,
                      "note": "module grads run in reverse order: a backward-only bug first shows in the first "
                              "module in backward order (= the last mismatching one in forward order)"}
    else:
        modules_ev["reason"] = ("neither trace has modules.json" if rm is None and cm is None else
                                f"only the {'reference' if rm is not None else 'candidate'} has modules.json")
        if cfg["require_modules"]:
            problems.append(f"modules required (require_modules) but {modules_ev['reason']}")

    # final.safetensors
    final_ev: dict[str, Any] = {"compared": False}
    rp, cp = read_final_params(ref_dir), read_final_params(cand_dir)
    if rp is not None and cp is not None:
        last = _trace_length(ref_recs)
        names = _param_order(set(rp) | set(cp))
        bad, worst = [], 0.0
        for j, name in enumerate(names):
            a, b = rp.get(name), cp.get(name)
            if a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b):
                continue
            mad = None
            if a is not None and b is not None and a.shape == b.shape:
                mad = float((b.double() - a.double()).abs().max()) if a.numel() else 0.0
                worst = mad if (math.isnan(mad) or mad > worst) else worst
            bad.append({"tensor": name, "max_abs_diff": mad})
            add(last, "param", {"l2": float(a.double().norm()), "shape": list(a.shape)} if a is not None else None,
                {"l2": float(b.double().norm()), "shape": list(b.shape)} if b is not None else None,
                order=j, rank="final_param", tensor=name, max_abs_diff=mad, source="final.safetensors",
                note="final parameters; per-step param digests would name the step where they first differ")
        final_ev = {"compared": True, "n_tensors": len(names), "mismatched": bad,
                    "max_abs_diff": worst if bad else 0.0}
    else:
        final_ev["reason"] = ("neither trace has final.safetensors" if rp is None and cp is None else
                              f"only the {'reference' if rp is not None else 'candidate'} has final.safetensors")
        if cfg["require_final_params"]:
            problems.append(f"final params required (require_final_params) but {final_ev['reason']}")

    mismatches.sort(key=lambda m: m[0])
    divs = [d for _, d in mismatches]
    counts: dict[str, int] = {}
    for d in divs:
        counts[d["kind"]] = counts.get(d["kind"], 0) + 1
    evidence = {
        "n_steps_ref": len(ref), "n_steps_cand": len(cand),
        "precision": {"ref": ref_meta.get("precision"), "cand": cand_meta.get("precision")},
        "n_mismatches": len(divs), "mismatch_counts": counts,
        "mismatches": divs[: int(cfg["max_reported_mismatches"])],
        "digests": digests_ev, "modules": modules_ev, "final_params": final_ev, "problems": problems,
        "order": "by step; within a step: tokens, module_fwd (forward_names), per_token_loss, loss, module_grad, "
                 "grad (hf_param_names), grad_norm, lr, param; final.safetensors after the last step",
        "config": cfg,
    }
    first = divs[0] if divs else None
    passed = not divs and not problems
    covered = ["loss", "grad_norm", "lr"] + (["digests"] if digests_ev["compared"] else []) + \
        (["modules"] if modules_ev["compared"] else []) + (["final params"] if final_ev["compared"] else [])
    if passed:
        summary = f"{len(steps)} steps bit-identical ({', '.join(covered)})"
        if not digests_ev["compared"]:
            summary += "; digests NOT compared"
    elif divs:
        summary = f"first divergence: {describe_divergence(first)}; {len(divs)} mismatch(es)"
    else:
        summary = problems[0]
    if divs and problems:
        summary += f"; also: {problems[0]}"
    return Verdict("bitwise", passed, summary, evidence, first)


# ----------------------------------------------------------------------------------------------------------------
# Tier 2: tolerance
# ----------------------------------------------------------------------------------------------------------------


def _rel_err(r: Any, c: Any, floor: float) -> float:
    """|c - r| / max(|r|, floor); inf when either value is missing or non-finite (so it always fails)."""
    if not (_finite(r) and _finite(c)):
        return math.inf
    return abs(c - r) / max(abs(r), floor)


def tolerance(ref_dir: str | Path, cand_dir: str | Path, cfg: Mapping | None = None,
              oracle_dir: str | Path | None = None) -> Verdict:
    """Tolerance tier: per-step relative errors and final-parameter relative L2 errors within per-dtype thresholds.

    Oracle mode (``oracle_dir``: an fp32 run of the reference from the same weights and batches; used for
    reduced precision). A value that exceeds its direct threshold still passes when the candidate is no further
    from the fp32 oracle than ``oracle_slack`` x the reference's own demonstrated error against it (the running
    max up to that step; for final params, the reference's per-tensor rel L2 vs the oracle). This is the kernel
    forge's criterion -- not worse than the replaced implementation's own error -- applied to whole engines: a
    bf16 candidate that is *more* accurate than the bf16 reference must not fail because the reference drifted.

    Inputs: two trace directories of the same precision (``meta.json`` ``"precision"``: ``fp32`` | ``bf16``, or
    ``cfg.precision``); ``cfg`` overrides ``conf/tier/tolerance.yaml``, which holds the thresholds and the
    derivation of every number (unit roundoff 2^-24 / 2^-8 times a growth factor).

    Per step s (steps 1..max_steps, all by default): ``rel = |cand - ref| / max(|ref|, denominator_floor)`` for
    ``loss`` (nats), ``grad_norm`` and ``lr`` must be <= ``loss_rtol`` / ``grad_norm_rtol`` / ``lr_rtol``;
    ``tokens`` must be equal. A missing or non-finite value has rel = inf. Final params (fp64 arithmetic): per
    tensor ``||c - r|| / ||r||`` <= ``param_rel_l2`` and over all tensors ``sqrt(sum ||c - r||^2) /
    sqrt(sum ||r||^2)`` <= ``param_rel_l2_total``; names and shapes must match.

    Evidence: per metric max/mean rel error, worst step, the number of steps exceeding; per tensor rel L2, the
    worst tensor, the total. ``first_divergence``: the first step exceeding (loss, then grad_norm, then lr),
    else the first tensor (``hf_param_names`` order) exceeding, reported at the last step.

    Fails (verdict, no exception) when precisions differ or are unknown, when the candidate lacks steps, or when
    final params are required and missing. Raises FileNotFoundError without ``trace.jsonl``, ConfigError when
    the yaml has no thresholds for the precision.
    """
    cfg = _tier_cfg("tolerance", cfg)
    ref_meta, ref_recs = read_trace(ref_dir)
    cand_meta, cand_recs = read_trace(cand_dir)
    problems: list[str] = []
    prec_ref, prec_cand = ref_meta.get("precision"), cand_meta.get("precision")
    precision = cfg.get("precision") or prec_ref
    evidence: dict[str, Any] = {"precision": precision, "precision_meta": {"ref": prec_ref, "cand": prec_cand},
                                "config": cfg}
    if not cfg.get("precision") and prec_ref != prec_cand:
        summary = f"precisions differ (ref {prec_ref}, cand {prec_cand}): not a tolerance comparison"
        return Verdict("tolerance", False, summary, evidence, None)
    if precision is None:
        return Verdict("tolerance", False, "meta.json has no precision and cfg.precision is unset", evidence, None)
    th = (cfg.get("thresholds") or {}).get(precision)
    if th is None:
        raise ConfigError(f"tolerance.yaml has no thresholds for precision {precision!r}")
    evidence["thresholds"] = th
    floor = float(cfg["denominator_floor"])

    ref, _ = _by_step(ref_recs)
    cand, _ = _by_step(cand_recs)
    steps = sorted(ref)
    max_steps = cfg.get("max_steps")
    if max_steps is not None:
        steps = [s for s in steps if s <= int(max_steps)]
    if not steps:
        problems.append(f"reference trace {ref_dir} has no step records")
    missing = [s for s in steps if s not in cand]
    if missing:
        problems.append(f"candidate lacks {len(missing)} step(s) of the reference (first: step {missing[0]})")
    extra = sorted(s for s in cand if s not in ref and (max_steps is None or s <= int(max_steps)))
    if extra:
        problems.append(f"candidate has {len(extra)} step(s) the reference lacks (first: step {extra[0]})")

    divergences: list[dict] = []
    metrics = (("loss", "loss_rtol"), ("grad_norm", "grad_norm_rtol"), ("lr", "lr_rtol"))
    metric_ev = {}
    per_step = {m: [] for m, _ in metrics}
    oracle = None
    slack = float(cfg.get("oracle_slack", 2.0))
    if oracle_dir is not None:
        oracle, _ = _by_step(read_trace(oracle_dir)[1])
        evidence["oracle"] = {"dir": str(oracle_dir), "slack": slack, "rescued": []}
    ref_err_max = {m: 0.0 for m, _ in metrics}
    for s in steps:
        r, c = ref[s], cand.get(s, {})
        if "tokens" in r and "tokens" in c and r["tokens"] != c["tokens"]:
            divergences.append({"step": s, "kind": "tokens", "ref": r["tokens"], "cand": c["tokens"]})
        for m, key in metrics:
            e = _rel_err(r.get(m), c.get(m), floor)
            per_step[m].append(e)
            if oracle is not None and s in oracle:
                o = oracle[s].get(m)
                ref_err_max[m] = max(ref_err_max[m], _rel_err(o, r.get(m), floor))
                if not e <= float(th[key]):
                    e_co = _rel_err(o, c.get(m), floor)
                    if e_co <= max(slack * ref_err_max[m], float(th[key])):
                        evidence["oracle"]["rescued"].append({"step": s, "kind": m, "rel_err_vs_ref": e,
                                                              "cand_err_vs_oracle": e_co,
                                                              "ref_err_vs_oracle_max": ref_err_max[m]})
                        continue
            if not e <= float(th[key]):
                divergences.append({"step": s, "kind": m, "ref": r.get(m), "cand": c.get(m), "rel_err": e,
                                    "threshold": float(th[key])})
    for m, key in metrics:
        errs = per_step[m]
        if errs:
            i = int(np.argmax(errs))
            metric_ev[m] = {"max_rel": errs[i], "mean_rel": float(np.mean(errs)), "worst_step": steps[i],
                            "n_exceeding": sum(not e <= float(th[key]) for e in errs),
                            "threshold": float(th[key])}
    evidence["steps_compared"] = len(steps)
    evidence["metrics"] = metric_ev

    # Final parameters.
    final_ev: dict[str, Any] = {"compared": False}
    n_total = _trace_length(ref_recs)
    if max_steps is not None and n_total > int(max_steps):
        final_ev["reason"] = (f"skipped: the run has {n_total} steps > max_steps={max_steps}, and final params "
                              "reflect every step")
    else:
        rp, cp = read_final_params(ref_dir), read_final_params(cand_dir)
        if rp is None or cp is None:
            final_ev["reason"] = ("neither trace has final.safetensors" if rp is None and cp is None else
                                  f"the {'candidate' if cp is None else 'reference'} has no final.safetensors")
            if cfg["require_final_params"]:
                problems.append(f"final params required (require_final_params) but {final_ev['reason']}")
        else:
            t_th, tot_th = float(th["param_rel_l2"]), float(th["param_rel_l2_total"])
            op = read_final_params(oracle_dir) if oracle_dir is not None else None

            def _rel_l2(x, y):
                x64, y64 = x.double(), y.double()
                return float((y64 - x64).norm()) / max(float(x64.norm()), floor)

            per_tensor, diff2, ref2 = {}, 0.0, 0.0
            for name in _param_order(set(rp) | set(cp)):
                a, b = rp.get(name), cp.get(name)
                if a is None or b is None or a.shape != b.shape:
                    e = math.inf
                    per_tensor[name] = e
                    divergences.append({"step": n_total, "kind": "param", "tensor": name, "final": True,
                                        "ref": None if a is None else list(a.shape),
                                        "cand": None if b is None else list(b.shape), "rel_err": e,
                                        "threshold": t_th, "note": "missing tensor or shape mismatch"})
                    continue
                a64, b64 = a.double(), b.double()
                d2, r2 = float((b64 - a64).pow(2).sum()), float(a64.pow(2).sum())
                diff2, ref2 = diff2 + d2, ref2 + r2
                e = math.sqrt(d2) / max(math.sqrt(r2), floor) if math.isfinite(d2) else math.inf
                per_tensor[name] = e
                if not e <= t_th and op is not None and name in op:
                    e_co, e_ro = _rel_l2(op[name], b), _rel_l2(op[name], a)
                    if e_co <= max(slack * e_ro, t_th):
                        evidence["oracle"]["rescued"].append({"tensor": name, "kind": "param",
                                                              "rel_l2_vs_ref": e, "cand_rel_l2_vs_oracle": e_co,
                                                              "ref_rel_l2_vs_oracle": e_ro})
                        continue
                if not e <= t_th:
                    divergences.append({"step": n_total, "kind": "param", "tensor": name, "final": True,
                                        "ref": {"l2": math.sqrt(r2)}, "cand": {"l2": float(b64.norm())},
                                        "rel_err": e, "threshold": t_th})
            total = math.sqrt(diff2) / max(math.sqrt(ref2), floor) if math.isfinite(diff2) else math.inf
            if any(math.isinf(e) for e in per_tensor.values()):
                total = math.inf
            worst = max(per_tensor, key=lambda k: per_tensor[k]) if per_tensor else None
            final_ev = {"compared": True, "n_tensors": len(per_tensor), "total_rel_l2": total,
                        "max_tensor_rel_l2": per_tensor[worst] if worst else None, "worst_tensor": worst,
                        "mean_tensor_rel_l2": float(np.mean(list(per_tensor.values()))) if per_tensor else None,
                        "n_exceeding": sum(not e <= t_th for e in per_tensor.values()),
                        "threshold_tensor": t_th, "threshold_total": tot_th, "per_tensor": per_tensor}
            if not total <= tot_th and op is not None:
                keys = [k for k in rp if k in op and k in cp]
                tot_co = math.sqrt(sum(float((cp[k].double() - op[k].double()).pow(2).sum()) for k in keys)) / \
                    max(math.sqrt(sum(float(op[k].double().pow(2).sum()) for k in keys)), floor)
                tot_ro = math.sqrt(sum(float((rp[k].double() - op[k].double()).pow(2).sum()) for k in keys)) / \
                    max(math.sqrt(sum(float(op[k].double().pow(2).sum()) for k in keys)), floor)
                final_ev["oracle_total"] = {"cand_vs_oracle": tot_co, "ref_vs_oracle": tot_ro}
                if tot_co <= max(slack * tot_ro, tot_th):
                    total = min(total, tot_th)
            if not total <= tot_th:
                problems.append(f"final params: total rel L2 {_fmt(total)} > {tot_th:g}")
    order = {"tokens": 0, "loss": 1, "grad_norm": 2, "lr": 3, "param": 4}
    divergences.sort(key=lambda d: (d["step"], order[d["kind"]]))  # stable: tensors stay in hf order
    evidence["final_params"] = final_ev
    evidence["problems"] = problems
    evidence["n_divergences"] = len(divergences)
    evidence["divergences"] = divergences[:20]
    first = divergences[0] if divergences else None
    passed = not divergences and not problems
    if passed:
        worst_parts = [f"{m} max rel {_fmt(v['max_rel'])} (step {v['worst_step']})" for m, v in metric_ev.items()
                       if m != "lr"]
        if final_ev.get("compared"):
            worst_parts.append(f"final params rel L2 {_fmt(final_ev['total_rel_l2'])}")
        summary = f"{precision}: {len(steps)} steps within tolerance; " + "; ".join(worst_parts)
    elif first is not None:
        rel = (f" rel {_fmt(first['rel_err'])} > {_fmt(first['threshold'])}" if "rel_err" in first
               else " (must be equal)")
        summary = f"{precision}: first exceedance {describe_divergence(first)}{rel}; {len(divergences)} exceedance(s)"
        if problems:
            summary += f"; also: {problems[0]}"
    else:
        summary = f"{precision}: {problems[0]}"
    return Verdict("tolerance", passed, summary, evidence, first)


# ----------------------------------------------------------------------------------------------------------------
# Tier 3: loss curve
# ----------------------------------------------------------------------------------------------------------------


def _t_abs_cdf(t: float, nu: int) -> float:
    """P(|T| <= t) for Student's t with integer ``nu`` >= 1 degrees of freedom.

    Closed forms of Abramowitz & Stegun, Handbook of Mathematical Functions, 26.7.3 (odd nu) and 26.7.4 (even
    nu), with theta = atan(t / sqrt(nu)).
    """
    theta = math.atan(t / math.sqrt(nu))
    s, c = math.sin(theta), math.cos(theta)
    if nu % 2 == 1:
        acc = 0.0
        if nu > 1:
            term = acc = c
            for j in range(1, (nu - 3) // 2 + 1):
                term *= c * c * (2 * j) / (2 * j + 1)
                acc += term
        return 2.0 / math.pi * (theta + s * acc)
    term = acc = 1.0
    for j in range(1, (nu - 2) // 2 + 1):
        term *= c * c * (2 * j - 1) / (2 * j)
        acc += term
    return s * acc


def t_quantile(p: float, nu: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with integer ``nu`` >= 1 degrees of freedom.

    Inverts :func:`_t_abs_cdf` by bisection to ~1e-12 relative (scipy is not a dependency). Checked against
    tables: t_2(0.975) = 4.3027, t_4(0.995) = 4.6041, t_1(0.975) = 12.706. Raises ValueError on bad arguments.
    """
    if not (0.5 <= p < 1.0) or int(nu) != nu or nu < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and integer nu >= 1, got p={p}, nu={nu}")
    target = 2.0 * p - 1.0
    lo, hi = 0.0, 1.0
    while _t_abs_cdf(hi, int(nu)) < target:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_abs_cdf(mid, int(nu)) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def _losses(records: list[dict]) -> dict[int, Any]:
    return {int(r["step"]): r.get("loss") for r in records}


def loss_curve(ref_dirs: Sequence[str | Path], cand_dir: str | Path, cfg: Mapping | None = None) -> Verdict:
    """Loss-curve tier: the candidate's smoothed loss stays in the band of the reference seeds, without drift.

    Inputs: ``ref_dirs``, trace directories of the reference run with different ``train.seed`` (>=
    ``min_seeds``, 3 by default); ``cand_dir``, the candidate's trace of the same length; ``cfg`` overrides
    ``conf/tier/loss_curve.yaml``. Losses are per-step mean token cross-entropies in nats.

    Rule (formulas and sources in the yaml): window means of ``window_steps`` steps; per window the reference
    mean ``m_w`` and sample std ``s_w`` over the n seeds; band half-width ``hw_w = max(k s_w, band_floor_rel
    |m_w|, band_floor_abs)`` with ``k = t_{n-1}(1 - band_alpha / (2 W)) sqrt(1 + 1/n)``: a Student-t prediction
    interval for one new run, Bonferroni-corrected over the W windows so that ``band_alpha`` bounds the
    false-fail rate of the whole band check. Every candidate window mean must lie in ``m_w +- hw_w``.
    Drift: ``D`` = candidate's mean over the late windows (last ``late_fraction``) minus the seeds' mean of the
    same; limit = ``min(max(t_{n-1}(1 - drift_alpha/2) sqrt(1 + 1/n) s_L, floors), drift_max_band_fraction *
    mean late hw_w)`` with ``s_L`` the std of the seeds' late means (a prediction interval for the late
    average, valid whatever the correlation between windows; the cap guarantees that a candidate consistently
    half a band off fails). ``|D| <= limit`` (``D <= limit`` when not ``drift_two_sided``).

    Steps compared: those present in every reference run (the shortest reference sets the length). Decision on
    bad input: the verdict FAILS with a clear reason (no exception) for fewer than ``min_seeds`` references,
    identical reference curves (seeds not varied), a non-finite reference loss, fewer than ``min_windows``
    windows, or candidate steps missing / non-finite -- so a ladder always gets a verdict.

    Evidence: the band per window (mean, std, half-width, lo, hi), the candidate's window mean and its position
    ``z = (cand - mean) / half_width`` (|z| <= 1 is in band), the drift statistic and limit, and for
    information the fixed rule "mean over steps of |cand - ref_mean| / ref_mean <= 2.5%" with a note comparing
    it to this verdict. ``first_divergence``: the first window out of band (its first step, with ``ref`` =
    {mean, lo, hi} and ``cand`` = the window mean), else the drift (the first late step).

    Raises FileNotFoundError when a directory has no ``trace.jsonl``; TypeError when ``ref_dirs`` is a single
    path rather than a list.
    """
    cfg = _tier_cfg("loss_curve", cfg)
    if isinstance(ref_dirs, (str, Path)):
        raise TypeError("loss_curve needs a list of reference trace directories (one per seed), not one path")
    ref_dirs = list(ref_dirs)
    n = len(ref_dirs)
    evidence: dict[str, Any] = {"n_seeds": n, "ref_dirs": [str(d) for d in ref_dirs], "config": cfg}

    def fail(reason: str, first: dict | None = None) -> Verdict:
        evidence["reason"] = reason
        return Verdict("loss_curve", False, reason, evidence, first)

    if n < int(cfg["min_seeds"]):
        return fail(f"{n} reference run(s) given; the band needs >= {cfg['min_seeds']} reference seeds")
    refs = [_losses(read_trace(d)[1]) for d in ref_dirs]
    cand = _losses(read_trace(cand_dir)[1])
    steps = sorted(set.intersection(*(set(r) for r in refs)))
    lengths = [len(r) for r in refs]
    evidence["ref_lengths"] = lengths
    if not steps:
        return fail("the reference runs share no steps")
    for i, r in enumerate(refs):
        bad = [s for s in steps if not _finite(r[s])]
        if bad:
            return fail(f"reference seed {i} ({ref_dirs[i]}) has a non-finite loss at step {bad[0]}; "
                        "the band cannot be calibrated")
    R = np.array([[float(r[s]) for s in steps] for r in refs])  # [n, T]
    if np.all(R == R[0]):
        return fail("the reference runs are identical: vary train.seed between them to calibrate a band")
    missing = [s for s in steps if s not in cand]
    if missing:
        return fail(f"candidate trace ends early / lacks {len(missing)} step(s) (first missing: step "
                    f"{missing[0]}; references have {len(steps)})",
                    {"step": missing[0], "kind": "loss", "ref": float(R[:, steps.index(missing[0])].mean()),
                     "cand": None})
    bad = [s for s in steps if not _finite(cand[s])]
    if bad:
        j = steps.index(bad[0])
        return fail(f"candidate loss is non-finite at step {bad[0]}",
                    {"step": bad[0], "kind": "loss", "ref": float(R[:, j].mean()), "cand": cand[bad[0]]})
    c = np.array([float(cand[s]) for s in steps])  # [T]

    win = int(cfg["window_steps"])
    edges = list(range(0, len(steps), win))
    W = len(edges)
    if W < int(cfg["min_windows"]):
        return fail(f"{len(steps)} steps make {W} window(s) of {win}; the tier needs >= {cfg['min_windows']}")
    Rw = np.stack([R[:, e:e + win].mean(axis=1) for e in edges], axis=1)  # [n, W]
    cw = np.array([c[e:e + win].mean() for e in edges])  # [W]
    mw, sw = Rw.mean(axis=0), Rw.std(axis=0, ddof=1)
    floor_rel, floor_abs = float(cfg["band_floor_rel"]), float(cfg["band_floor_abs"])
    band_alpha = float(cfg["band_alpha"])
    t_band = t_quantile(1.0 - band_alpha / (2.0 * W), n - 1)  # Bonferroni over the W windows
    k = t_band * math.sqrt(1.0 + 1.0 / n)
    hw = np.maximum(np.maximum(k * sw, floor_rel * np.abs(mw)), floor_abs)
    z = (cw - mw) / hw
    inside = np.abs(z) <= 1.0

    # Drift: a prediction interval for the candidate's late-window average, from the seeds' late averages.
    n_late = max(1, math.ceil(float(cfg["late_fraction"]) * W))
    late = slice(W - n_late, W)
    late_ref = Rw[:, late].mean(axis=1)  # [n] each seed's late average
    drift = float(cw[late].mean() - late_ref.mean())
    t_drift = t_quantile(1.0 - float(cfg["drift_alpha"]) / 2.0, n - 1)
    mean_late_hw = float(np.mean(hw[late]))
    limit_stat = max(t_drift * math.sqrt(1.0 + 1.0 / n) * float(late_ref.std(ddof=1)),
                     floor_rel * abs(float(late_ref.mean())), floor_abs)
    limit = min(limit_stat, float(cfg["drift_max_band_fraction"]) * mean_late_hw)
    two_sided = bool(cfg["drift_two_sided"])
    drift_ok = (abs(drift) <= limit) if two_sided else (drift <= limit)
    frac = limit / mean_late_hw

    # Fixed 2.5% rule, for information.
    m_t = R.mean(axis=0)
    mrd = float(np.mean(np.abs(c - m_t) / np.abs(m_t)))
    seed_mrd = [float(np.mean(np.abs(R[i] - m_t) / np.abs(m_t))) for i in range(n)]
    fixed = float(cfg["fixed_rule_rel"])

    windows = []
    for w, e in enumerate(edges):
        s0, s1 = steps[e], steps[min(e + win, len(steps)) - 1]
        windows.append({"window": w, "steps": [s0, s1], "ref_mean": float(mw[w]), "ref_std": float(sw[w]),
                        "half_width": float(hw[w]), "lo": float(mw[w] - hw[w]), "hi": float(mw[w] + hw[w]),
                        "cand": float(cw[w]), "z": float(z[w]), "inside": bool(inside[w])})
    passed = bool(inside.all()) and drift_ok
    rel_hw = hw / np.abs(mw)
    evidence.update({
        "steps_compared": len(steps), "window_steps": win, "n_windows": W, "k": k, "t_band": t_band,
        "per_window_alpha": band_alpha / W,
        "windows": windows, "n_outside": int((~inside).sum()), "max_abs_z": float(np.abs(z).max()),
        "band_half_width_rel": {"min": float(rel_hw.min()), "max": float(rel_hw.max())},
        "drift": {"late_windows": n_late, "late_steps": [windows[W - n_late]["steps"][0], steps[-1]],
                  "mean_diff": drift, "limit": limit, "limit_statistical": limit_stat,
                  "ref_late_means": late_ref.tolist(), "band_fraction": frac, "two_sided": two_sided,
                  "passed": drift_ok, "in_band_units": drift / mean_late_hw,
                  "note": f"limit = the smallest consistent late shift this test detects with {n} seeds; "
                          "more seeds shrink it (t quantile and std estimate)"},
        "fixed_rule": {"rule": f"mean |cand - ref_mean| / ref_mean <= {fixed:.1%}", "mean_rel_diff": mrd,
                       "passes": mrd <= fixed, "ref_seeds_mean_rel_diff": seed_mrd},
    })
    evidence["fixed_rule"]["note"] = (
        f"the fixed {fixed:.1%} rule would {'PASS' if mrd <= fixed else 'FAIL'} (candidate mean rel diff "
        f"{mrd:.3%}; the reference seeds themselves sit at {min(seed_mrd):.3%}-{max(seed_mrd):.3%}), while the "
        f"calibrated band (half-width {rel_hw.min():.3%}-{rel_hw.max():.3%} of the loss) "
        f"{'passes' if passed else 'fails'} the candidate" +
        ("; the two disagree" if (mrd <= fixed) != passed else ""))

    first = None
    if not inside.all():
        w = int(np.argmax(~inside))
        first = {"step": windows[w]["steps"][0], "kind": "loss", "window": w, "steps": windows[w]["steps"],
                 "ref": {"mean": windows[w]["ref_mean"], "lo": windows[w]["lo"], "hi": windows[w]["hi"]},
                 "cand": windows[w]["cand"], "z": windows[w]["z"]}
        summary = (f"{int((~inside).sum())}/{W} windows out of band; first: steps {windows[w]['steps'][0]}-"
                   f"{windows[w]['steps'][1]}, cand {_fmt(float(cw[w]))} vs band [{_fmt(windows[w]['lo'])}, "
                   f"{_fmt(windows[w]['hi'])}]")
        if not drift_ok:
            summary += f"; late drift {drift:+.4g} (limit {limit:.4g})"
    elif not drift_ok:
        s0 = windows[W - n_late]["steps"][0]
        first = {"step": s0, "kind": "loss", "window": "late", "steps": [s0, steps[-1]],
                 "ref": float(np.mean(mw[late])), "cand": float(np.mean(cw[late])), "drift": drift,
                 "limit": limit}
        summary = (f"in band, but late drift {drift:+.4g} nats over steps {s0}-{steps[-1]} exceeds "
                   f"{'+-' if two_sided else '+'}{limit:.4g} ({frac:.2f} x band)")
    else:
        summary = (f"{W} windows in band (max |z| {np.abs(z).max():.2f}, n={n} seeds, k={k:.2f}); late drift "
                   f"{drift:+.3g} within {limit:.3g}")
    # How much the band can see: its median half-width relative to the loss. A band as wide as the loss passes
    # nearly anything, so say so (a warning, not a verdict: the drift check still has its own limit).
    med_rel = float(np.median(rel_hw))
    warn_at = float(cfg.get("warn_band_rel", 0.10))
    evidence["band_half_width_rel"]["median"] = med_rel
    summary += f"; band half-width median {med_rel:.1%} of the loss"
    if med_rel > warn_at:
        evidence["band_warning"] = (f"the band's median half-width is {med_rel:.1%} of the loss (> {warn_at:.0%}): "
                                    f"too wide to mean much with {n} seeds; add seeds (verify.seeds) to narrow it")
        summary += f" -- WARNING: too wide to mean much with {n} seeds, add seeds"
    return Verdict("loss_curve", passed, summary, evidence, first)


# ----------------------------------------------------------------------------------------------------------------
# Tier 4: surpass
# ----------------------------------------------------------------------------------------------------------------


def _timings(x: Sequence[float], what: str, discard: int) -> np.ndarray:
    a = np.asarray(list(x), dtype=np.float64)[discard:]
    if a.ndim != 1 or not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{what}: step times must be a flat list of finite positive seconds")
    return a


def surpass(loss_curve_verdict: Verdict, timings_ref: Sequence[float], timings_cand: Sequence[float],
            cfg: Mapping | None = None) -> Verdict:
    """Surpass tier: equivalence holds and the candidate is faster by more than the measured noise.

    Inputs: ``loss_curve_verdict``, the equivalence verdict the speed claim rests on (normally
    :func:`loss_curve`'s; a ``bitwise`` or ``tolerance`` verdict over the same run is accepted and recorded);
    ``timings_ref`` / ``timings_cand``, per-step wall seconds of the same work per step, measured side by side,
    interleaved A/B, warm; ``cfg`` overrides ``conf/tier/surpass.yaml``.

    Rule (sources in the yaml): speedup ``S = median(ref) / median(cand)`` (a throughput ratio); ``noise =
    max(S - q_lo(S*), S z se)`` where ``S*`` are seeded percentile-bootstrap resamples of the speedup and
    ``se = sqrt(se_ref^2 + se_cand^2)``, ``se = 1.2533 (IQR / 1.349) / (median sqrt(n))`` (large-sample
    standard error of a median, relative); pass iff the equivalence verdict passed and ``S > 1 +
    min_speedup_margin + noise``. Fails (verdict) with fewer than ``min_samples`` timings on either side.

    Evidence: medians (s), speedup, noise (both estimates), the bootstrap interval, relative IQRs, n per side,
    and the paired median ratio when both lists have equal length (information only).

    Raises ValueError when the verdict is not an equivalence verdict, or timings are not finite positive numbers.
    """
    cfg = _tier_cfg("surpass", cfg)
    if not isinstance(loss_curve_verdict, Verdict) or loss_curve_verdict.tier not in EQUIVALENCE_TIERS:
        raise ValueError("surpass needs an equivalence Verdict (loss_curve, tolerance or bitwise)")
    discard = int(cfg["discard_first"])
    a = _timings(timings_ref, "timings_ref", discard)
    b = _timings(timings_cand, "timings_cand", discard)
    evidence: dict[str, Any] = {"equivalence_tier": loss_curve_verdict.tier,
                                "equivalence_passed": loss_curve_verdict.passed,
                                "n_ref": int(a.size), "n_cand": int(b.size), "config": cfg}
    if min(a.size, b.size) < int(cfg["min_samples"]):
        reason = f"too few timings (ref {a.size}, cand {b.size}); need >= {cfg['min_samples']} per side"
        evidence["reason"] = reason
        return Verdict("surpass", False, reason, evidence, None)

    med_a, med_b = float(np.median(a)), float(np.median(b))
    speedup = med_a / med_b
    conf = float(cfg["confidence"])
    rng = np.random.default_rng(int(cfg["bootstrap_seed"]))
    B = int(cfg["bootstrap_resamples"])
    boot_a = np.median(a[rng.integers(0, a.size, size=(B, a.size))], axis=1)
    boot_b = np.median(b[rng.integers(0, b.size, size=(B, b.size))], axis=1)
    boot = boot_a / boot_b
    lo, hi = (float(q) for q in np.quantile(boot, [(1 - conf) / 2, (1 + conf) / 2]))
    noise_boot = max(0.0, speedup - lo)

    def rel_se(x: np.ndarray, med: float) -> tuple[float, float]:
        iqr = float(np.subtract(*np.percentile(x, [75, 25])))
        return iqr / med, math.sqrt(math.pi / 2) * (iqr / 1.349) / (med * math.sqrt(x.size))

    riqr_a, se_a = rel_se(a, med_a)
    riqr_b, se_b = rel_se(b, med_b)
    z = statistics.NormalDist().inv_cdf((1 + conf) / 2)
    noise_asym = speedup * z * math.sqrt(se_a ** 2 + se_b ** 2)
    noise = max(noise_boot, noise_asym)
    margin = float(cfg["min_speedup_margin"])
    needed = 1.0 + margin + noise
    fast = speedup > needed
    passed = bool(loss_curve_verdict.passed and fast)
    evidence.update({
        "median_ref_step_s": med_a, "median_cand_step_s": med_b, "speedup": speedup,
        "noise": noise, "noise_bootstrap": noise_boot, "noise_asymptotic": noise_asym,
        "bootstrap_ci": [lo, hi], "confidence": conf, "required_speedup": needed,
        "rel_iqr_ref": riqr_a, "rel_iqr_cand": riqr_b, "faster_beyond_noise": fast,
    })
    if a.size == b.size:
        evidence["paired_median_ratio"] = float(np.median(a / b))
    speed = f"speedup {speedup:.3f}x (needs > {needed:.3f}x: noise {noise:.3f}, n={a.size}/{b.size})"
    if not loss_curve_verdict.passed:
        summary = f"{loss_curve_verdict.tier} tier failed, so no speed claim counts; {speed}"
    elif not fast:
        summary = f"not faster beyond noise: {speed}"
    else:
        summary = f"{loss_curve_verdict.tier} holds and {speed}"
    return Verdict("surpass", passed, summary, evidence, None)


# ----------------------------------------------------------------------------------------------------------------
# The ladder
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class LadderResult:
    """strictest_passed: the strictest equivalence tier that passed (bitwise > tolerance > loss_curve), or None.
    surpassed: the surpass verdict's outcome, None when surpass was not run. verdicts: in the order run."""

    strictest_passed: str | None
    surpassed: bool | None
    verdicts: list[Verdict]

    def verdict(self, tier: str) -> Verdict | None:
        return next((v for v in self.verdicts if v.tier == tier), None)

    def to_dict(self) -> dict:
        return {"strictest_passed": self.strictest_passed, "surpassed": self.surpassed,
                "verdicts": [v.to_dict() for v in self.verdicts]}


def ladder(tiers: Sequence[str] = TIER_ORDER, *, ref_dir: str | Path | None = None,
           cand_dir: str | Path | None = None, ref_dirs: Sequence[str | Path] | None = None,
           curve_cand_dir: str | Path | None = None, timings_ref: Sequence[float] | None = None,
           timings_cand: Sequence[float] | None = None, cfgs: Mapping[str, Mapping] | None = None
           ) -> LadderResult:
    """Run ``tiers`` strictest-first (sorted by :data:`TIER_ORDER`, whatever order they are given in).

    Inputs per tier: ``bitwise`` and ``tolerance`` compare ``ref_dir`` with ``cand_dir`` (a short run);
    ``loss_curve`` compares ``ref_dirs`` (>= 3 seeds) with ``curve_cand_dir`` (default ``cand_dir``; a long run);
    ``surpass`` uses this ladder's loss_curve verdict and ``timings_ref`` / ``timings_cand`` (step seconds).
    ``cfgs`` maps a tier name to its cfg overrides. Every tier is run (a pass does not skip the weaker ones, so
    every verdict carries its evidence); a tier whose inputs are missing gets a failed verdict naming them.

    Returns a :class:`LadderResult`. Raises ValueError on an unknown tier name or ``surpass`` without
    ``loss_curve`` in ``tiers``.
    """
    unknown = [t for t in tiers if t not in TIER_ORDER]
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown}; known: {list(TIER_ORDER)}")
    order = sorted(dict.fromkeys(tiers), key=TIER_ORDER.index)
    if "surpass" in order and "loss_curve" not in order:
        raise ValueError("surpass rests on loss_curve: include loss_curve in the ladder's tiers")
    cfgs = cfgs or {}
    curve_cand_dir = curve_cand_dir if curve_cand_dir is not None else cand_dir
    verdicts: list[Verdict] = []

    def missing(tier: str, what: str) -> Verdict:
        return Verdict(tier, False, f"not run: missing input {what}", {"reason": f"missing {what}"}, None)

    for tier in order:
        if tier in ("bitwise", "tolerance"):
            if ref_dir is None or cand_dir is None:
                v = missing(tier, "ref_dir/cand_dir")
            else:
                v = (bitwise if tier == "bitwise" else tolerance)(ref_dir, cand_dir, cfgs.get(tier))
        elif tier == "loss_curve":
            if not ref_dirs or curve_cand_dir is None:
                v = missing(tier, "ref_dirs/curve_cand_dir")
            else:
                v = loss_curve(ref_dirs, curve_cand_dir, cfgs.get(tier))
        else:
            lc = next(x for x in verdicts if x.tier == "loss_curve")
            if timings_ref is None or timings_cand is None:
                v = missing(tier, "timings_ref/timings_cand")
            else:
                v = surpass(lc, timings_ref, timings_cand, cfgs.get(tier))
        verdicts.append(v)
    strictest = next((v.tier for v in verdicts if v.tier in EQUIVALENCE_TIERS and v.passed), None)
    sv = next((v for v in verdicts if v.tier == "surpass"), None)
    return LadderResult(strictest, None if sv is None else sv.passed, verdicts)
