"""The bitwise tier: the candidate's trace equals the reference's to the bit (docs/design.md, "The tiers").

Thresholds: none; what must be present is in ``conf/tier/bitwise.yaml``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from forgetrain.equivalence.verdict import (Verdict, by_step, exact_equal, module_order, param_order,
                                            tier_settings, trace_length, describe_divergence)
from forgetrain.trace import read_final_params, read_modules, read_trace

# Order of checks within one step: the order the step produces the quantities in, so the first divergence is where
# a difference enters. Module probes exist for step 1 only (modules.json). Final params (final.safetensors) come
# after the last step's per-step params.
_BITWISE_RANK = {"tokens": 0, "module_fwd": 1, "moe_tokens_per_expert": 2, "moe_load_balancing_loss": 3,
                 "per_token_loss": 4, "loss": 5, "module_grad": 6, "grad": 7, "grad_norm": 8, "clipped_grad": 9,
                 "lr": 10, "param": 11, "final_param": 12}
# A mixture of experts' routing statistics (StepResult.extra), compared exactly where both traces record them:
# tokens per expert [L][E] (ints) and the unweighted load-balancing loss [L] (floats); both come from the forward
MOE_KEYS = ("moe_tokens_per_expert", "moe_load_balancing_loss")
_DIGEST_KINDS = ("per_token_loss", "grads", "params")  # required with require_digests; clipped_grads is optional
# digests key -> divergence kind, and whether the backward produces it (then it is ordered in backward order)
_TENSOR_DIGESTS = (("grads", "grad", True), ("clipped_grads", "clipped_grad", True), ("params", "param", False))
ORDER = ("by step; within a step: tokens, module_fwd (forward order), moe_tokens_per_expert and "
         "moe_load_balancing_loss (by layer), per_token_loss, loss, module_grad (backward "
         "order), grad (backward order: hf_param_names reversed), grad_norm, clipped_grad (backward order), lr, "
         "param (forward order); final.safetensors after the last step")


def bitwise(ref_dir: str | Path, cand_dir: str | Path, cfg: Mapping | None = None) -> Verdict:
    """Bitwise tier: the candidate's trace equals the reference's to the bit.

    Inputs: two trace directories; ``cfg`` overrides ``conf/tier/bitwise.yaml`` (``require_digests``,
    ``require_modules``, ``require_final_params``, ``max_reported_mismatches``).

    Checks, each must hold:

    * the same set of steps (no duplicate step records);
    * per step: ``loss``, ``grad_norm`` and ``lr`` equal with Python ``float ==`` (a NaN or a missing value never
      passes), ``tokens`` equal when both sides record it;
    * per step, when both sides recorded digests: ``per_token_loss``, every ``grads[name]`` (pre-clip), every
      ``clipped_grads[name]`` (the gradients the update applied; compared when both sides recorded them, see
      ``forgetrain.train.clipped_grads``) and every ``params[name]`` digest equal (a name present on one side
      only is a mismatch). With ``require_digests`` (default, see the yaml for why) a step lacking any of
      per_token_loss/grads/params on either side fails the tier with that reason;
    * per step, when both sides recorded them (a mixture of experts, :data:`MOE_KEYS`): ``moe_tokens_per_expert``
      (``[L][E]`` tokens) and ``moe_load_balancing_loss`` (``[L]``) equal element by element with ``==`` (a NaN
      never passes); a mismatch names the key (its ``kind``), the step and the ``layer``. Recorded by the
      reference only, the tier fails (the candidate's routing cannot be judged); by the candidate only (a
      reference that does not report them), they are not compared and a passing summary says so;
    * ``modules.json`` (step-1 probes) when both sides have it: every module's ``fwd`` and ``grad`` digest;
    * ``final.safetensors`` when both sides have it: every tensor ``torch.equal`` (same names, shapes, dtypes).

    ``first_divergence`` is where the difference enters: the first mismatch by step, then within a step in the
    order the step produces things (:data:`ORDER`): tokens, module forwards (forward order), the MoE routing
    statistics (by layer), per-token losses, loss, then what the backward produces in the order it produces it --
    module gradients from ``output_layer`` back to ``embedding``, parameter gradients from ``lm_head.weight`` back
    to ``model.embed_tokens.weight`` --
    then the grad norm, the clipped gradients (same order), lr and params (forward order). A module gradient is
    the gradient of that module's output, so a ``module_grad`` divergence also names ``produced_by``: the module
    whose backward computed it (the next one in forward order; ``loss`` for ``output_layer``). Final params count
    as after the last step (their ``step`` is the last step, and ``note`` says per-step digests would localise
    it). Magnitudes are attached where they exist: ``fwd_l2``/``grad_l2`` for modules, ``max_abs_diff`` for final
    params.

    Raises FileNotFoundError when either directory has no ``trace.jsonl``; ConfigError on a bad cfg.
    """
    cfg = tier_settings("bitwise", cfg)
    ref_meta, ref_recs = read_trace(ref_dir)
    cand_meta, cand_recs = read_trace(cand_dir)
    ref, ref_dup = by_step(ref_recs)
    cand, cand_dup = by_step(cand_recs)
    problems: list[str] = []
    mismatches: list[tuple[tuple, dict]] = []  # (sort key, divergence dict)

    def add(step: int, kind: str, ref_v: Any, cand_v: Any, order: int = 0, rank: str | None = None, **extra):
        d = {"step": step, "kind": kind, **extra, "ref": ref_v, "cand": cand_v}
        mismatches.append(((step, _BITWISE_RANK[rank or kind], order), d))

    if ref_dup or cand_dup:
        problems.append(f"duplicate step records (ref {sorted(set(ref_dup))[:5]}, cand {sorted(set(cand_dup))[:5]})")
    if not ref:
        problems.append(f"reference trace {ref_dir} has no step records")
    steps = sorted(set(ref) | set(cand))
    digests_ev = _compare_steps(ref, cand, steps, cfg, add, problems)
    moe_ev = _compare_moe(ref, cand, steps, add)
    if missing := sorted(k for k, d in moe_ev["one_sided_steps"].items() if "reference" in d):
        # the reference routes through experts and the candidate does not say how: its routing cannot be judged
        problems.append(f"the candidate's trace lacks {', '.join(missing)}, which the reference records "
                        f"(a mixture of experts reports them through StepResult.extra)")
    modules_ev = _compare_modules(read_modules(ref_dir), read_modules(cand_dir), cfg, add, problems)
    final_ev = _compare_final(read_final_params(ref_dir), read_final_params(cand_dir), trace_length(ref_recs),
                              cfg, add, problems)

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
        "digests": digests_ev, "moe": moe_ev, "modules": modules_ev, "final_params": final_ev, "problems": problems,
        "order": ORDER, "config": cfg,
    }
    first = divs[0] if divs else None
    passed = not divs and not problems
    covered = ["loss", "grad_norm", "lr"] + (["digests"] if digests_ev["compared"] else []) + \
        (["clipped grads"] if digests_ev["clipped_grads_steps"] else []) + \
        (["MoE routing"] if moe_ev["compared"] else []) + \
        (["modules"] if modules_ev["compared"] else []) + (["final params"] if final_ev["compared"] else [])
    if passed:
        summary = f"{len(steps)} steps bit-identical ({', '.join(covered)})"
        if not digests_ev["compared"]:
            summary += "; digests NOT compared"
        if moe_ev["one_sided_steps"] and not moe_ev["compared"]:
            summary += f"; MoE routing NOT compared ({moe_ev['reason']})"
    elif divs:
        summary = f"first divergence: {describe_divergence(first)}; {len(divs)} mismatch(es)"
    else:
        summary = problems[0]
    if divs and problems:
        summary += f"; also: {problems[0]}"
    return Verdict("bitwise", passed, summary, evidence, first)


def _compare_steps(ref: dict, cand: dict, steps: list[int], cfg: dict, add, problems: list[str]) -> dict:
    """Per step: the scalars, then the digests (``add`` each mismatch, ``problems`` each missing requirement).
    Returns the digests' evidence."""
    digest_steps, clipped_steps = 0, 0
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
            if not exact_equal(r.get(key), c.get(key)):
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
        for dkey, kind, backward in _TENSOR_DIGESTS:
            rg, cg = rd.get(dkey), cd.get(dkey)
            if rg and cg:
                compared_here = True
                clipped_steps += dkey == "clipped_grads"
                names = param_order(set(rg) | set(cg))
                for j, name in enumerate(names):
                    if rg.get(name) != cg.get(name):
                        add(s, kind, rg.get(name), cg.get(name), order=len(names) - 1 - j if backward else j,
                            tensor=name)
            elif rg or cg:
                one_sided[dkey] = one_sided.get(dkey, 0) + 1
        digest_steps += compared_here

    for side, lst in missing_required.items():
        if lst:
            who = "reference" if side == "ref" else "candidate"
            problems.append(f"digests required (require_digests) but the {who}"
                            f" lacks per_token_loss/grads/params digests at {len(lst)} step(s) (first: step "
                            f"{lst[0]}); record them with train.digests=true")
    ev = {"compared": digest_steps > 0, "steps_compared": digest_steps, "steps_total": len(steps),
          "clipped_grads_steps": clipped_steps, "one_sided_steps": one_sided, "required": bool(cfg["require_digests"])}
    if digest_steps == 0:
        ev["reason"] = "neither trace has digests" if not one_sided else "only one trace has digests"
    return ev


def _compare_moe(ref: dict, cand: dict, steps: list[int], add) -> dict:
    """Per step present on both sides, each of :data:`MOE_KEYS` that both records carry, compared layer by layer
    (``add`` one mismatch per differing layer, ``layer`` its index; a different layer count is one mismatch of the
    whole value). Returns the MoE evidence: steps compared and steps where one side only recorded a key."""
    compared = {k: 0 for k in MOE_KEYS}
    one_sided: dict[str, dict[str, int]] = {}
    for s in steps:
        r, c = ref.get(s), cand.get(s)
        if r is None or c is None:
            continue  # reported by _compare_steps
        for key in MOE_KEYS:
            if key in r and key in c:
                compared[key] += 1
                rv, cv = r[key], c[key]
                if isinstance(rv, list) and isinstance(cv, list) and len(rv) == len(cv):
                    for i, (a, b) in enumerate(zip(rv, cv)):
                        if not _nested_equal(a, b):
                            add(s, key, a, b, order=i, layer=i)
                elif not _nested_equal(rv, cv):
                    add(s, key, rv, cv, note="the two sides record different layer counts")
            elif key in r or key in c:
                side = "reference" if key in r else "candidate"
                one_sided.setdefault(key, {}).setdefault(side, 0)
                one_sided[key][side] += 1
    ev: dict[str, Any] = {"compared": any(compared.values()), "steps_compared": compared,
                          "one_sided_steps": one_sided}
    if one_sided:
        sides = sorted({side for d in one_sided.values() for side in d})
        ev["reason"] = f"only the {sides[0]} records {', '.join(sorted(one_sided))}" if len(sides) == 1 else \
            f"each side records some of {', '.join(sorted(one_sided))} alone"
    return ev


def _nested_equal(a: Any, b: Any) -> bool:
    """Lists of the same length equal element by element (recursively), numbers with :func:`exact_equal` (NaN and
    missing values never pass, unlike Python's list ``==``, which takes an identical NaN object as equal)."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and \
            all(_nested_equal(x, y) for x, y in zip(a, b))
    return exact_equal(a, b)


def _compare_modules(rm: dict | None, cm: dict | None, cfg: dict, add, problems: list[str]) -> dict:
    """modules.json (step-1 probes): forwards in forward order, output gradients in backward order. Returns the
    modules' evidence."""
    if rm is None or cm is None:
        ev: dict[str, Any] = {"compared": False, "reason": (
            "neither trace has modules.json" if rm is None and cm is None else
            f"only the {'reference' if rm is not None else 'candidate'} has modules.json")}
        if cfg["require_modules"]:
            problems.append(f"modules required (require_modules) but {ev['reason']}")
        return ev
    names = module_order(set(rm) | set(cm))
    fwd_bad, grad_bad = [], []
    for j, name in enumerate(names):
        re_, ce = rm.get(name) or {}, cm.get(name) or {}
        for key, kind, lst in (("fwd", "module_fwd", fwd_bad), ("grad", "module_grad", grad_bad)):
            if name not in rm or name not in cm or re_.get(key) != ce.get(key):
                lst.append(name)
                extra = {"produced_by": names[j + 1] if j + 1 < len(names) else "loss"} if key == "grad" else {}
                add(1, kind, {"digest": re_.get(key), "l2": re_.get(f"{key}_l2")} if name in rm else None,
                    {"digest": ce.get(key), "l2": ce.get(f"{key}_l2")} if name in cm else None,
                    order=j if key == "fwd" else len(names) - 1 - j, module=name, **extra)
    if rm and not set(rm) & set(cm):
        problems.append(f"the candidate recorded none of the reference's {len(rm)} module probes (an engine that "
                        f"fuses across modules records none, e.g. engine.mode=fast; the bitwise tier is for "
                        f"mode=exact)")
    return {"compared": True, "n_modules": len(names), "fwd_mismatches": fwd_bad, "grad_mismatches": grad_bad,
            "first_fwd_mismatch": fwd_bad[0] if fwd_bad else None,
            "first_grad_mismatch_forward_order": grad_bad[0] if grad_bad else None,
            "first_grad_mismatch_backward_order": grad_bad[-1] if grad_bad else None,
            "note": "module grads (of each module's output) are produced in reverse order: the first divergence "
                    "names the first mismatching one in backward order, and produced_by the module whose "
                    "backward computed it"}


def _compare_final(rp: dict | None, cp: dict | None, last: int, cfg: dict, add, problems: list[str]) -> dict:
    """final.safetensors, counted as after step ``last``. Returns the final params' evidence."""
    if rp is None or cp is None:
        ev: dict[str, Any] = {"compared": False, "reason": (
            "neither trace has final.safetensors" if rp is None and cp is None else
            f"only the {'reference' if rp is not None else 'candidate'} has final.safetensors")}
        if cfg["require_final_params"]:
            problems.append(f"final params required (require_final_params) but {ev['reason']}")
        return ev
    names = param_order(set(rp) | set(cp))
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
    return {"compared": True, "n_tensors": len(names), "mismatched": bad, "max_abs_diff": worst if bad else 0.0}
