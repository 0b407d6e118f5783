"""The run-time guard of the forge's candidate process (``forgetrain.forge._candidate``).

:func:`install` adds an audit hook (``sys.addaudithook``, PEP 578; it cannot be removed) before the candidate's code
is imported, and returns the check that runs after the candidate has run. Every violation is written at once, as a
JSON line, to a pipe whose read end the ladder process holds (:func:`forgetrain.forge.sandbox.read_report`): a
line once written cannot be taken back, whatever the candidate does next. The hook also refuses the operation
(it raises PermissionError), so a blocked import never runs.

What the hook watches (the escape classes are :data:`forgetrain.forge.sandbox.ESCAPE_CLASSES`):

* ``import`` of an installed module whose root is forbidden (``forgetrain.guard.FORBIDDEN_ROOTS``), and ``exec``
  of a code object whose file lies in a forbidden package (``importlib.import_module`` raises no ``import``
  event for the top module; executing its body does) -> class 2;
* ``exec`` / ``compile`` called directly from engine code, a process started from engine code (``subprocess``,
  ``os.system``, ``os.fork``, ``os.exec*``, ``os.posix_spawn``: the hook cannot see into it) -> class 2;
* module code executed from a file outside engine/, the installed packages, the standard library and the harness;
  ``ctypes``, ``marshal.loads`` and new code objects from engine code -> class 3;
* reading the run's goldens or the ladder run's other files, replacing a harness function's ``__code__``, walking
  the interpreter's objects (``gc.get_referrers`` ...) or tracing frames (``sys.settrace``) from engine code
  -> class 1; reading a reference's source -> class 2;
* writes (open for writing, rename, remove, ...) into the repository's gate directories -> class 4, into the
  workspace or a bytecode cache -> class 3, into the goldens or the ladder run's dir -> class 1; reads or writes of
  the shared caches (prepared corpora, the CPU peak), writes of the data window, and writes anywhere but the
  candidate's own run dir and the compile caches -> class 8;
* ``sys.path`` grown by an entry in engine/ (class 7: the engine's files as top-level packages of their own) or
  in the workspace or outside the code roots (class 3), seen at each import;
* at every write into the candidate's run dir, the modules the harness's trace writer runs on
  (:data:`TRACE_WRITER`) compared with their snapshot -> class 5.

After the run (:func:`install`'s returned check): a forbidden module in ``sys.modules`` -> class 2; a candidate
module not loaded from a ``.py`` file in engine/, or a module from outside the code roots -> class 3; a harness
function or class attribute (``forgetrain.*``) rebound since the snapshot taken at install, or bound to code
from engine/ -> class 1; the same for every other module loaded before the engine (the standard library and
the installed packages: a library wrapping its own function with ``functools.wraps`` aside) -> class 5; a module
loaded from engine/ under another name, a ``sys.path`` entry in engine/, an import finder defined in engine code
-> class 7.

Limits (docs/forge.md, threat model): native code (a C extension, ctypes reached without Python frames), child
processes started through a library (torch's compile workers) and anything outside this process are beyond an
in-process hook, and a candidate that ends its own process early (``os._exit`` from a thread) skips the checks
after the run, though not what the hook reported before; run the agent in a container for those. The checks
after the run are the second line: what decides the verdict is that the judge runs elsewhere. This module
imports neither torch nor the candidate.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import re
import site
import sys
import sysconfig
import tempfile
import threading
import types
from dataclasses import dataclass
from pathlib import Path

from forgetrain.guard import FORBIDDEN_ROOTS

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS_DIR = REPO_ROOT / "forgetrain"
GATE_DIRS = ("forgetrain", "references", "conf", "tests")  # the repository's hashed gate set (sandbox.gate_paths)
CANDIDATE_PACKAGE = "_forge_candidate"  # the engine package's private name (workspace.load_engine_class)
CHANNEL_LOST = 97  # exit status when the report pipe was closed or replaced under the hook
_SPAWN = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty")
_WRITES = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.utime": (0,),
           "os.truncate": (0,), "os.rename": (0, 1), "os.link": (1,), "os.symlink": (1,), "shutil.rmtree": (0,),
           "shutil.move": (0, 1), "shutil.copyfile": (1,), "shutil.copytree": (1,)}
_READS = {"os.link": (0,), "shutil.copyfile": (0,), "shutil.copytree": (0,), "os.symlink": (0,)}
# events refused when engine code is the first caller outside the standard library (ctypes, gc and tracing are
# reached through the standard library) ...
_ENGINE_ONLY = {"ctypes.dlopen": 3, "ctypes.dlsym": 3, "ctypes.cdata": 3, "ctypes.addressof": 3,
                "ctypes.string_at": 3, "ctypes.call_function": 3, "gc.get_referrers": 1, "gc.get_referents": 1,
                "gc.get_objects": 1, "sys.settrace": 1, "sys.setprofile": 1, "sys._current_frames": 1}
# ... and when engine code calls them directly (the import system loads every .pyc with marshal.loads)
_ENGINE_DIRECT = {"marshal.loads": 3, "code.__new__": 3}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _real(p) -> str:
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    return os.path.realpath(os.fspath(p))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@dataclass(frozen=True)
class Policy:
    """What the candidate's process may touch. Paths are real (symlinks resolved). ``read_deny`` /
    ``write_deny`` pair a root with the escape class a touch of it names; ``read_allow`` (the candidate's own
    output dir, its init weights, its data and engine/) and ``write_allow`` (its own output dir, the compile
    caches) win over them. With ``write_only``, a write anywhere else names class 8."""

    engine_dir: str
    read_allow: tuple[str, ...]
    write_allow: tuple[str, ...]
    read_deny: tuple[tuple[str, int], ...]
    write_deny: tuple[tuple[str, int], ...]
    forbidden_dirs: tuple[tuple[str, str], ...]  # (package dir, module root)
    installed_forbidden: frozenset
    code_roots: tuple[str, ...]
    candidate_package: str = CANDIDATE_PACKAGE
    own_out: str = ""
    workspace: str = ""
    write_only: bool = True


def forbidden_package_dirs(workspace: Path | None = None) -> list[tuple[str, str]]:
    """(dir, root) of every installed forbidden package, the repository's ``references/`` and the workspace's
    copy. ``find_spec`` of a top-level name locates the package without running it."""
    out = []
    for root in FORBIDDEN_ROOTS:
        try:
            spec = importlib.util.find_spec(root)
        except (ImportError, ValueError):
            spec = None
        for d in list(getattr(spec, "submodule_search_locations", None) or []) + \
                ([os.path.dirname(spec.origin)] if spec is not None and spec.origin else []):
            out.append((_real(d), root))
    out.append((_real(REPO_ROOT / "references"), "references"))
    if workspace is not None:
        out.append((_real(Path(workspace) / "references"), "references"))
    return sorted(set(out))


def code_roots(engine_dir: Path) -> list[str]:
    """Where module files may come from: the standard library, the installed packages (the site dirs and the
    harness's ``sys.path`` entries, except the repository root, under which only the harness counts), the
    harness, engine/, and the compile caches torch writes generated code into (Inductor's and Triton's)."""
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    roots += list(getattr(site, "getsitepackages", lambda: [])())
    roots += [p for p in sys.path if p and os.path.isabs(p) and _real(p) != _real(REPO_ROOT)]
    roots += compile_caches() + [str(HARNESS_DIR), str(engine_dir), str(REPO_ROOT / "scenarios" / "__init__.py")]
    return sorted({_real(r) for r in roots})


def compile_caches() -> list[str]:
    """The dirs torch writes generated code into (Inductor's and Triton's caches): code roots, and writable."""
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # torch's own default cache dir name
    except (KeyError, OSError):
        user = "unknown"
    return [os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"),
            os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton")]


def build_policy(engine_dir: Path, own_out: Path, init: Path | None, golden_root: Path, workspace: Path,
                 ladder_dir: Path, data_dir: str | None = None, judge_cache: Path | None = None, *,
                 shared_caches: tuple = (), candidate_package: str = CANDIDATE_PACKAGE, hidden: tuple = ()) -> Policy:
    """The policy of one candidate run: ``own_out`` is its output dir, ``init`` the copy of the reference's init
    weights it starts from, ``golden_root`` the run's goldens, ``ladder_dir`` the ladder run's dir (the judge's
    files), ``data_dir`` the data the run reads (the judge's window, read-only), ``judge_cache`` the harness's
    bytecode cache (this process reads its own view, ``sys.pycache_prefix``; the harness's is neither read nor
    written), ``shared_caches`` the project's caches (prepared corpora, the CPU peak: class 8 to touch),
    ``candidate_package`` the name the engine is imported under, ``hidden`` the judge's other dirs (the forge
    run's: other rounds' runs, the installed copy's; class 1 to read)."""
    forbidden = forbidden_package_dirs(workspace)
    cache = [_real(sys.pycache_prefix)] if sys.pycache_prefix else []  # this process's view of the bytecode cache
    judge = [(_real(judge_cache), 3)] if judge_cache is not None else []
    shared = [(_real(c), 8) for c in shared_caches if c]
    data = [_real(data_dir)] if data_dir else []
    read_allow = [_real(own_out), _real(engine_dir)] + ([_real(init)] if init is not None else []) + cache + data
    read_deny = [(_real(golden_root), 1), (_real(ladder_dir), 1)] + [(d, 2) for d, _ in forbidden] + judge + shared \
        + [(_real(h), 1) for h in hidden]
    write_deny = [(_real(REPO_ROOT / d), 4) for d in GATE_DIRS] + [(_real(workspace), 3), (_real(golden_root), 1),
                                                                      (_real(ladder_dir), 1)] + \
        [(c, 3) for c in cache] + judge + shared + [(d, 8) for d in data]
    installed = frozenset(r for _, r in forbidden)
    write_allow = (_real(own_out), _real(os.devnull)) + tuple(_real(c) for c in compile_caches())
    return Policy(_real(engine_dir), tuple(read_allow), write_allow, tuple(read_deny), tuple(write_deny),
                  tuple(forbidden), installed, tuple(code_roots(engine_dir)), candidate_package, _real(own_out),
                  _real(workspace))


def _verdict_for(policy: Policy, path: str, write: bool) -> int | None:
    """The escape class a touch of ``path`` names, or None when it is allowed. The most specific rule wins."""
    best: tuple[int, int | None] = (-1, None)
    for root in (policy.write_allow if write else policy.read_allow):
        if _under(path, root) and len(root) > best[0]:
            best = (len(root), None)
    for root, cls in (policy.write_deny if write else policy.read_deny):
        if _under(path, root) and len(root) > best[0]:
            best = (len(root), cls)
    if write and best[0] < 0 and policy.write_only:
        return 8  # no rule: the candidate writes only into its own output dir
    return best[1]


class _Hook:
    """The audit hook of one candidate process (:func:`install`). The functions it calls are bound when it is
    made, so that rebinding ``os.write`` or ``json.dumps`` later does not reach it."""

    def __init__(self, policy: Policy, fd: int):
        self.policy, self.fd = policy, fd
        self._write, self._exit, self._fstat, self._frame = os.write, os._exit, os.fstat, sys._getframe
        self._ident, self._dumps = threading.get_ident, json.dumps
        st = os.fstat(fd)
        self.channel = (st.st_dev, st.st_ino)
        self.busy: set = set()
        self.reported: set = set()
        paths = sysconfig.get_paths()
        self.stdlib = tuple(_real(paths[k]) for k in ("stdlib", "platstdlib"))
        self.purelib = tuple(_real(paths[k]) for k in ("purelib", "platlib"))
        self.snap, self.path0 = _snapshot(), list(sys.path)
        self.writer = {n: self.snap[n] for n in TRACE_WRITER if n in self.snap}

    def emit(self, obj: dict) -> None:
        try:
            st = self._fstat(self.fd)
            if (st.st_dev, st.st_ino) != self.channel:
                self._exit(CHANNEL_LOST)
            self._write(self.fd, (self._dumps(obj, default=str) + "\n").encode())
        except OSError:
            self._exit(CHANNEL_LOST)

    def _is_stdlib(self, fn: str) -> bool:
        return fn.startswith("<frozen") or (any(_under(fn, r) for r in self.stdlib)
                                            and not any(_under(fn, r) for r in self.purelib))

    def in_engine(self, fn: str) -> bool:
        return bool(fn) and not fn.startswith("<") and _under(_real(fn), self.policy.engine_dir)

    def caller(self, past_stdlib: bool) -> str:
        """The file of the first frame outside this module (and, with ``past_stdlib``, the standard library)."""
        f = self._frame(1)
        while f is not None and (f.f_code.co_filename == __file__ or
                                 (past_stdlib and self._is_stdlib(f.f_code.co_filename))):
            f = f.f_back
        return f.f_code.co_filename if f is not None else ""

    def violation(self, cls: int, what: str, block: bool = True) -> None:
        self.emit({"violation": {"class": cls, "what": what}})
        if block:
            raise PermissionError(f"forge sandbox: {what}")

    def once(self, cls: int, key: str, what: str) -> None:
        if key not in self.reported:
            self.reported.add(key)
            self.violation(cls, what, block=False)

    def touch(self, path, write: bool, event: str) -> None:
        if isinstance(path, int) or path is None:
            return
        p = _real(path)
        cls = _verdict_for(self.policy, p, write)
        if cls is not None:
            self.violation(cls, f"{'wrote' if write else 'read'} {p} ({event})")

    def on_import(self, args: tuple) -> None:
        name = str(args[0])
        if name.split(".")[0] in self.policy.installed_forbidden:
            self.violation(2, f"import of {name}")
        if len(args) > 2 and args[2] is not None and list(args[2]) != self.path0:
            for cls, p in path_additions(self.policy, self.path0, list(args[2])):
                # reported once; the import goes on, so what it loads is named too
                self.once(cls, p, f"sys.path edited: {p} added before importing {name} (a top-level package from "
                                  f"the workspace's files, under a name of its own)")

    def on_exec(self, args: tuple) -> None:
        fn = getattr(args[0], "co_filename", "") or ""
        if fn and not fn.startswith("<") and (os.path.isabs(fn) or os.path.exists(fn)):
            real = _real(fn)
            for d, root in self.policy.forbidden_dirs:
                if _under(real, d):
                    self.violation(2, f"code of {root} executed ({real})")
            if not any(_under(real, r) for r in self.policy.code_roots):
                self.violation(3, f"module code from {real}, outside engine/ and the installed packages")
        if self.in_engine(self.caller(False)):
            self.violation(2, f"exec() from engine code ({self.caller(False)})")

    def on_open(self, args: tuple) -> None:
        mode, flags = (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else 0)
        w = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        self.touch(args[0], w, "open")
        if w and self.policy.own_out and isinstance(args[0], (str, bytes, os.PathLike)) and \
                _under(_real(args[0]), self.policy.own_out):
            # the modules the harness's trace writer uses, patched while it writes (class 5)
            for cls, what in rebindings(self.writer, self.policy, harness=False):
                self.once(cls, what, what)

    def handle(self, event: str, args: tuple) -> None:
        if event == "import":
            self.on_import(args)
        elif event == "exec":
            self.on_exec(args)
        elif event == "compile":
            if self.in_engine(self.caller(False)):
                self.violation(2, f"compile() of source from engine code ({self.caller(False)})")
        elif event == "open":
            self.on_open(args)
        elif event in _WRITES or event in _READS:
            for i in _WRITES.get(event, ()):
                if i < len(args):
                    self.touch(args[i], True, event)
            for i in _READS.get(event, ()):
                if i < len(args):
                    self.touch(args[i], False, event)
        elif event in _SPAWN or event in _ENGINE_ONLY or event in _ENGINE_DIRECT:
            where = self.caller(event not in _ENGINE_DIRECT)
            if not self.in_engine(where):
                return
            if event in _SPAWN:
                self.violation(2, f"a process started from engine code ({event} in {where}); the guard cannot see "
                                  f"what it imports")
            self.violation(_ENGINE_ONLY.get(event) or _ENGINE_DIRECT[event], f"{event} from engine code ({where})")
        elif event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__defaults__",
                                                                             "__kwdefaults__"):
            target = args[0]
            if isinstance(target, types.FunctionType) and _under(_real(target.__code__.co_filename), str(HARNESS_DIR)):
                self.violation(1, f"{target.__module__}.{target.__qualname__}.{args[1]} replaced")

    def __call__(self, event: str, args: tuple) -> None:
        tid = self._ident()
        if tid in self.busy:
            return
        self.busy.add(tid)
        try:
            self.handle(event, args)
        finally:
            self.busy.discard(tid)

    def finish(self) -> None:
        self.busy.add(self._ident())  # the checks below read files (module paths); they are the harness's own
        for cls, what in end_checks(self.policy, self.snap, self.path0):
            self.emit({"violation": {"class": cls, "what": what}})
        self.emit({"done": True})


def install(policy: Policy, fd: int):
    """Install the audit hook, reporting to ``fd``, and snapshot every loaded module. Returns ``finish()``: the
    checks after the run, which also writes the closing ``{"done": true}`` line."""
    hook = _Hook(policy, fd)
    sys.addaudithook(hook)
    return hook.finish


# ---------------------------------------------------------------------------------------------------- after the run

def _harness_modules() -> list[tuple[str, types.ModuleType]]:
    return [(n, m) for n, m in list(sys.modules.items())
            if (n == "forgetrain" or n.startswith("forgetrain.")) and isinstance(m, types.ModuleType)]


def _is_harness(name: str) -> bool:
    return name == "forgetrain" or name.startswith("forgetrain.")


def _checked(v) -> bool:
    """Attributes whose identity the snapshot checks: code (functions, classes, modules, descriptors)."""
    return callable(v) or isinstance(v, (types.ModuleType, staticmethod, classmethod, property))


def _snapshot() -> dict:
    """Identity of every callable attribute of every loaded module (the harness, the standard library, the
    installed packages) and of the classes they define: what the harness's trace writer runs on."""
    snap = {}
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType) or name == "__main__":
            continue
        try:
            attrs = {k: v for k, v in list(vars(mod).items()) if _checked(v)}
        except TypeError:
            continue
        classes = {}
        for k, v in attrs.items():
            if isinstance(v, type) and getattr(v, "__module__", None) == name:
                try:
                    classes[k] = {a: b for a, b in vars(v).items() if _checked(b)}
                except TypeError:
                    pass
        snap[name] = (mod, attrs, classes)
    return snap


# What the harness's trace writer (forgetrain.trace, the train loop's records) runs on: checked at every write
# into the candidate's own output dir, and for bindings to engine code after the run; every other module is
# checked for rebinding after the run only.
TRACE_WRITER = ("builtins", "json", "json.encoder", "json.decoder", "hashlib", "os", "posixpath", "io", "tempfile",
                "shutil", "pathlib", "struct", "math", "numpy", "safetensors", "safetensors.torch", "torch",
                "torch.serialization", "concurrent.futures", "concurrent.futures.thread", "forgetrain.trace",
                "forgetrain.train", "forgetrain.verify", "forgetrain.equivalence.runs", "forgetrain.equivalence.inits",
                "forgetrain.distributed", "forgetrain.metrics")

# Module attributes that the libraries themselves rebind while a run goes on (lazy loaders, hooks they install on
# first use); a change there says nothing about the candidate.
_LIVE = {("warnings", "showwarning"), ("warnings", "formatwarning"), ("sys", "excepthook"),
         ("threading", "excepthook"), ("signal", "default_int_handler")}


def _submodule_binding(name: str, attr: str, value) -> bool:
    """The import system binds ``pkg.sub`` on ``pkg`` when it imports the submodule: not a rebinding."""
    return isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{attr}" and \
        sys.modules.get(value.__name__) is value


def _engine_code(v, engine_dir: str) -> bool:
    """Whether ``v`` (a function, method or descriptor around one) runs code from ``engine_dir``."""
    try:
        f = getattr(v, "__func__", v)
        code = getattr(f, "__code__", None)
    except Exception:  # noqa: BLE001 - a lazy object whose attribute access fails is no engine function
        return False
    return isinstance(code, types.CodeType) and _under(_real(code.co_filename), engine_dir)


def _engine_finder(f, engine_dir: str) -> bool:
    """Whether an import finder (or path hook) runs code from engine/: it is, or its class defines, such code."""
    kind = f if isinstance(f, type) else type(f)
    try:
        members = list(vars(kind).values())
    except TypeError:
        members = []
    return _engine_code(f, engine_dir) or any(_engine_code(v, engine_dir) for v in members)


def path_additions(policy: Policy, before: list, now: list) -> list[tuple[int, str]]:
    """(class, entry) for each entry added to ``sys.path`` since ``before``: one in engine/ is class 7 (the
    engine's files imported as top-level packages, under names of their own: a renamed copy of a reference
    framework would be), one in the workspace, the candidate's own output dir or outside every code root is
    class 3 (code the scan never read)."""
    out = []
    for p in now:
        if p in before or not isinstance(p, str):
            continue
        real = _real(p or ".")
        if _under(real, policy.engine_dir):
            out.append((7, real))
        elif any(_under(real, r) for r in (policy.workspace, policy.own_out) if r) or \
                not any(_under(real, r) for r in policy.code_roots):
            out.append((3, real))
    return out


def _rewrapped(new, old, engine_dir: str) -> bool:
    """Whether ``new`` is ``old`` wrapped by a library (``functools.wraps``: ``torch._dynamo`` wraps
    ``torch.manual_seed`` when it is first imported), with no engine code anywhere on the ``__wrapped__`` chain."""
    seen, f = 0, new
    while f is not None and seen < 8:
        if _engine_code(f, engine_dir):
            return False
        if f is old:
            return seen > 0
        try:
            f = getattr(f, "__wrapped__", None)
        except Exception:  # noqa: BLE001
            return False
        seen += 1
    return False


def rebindings(snap: dict, policy: Policy, harness: bool = True) -> list[tuple[int, str]]:
    """(class, what) of every attribute of a snapshotted module, or of a class it defines, that is no longer the
    object the snapshot saw, or that is bound to code from engine/: class 1 for the harness (``forgetrain.*``,
    with ``harness``), class 5 for every other module (a stdlib or third-party module the harness's trace writer
    runs on, patched so that the trace says what the candidate did not compute)."""
    out: list[tuple[int, str]] = []
    for name, (old_mod, attrs, classes) in snap.items():
        h = _is_harness(name)
        if h and not harness:
            continue
        cls = 1 if h else 5
        mod = sys.modules.get(name)
        if mod is None:
            continue
        if mod is not old_mod:
            out.append((cls, f"sys.modules['{name}'] replaced"))
            continue
        try:
            now = vars(mod)
        except TypeError:
            continue
        scan = h or name in TRACE_WRITER  # bindings to engine code: the harness and what its trace writer uses
        for k, v in attrs.items():
            cur = now.get(k)
            if cur is not v and (name, k) not in _LIVE and not _submodule_binding(name, k, cur) and \
                    (h or k in now) and not _rewrapped(cur, v, policy.engine_dir):
                out.append((cls, f"{name}.{k} rebound" + ("" if h else " in the candidate's process (the "
                                                                        "harness writes the trace with it)")))
        for k, v in list(now.items()) if scan else ():
            if _engine_code(v, policy.engine_dir):
                out.append((cls, f"{name}.{k} bound to engine code"))
        for cname, members in (classes.items() if scan else ()):  # classes: the harness's and the writer's
            cur = vars(attrs[cname])
            out += [(cls, f"{name}.{cname}.{a} rebound") for a, b in members.items() if cur.get(a) is not b
                    and not _rewrapped(cur.get(a), b, policy.engine_dir)]
            out += [(cls, f"{name}.{cname}.{a} bound to engine code") for a, b in (list(cur.items()) if scan else ())
                    if _engine_code(b, policy.engine_dir)]
    return out


def end_checks(policy: Policy, snap: dict, path0: list | None = None) -> list[tuple[int, str]]:
    """(class, what) of every violation visible after the run (see the module docstring)."""
    out: list[tuple[int, str]] = []
    pkg = policy.candidate_package
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] in FORBIDDEN_ROOTS:
            out.append((2, f"module {name} is loaded"))
            continue
        fn = getattr(mod, "__file__", None)
        if not isinstance(fn, str) or not (os.path.isabs(fn) or os.path.exists(fn)):
            continue  # no file, or a label (torch.ops says "_ops.py")
        real = _real(fn)
        if name == pkg or name.startswith(pkg + "."):
            if not (real.endswith(".py") and _under(real, policy.engine_dir)):
                out.append((3, f"candidate module {name} loaded from {real}, not from a .py file in engine/"))
        elif _under(real, policy.engine_dir):
            out.append((7, f"module {name} loaded from {real}: the engine's code under a name other than the "
                           f"engine's ({pkg}), a top-level package of its own"))
        elif any(_under(real, d) for d, _ in policy.forbidden_dirs):
            out.append((2, f"module {name} loaded from {real}"))
        elif not any(_under(real, r) for r in policy.code_roots):
            out.append((3, f"module {name} loaded from {real}, outside engine/ and the installed packages"))
    for name, mod in _harness_modules():
        fn = getattr(mod, "__file__", None)
        if not (isinstance(fn, str) and _under(_real(fn), str(HARNESS_DIR))):
            out.append((1, f"module {name} is not the harness's own file ({fn})"))
    out += rebindings(snap, policy)
    if path0 is not None:
        out += [(cls, f"sys.path edited: {p} added (a top-level package from the workspace's files, under a name "
                      f"of its own)") for cls, p in path_additions(policy, path0, list(sys.path))]
    out += [(7, f"an import finder or path hook defined in engine code is installed ({f!r:.80})")
            for f in list(sys.meta_path) + list(sys.path_hooks) if _engine_finder(f, policy.engine_dir)]
    return sorted(set(out))
