"""What ``forgetrain.bench`` reports: one row per side (median step, spread, tokens/s, both MFU conventions,
memory, speed vs the forged engine), the printed tables and warnings, and ``bench.json``."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from forgetrain.bench.sides import value_text, recompute_warnings, side_label
from forgetrain.bench.steps import rank_world
from forgetrain.config import RunConfig, grad_accum_steps

if TYPE_CHECKING:
    from forgetrain.bench import BenchConfig


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
                     **mfu_metrics(cfg.model, tokens / med, peak, rank_world()[1]), "mem_gib": mem.get(name),
                     "forged_speedup": med / base, "n": len(ts), "peak": label, "devices": rank_world()[1],
                     "label": side_label(name, cfg),
                     "global_batch_size": cfg.train.global_batch_size, "grad_accum": grad_accum_steps(cfg)})
    return rows


def noise_warnings(rows: Optional[list[dict]], title: str) -> list[str]:
    """One ``warning:`` line per row of ``rows`` (from :func:`summarize`; None: no rows) whose step times are noisy
    (``noisy``: IQR above :data:`NOISY_IQR_PCT` percent of the median), naming the row set ``title``, the spread
    and what to do."""
    return [f"warning: noisy timings ({title}, side {r['side']}): step_s IQR {r['step_s_iqr_pct']:.1f}% of the "
            f"median, steps from {r['step_s_min_pct']:.0f}% to {r['step_s_max_pct']:.0f}% of it (above "
            f"{NOISY_IQR_PCT:g}%, forgetrain.bench.report.NOISY_IQR_PCT: differences of a few % between sides are not "
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


def candidate_line(candidate: dict, times: dict) -> str:
    """One line comparing the candidate's median step with the forged one's (``times`` as from
    :func:`timed_sides`): "candidate {overrides}: step_s 0.9870 vs forged 1.0000 (1.3% faster)"."""
    f, c = statistics.median(times["forged"]), statistics.median(times["candidate"])
    what = ", ".join(f"{k}={value_text(v)}" for k, v in candidate.items())
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


def report_rows(title: str, cfg: RunConfig, b: BenchConfig, mode: str, times: dict) -> list[dict]:
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


def write_report(out: Path, rc: RunConfig, b: BenchConfig, mode: str, times: dict, rows: list[dict],
                  warning: Optional[str], complete: bool, single_times: Optional[dict] = None,
                  rows_single: Optional[list[dict]] = None) -> None:
    """``<out>/bench.json`` (atomically): the headline ``rows`` and ``times``, the one-micro-batch ``rows_single``
    and ``single_times`` (None: not timed, or not yet when ``complete`` is false), what ran out of memory and why,
    the sides that could not run, profiles, engine info, warnings (noisy sides' included, with the threshold
    ``noisy_iqr_pct``: :data:`NOISY_IQR_PCT`), versions and the command line."""
    from forgetrain.trace import atomic_write_json
    from forgetrain.run.identity import versions

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
