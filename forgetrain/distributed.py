"""Process-group setup for torchrun launches (one process to many nodes).

Under ``torchrun`` (``WORLD_SIZE`` > 1) the default group is created with the backend from ``parallel.backend``
(``auto``: nccl on CUDA, gloo on CPU) and a collective timeout of ``parallel.timeout_s`` seconds, so a dead rank
ends the job with an error instead of hanging it. A single process needs no group.

Failure handling: :func:`collective_errors` turns a failed collective (a peer rank died, hung past
``parallel.timeout_s``, or became unreachable) into a one-line :class:`CollectiveError` (exit code 1) that names
this rank, instead of a multi-page traceback. Under torchrun the launcher then stops the remaining local ranks.
Ranks whose collectives do not match (another op, or other sizes: an engine bug) are told apart where torch makes
it known: with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch compares every collective's op, shapes and dtypes across
ranks first, and the line names the op and each rank's sizes (:func:`describe_mismatch`). Without it, gloo aborts
the rank that received the wrong size (a C++ abort no Python code can catch) and its peers see a dead peer; their
line then says how to get the op and the sizes named.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from forgetrain.errors import ForgeTrainError


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` from rank ``src`` on every rank (picklable objects; identity for a single process)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank: an all-reduce MAX of one int32 (on the current CUDA device under
        NCCL, on the CPU under gloo); ``flag`` itself for a single process. A collective: every rank calls it at
        the same point, or the ranks hang until ``parallel.timeout_s``."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return flag
        nccl = dist.get_backend() == "nccl"
        t = torch.tensor([int(flag)], dtype=torch.int32,
                         device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


class CollectiveError(ForgeTrainError):
    """A collective failed or timed out: a peer rank died, hung or is unreachable. Exit code 1."""

    exit_code = 1


_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout",
                       "broken pipe", "socket", "peer")


_MISMATCH = "Detected mismatch between collectives"  # torch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL)


def _is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and (_MISMATCH in str(e)
                                            or any(m in str(e).lower() for m in _COLLECTIVE_MARKERS))


def describe_mismatch(message: str) -> str | None:
    """One line from torch's collective-mismatch error (raised on every rank under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): each rank's op, tensor shapes and dtypes, and the aspect that differs, e.g.
    ``rank 0 ran ALLREDUCE of shape [10] (Float), rank 1 ran ALLREDUCE of shape [12] (Float); they differ in tensor
    shapes: 10 vs 12``. None when ``message`` is not that error."""
    import re

    if _MISMATCH not in message:
        return None
    runs = []
    for m in re.finditer(r"Rank (\d+) is running collective: CollectiveFingerPrint\((.*?)(?:TensorDeviceTypes|\)\))",
                         message, re.S):
        fp = m.group(2)
        op = re.search(r"OpType=(\w+)", fp)
        shape = re.search(r"TensorShape=(.*?)(?:, TensorDtypes=|$)", fp, re.S)
        dtype = re.search(r"TensorDtypes=(\w+)", fp)
        run = f"rank {m.group(1)} ran {op.group(1) if op else 'a collective'}"
        if shape:
            run += f" of shape {shape.group(1).strip().rstrip(',')}"
        if dtype:
            run += f" ({dtype.group(1)})"
        runs.append((int(m.group(1)), run))
    differ = re.search(r"differ in the following aspects:\s*(.*)", message, re.S)
    aspect = None
    if differ:
        aspect = " ".join(differ.group(1).split())
        aspect = re.sub(r"^Tensor Tensor", "tensor", aspect)
        aspect = re.sub(r"(\S)vs ", r"\1 vs ", aspect)
    text = ", ".join(r for _, r in sorted(runs)) or "the ranks ran different collectives"
    return text + (f"; they differ in {aspect}" if aspect else "")


@contextlib.contextmanager
def collective_errors(timeout_s: int | float):
    """Re-raise a failed collective as a one-line :class:`CollectiveError` (only inside a multi-rank group).

    The message names this rank, the world size and ``parallel.timeout_s``, plus the backend's first line.
    """
    try:
        yield
    except Exception as e:  # noqa: BLE001 - filtered below, everything else propagates unchanged
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not multi or isinstance(e, ForgeTrainError) or not _is_collective_failure(e):
            raise
        print(file=sys.stderr, flush=True)  # end a progress-bar line, so "error: ..." starts its own line
        where = f"rank {dist.get_rank()}/{dist.get_world_size()}"
        mismatch = describe_mismatch(str(e))
        if mismatch:
            raise CollectiveError(f"{where}: the ranks' collectives do not match ({mismatch}): every rank must issue "
                                  f"the same collectives with the same sizes; stopping this rank") from e
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        hint = "" if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL" else (
            "; if a rank aborted with a size mismatch (gloo: \"Received data size doesn't match\"), the ranks' "
            "collectives differ: rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to have the op and the sizes named")
        raise CollectiveError(
            f"{where}: a collective failed, so a peer rank died, hung longer than parallel.timeout_s={timeout_s} s "
            f"or became unreachable; stopping this rank ({type(e).__name__}: {first[:300]}){hint}") from e


def init_distributed(parallel_cfg) -> DistEnv:
    """Create (or reuse) the default process group; returns this process's rank, world size and local rank."""
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    die_with_launcher()
    backend = parallel_cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=parallel_cfg.timeout_s))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank)


def die_with_launcher() -> None:
    """Under torchrun: have the kernel send this worker SIGKILL when its launcher dies (Linux ``prctl
    PR_SET_PDEATHSIG``), so a ``kill -9`` of torchrun or of its process group leaves no worker training on. The
    launcher may already be gone between fork and this call: then exit at once. No-op off Linux."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # orphaned before the signal was armed
        os._exit(1)


_WORLD1_STORE = None  # keeps the FileStore directory of a world-1 group alive for the process


def ensure_process_group(parallel_cfg, device: torch.device) -> None:
    """A world-1 default process group when none exists (a torchrun launch has already created one).

    For engines whose framework needs a process group even in one process (Megatron's parallel state, DeepSpeed,
    torchtitan's FSDP2 mesh). Backend from ``parallel.backend`` (``auto``: nccl on CUDA, gloo on CPU), timeout
    ``parallel.timeout_s``, rendezvous through a private FileStore (no port is opened).
    """
    global _WORLD1_STORE
    import tempfile

    if dist.is_initialized():
        return
    backend = parallel_cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    _WORLD1_STORE = tempfile.TemporaryDirectory(prefix="forgetrain-pg-")
    store = dist.FileStore(os.path.join(_WORLD1_STORE.name, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=parallel_cfg.timeout_s))
    # Torn down at exit by whoever created it: an NCCL group left to its destructor stalls the interpreter's exit
    # until its watchdog gives up (seen on an H100: about 2 minutes after a driver that called verify in-process).
    atexit.register(destroy_process_group)


def is_rank0() -> bool:
    """True outside torchrun (no default process group) and on global rank 0: under torchrun only rank 0 writes
    shared files (reports, goldens) and prints."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def destroy_process_group() -> None:
    """Tear the default process group down if one exists (best effort: this runs on the way out)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def set_deterministic(on: bool, device: str) -> None:
    """Megatron's deterministic mode, process-wide and for both sides: deterministic algorithms, no TF32.

    Needed on the CPU too: without it ``weight[ids]``'s backward (``index_put_`` with accumulate) adds repeated
    tokens' gradients in a thread-dependent order, so even the reference does not reproduce itself at the
    llama_tiny shape (measured: two identical backward passes differed).
    """
    if on and device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(bool(on), warn_only=False)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def use_device(device: torch.device, deterministic: bool) -> torch.device:
    """Claim ``device`` for an engine built on another framework, before it allocates anything.

    CUDA: make it this process's current GPU (its index, else ``LOCAL_RANK`` under torchrun), switch TF32 off and,
    with ``deterministic``, Megatron-LM's deterministic mode (README "Model configuration": cuBLAS workspace,
    deterministic algorithms, ``NCCL_ALGO=Ring``). CPU: nothing to do. Returns the device with its index resolved.
    Raises ValueError for another device type.
    """
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {device}")
    if device.index is not None:
        torch.cuda.set_device(device)
    elif "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    if deterministic:
        os.environ.setdefault("NCCL_ALGO", "Ring")
        set_deterministic(True, "cuda")
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def release_host_cache() -> bool:
    """Give the pinned host memory that torch's caching host allocator keeps after an engine is freed back to the
    system (``torch.accelerator.empty_host_cache``, or ``torch._C._host_emptyCache`` on older CUDA builds). Between
    sequential blocks: the forged optimizer offload pins about 68 GiB for Llama-3-8B, which the allocator would
    otherwise hold while the next side (e.g. DeepSpeed's ZeRO-Offload) needs host memory. True when a release
    function was called."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if fn is None or not torch.cuda.is_available():  # no device: no pinned host cache (and torch would raise)
        return False
    fn()
    return True


def free_device(device: Optional[torch.device] = None) -> Optional[float]:
    """After the last reference to an engine is dropped (between two engines in one process: the bench's sides,
    verify's reference and candidate): drop torch.compile's caches (``torch._dynamo.reset``: a
    compiled side's graphs and guards go with it, and the next side compiles with a fresh recompile budget), collect
    the engine, and give the CUDA caching allocator's free blocks and the pinned host cache back
    (:func:`release_host_cache`). Returns the GiB still allocated on the device (what the freed side left
    behind; None on CPU). ``device`` None: the current CUDA device where there is one, else the CPU."""
    import gc

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    release_host_cache()
    return torch.cuda.memory_allocated(device) / 2**30
