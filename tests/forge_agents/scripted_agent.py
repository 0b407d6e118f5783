"""A scripted coding agent for the forge tests: applies prepared patches to the workspace, round by round.

``python tests/forge_agents/scripted_agent.py PLAN.json`` run by the forge in the workspace (cwd). ``PLAN.json``::

    {"rounds": {"1": ["eps_wrong"], "2": ["eps_fix"], "3": [{"op": "sleep", "seconds": 60}]}}

Each entry is a patch name (``patches/<name>.json``: ``{"description", "ops": [...]}``) or one op. Ops:

* ``replace``: ``path``, ``old``, ``new`` -- exact text replacement (fails loudly when ``old`` is absent);
* ``write`` / ``append``: ``path``, ``text`` (``path`` relative to the workspace, or absolute);
* ``pyc``: ``path``, and ``source`` (text) or ``source_from`` (a file, with optional ``old`` -> ``new``
  replacement and ``append`` text) -- writes that source compiled to bytecode at ``path``; with ``stamp_like`` (a
  ``.py`` path) the header carries that file's mtime and size and the code that file's name, so Python would take
  the bytecode for that file's (a planted cache); with ``"encoding": "base64"`` the bytes are written as base64
  text (a payload the engine carries as data and plants at run time);
* ``python``: ``code`` -- run Python code in the agent's process, in the workspace (an agent's own scripts: it
  may run the gate's golden maker, read the repository, write anywhere it has permission to);
* ``sleep``: ``seconds`` (a hung agent);
* ``kill_harness``: SIGKILL the forge process ($FORGE_HARNESS_PID), once per plan (a marker file beside the plan
  remembers it), simulating a crash of the loop in the middle of a round;
* ``pidfile``: ``path`` -- write this agent's pid there (to check that a hung agent was killed);
* ``exit``: ``code``.

The round comes from $FORGE_ROUND; a round absent from the plan does nothing. ``{name}`` in an op's strings is
replaced by the plan's ``vars`` (e.g. ``{"vars": {"gate_root": "/tmp/x"}}``): the tests point patches at a private
copy of the repository's gate files.
"""

import base64
import importlib.util
import json
import marshal
import os
import signal
import struct
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _path(x: str) -> Path:
    p = Path(x)
    return p if p.is_absolute() else Path.cwd() / p


def _subst(op, plan_vars: dict):
    if isinstance(op, str):
        for k, v in plan_vars.items():
            op = op.replace("{" + k + "}", str(v))
        return op
    if isinstance(op, dict):
        return {k: _subst(v, plan_vars) for k, v in op.items()}
    return op


def apply(op: dict, plan_path: Path) -> None:
    kind = op["op"]
    if kind == "pyc":
        src = op["source"] if "source" in op else _path(op["source_from"]).read_text()
        if "old" in op:
            src = src.replace(op["old"], op["new"])
        src += op.get("append", "")
        target = _path(op["path"])
        stamp = _path(op["stamp_like"]) if "stamp_like" in op else None
        code = compile(src, str(stamp or target), "exec")
        st = stamp.stat() if stamp else None
        header = importlib.util.MAGIC_NUMBER + struct.pack(
            "<III", 0, int(st.st_mtime) & 0xFFFFFFFF if st else 0, (st.st_size if st else len(src.encode())) & 0xFFFFFFFF)
        target.parent.mkdir(parents=True, exist_ok=True)
        blob = header + marshal.dumps(code)
        target.write_bytes(base64.b64encode(blob) if op.get("encoding") == "base64" else blob)
        print(f"pyc {target}")
    elif kind in ("replace", "write", "append"):
        p = _path(op["path"])
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
    elif kind == "python":
        exec(compile(op["code"], f"<plan op {kind}>", "exec"), {"__name__": "__plan__", "plan_path": plan_path})
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
    plan_vars = {"cache_tag": sys.implementation.cache_tag, **plan.get("vars", {})}
    for entry in plan.get("rounds", {}).get(k, []):
        if isinstance(entry, str):
            patch = json.loads((HERE / "patches" / f"{entry}.json").read_text())
            print(f"patch {entry}: {patch.get('description', '')}")
            for op in patch["ops"]:
                apply(_subst(op, plan_vars), plan_path)
        else:
            apply(_subst(entry, plan_vars), plan_path)


if __name__ == "__main__":
    main()
