"""Write a ladder's verdicts to disk (``verdict.json``, ``loss_curves.png``) and print them as a table.

``verdict.json`` is strict JSON: non-finite floats in the evidence become the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``. It is written atomically (:func:`forgetrain.trace.atomic_write_json`).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

import numpy as np

from forgetrain.equivalence import registry
from forgetrain.equivalence.ladder import LadderResult, summarize
from forgetrain.equivalence.verdict import Verdict, describe_divergence
from forgetrain.trace import atomic_write_bytes, atomic_write_json, read_trace

REPORT_SCHEMA = 1


def jsonable(x: Any) -> Any:
    """Strict-JSON copy: non-finite floats -> strings, tuples -> lists, paths and other objects -> str."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return [jsonable(v) for v in x.tolist()]
    return str(x)


def _as_list(verdicts: Sequence[Verdict] | LadderResult) -> tuple[list[Verdict], str | None, bool | None]:
    if isinstance(verdicts, LadderResult):
        return list(verdicts.verdicts), verdicts.strictest_passed, verdicts.surpassed
    vs = list(verdicts)
    return (vs, *summarize(vs))


def _paths(ref_dirs: Any) -> list[str]:
    if ref_dirs is None:
        return []
    if isinstance(ref_dirs, (str, os.PathLike)):
        return [str(ref_dirs)]
    return [str(d) for d in ref_dirs]


def _curve(d: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps, losses) of a trace directory, non-numeric losses as NaN; None when it cannot be read."""
    try:
        _, recs = read_trace(d)
    except (OSError, ValueError):
        return None
    steps = np.array([int(r["step"]) for r in recs], dtype=np.int64)
    loss = np.array([float(r["loss"]) if isinstance(r.get("loss"), (int, float)) else np.nan for r in recs])
    order = np.argsort(steps, kind="stable")
    return steps[order], loss[order]


def _plot_difference(ax2, refs: list, cand: tuple, windows: list, lc) -> None:
    """The bottom panel of :func:`plot_loss_curves` without a paired verdict: candidate - reference mean per
    common step, as log |diff| at rounding level, else signed with its running mean and the band around zero."""
    common = sorted(set.intersection(*(set(s.tolist()) for _, (s, _) in refs), set(cand[0].tolist())))
    if not common:
        return

    def at(curve):
        idx = {int(s): j for j, s in enumerate(curve[0])}
        return np.array([curve[1][idx[s]] for s in common])

    R = np.stack([at(c) for _, c in refs])
    mean = R.mean(axis=0)
    diff = at(cand) - mean
    x = np.array(common)
    label = "cand - reference" if len(refs) == 1 else f"cand - mean of {len(refs)} references"
    nz = np.abs(diff[np.isfinite(diff) & (diff != 0)])
    scale = float(np.nanmean(np.abs(mean))) or 1.0
    if nz.size == 0:
        ax2.axhline(0.0, color="tab:red", lw=1)
        ax2.text(0.5, 0.5, "candidate == reference at every compared step", transform=ax2.transAxes,
                 ha="center", va="center")
        ax2.set_ylabel("cand - ref (nats)")
    elif nz.max() < 1e-3 * scale:  # rounding-level differences: magnitudes matter, use log |diff|
        ax2.semilogy(x, np.abs(diff), ".-", ms=3, lw=0.6, color="tab:red", label=f"|{label}|")
        if len(refs) > 1:
            for i in range(len(refs)):
                ax2.semilogy(x, np.abs(R[i] - mean), lw=0.6, color="0.6",
                             label="|seed - mean| (reference spread)" if i == 0 else None)
        ax2.set_ylabel("|cand - ref| (nats, log)")
        ax2.legend(fontsize=8, loc="upper right")
    else:  # noisy curves: signed per-step diff, its running mean, and the band around zero
        for j, w in enumerate(windows):
            s0, s1 = w["steps"]
            ax2.fill_between([s0, s1], [-w["half_width"]] * 2, [w["half_width"]] * 2, color="0.88",
                             zorder=0, label="band half-width" if j == 0 else None)
        if len(refs) > 1:
            for i in range(len(refs)):
                ax2.plot(x, R[i] - mean, lw=0.5, color="0.6",
                         label="seed - mean (reference spread)" if i == 0 else None)
        ax2.plot(x, diff, lw=0.6, color="tab:red", alpha=0.45, label=label)
        win = int(lc.evidence["window_steps"]) if lc is not None else max(1, len(x) // 20)
        if win > 1 and len(x) >= win:
            run = np.convolve(diff, np.ones(win) / win, mode="valid")
            ax2.plot(x[win - 1:], run, lw=1.6, color="tab:red", label=f"running mean ({win} steps)")
        ax2.axhline(0.0, color="k", lw=0.5)
        ax2.set_ylabel("cand - ref (nats)")
        ax2.legend(fontsize=8, loc="upper left", ncol=2)


def plot_loss_curves(path: str | Path, ref_dirs: Any, cand_dir: str | Path | None,
                     verdicts: Sequence[Verdict] = ()) -> Path:
    """Write a two-panel PNG. Top: losses of the references and the candidate, and, when a loss_curve verdict
    is given, its band (one box per window: the band constrains window means) with the reference and candidate
    window means. Bottom: the per-step difference candidate - reference mean: log |diff| when every difference
    is below 1e-3 of the loss (rounding-level: bitwise/tolerance runs), else signed, with its running mean and
    the band half-width around zero; the references' own seed - mean in grey for scale. Unreadable traces are
    skipped and named in the figure. Returns the path. Uses matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    refs = [(d, _curve(d)) for d in _paths(ref_dirs)]
    cand = _curve(str(cand_dir)) if cand_dir is not None else None
    unreadable = [d for d, c in refs if c is None]
    if cand_dir is not None and cand is None:
        unreadable.append(str(cand_dir))
    refs = [(d, c) for d, c in refs if c is not None]

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    curve_tiers = registry.names(registry.CURVE)
    lc = next((v for v in verdicts if v.tier in curve_tiers and v.evidence.get("windows")), None)
    windows = lc.evidence["windows"] if lc is not None else []
    for j, w in enumerate(windows):  # the band constrains WINDOW MEANS: one box per window, the mean as a mark
        s0, s1 = w["steps"]
        ax1.fill_between([s0, s1], [w["lo"]] * 2, [w["hi"]] * 2, color="0.88", zorder=0,
                         label="loss-curve band for window means" if j == 0 else None)
        ax1.plot([s0, s1], [w["ref_mean"]] * 2, color="0.35", lw=1.2, zorder=1,
                 label="reference window mean" if j == 0 else None)
        ax1.plot([(s0 + s1) / 2], [w["cand"]], "D", ms=4, zorder=3,
                 color="tab:red" if w["inside"] else "black",
                 label=("candidate window mean" + (" (unpaired runs)" if lc.evidence.get("unpaired") else ""))
                 if j == 0 else None)
    cmap = plt.get_cmap("Blues")
    for i, (d, (s, l)) in enumerate(refs):
        ax1.plot(s, l, lw=0.9, alpha=0.8, color=cmap(0.45 + 0.5 * i / max(1, len(refs) - 1)),
                 label=f"reference {i}: {Path(d).parent.name if Path(d).name == 'trace' else Path(d).name}")
    if cand is not None:
        name = Path(str(cand_dir))
        ax1.plot(cand[0], cand[1], lw=1.4, color="tab:red",
                 label=f"candidate: {name.parent.name if name.name == 'trace' else name.name}")
    ax1.set_ylabel("loss (nats)")
    ax1.set_title("loss curves" + (f"  (unreadable: {', '.join(Path(u).name for u in unreadable)})"
                                   if unreadable else ""))
    ax1.legend(fontsize=8, loc="upper right")
    ax1.grid(alpha=0.3)

    paired = next((v.evidence["paired"] for v in verdicts if v.tier in curve_tiers and v.evidence.get("paired")),
                  None)
    if paired is not None:
        _plot_paired(ax2, paired)
    elif refs and cand is not None:
        _plot_difference(ax2, refs, cand, windows, lc)
    else:
        ax2.text(0.5, 0.5, "no reference/candidate pair to difference", transform=ax2.transAxes,
                 ha="center", va="center")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()

    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _plot_paired(ax, pe: dict) -> None:
    """The paired test on ``ax``: each window's mean paired difference (candidate - reference, same seed) with its
    interval, inside the window's shaded margin, and the late interval against +-delta."""
    for j, w in enumerate(pe["windows"]):
        s0, s1 = w["steps"]
        ax.fill_between([s0, s1], [-w["margin"]] * 2, [w["margin"]] * 2, color="0.88", zorder=0,
                        label="window margin" if j == 0 else None)
        mid = (s0 + s1) / 2
        ax.errorbar([mid], [w["mean_diff"]], yerr=[[w["mean_diff"] - w["ci"][0]], [w["ci"][1] - w["mean_diff"]]],
                    fmt="D", ms=4, color="tab:red" if w["inside"] else "black", capsize=2,
                    label=f"mean paired diff, {pe['ci_level']:.0%} CI" if j == 0 else None)
    late = [w for w in pe["windows"]][-max(1, len(pe["windows"]) // 4):]
    x0, x1 = late[0]["steps"][0], late[-1]["steps"][1]
    for y in (-pe["delta"], pe["delta"]):
        ax.plot([x0, x1], [y, y], color="tab:blue", lw=1.2, label="late margin +-delta" if y > 0 else None)
    ax.fill_between([x0, x1], [pe["ci"][0]] * 2, [pe["ci"][1]] * 2, color="tab:red", alpha=0.25,
                    label="late difference CI")
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_ylabel("cand - ref, paired (nats)")
    ax.legend(fontsize=8, loc="upper left", ncol=2)


def write_report(verdicts: Sequence[Verdict] | LadderResult, out_dir: str | Path, ref_dirs: Any,
                 cand_dir: str | Path | None) -> dict[str, Path]:
    """Write ``out_dir/verdict.json`` (atomically) and ``out_dir/loss_curves.png``.

    Inputs: the verdicts (a list or a :class:`LadderResult`); the reference trace dir(s) (one path or a list)
    and the candidate's trace dir (or its curve runs: the first one is drawn), used for the plot and recorded in
    the JSON. The JSON holds ``schema``,
    ``ref_dirs``, ``cand_dir``, ``strictest_passed``, ``surpassed``, ``all_passed`` and every verdict's dict.
    Returns ``{"verdict": path, "plot": path}``. Raises OSError when ``out_dir`` cannot be written.
    """
    from forgetrain.equivalence.tiers.loss_curve import CurveRuns

    vs, strictest, surpassed = _as_list(verdicts)
    if isinstance(cand_dir, CurveRuns):
        cand_dir = cand_dir.first
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"schema": REPORT_SCHEMA, "ref_dirs": _paths(ref_dirs),
           "cand_dir": None if cand_dir is None else str(cand_dir),
           "strictest_passed": strictest, "surpassed": surpassed, "all_passed": all(v.passed for v in vs),
           "verdicts": [v.to_dict() for v in vs]}
    vpath = out / "verdict.json"
    atomic_write_json(vpath, jsonable(doc))
    ppath = plot_loss_curves(out / "loss_curves.png", ref_dirs, cand_dir, vs)
    return {"verdict": vpath, "plot": ppath}


def _clip(s: str, width: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= width else s[: width - 3] + "..."


def format_verdict_table(verdicts: Sequence[Verdict] | LadderResult, summary_width: int = 72,
                         divergence_width: int = 56) -> str:
    """The plain-text table of :func:`print_verdict_table`, as a string."""
    vs, strictest, surpassed = _as_list(verdicts)
    rows = [("tier", "result", "summary", "first divergence")]
    rows += [(v.tier, "pass" if v.passed else "FAIL", _clip(v.summary, summary_width),
              _clip(describe_divergence(v.first_divergence), divergence_width)) for v in vs]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    lines.append(f"strictest equivalence tier passed: {strictest or 'none'}"
                 + ("" if surpassed is None else f"; surpass: {'pass' if surpassed else 'FAIL'}"))
    lines += [f"{v.tier}: {v.summary}" for v in vs if len(v.summary) > summary_width]  # clipped above: in full
    return "\n".join(lines)


def print_verdict_table(verdicts: Sequence[Verdict] | LadderResult, file: TextIO | None = None) -> str:
    """Print ``tier | pass/FAIL | summary | first divergence`` (one row per verdict, long cells clipped with
    ``...``) and a footer naming the strictest equivalence tier passed. Returns the printed text."""
    text = format_verdict_table(verdicts)
    print(text, file=file or sys.stdout, flush=True)
    return text
