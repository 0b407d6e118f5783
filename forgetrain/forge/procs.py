"""The forge's processes: the agent, the ladder, and the sandboxed sides the ladder starts.

Every process runs with a time limit and its leftovers are killed when it returns (:func:`run_group`), so nothing
keeps writing after the harness moves on. The ladder and the golden and candidate sides it starts use the
forge run's private bytecode cache (:func:`forgetrain.forge.sandbox.sandbox_env`); a candidate's side only reads
it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

from forgetrain.forge import AgentConfig
from forgetrain.forge import workspace as wsmod
from forgetrain.forge.sandbox import private_cache, sandbox_env


def kill_group(p: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process group led by ``p``, then SIGKILL what is left after ``grace_s``. The leader is reaped
    while waiting (a zombie still counts as a group member for ``killpg(pgid, 0)``)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            p.poll()
            try:
                os.killpg(p.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)
        else:
            continue
        break
    if p.poll() is None:
        p.wait()


_ACTIVE: set = set()  # groups started by run_group and not yet reaped (kill_active)


def run_group(cmd, *, cwd: Path, env: dict, timeout_s: float | None, stdin=None, stdout=None, stderr=None,
              shell: bool = False, pass_fds: tuple = ()) -> tuple[Optional[int], bool, float]:
    """Run ``cmd`` in its own process group; returns (rc or None, timed_out, seconds). Leftover children of the
    group are killed when it returns."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, shell=shell, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                         start_new_session=True, pass_fds=pass_fds)
    _ACTIVE.add(p)
    timed_out = False
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out, rc = True, None
    finally:
        kill_group(p)
        _ACTIVE.discard(p)
    return rc, timed_out, time.monotonic() - t0


def kill_active(*_) -> None:
    """SIGKILL every group this process started and has not reaped; then exit 143. Installed as the ladder's
    SIGTERM handler, so that killing the ladder (its time limit) also ends the sides it started in sessions of
    their own."""
    for p in list(_ACTIVE):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os._exit(143)


def run_reporting(cmd: list[str], *, cwd: Path, env: dict, log_path: Path,
                  timeout_s: float | None) -> tuple[Optional[int], bool, list[str]]:
    """Run a side that reports on a pipe: ``cmd`` gets ``--report-fd N`` appended, N being the write end of a pipe
    whose read end is this process's. Output goes to ``log_path``. Returns (rc or None, timed_out, the report's
    lines). The write end is closed here once the side has started, so the report ends when the side's group
    does."""
    r, w = os.pipe()
    lines: list[str] = []

    def drain() -> None:
        with os.fdopen(r, "rb") as f:
            for raw in f:
                lines.append(raw.decode(errors="replace"))

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with open(log_path, "ab") as log:
            rc, timed_out, _ = run_group(cmd + ["--report-fd", str(w)], cwd=cwd, env=env, timeout_s=timeout_s,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         pass_fds=(w,))
    finally:
        os.close(w)
    reader.join(timeout=10.0)
    return rc, timed_out, list(lines)


def format_agent_command(template: str, brief: Path, ws: Path, round_k: int) -> str:
    """Substitute ``{brief}``, ``{workspace}`` and ``{round}`` (paths shell-quoted where needed)."""
    return (template.replace("{brief}", shlex.quote(str(brief))).replace("{workspace}", shlex.quote(str(ws)))
            .replace("{round}", str(round_k)))


def run_agent(agent: AgentConfig, ws: Path, brief: Path, round_k: int, rdir: Path) -> dict:
    """Run the agent command in the workspace; stdout/stderr go to ``rdir``. Returns rc, timeout flag, seconds.
    Its Python writes no bytecode (``PYTHONDONTWRITEBYTECODE``): bytecode in the workspace rejects a round."""
    cmd = format_agent_command(agent.command, brief, ws, round_k)
    env = dict(os.environ, FORGE_BRIEF=str(brief), FORGE_WORKSPACE=str(ws), FORGE_ROUND=str(round_k),
               FORGE_HARNESS_PID=str(os.getpid()), PYTHONDONTWRITEBYTECODE="1")
    (rdir / "agent.command").write_text(cmd + "\n")
    with open(rdir / "agent.stdout", "wb") as so, open(rdir / "agent.stderr", "wb") as se:
        rc, timed_out, secs = run_group(cmd, shell=True, cwd=ws, env=env, timeout_s=agent.timeout_s,
                                        stdin=subprocess.DEVNULL, stdout=so, stderr=se)
    return {"agent_rc": rc, "agent_timeout": timed_out, "agent_s": round(secs, 3)}


def subprocess_ladder(spec_path: Path, ws: Path, out: Path, timeout_s: float, log_path: Path,
                      cache_dir: Path | None = None) -> dict:
    """The default ladder: ``python -m forgetrain.forge._ladder`` in a subprocess with a time limit, using the
    private bytecode cache ``cache_dir`` (default: a new, empty one)."""
    result = out.parent / "ladder_result.json"
    if result.exists():
        result.unlink()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [wsmod.python(), "-m", "forgetrain.forge._ladder", "--spec", str(spec_path), "--workspace", str(ws),
           "--out", str(out), "--result", str(result)]
    with private_cache(cache_dir) as cache, open(log_path, "wb") as log:
        rc, timed_out, secs = run_group(cmd, cwd=out, env=sandbox_env(cache, writable=True), timeout_s=timeout_s,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    if timed_out:
        return {"ok": False, "error": f"ladder timed out after {timeout_s:.0f} s (candidate hung or too slow)",
                "timeout": True, "verdicts": [], "target_met": False, "strictest_passed": None, "wall_s": secs}
    if not result.exists():
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        return {"ok": False, "error": f"ladder process died (rc={rc}) without a result; see {log_path}",
                "traceback": tail, "verdicts": [], "target_met": False, "strictest_passed": None, "wall_s": secs}
    return json.loads(result.read_text())
