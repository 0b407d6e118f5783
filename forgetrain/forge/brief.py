"""The per-round brief (``BRIEF.md`` in the workspace): what the agent is told.

``full`` mode: the goal, the constraints, the commands the agent may run, the ladder status with evidence (every
round so far; the last verdicts with the first diverging step, kind, module and tensor; the MFU breakdown), what
went wrong in the last round (guard rejection, timeout, a crash of the candidate), lessons from the knowledge
base, and a workflow.

``goal_only`` mode (the baseline the full mode is measured against): the goal, the constraints and the final
gate command; nothing else.
"""

from __future__ import annotations

import json

from forgetrain.forge.knowledge import fix_line


def _value(x):
    """A divergence side as a short value: the L2 or mean of a probe/tensor record, else the value itself."""
    if isinstance(x, dict):
        for k in ("l2", "mean", "value"):
            if k in x:
                return x[k]
    return x


def describe(d: dict | None) -> str:
    """One line for a first_divergence dict (kept local so that the brief renders without the gates' code)."""
    if not d:
        return "-"
    where = d.get("tensor") or d.get("module") or ""
    s = f"step {d.get('step')} {d.get('kind')}" + (f" {where}" if where else "")
    ref, cand = _value(d.get("ref")), _value(d.get("cand"))
    if isinstance(ref, (int, float)) and isinstance(cand, (int, float)) and not isinstance(ref, bool):
        s += f" (ref {ref:.6g}, cand {cand:.6g})"
    elif isinstance(ref, str) and isinstance(cand, str):
        s += f" (digest {ref[:8]} != {cand[:8]})"
    elif ref is not None or cand is not None:
        s += f" (ref {json.dumps(ref, default=str)[:80]}, cand {json.dumps(cand, default=str)[:80]})"
    return s


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 3] + "..."


def _goal(ctx: dict) -> list[str]:
    g = [f"Make the engine in `engine/` pass the **{ctx['target_tier']}** tier of the equivalence ladder against "
         f"the golden reference (`{ctx['reference']}`) for scenario `{ctx['scenario']}`"
         + (f" ({ctx['description']})" if ctx.get("description") else "") + "."]
    if ctx.get("target_mfu_pct") is not None:
        g.append(f"Also reach a candidate MFU of at least {ctx['target_mfu_pct']:.2f}% (as measured by the gate).")
    g.append(f"Tiers, strictest first: bitwise > tolerance > loss_curve > surpass. The harness tries "
             f"{' -> '.join(ctx['tiers'])} and stops at the first that passes. Gate runs use "
             f"{ctx['shape']}.")
    return g


def _constraints(ctx: dict) -> list[str]:
    return [
        "- Edit only files under `engine/` (add files there if you need them). Everything else in this "
        "directory is read-only: `BRIEF.md`, `gates/`, `references/`, `.gitignore`. A round that changes "
        "anything outside `engine/` is rejected and reverted. Put scratch files under `.gate/` (git-ignored).",
        "- Do not import megatron, deepspeed, transformer_engine, apex or the repository's `references` anywhere "
        "in `engine/`, not even indirectly (importlib or __import__ of a computed name, exec/eval/compile of code, "
        "a child process). An AST scan rejects what it can see; a guard in the gate's candidate process rejects "
        "the rest at run time. Either way the round is rejected and reverted.",
        "- Only the `.py` source in `engine/` runs: bytecode or native modules in the workspace reject the round, "
        "and the engine may import only from `engine/`, `forgetrain.*` and installed packages.",
        "- No reference framework's code under any other name either: a content check compares every function and "
        "module of `engine/` with megatron-core's, deepspeed's and `references/`, renamed or not; and no edits of "
        "`sys.path` or the import machinery.",
        "- The gate's seed, step count and data window are drawn after your round; the golden is made for them then. "
        "Nothing recorded in advance matches a gate run. Write nothing outside this directory: the prepared "
        "corpora and the installed packages are checked around every round.",
        "- An engine is sealed only when its installed copy passes the gate again, run as a user's run: it must "
        "compute the same wherever it is installed and however it is run.",
        "- The engine runs in a process of its own and is judged from its trace: it must leave the harness alone "
        "(no rebinding `forgetrain.*`, no reading the goldens, no writing outside its run directory). Any attempt "
        "rejects the round.",
        "- Do not touch the harness or the gates outside this directory (the ForgeTrain repository's "
        "`forgetrain/`, `conf/`, `references/`, `tests/`) nor the forge run's goldens: they are hashed before and "
        "after you run, and any change aborts the forge run.",
        "- `engine/engine.py` must define `Engine(cfg, device)` implementing `forgetrain.engine.TrainEngine`; "
        "import sibling modules relatively (`from .model import Llama`). `forgetrain.*` helpers may be imported.",
        f"- Each round has a time limit of {ctx['agent_timeout_s']:.0f} s; stop editing well before it.",
    ] + _features(ctx)


def _features(ctx: dict) -> list[str]:
    """The model features beyond Llama the scenario's model sets (:data:`forgetrain.levers.MODEL_FEATURES`): the
    seeded engine may not implement them yet, and a run of an engine whose spec does not declare one is refused."""
    feats = ctx.get("model_features") or []
    if not feats:
        return []
    return [f"- The model sets {', '.join(f'`{f}`' for f in feats)} (see `forgetrain/config/schema.py`, "
            "ModelConfig): the engine must implement each as the reference does and declare it in its spec "
            "(`spec = EngineSpec(..., model_features=(...))`, `forgetrain/levers.py`); a run of an engine that does "
            "not declare one is refused before it starts."]


def _gate(ctx: dict) -> list[str]:
    return ["Run from the workspace directory; it prints a verdict table and exits 0 when the target is met:",
            "", "```", ctx["gate_command"], "```"]


def _verdict_block(res: dict) -> list[str]:
    out = []
    if res.get("error"):
        out.append(f"- The candidate crashed in the gate: `{res['error']}`")
        tb = (res.get("traceback") or "").strip().splitlines()
        if tb:
            out += ["", "```", *tb[-15:], "```", ""]
    for v in res.get("verdicts", []):
        out.append(f"- **{v['tier']}: {'PASS' if v['passed'] else 'FAIL'}** -- {v['summary']}")
        fd = v.get("first_divergence")
        if fd:
            out.append(f"  - first divergence: {describe(fd)}")
            parts = [f"step {fd.get('step')}", f"kind `{fd.get('kind')}`"]
            if fd.get("module"):
                parts.append(f"module `{fd['module']}`")
            if fd.get("tensor"):
                parts.append(f"tensor `{fd['tensor']}`")
            out.append("  - where: " + ", ".join(parts))
            extra = {k: x for k, x in fd.items() if k not in ("step", "kind", "module", "tensor", "ref", "cand")}
            if extra:
                out.append(f"  - detail: `{_clip(json.dumps(extra, default=str), 400)}`")
        if not v["passed"] and v.get("evidence"):
            ev = {k: x for k, x in v["evidence"].items() if k != "config"}  # the tier's config is in gates/
            out.append(f"  - evidence: `{_clip(json.dumps(ev, default=str, sort_keys=True), 1200)}`")
    m = res.get("metrics") or {}
    if m.get("mfu_pct") is not None or m.get("reference"):
        c, r = m.get("candidate") or {}, m.get("reference") or {}
        out += ["", "MFU breakdown (" + m.get("measured_on", "gate run") + "):", "",
                "| side | step_s | tokens/s | MFU % |", "|---|---|---|---|"]
        for name, x in (("candidate", c), ("reference", r)):
            if x:
                out.append(f"| {name} | {x.get('step_s', float('nan')):.4f} | {x.get('tokens_per_s', 0):,.0f} | "
                           f"{x.get('mfu_pct', float('nan')):.3f} |")
        if m.get("speed_ratio_ref_over_cand"):
            out.append(f"\nspeed ratio reference/candidate step time: {m['speed_ratio_ref_over_cand']:.3f}x")
        if m.get("surpass"):
            out.append(f"surpass timing: `{json.dumps(m['surpass'], default=str)}`")
    return out


def _history(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rounds yet)"]
    out = ["| round | agent | guard | ladder | first divergence |", "|---|---|---|---|---|"]
    for r in rows:
        agent = "timeout" if r.get("agent_timeout") else f"rc={r.get('agent_rc')}" if r.get("agent_rc") is not None \
            else "-"
        out.append(f"| {r['round']} | {agent} | {r.get('guard', '-')} | {r.get('ladder', '-')} | "
                   f"{_clip(r.get('first_divergence_text') or '-', 90)} |")
    return out


def _last_round(r: dict | None) -> list[str]:
    if not r:
        return []
    out = []
    if r.get("agent_timeout"):
        out.append(f"- Round {r['round']}: the agent hit the time limit after {r.get('agent_s', 0):.0f} s and was "
                   f"killed; its partial edits were kept and checked.")
    elif r.get("agent_rc") not in (None, 0):
        out.append(f"- Round {r['round']}: the agent exited with code {r['agent_rc']}.")
    if r.get("guard") not in (None, "ok", "skipped"):
        out.append(f"- Round {r['round']}: the guard **rejected** the round ({r['guard']}) and reverted it:")
        out += [f"  - {p}" for p in r.get("guard_problems", [])[:20]]
    if r.get("ladder") == "skipped (no change)":
        out.append(f"- Round {r['round']}: nothing changed in `engine/`; the ladder was not re-run.")
    if r.get("ladder_error"):
        out.append(f"- Round {r['round']}: the gate failed to run the candidate: `{r['ladder_error']}`")
    return out


def _lessons(lessons: list[dict]) -> list[str]:
    if not lessons:
        return ["(none recorded yet)"]
    out = []
    for x in lessons:
        fixes = x.get("fixes") or []
        out.append(f"- [{x.get('tier')}] **pitfall:** {x.get('pitfall')} (seen {x.get('count', 1)}x; "
                   f"scenarios: {', '.join(x.get('scenarios', []))})")
        for f in fixes:
            out.append(f"  - fix that passed: {_clip(fix_line(f), 400)}")
    return out


WORKFLOW = [
    "1. Read the last verdict above: the first divergence names the step, the quantity (per-token loss, a "
    "gradient, a parameter, a module's forward or backward output) and the module/tensor where the candidate "
    "first left the reference. Fix the earliest divergence first; later ones are usually its consequences.",
    "2. Compare the module with the reference source in `references/` and the tier rules in `gates/`.",
    "3. Make the smallest change in `engine/` that addresses it; keep a list of deliberate optimisations in "
    "`engine/OPTIMISATIONS.json` (`[{\"name\", \"description\", \"tier\"}]`, the weakest tier each needs).",
    "4. Run the gate command; iterate until it exits 0 or the round's time is nearly spent. The harness re-runs "
    "the gate after you stop, and that verdict is the one that counts.",
]


def render(ctx: dict) -> str:
    """The brief's Markdown. ``ctx`` keys: scenario, description, mode, round, max_rounds, target_tier,
    target_mfu_pct, tiers, reference, shape, gate_command, agent_timeout_s, and (full mode) last_ladder,
    last_round, history, lessons."""
    head = [f"# Forge brief: `{ctx['scenario']}`, round {ctx['round']}/{ctx['max_rounds']}", ""]
    if ctx["mode"] == "goal_only":
        return "\n".join(head + ["## Goal", "", *_goal(ctx), "", "## Constraints", "", *_constraints(ctx), "",
                                 "## Final gate command", "", *_gate(ctx), ""])
    lines = head + ["## Goal", "", *_goal(ctx), "", "## Constraints", "", *_constraints(ctx), "",
                    "## Commands you may run", "", *_gate(ctx), "",
                    "Also: read anything in this directory; run python/pytest on your own scratch files under `.gate/`.", "",
                    "## Ladder status", "", *_history(ctx.get("history") or []), ""]
    last = ctx.get("last_ladder")
    if last:
        lines += [f"### Last verdict (round {last.get('round')})", "", *_verdict_block(last), ""]
    lr = _last_round(ctx.get("last_round"))
    if lr:
        lines += ["### Last round", "", *lr, ""]
    lines += ["## Lessons from the knowledge base", "", *_lessons(ctx.get("lessons") or []), "",
              "## Workflow", "", *WORKFLOW, ""]
    return "\n".join(lines)
