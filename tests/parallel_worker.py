"""Every rank of a multi-process test launch: ``torchrun --nproc-per-node N -m tests.parallel_worker JOBS.json``.

``JOBS.json`` is a list of runs executed one after another in the same processes (one launch pays the torch /
megatron import once). Each job is a dict:

* ``side``: ``reference`` (the reference named by ``reference``, default ``megatron``; rank 0 writes
  ``OUT/init.safetensors``) or ``candidate`` (the forged engine, or ``engine: "module:Class"``);
* ``out``: output directory; ``overrides``: Hydra overrides on top of ``conf/config.yaml``
  (e.g. ``["parallel=dp2", "model=llama_micro"]``);
* optional ``init`` (HF safetensors the candidate starts from), ``digests`` (default true),
  ``stop_after`` / ``resume`` (train.* fields, for the resume gates).

Every rank runs ``forgetrain.train.train``: the harness builds the gloo group from the torchrun environment and
rank 0 writes the trace. Exits non-zero on the first failing job. Used by ``tests/test_parallel.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compose(overrides: list[str]):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from forgetrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_run_config(hcompose(config_name="config", overrides=list(overrides)))


def run_job(job: dict) -> Path:
    from safetensors.torch import load_file

    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.train import train

    cfg = compose(job.get("overrides", []))
    over = {"steps": cfg.train.steps, "digests": bool(job.get("digests", True))}
    for k in ("stop_after", "resume"):
        if job.get(k) is not None:
            over[k] = job[k]
    out = Path(job["out"])
    rcfg = run_cfg(cfg, out, **over)
    if job["side"] == "reference":
        return train(rcfg, kind="references", engine_name=job.get("reference", "megatron"), progress=False,
                     export_init=True)
    engine_cls = None
    if job.get("engine"):
        from forgetrain.registry import resolve_engine

        engine_cls = resolve_engine(job["engine"])
    init = load_file(job["init"]) if job.get("init") and not job.get("resume") else None
    return train(rcfg, init_hf=init, progress=False, engine_cls=engine_cls)


def main(argv: list[str]) -> None:
    jobs = json.loads(Path(argv[0]).read_text())
    for job in jobs:
        run_job(job)


if __name__ == "__main__":
    main(sys.argv[1:])
