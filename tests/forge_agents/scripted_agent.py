"""A scripted coding agent for the forge tests: applies prepared patches to the workspace, round by round.

``python tests/forge_agents/scripted_agent.py PLAN.json`` run by the forge in the workspace (cwd). ``PLAN.json``::

    {"rounds": {"1": ["eps_wrong"], "2": ["eps_fix"], "3": [{"op": "sleep", "seconds": 60}]}}

Each entry is a patch name (``patches/<name>.json``: ``{"description", "ops": [...]}``) or one op. Ops:

* ``replace``: ``path``, ``old``, ``new`` -- exact text replacement (fails loudly when ``old`` is absent);
* ``write`` / ``append``: ``path``, ``text`` (``path`` relative to the workspace, or absolute);
* ``sleep``: ``seconds`` (a hung agent);
* ``kill_harness``: SIGKILL the forge process ($FORGE_HARNESS_PID), once per plan (a marker file beside the plan
  remembers it), simulating a crash of the loop in the middle of a round;
* ``pidfile``: ``path`` -- write this agent's pid there (to check that a hung agent was killed);
* ``exit``: ``code``.

The round comes from $FORGE_ROUND; a round absent from the plan does nothing.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def apply(op: dict, plan_path: Path) -> None:
    kind = op["op"]
    if kind in ("replace", "write", "append"):
        p = Path(op["path"])
        p = p if p.is_absolute() else Path.cwd() / p
        if kind == "replace":
            text = p.read_text()
            if op["old"] not in text:
                sys.exit(f"scripted agent: {op['old']!r} not found in {p}")
            p.write_text(text.replace(op["old"], op["new"], op.get("count", 1)))
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "a" if kind == "append" else "w") as f:
                f.write(op["text"])
        print(f"{kind} {p}")
    elif kind == "sleep":
        print(f"sleeping {op['seconds']} s", flush=True)
        time.sleep(op["seconds"])
    elif kind == "kill_harness":
        marker = plan_path.with_suffix(".killed")
        if marker.exists():
            print("kill_harness: already done once; doing nothing")
            return
        marker.write_text("1")
        print(f"killing the harness {os.environ['FORGE_HARNESS_PID']}", flush=True)
        os.kill(int(os.environ["FORGE_HARNESS_PID"]), signal.SIGKILL)
        sys.exit(0)  # the harness is gone: a real agent would keep editing, but the resumed round redoes it
    elif kind == "pidfile":
        Path(op["path"]).write_text(str(os.getpid()))
    elif kind == "exit":
        sys.exit(op["code"])
    else:
        sys.exit(f"scripted agent: unknown op {kind}")


def main() -> None:
    plan_path = Path(sys.argv[1]).resolve()
    plan = json.loads(plan_path.read_text())
    k = os.environ["FORGE_ROUND"]
    brief = Path(os.environ["FORGE_BRIEF"]).read_text()
    print(f"round {k}: brief of {len(brief)} chars")
    for entry in plan.get("rounds", {}).get(k, []):
        if isinstance(entry, str):
            patch = json.loads((HERE / "patches" / f"{entry}.json").read_text())
            print(f"patch {entry}: {patch.get('description', '')}")
            for op in patch["ops"]:
                apply(op, plan_path)
        else:
            apply(entry, plan_path)


if __name__ == "__main__":
    main()
