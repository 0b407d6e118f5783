"""The per-step trace: one JSON record per optimizer step, written by both sides in the same format.

A trace directory holds:

* ``meta.json``    -- ``{"side", "scenario", "config_hash", "precision", "platform", "versions", "steps"}``
* ``trace.jsonl``  -- one record per step: ``step`` (1-based, after the update), ``loss`` (nats), ``grad_norm``
  (pre-clip L2), ``lr``, ``tokens`` (cumulative, all ranks), ``step_s`` (s), ``tokens_per_s``, ``mfu_pct``,
  optionally ``val_loss`` and ``digests`` (``per_token_loss``: sha256; ``params``/``grads``/``clipped_grads``:
  name -> sha256 of the fp32 HF-layout tensor after this step / its pre-clip gradient / the gradient its update
  applied, after clipping: ``forgetrain.train.clipped_grads``), and an engine's own per-step values
  (``StepResult.extra``: a mixture of experts' ``moe_tokens_per_expert`` and ``moe_load_balancing_loss``).
* ``modules.json`` -- optional, step-1 module probes: name -> {"fwd", "fwd_l2", "grad", "grad_l2"}.
* ``final.safetensors`` -- optional, the final parameters in the HF layout (fp32).

Floats are Python floats written with ``repr`` (JSON round-trips float64 exactly), so bitwise comparison of two
traces is meaningful. Every file is written atomically (temp file + ``os.replace``); the JSONL is rewritten whole
on each flush so a crash never leaves a half line.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 (first 16 hex) of a tensor's bytes, dtype and shape; layout-sensitive by design.

    Float tensors are canonicalised first so -0.0 and +0.0 hash alike (``torch.equal`` semantics: an accumulation
    buffer that starts at +0 may legitimately differ in the sign of an exact zero): ``-0.0 + 0.0 = +0.0`` under
    IEEE 754 round-to-nearest, applied in place to the tensor's own contiguous host copy. The bytes are hashed
    through the buffer protocol, with no further copy; bf16 is hashed as its int16 bit pattern (numpy has no
    bf16). The digest of a given tensor is the same as it has always been: stored goldens stay comparable.
    """
    c = t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    if c.is_floating_point():
        c.add_(0.0)
    if c.dtype == torch.bfloat16:
        c = c.view(torch.int16)
    a = c.numpy()
    h = hashlib.sha256()
    h.update(f"{a.dtype}:{tuple(a.shape)}:".encode())
    h.update(a.reshape(-1).data)  # 0-d tensors too: hash the C-contiguous buffer itself
    return h.hexdigest()[:16]


def tensor_digests(named: Mapping[str, torch.Tensor], workers: int | None = None) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor of ``named`` (name -> tensor of any shape, device and dtype), the
    tensors hashed concurrently by ``workers`` threads (default: the CPU count, at most 8).

    The host copy, the canonicalisation and sha256 all release the GIL on large buffers, so the threads overlap.
    At the 8B width (1.5 B parameters at 2 layers) a bitwise step hashes about 12 GB per side (the fp32 grads
    and params), tens of seconds on one thread at the 0.2 GB/s the single-threaded form managed. Returns the digests in ``named``'s order; the values are exactly those of
    :func:`tensor_digest`. Host memory held at once: at most ``workers`` tensors' copies.
    """
    names = list(named)
    n = workers or min(8, os.cpu_count() or 1)
    if n <= 1 or len(names) <= 1:
        return {k: tensor_digest(named[k]) for k in names}
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="digest") as pool:
        return dict(zip(names, pool.map(lambda k: tensor_digest(named[k]), names)))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a crash leaves either the old file or the new one."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write_with(path, write)


def atomic_write_with(path: str | os.PathLike, write) -> None:
    """Call ``write(tmp)`` to fill a temp file beside ``path`` (``tmp``: its path, the file exists and is empty),
    then fsync it and rename it over ``path``: a crash or an error (a full disk raises OSError) leaves the old
    file or none, and no temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """The temp files :func:`atomic_write_with` leaves in ``directory`` when its process is killed mid-write."""
    d = Path(directory)
    return sorted(d.glob(".*.tmp")) if d.is_dir() else []


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


class TraceWriter:
    """Accumulates step records and flushes ``trace.jsonl`` atomically.

    On resume, pass the records already on disk up to the checkpoint step via ``existing`` so the resumed trace
    is the uninterrupted one.
    """

    def __init__(self, out_dir: str | os.PathLike, meta: dict, existing: Iterable[dict] = ()):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in stale_temp_files(self.dir):  # a run killed mid-write (32 GB for an 8B export); the run
            stale.unlink(missing_ok=True)          # owns the directory (its lock), so no live writer holds them
        self.records: list[dict] = list(existing)
        atomic_write_json(self.dir / "meta.json", meta)

    def append(self, record: dict) -> None:
        self.records.append(record)

    def flush(self) -> None:
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.records)
        atomic_write_bytes(self.dir / "trace.jsonl", data.encode())

    def write_modules(self, modules: dict) -> None:
        atomic_write_json(self.dir / "modules.json", modules)

    def write_final_params(self, params: dict[str, torch.Tensor]) -> None:
        """``final.safetensors``: ``params`` in fp32, written atomically. Raises OSError (a full disk) with no
        file left behind. The file is streamed: no second host copy of the weights as one bytes object (32 GB
        for Llama-3-8B)."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().float().contiguous().cpu() for k, v in params.items()}

        def write(tmp: str) -> None:
            try:
                save_file(tensors, tmp)
            except Exception as e:  # noqa: BLE001 - safetensors reports I/O errors as its own SafetensorError
                raise OSError(str(e)) from None

        atomic_write_with(self.dir / "final.safetensors", write)


def read_trace(trace_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """Return ``(meta, records)`` of a trace directory. Raises FileNotFoundError when it has no trace."""
    d = Path(trace_dir)
    meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
    lines = (d / "trace.jsonl").read_text().splitlines()
    return meta, [json.loads(x) for x in lines if x.strip()]


def read_modules(trace_dir: str | os.PathLike) -> dict | None:
    p = Path(trace_dir) / "modules.json"
    return json.loads(p.read_text()) if p.exists() else None


def read_final_params(trace_dir: str | os.PathLike) -> dict[str, torch.Tensor] | None:
    p = Path(trace_dir) / "final.safetensors"
    if not p.exists():
        return None
    from safetensors.torch import load_file

    return load_file(str(p))
