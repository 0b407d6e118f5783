"""The operating system's isolation of a candidate's process: a private mount namespace in which the judge's
files do not exist and nothing but the candidate's own output dir is writable.

``python -I -S -B forgetrain/forge/isolate.py PLAN -- CMD...`` (a script with no import of the package: it runs
before anything else in the candidate's process) enters a new user and mount namespace (``unshare(2)``, the
mechanism bubblewrap uses; no setuid helper, no root needed where unprivileged user namespaces are enabled),
then, before ``execve(CMD)``:

1. binds each ``rw`` path of the plan onto itself (a writable mount of its own);
2. remounts every other mount read-only (``MS_BIND|MS_REMOUNT|MS_RDONLY``; procfs and sysfs stay, their writable
   files need capabilities the namespace does not have);
3. covers each ``scratch`` path (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``$TMPDIR``: places any process could fill
   while the candidate runs) with an empty tmpfs of its own, writable and gone with the namespace, and each
   ``hide`` path with an empty, read-only tmpfs: the goldens, the ladder run's dir, the reference frameworks'
   packages, ``references/``, the shared caches, the harness's bytecode cache, the forge run's dir;
4. binds back in place, read-only, each ``base`` path that lies inside a covered scratch path (what the process
   needs to run: the repository, the interpreter's prefixes, when a checkout lives under ``/tmp``), then the
   ``hide`` paths inside it are covered again, and last the ``ro`` and ``rw`` paths that lie inside a covered one
   are bound back in place (all from descriptors opened before step 1);
5. enters a second user namespace, so that every mount above is locked: the candidate, whatever its
   capabilities inside, can neither unmount a cover nor remount a read-only mount writable. ``/proc/<pid>/root``
   of the processes outside is refused to it too (another user namespace).

:func:`available` probes this once per process (a child runs steps 1-5 on a scratch dir); :func:`wrap` prefixes
the candidate's command when it works and returns the command unchanged (the in-process guard alone) when it
does not, and :func:`status` says which holds, for the ladder's result. docs/forge.md (threat model) says what
holds in each case.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
_KEEP = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
         (getattr(os, "ST_NOATIME", 1024), MS_NOATIME), (getattr(os, "ST_NODIRATIME", 2048), MS_NODIRATIME),
         (getattr(os, "ST_RELATIME", 4096), MS_RELATIME))
_LIVE_FS = ("proc", "sysfs")
_PROBE: list = []  # [(ok, why)] once probed


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(libc, src, target: str, fs, flags: int, data=None) -> None:
    _check(libc.mount(src and src.encode(), target.encode(), fs and fs.encode(), ctypes.c_ulong(flags),
                      data and data.encode()), f"mount {target}")


def _enter_userns(libc) -> None:
    """A new user and mount namespace, this process's uid and gid mapped onto themselves."""
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _mount_points() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, rest = line.partition(" - ")
            if rest.split()[0] in _LIVE_FS:
                continue
            out.append(fields.split()[4].encode().decode("unicode_escape"))
    return out


def _remount_ro(libc, target: str) -> None:
    st = os.statvfs(target)
    keep = sum(ms for st_flag, ms in _KEEP if st.f_flag & st_flag)
    _mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def enter(plan: dict) -> None:
    """Steps 1-5 of the module docstring in this process, for ``plan`` (``scratch``, ``base``, ``hide``, ``ro``,
    ``rw``: lists of absolute paths; missing ``scratch``, ``base`` and ``hide`` paths are skipped, ``ro``/``rw``
    paths must exist). Raises OSError when a step fails (the caller must then not run the candidate)."""
    libc = _libc()
    scratch = _outermost({os.path.realpath(p) for p in plan.get("scratch", []) if os.path.isdir(p)})
    base = _outermost({os.path.realpath(p) for p in plan.get("base", []) if os.path.isdir(p)})
    base = [b for b in base if any(_under(b, x) for x in scratch)]  # only what a scratch cover would take away
    hide = _outermost({os.path.realpath(p) for p in plan.get("hide", []) if os.path.isdir(p)})
    # a hide under a scratch cover is gone with it, unless a base path brings it back
    hide = [h for h in hide if not any(_under(h, x) for x in scratch) or any(_under(h, b) for b in base)]
    rw = sorted({os.path.realpath(p) for p in plan.get("rw", [])})
    ro = sorted({os.path.realpath(p) for p in plan.get("ro", [])} - set(rw))
    _enter_userns(libc)
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    for p in rw:
        _mount(libc, p, p, None, MS_BIND | MS_REC)
    fds = {p: os.open(p, os.O_PATH) for p in rw + ro + base}  # before the covers: they keep reaching the real files
    for mp in _mount_points():
        if mp not in rw and os.path.exists(mp):
            _remount_ro(libc, mp)
    for x in scratch:  # empty and writable: nothing another process put there is visible
        _mount(libc, "tmpfs", x, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for b in base:  # what the process needs to run, back in place and read-only
        _bind_back(libc, fds[b], b)
        _remount_ro(libc, b)
    for h in hide:
        _mount(libc, "tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")

    def covered(p):
        return any(_under(p, h) for h in hide) or (any(_under(p, x) for x in scratch)
                                                   and not any(_under(p, b) for b in base))

    for p in rw + ro:
        if not covered(p):
            if p in ro:
                continue  # already visible, and read-only like everything else
        else:
            _bind_back(libc, fds[p], p)
        if p in ro:
            _remount_ro(libc, p)
    for h in hide:
        _remount_ro(libc, h)
    for fd in fds.values():
        os.close(fd)
    _enter_userns(libc)  # the mounts above are now locked for whatever runs next


def runtime_paths(repo: str) -> list:
    """What a process of this interpreter needs to run from the repository ``repo``: the repository, the
    interpreter's prefixes and executable's dir, and this process's ``sys.path`` entries; a plan's ``base``, kept in
    place where a scratch cover would take it (a checkout or virtual environment under ``/tmp``)."""
    paths = [repo, sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *sys.path[1:]]
    return [p for p in paths if p]


def _outermost(paths) -> list:
    """``paths`` without those that lie inside another of them, sorted."""
    paths = sorted(paths)
    return [p for p in paths if not any(_under(p, o) and p != o for o in paths)]


def _bind_back(libc, fd: int, p: str) -> None:
    """Bind what descriptor ``fd`` (opened on ``p`` before the covers) reaches back at ``p``, making the mount point
    (a dir, or an empty file) under whatever now covers it."""
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(p, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()
    _mount(libc, f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)


def _probe() -> tuple[bool, str]:
    """Whether :func:`enter` works here: a forked child runs it on a scratch dir and checks that a hidden file is
    gone, a rw path takes a write and the rest refuses one."""
    if not sys.platform.startswith("linux"):
        return False, f"no mount namespaces on {sys.platform}"
    import tempfile

    root = tempfile.mkdtemp(prefix="forge-isolate-probe-")
    try:
        for d in ("hidden/own", "ro"):
            os.makedirs(os.path.join(root, d))
        open(os.path.join(root, "hidden", "secret"), "w").close()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: isolate, check, report one line
            os.close(r)
            try:
                enter({"hide": [os.path.join(root, "hidden")], "rw": [os.path.join(root, "hidden", "own")]})
                ok = not os.path.exists(os.path.join(root, "hidden", "secret"))
                open(os.path.join(root, "hidden", "own", "x"), "w").close()
                try:
                    open(os.path.join(root, "ro", "y"), "w").close()
                    ok = False
                except OSError:
                    pass
                os.write(w, b"ok" if ok else b"the plan did not hold")
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(w, f"{type(e).__name__}: {e}".encode()[:300])
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            msg = f.read().decode(errors="replace")
        os.waitpid(pid, 0)
        return (True, "private mount namespace") if msg == "ok" else (False, msg or "the probe died")
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def available() -> tuple[bool, str]:
    """(whether the candidate's process can be isolated here, how or why not); probed once per process.
    ``FORGE_ISOLATION=off`` turns it off (the tests of the fallback)."""
    if os.environ.get("FORGE_ISOLATION") == "off":
        return False, "turned off (FORGE_ISOLATION=off)"
    if not _PROBE:
        _PROBE.append(_probe())
    return _PROBE[0]


def status() -> str:
    ok, why = available()
    return why if ok else f"none ({why}): the in-process guard alone"


def wrap(cmd: list[str], plan: dict) -> list[str]:
    """``cmd`` run inside the isolation of ``plan`` when :func:`available`, else ``cmd`` itself."""
    if not available()[0]:
        return cmd
    return [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(plan), "--", *cmd]


def main(argv: list[str]) -> None:
    """``PLAN -- CMD...``: enter the isolation of ``PLAN`` (JSON), then become ``CMD``. Bad arguments, or an
    isolation that cannot be entered, end it with one ``error:`` line and exit status 2 (the candidate never
    runs)."""
    if len(argv) < 3 or argv[1] != "--":
        print("error: usage: isolate.py PLAN -- CMD...", file=sys.stderr)
        sys.exit(2)
    try:
        plan = json.loads(argv[0])
        if not isinstance(plan, dict):
            raise ValueError("not an object")
        enter(plan)
    except (OSError, ValueError) as e:
        print(f"error: cannot isolate the candidate's process: {e}", file=sys.stderr)
        sys.exit(2)
    os.execv(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
