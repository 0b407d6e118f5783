"""The gate's secret parameters: what each ladder run judges, drawn after the agent's round, never shown before.

An agent that knows the gate's exact run (shape, seed, steps, data) can record the reference's trace and weights
in advance and make its engine write them (escape class 5, replaying the reference). The ladder spec therefore
declares *ranges* only (:func:`declare`: the brief tells the agent these), and every ladder run draws its own
values from them with the operating system's randomness (:func:`draw`):

* ``seed``: the run's ``train.seed`` (init and data order), uniform in the declared range;
* ``steps``: the short-run tiers' step count, uniform in ``[verify_steps, verify_steps_max]``;
* ``window``: the run's data, a contiguous run of the prepared corpus's training documents starting at a random
  document (:func:`build_window`), copied into the ladder run's own dir in Megatron's indexed format, with
  content hashes in its manifest;
* ``curve_seeds``: the reference seeds of a loss-curve golden (the candidate's paired runs start from each one's
  reference init and read its batches);
* ``candidate_seeds``: the seeds of the candidate's unpaired curve runs (its own init and data order), none of
  them a reference seed.

The golden for the drawn values is made by the reference's side of that ladder run, into the ladder run's own dir,
which the candidate's process can neither read nor write (``forgetrain.forge.isolate``, the run-time guard). A
spec may pin ``drawn`` (a rerun of a recorded ladder run); the loop never does.
"""

from __future__ import annotations

import copy
import math
import os
import secrets
import shutil
from pathlib import Path

from forgetrain.config import SEED_MAX
from forgetrain.errors import ConfigError

CURVE_SEEDS = 3
WINDOW_FILES = ["train.bin", "train.idx", "valid.bin", "valid.idx"]


def declare(verify_steps: int, steps_max: int | None, window: float) -> dict:
    """The ranges a ladder spec declares (``spec["secret"]``). Raises ConfigError on an empty range or a window
    fraction outside (0, 1]."""
    hi = verify_steps + 2 if steps_max is None else steps_max
    if hi < verify_steps:
        raise ConfigError(f"forge.verify_steps_max={hi} is below forge.verify_steps={verify_steps}")
    if not 0 < window <= 1:
        raise ConfigError(f"forge.gate_window must lie in (0, 1], got {window}")
    return {"seed": [0, SEED_MAX], "steps": [verify_steps, hi], "window": window}


def draw(ranges: dict) -> dict:
    """Values for one ladder run, uniform in ``ranges`` (:func:`declare`), from ``secrets.SystemRandom``. Raises
    ConfigError when ``ranges`` is malformed."""
    try:
        (s0, s1), (n0, n1), frac = ranges["seed"], ranges["steps"], float(ranges["window"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"the ladder spec's secret ranges are malformed: {ranges!r}") from None
    rng = secrets.SystemRandom()
    seeds = rng.sample(range(int(s0), int(s1) + 1), 2 * CURVE_SEEDS)  # distinct: reference and candidate seeds
    return {"seed": rng.randint(int(s0), int(s1)), "steps": rng.randint(int(n0), int(n1)),
            "window": {"fraction": frac, "start": rng.random()},
            "curve_seeds": seeds[:CURVE_SEEDS], "candidate_seeds": seeds[CURVE_SEEDS:]}


def judge_spec(spec: dict, drawn: dict, data_dir: Path, golden_root: Path) -> dict:
    """The spec one ladder run judges with: ``spec`` with the drawn seed and step count, the data window's
    prefix (``data_dir/train``) as ``data.path``, the curve seeds, and the run's own golden dir. The corpus the
    window is cut from stays in ``source_data``."""
    j = copy.deepcopy(spec)
    rc = j["run_config"]
    j["source_data"] = dict(rc["data"])
    rc["train"].update(seed=int(drawn["seed"]), steps=int(drawn["steps"]))
    rc["data"].update(path=str(data_dir / "train"), tokenizer=None, cache_dir=None)
    j["verify"].update(steps=int(drawn["steps"]), seeds=[int(s) for s in drawn["curve_seeds"]])
    if drawn.get("candidate_seeds"):  # a recorded draw from before they were drawn keeps the spec's
        j["verify"]["candidate_seeds"] = [int(s) for s in drawn["candidate_seeds"]]
    j.update(drawn=drawn, golden_root=str(golden_root))
    return j


def _need_tokens(spec: dict) -> int:
    rc, v = spec["run_config"], spec["verify"]
    steps = max(int(v.get("steps") or 1), int(v.get("curve_steps") or 1))
    return (int(rc["model"]["seq_length"]) + 1) * int(rc["train"]["global_batch_size"]) * steps


def build_window(spec: dict, dest: Path) -> dict:
    """Cut the drawn window (``spec["drawn"]["window"]``) out of the corpus ``spec["source_data"]`` prepares
    (its cache entry is checked against its manifest's hashes first) into ``dest``: ``train.{bin,idx}`` (the
    window's documents, in order, written with ``megatron.core.datasets``' builder), ``valid.{bin,idx}`` and the
    tokenizer (copies), ``manifest.json`` with every file's hash. The window holds the declared fraction of the
    documents and at least one run's tokens where the corpus has them (else the whole corpus). Returns what was
    cut: ``first_doc``, ``docs``, ``of``, ``tokens``. Raises DataError for a bad corpus."""
    import warnings

    import numpy as np

    from forgetrain.config import DataConfig
    from forgetrain.data import integrity, prepare
    from forgetrain.trace import atomic_write_json

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    data = prepare(DataConfig(**spec["source_data"]), progress=False)
    src = IndexedDataset(data.train_prefix, mmap=True)
    n, lengths = len(src), np.asarray(src.sequence_lengths, dtype=np.int64)
    frac, start_u = float(spec["drawn"]["window"]["fraction"]), float(spec["drawn"]["window"]["start"])
    k = min(n, max(1, math.ceil(frac * n)))
    need = _need_tokens(spec)
    while k < n and lengths[:k].sum() < need:  # a window too short for one run grows (never past the corpus)
        k = min(n, k * 2)
    first = min(n - k, int(start_u * (n - k + 1)))
    dest.mkdir(parents=True, exist_ok=True)  # the dir itself stays: a candidate's view may already be bound to it
    for old in dest.iterdir():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    builder = IndexedDatasetBuilder(str(dest / "train.bin"), dtype=src.index.dtype)
    for i in range(first, first + k):
        builder.add_document(src[i], [int(lengths[i])])
    builder.finalize(str(dest / "train.idx"))
    for suffix in (".bin", ".idx"):
        shutil.copyfile(data.valid_prefix + suffix, dest / f"valid{suffix}")
    shutil.copyfile(data.tokenizer_path, dest / os.path.basename(data.tokenizer_path))
    files = integrity.file_entries(dest, WINDOW_FILES + [os.path.basename(data.tokenizer_path)])
    info = {"first_doc": first, "docs": k, "of": n, "tokens": int(lengths[first:first + k].sum())}
    atomic_write_json(dest / "manifest.json", {"window": info, "files": files})
    integrity.stamp(dest, files)  # the judge hashed them: no process that reads the window writes a stamp
    return info


def candidate_config(jspec: dict, peak: dict | None) -> dict:
    """The run config the candidate gets: the judge's, with the CPU peak the reference's side measured as a
    datasheet value (``hardware.peak_tflops``), so the candidate's process neither reads nor writes the shared
    peak cache. Only MFU's denominator changes; no hashed setting does."""
    rc = copy.deepcopy(jspec["run_config"])
    if peak and not rc["hardware"].get("peak_tflops"):
        rc["hardware"].update(peak_tflops=float(peak["peak_tflops"]), peak_source=str(peak["label"]))
    return rc
