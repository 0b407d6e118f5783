"""The training loop around an engine: ``train(cfg) -> out_dir``. Pure function; ``forgetrain.cli`` wraps it.

The harness owns data order, the trace, checkpoints, evaluation, progress and metric sinks; the engine owns the
optimizer step (see ``forgetrain.engine``). The same loop drives forged scenarios and references, which is what
makes their traces comparable.

This module is the entry and the order of the phases; the pieces are in :mod:`forgetrain.run`: the loop itself
(:mod:`forgetrain.run.loop`, one file), the phases around it (:mod:`forgetrain.run.phases`), resuming
(:mod:`forgetrain.run.resume`), the output directory (:mod:`forgetrain.run.outdir`) and what identifies a run
(:mod:`forgetrain.run.identity`). The names other modules use are importable from here too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from forgetrain.config import RunConfig, validate
from forgetrain.distributed import DistEnv, init_distributed
from forgetrain.errors import ConfigError
from forgetrain.run.identity import config_changes, config_hash, engine_settings, hashed_config, versions
from forgetrain.run.loop import clipped_grads, run_loop
from forgetrain.run.outdir import check_disk, lock_out_dir, missing_dirs, out_dir, record_config, unlock_out_dir
from forgetrain.run.phases import build_engine, finish, open_sinks, setup
from forgetrain.run.resume import check_resumable, resume

__all__ = ["build_engine", "clipped_grads", "config_changes", "config_hash", "engine_settings", "hashed_config",
           "train", "versions"]

log = logging.getLogger("forgetrain")


def train(cfg: RunConfig, *, record=None, **kw) -> Path:
    """Train ``cfg.scenario.name`` holding the output directory's lock, from ``train.init_weights`` where it is set
    (and no ``init_hf`` is given); see :func:`_train` for the arguments, the outputs and the errors. A second run
    on a directory in use, or an ``init_weights`` file that is not safetensors, raises ConfigError. ``record``: the
    composed Hydra config, written to ``<out>/.hydra/config.yaml`` (``config.resume.yaml`` on a resume) once the
    run owns ``out``, so a rejected run writes nothing and a refused second run leaves the first run's record
    alone."""
    env: DistEnv = init_distributed(cfg.parallel)
    ref = kw.get("kind", "scenarios") != "scenarios"
    if ref:
        from forgetrain.registry import load_engine_class

        engine_cls = load_engine_class(kw["kind"], kw.get("engine_name") or "megatron")
    else:
        engine_cls = kw.get("engine_cls")
    validate(cfg, world_size=env.world_size, engine_cls=engine_cls, reference=ref)
    out = Path(env.broadcast_object(str(out_dir(cfg))))  # rank 0's run directory on every rank (torchrun)
    made = missing_dirs(out)  # what the directory lock will create: removed again if the run writes nothing
    check_disk(cfg, out, env, final_params=kw.get("final_params", True))
    lock = lock_out_dir(out, env)
    try:
        if cfg.train.resume:  # after the lock (a live run's directory is refused as in use), before the data and
            check_resumable(out / "checkpoints")  # the engine are prepared: nothing to resume fails fast
        if cfg.train.init_weights and kw.get("init_hf") is None and not cfg.train.resume:
            from safetensors.torch import load_file

            try:  # the weights the run starts from
                kw["init_hf"] = load_file(os.path.expanduser(cfg.train.init_weights))
            except Exception as e:  # noqa: BLE001 - an unreadable file is bad input
                raise ConfigError(f"train.init_weights={cfg.train.init_weights} cannot be read as safetensors "
                                  f"({type(e).__name__}: {e})") from None
        return _train(cfg, env, out, record=record, **kw)
    finally:
        if lock is not None:
            unlock_out_dir(out, lock)
            for d in made:  # the lock made these directories: a run that wrote nothing leaves none behind
                try:
                    d.rmdir()  # innermost first; a directory the run wrote into is not empty and stays
                except OSError:
                    break


def _train(cfg: RunConfig, env: DistEnv, out: Path, *, record=None, kind: str = "scenarios", engine_name: str | None = None,
           init_hf: dict[str, torch.Tensor] | None = None, progress: bool = True, final_params: bool = True,
           engine_cls=None, export_init: bool = False) -> Path:
    """Train ``cfg.scenario.name`` (or ``kind/engine_name``) and return the output directory.

    Writes ``<out>/trace/{meta.json,trace.jsonl,final.safetensors[,modules.json]}``, checkpoints under
    ``<out>/checkpoints`` and ``<out>/summary.json``. ``init_hf`` (HF-layout fp32 weights) replaces the engine's
    own init, e.g. the reference's exported weights; ``export_init`` writes the weights the run starts from to
    ``<out>/init.safetensors``. ``engine_cls`` bypasses the registry (tests feed mutant engines). Raises ConfigError / DataError / CheckpointError on bad input.

    Phases, in order: :func:`setup` (data, engine, initial weights), :func:`resume` (``train.resume``: the newest
    good checkpoint and the trace up to it; a run already at ``train.steps`` ends here, having written nothing),
    the config record, :func:`open_sinks` (trace writer, W&B, the run's
    banner), :func:`run_loop` (the steps, checkpoints) and :func:`finish` (final parameters, sample, summary).
    """
    run = setup(cfg, env, out, kind=kind, engine_name=engine_name, init_hf=init_hf, engine_cls=engine_cls,
                export_init=export_init, progress=progress)
    if cfg.train.resume:
        resume(run)
        if run.start == cfg.train.steps:  # finished already: nothing to do, so nothing is written (no config record,
            env.barrier()  # trace rewrite, W&B run, export or summary)
            return out
    if record is not None and env.rank == 0:  # the data, engine and checkpoint all loaded: the run is on
        record_config(out, record, cfg.train.resume)
    open_sinks(run)
    run_loop(run, progress)
    finish(run, final_params=final_params and cfg.train.final_params, progress=progress)
    env.barrier()
    return out


if __name__ == "__main__":  # ``python -m forgetrain.train`` is ``python -m forgetrain`` (it silently did nothing)
    import runpy

    runpy.run_module("forgetrain", run_name="__main__", alter_sys=True)
