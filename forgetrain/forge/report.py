"""The forge run's closing report: the table of its rounds and the side-by-side of its modes."""

from __future__ import annotations

import json
import sys
import time

from forgetrain.trace import atomic_write_json


def say(msg: str) -> None:
    """``msg`` on stderr, flushed."""
    print(msg, file=sys.stderr, flush=True)


def summary(run) -> None:
    """The run's table of rounds on stderr (``run``: a :class:`forgetrain.forge.loop._Run`)."""
    rows = [("round", "mode", "agent", "guard", "ladder", "first divergence", "MFU %", "wall")]
    for r in run.records:
        agent = "-" if r["mode"] == "baseline" else ("timeout" if r.get("agent_timeout") else
                                                     f"rc={r.get('agent_rc')} {r.get('agent_s', 0):.1f}s")
        rows.append((str(r["round"]), r["mode"], agent, r.get("guard", "-"), r.get("ladder", "-"),
                     (r.get("first_divergence_text") or "-")[:60],
                     "-" if r.get("mfu_pct") is None else f"{r['mfu_pct']:.3f}", f"{r['wall_s']:.1f}s"))
    widths = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
    lines = ["", f"=== forge summary: {run.scenario} ({run.opts.mode}) -> {run.state['status']} ==="]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"log: {run.log_path}  workspace: {run.ws}" +
                 (f"  seal: {run.state['seal']}" if run.state.get("seal") else ""))
    say("\n".join(lines))


def update_modes(run) -> None:
    """``<out>/../modes.json``: this mode's outcome beside the other mode's, when both have run."""
    path = run.out.parent / "modes.json"
    try:
        modes = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        modes = {}
    last = run.state.get("last_ladder") or {}
    modes[run.opts.mode] = {"status": run.state["status"], "rounds_run": run.state["round"],
                            "rounds_to_pass": run.state.get("rounds_to_pass"),
                            "tier": last.get("strictest_passed"),
                            "final_mfu_pct": (last.get("metrics") or {}).get("mfu_pct"),
                            "wall_s": round(float(run.state.get("wall_s", 0.0)), 3),
                            "out_dir": str(run.out), "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic_write_json(path, modes)
    if len(modes) > 1:
        lines = [f"{'mode':<10} {'status':<24} {'rounds to pass':>14} {'final MFU %':>11} {'wall s':>9}"]
        for m, x in sorted(modes.items()):
            mfu = "-" if x.get("final_mfu_pct") is None else f"{x['final_mfu_pct']:.3f}"
            lines.append(f"{m:<10} {x['status']:<24} {str(x.get('rounds_to_pass') or '-'):>14} {mfu:>11} "
                         f"{x['wall_s']:>9.1f}")
        say("modes side by side (" + str(path) + "):\n" + "\n".join(lines))
