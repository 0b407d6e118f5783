"""The forge's processes: the agent, the ladder, and the sandboxed sides the ladder starts.

Every process runs with a time limit and its leftovers are killed when it returns (:func:`run_group`), so nothing
keeps writing after the harness moves on. A process that left its group (``setsid``, ``setpgid``) escapes that
kill; the ladder process therefore becomes its orphans' reaper (:func:`become_subreaper`, Linux) and, after each
side, kills whatever the side left behind (:func:`kill_leftovers`): nothing a candidate started can act after its
checks. The ladder and the golden sides use the forge run's bytecode cache, and each candidate's side a private
copy of it (:func:`forgetrain.forge.sandbox.sandbox_env`, :func:`forgetrain.forge.sandbox.candidate_cache`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from forgetrain.forge import AgentConfig
from forgetrain.forge import workspace as wsmod
from forgetrain.forge.sandbox import private_cache, sandbox_env


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent exits
PR_SET_CHILD_SUBREAPER = 36  # prctl(2): orphaned descendants are re-parented to this process, not to init
_SUBREAPER = False  # set by become_subreaper(): this process reaps the orphans it adopts


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): a process
    that a side started and that left the side's process group is re-parented here when its parent exits, where
    :func:`kill_leftovers` finds it. Returns whether it took effect (False off Linux: docs/forge.md, threat
    model)."""
    global _SUBREAPER
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        _SUBREAPER = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        _SUBREAPER = False
    return _SUBREAPER


PR_SET_DUMPABLE = 4  # prctl(2): 0 = no ptrace attach, no /proc/<pid>/mem by another process of the same user


def no_ptrace() -> bool:
    """Make this process non-dumpable (Linux ``prctl(PR_SET_DUMPABLE, 0)``): another process of the same user can
    then neither attach to it with ptrace nor read or write its ``/proc/<pid>/mem``, so code it waits on (the
    user's run of the seal's plain re-check) cannot rewrite a judge in memory. A process with ``CAP_SYS_PTRACE``
    (root) still can. Returns whether it took effect (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int | None, sig: int = signal.SIGTERM) -> bool:
    """Have this process get ``sig`` when its parent exits (Linux ``prctl(PR_SET_PDEATHSIG)``), so that a killed
    forge does not leave its ladder (and the sides the ladder ends on SIGTERM, :func:`kill_active`) running. When
    ``parent`` (the pid that started this process) is given and is no longer the parent, it has already exited:
    ``sig`` is sent at once. Returns whether the setting took effect (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        ok = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return ok


def children() -> dict[int, str]:
    """{pid: state} of this process's children (``/proc/*/stat``; empty where there is no ``/proc``)."""
    me, out = os.getpid(), {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for n in names:
        if not n.isdigit():
            continue
        try:
            with open(f"/proc/{n}/stat", "rb") as f:
                rest = f.read().decode(errors="replace").rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if len(rest) > 1 and rest[1].isdigit() and int(rest[1]) == me:
            out[int(n)] = rest[0]
    return out


def _reap_adopted() -> None:
    """Reap the zombies among the orphans this process adopted as a subreaper (never a Popen's own child)."""
    if not _SUBREAPER:
        return
    ours = {p.pid for p in _ACTIVE}
    for pid, state in children().items():
        if state == "Z" and pid not in ours:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def kill_leftovers(before: set[int], grace_s: float = 0.5, limit_s: float = 10.0) -> list[str]:
    """SIGKILL every live child of this process that is not in ``before`` (its children before a side started) and
    not a running side: the orphans a side left behind, re-parented here (:func:`become_subreaper`). One that ends
    by itself within ``grace_s`` (a worker exiting because its parent died) is reaped, not counted. Repeats until
    none is left (a killed orphan's own children are adopted in turn). Returns ``pid N: command line`` of each
    one killed."""
    found: dict[int, str] = {}
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        _reap_adopted()
        ours = {p.pid for p in _ACTIVE} | set(before)
        live = [pid for pid, state in children().items() if pid not in ours and state not in "ZX"]
        if not live:
            break
        if time.monotonic() - t0 >= grace_s:
            for pid in live:
                if pid not in found:
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            cmd = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
                    except OSError:
                        cmd = ""
                    found[pid] = f"pid {pid}: {cmd[:200] or '?'}"
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.02)
    _reap_adopted()
    return list(found.values())


def kill_group(p: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process group led by ``p``, then SIGKILL what is left after ``grace_s``. The leader is reaped
    while waiting (a zombie still counts as a group member for ``killpg(pgid, 0)``), and so are the group's members
    this process adopted as a subreaper."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            p.poll()
            _reap_adopted()
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


def start_group(cmd, *, cwd: Path, env: dict, stdin=None, stdout=None, stderr=None, shell: bool = False,
                pass_fds: tuple = ()) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (:func:`wait_group` ends it)."""
    p = subprocess.Popen(cmd, shell=shell, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                         start_new_session=True, pass_fds=pass_fds)
    _ACTIVE.add(p)
    return p


def wait_group(p: subprocess.Popen, timeout_s: float | None) -> tuple[Optional[int], bool]:
    """Wait for a group :func:`start_group` started; returns (rc or None, timed_out). Its leftover members are
    killed when it returns."""
    timed_out = False
    try:
        rc = p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out, rc = True, None
    finally:
        kill_group(p)
        _ACTIVE.discard(p)
    return rc, timed_out


def run_group(cmd, *, cwd: Path, env: dict, timeout_s: float | None, stdin=None, stdout=None, stderr=None,
              shell: bool = False, pass_fds: tuple = ()) -> tuple[Optional[int], bool, float]:
    """Run ``cmd`` in its own process group; returns (rc or None, timed_out, seconds). Leftover children of the
    group are killed when it returns."""
    t0 = time.monotonic()
    p = start_group(cmd, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, shell=shell, pass_fds=pass_fds)
    rc, timed_out = wait_group(p, timeout_s)
    return rc, timed_out, time.monotonic() - t0


TERMINAL_SIZE = (24, 80)  # rows, columns: a pseudo-terminal's window, as a terminal emulator opens one


def _controlling_terminal() -> None:
    """In the child, after ``setsid``: make stdin (the pty's slave) the controlling terminal of the group it leads."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def run_on_terminal(cmd, *, cwd: Path, env: dict, timeout_s: float | None,
                    log_path: Path) -> tuple[Optional[int], bool, float, dict]:
    """Run ``cmd`` as a user's command typed at a terminal: in a session of its own (its process group's leader)
    whose controlling terminal is a fresh pseudo-terminal (``os.openpty``, a :data:`TERMINAL_SIZE` window), with
    stdin, stdout and stderr on its slave; what it writes is drained from the master into ``log_path`` (the
    terminal's output processing included: ``\\r\\n`` line ends). Its group's leftovers are killed when it
    returns, as :func:`run_group` does. Where no pseudo-terminal can be had (no ``/dev/ptmx``, none free,
    ``TIOCSCTTY`` refused), it runs as :func:`run_group` would, stdin ``/dev/null`` and output to ``log_path``,
    and the record says why. Returns (rc or None, timed_out, seconds, the terminal's record: ``pty``,
    ``controlling``, ``size``, or ``why`` not)."""
    import fcntl
    import struct
    import termios

    t0 = time.monotonic()
    try:
        master, slave = os.openpty()
    except OSError as e:
        why = f"no pseudo-terminal could be opened ({type(e).__name__}: {e})"
        with open(log_path, "wb") as log:
            rc, timed_out, secs = run_group(cmd, cwd=cwd, env=env, timeout_s=timeout_s, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        return rc, timed_out, secs, {"pty": False, "why": why}
    record: dict = {"pty": True, "controlling": True, "size": list(TERMINAL_SIZE)}
    p = None
    try:
        try:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *TERMINAL_SIZE, 0, 0))
        except OSError:
            record["size"] = None
        for ctty in (True, False):  # the pty as the controlling terminal; where refused, as stdio alone
            try:
                p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=_controlling_terminal if ctty else None)
                break
            except (subprocess.SubprocessError, OSError) as e:
                if not ctty:
                    raise
                record.update(controlling=False, why=f"TIOCSCTTY refused ({type(e).__name__}: {e})")
        _ACTIVE.add(p)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)  # the child holds it now: the master reads EOF (EIO) once every holder has closed it

    def drain() -> None:
        try:
            with open(log_path, "wb") as log:
                while True:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:  # EIO: no process holds the slave any more
                        break
                    if not chunk:
                        break
                    log.write(chunk)
                    log.flush()
        finally:
            os.close(master)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        rc, timed_out = wait_group(p, timeout_s)
    finally:
        # a process that left the group may still hold the slave (the caller kills it: kill_leftovers); the
        # drain then ends, and closes the master, by itself
        reader.join(timeout=5.0)
    return rc, timed_out, time.monotonic() - t0, record


def kill_active(*_) -> None:
    """SIGKILL every group this process started and has not reaped, and every process it adopted as a subreaper;
    reap them; then exit 143. Installed as the ladder's SIGTERM handler, so that killing the ladder (its time limit,
    or its parent's death: :func:`die_with_parent`) also ends the sides it started in sessions of their own, before
    the forge run's lock (held by the ladder too) is released."""
    for p in list(_ACTIVE):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in list(_ACTIVE):
        try:
            os.waitpid(p.pid, 0)
        except (ChildProcessError, OSError):
            pass
        _ACTIVE.discard(p)
    kill_leftovers(set(), grace_s=0.0, limit_s=3.0)
    os._exit(143)


def run_reporting(cmd: list[str], *, cwd: Path, env: dict, log_path: Path, timeout_s: float | None,
                  send: Callable[[], bytes] | None = None) -> tuple[Optional[int], bool, list[str]]:
    """Run a side that reports on a pipe: ``cmd`` gets ``--report-fd N`` appended, N being the write end of a pipe
    whose read end is this process's. Output goes to ``log_path``. ``send``, called once the side has started
    (it may take long: the reference's side runs meanwhile), returns what the side reads on its stdin; an
    exception from it kills the side and is raised. Returns (rc or None, timed_out, the report's lines)."""
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
            p = start_group(cmd + ["--report-fd", str(w)], cwd=cwd, env=env,
                            stdin=subprocess.PIPE if send else subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, pass_fds=(w,))
            os.close(w)
            w = -1
            try:
                if send is not None:
                    data = send()
                    try:
                        p.stdin.write(data)
                        p.stdin.close()
                    except (BrokenPipeError, OSError):
                        pass  # the side died before reading its run: its report says why
            except BaseException:
                kill_group(p, grace_s=0.5)
                _ACTIVE.discard(p)
                raise
            rc, timed_out = wait_group(p, timeout_s)
    finally:
        if w >= 0:
            os.close(w)
    reader.join(timeout=10.0)
    return rc, timed_out, list(lines)


def format_agent_command(template: str, brief: Path, ws: Path, round_k: int) -> str:
    """Substitute ``{brief}``, ``{workspace}`` and ``{round}`` (paths shell-quoted where needed)."""
    return (template.replace("{brief}", shlex.quote(str(brief))).replace("{workspace}", shlex.quote(str(ws)))
            .replace("{round}", str(round_k)))


def run_agent(agent: AgentConfig, ws: Path, brief: Path, round_k: int, rdir: Path) -> dict:
    """Run the agent command in the workspace; stdout/stderr go to ``rdir``. Returns rc, timeout flag, seconds and
    ``agent_leftovers``: the processes the agent started that outlived its round (``pid N: command line``), killed.
    This process is made the subreaper of its descendants (:func:`become_subreaper`) before the agent starts, so
    that one which left the agent's process group (``setsid``, a double fork) is re-parented here and
    found (:func:`kill_leftovers`; on Linux only). Its Python writes no bytecode (``PYTHONDONTWRITEBYTECODE``):
    bytecode in the workspace rejects a round."""
    cmd = format_agent_command(agent.command, brief, ws, round_k)
    env = dict(os.environ, FORGE_BRIEF=str(brief), FORGE_WORKSPACE=str(ws), FORGE_ROUND=str(round_k),
               FORGE_HARNESS_PID=str(os.getpid()), PYTHONDONTWRITEBYTECODE="1")
    (rdir / "agent.command").write_text(cmd + "\n")
    become_subreaper()
    kids = set(children())
    with open(rdir / "agent.stdout", "wb") as so, open(rdir / "agent.stderr", "wb") as se:
        rc, timed_out, secs = run_group(cmd, shell=True, cwd=ws, env=env, timeout_s=agent.timeout_s,
                                        stdin=subprocess.DEVNULL, stdout=so, stderr=se)
    left = kill_leftovers(kids)
    return {"agent_rc": rc, "agent_timeout": timed_out, "agent_s": round(secs, 3), "agent_leftovers": left}


def subprocess_ladder(spec_path: Path, ws: Path, out: Path, timeout_s: float, log_path: Path,
                      cache_dir: Path | None = None, pass_fds: tuple = ()) -> dict:
    """The default ladder: ``python -m forgetrain.forge._ladder`` in a subprocess with a time limit, using the
    private bytecode cache ``cache_dir`` (default: a new, empty one). It dies with this process
    (``--parent-pid``: :func:`die_with_parent`); ``pass_fds`` (the forge run's lock) are held by it too, so that
    the lock is free only once the ladder and its sides have ended."""
    result = out.parent / "ladder_result.json"
    if result.exists():
        result.unlink()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [wsmod.python(), "-m", "forgetrain.forge._ladder", "--spec", str(spec_path), "--workspace", str(ws),
           "--out", str(out), "--result", str(result), "--parent-pid", str(os.getpid())]
    with private_cache(cache_dir) as cache, open(log_path, "wb") as log:
        rc, timed_out, secs = run_group(cmd, cwd=out, env=sandbox_env(cache, writable=True), timeout_s=timeout_s,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        pass_fds=tuple(pass_fds))
    if timed_out:
        return {"ok": False, "error": f"ladder timed out after {timeout_s:.0f} s (candidate hung or too slow)",
                "timeout": True, "verdicts": [], "target_met": False, "strictest_passed": None, "wall_s": secs}
    if not result.exists():
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        return {"ok": False, "error": f"ladder process died (rc={rc}) without a result; see {log_path}",
                "traceback": tail, "verdicts": [], "target_met": False, "strictest_passed": None, "wall_s": secs}
    return json.loads(result.read_text())
