"""Continuing a run: the check that there is a checkpoint to continue, the resume phase (the newest good
checkpoint and the trace up to it), and the line that tells a stopped run how to continue."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from forgetrain import checkpoint
from forgetrain.errors import CheckpointError
from forgetrain.run.identity import config_changes, config_hash, engine_settings, hashed_config
from forgetrain.trace import read_trace

if TYPE_CHECKING:
    from forgetrain.run.phases import Run


def check_resumable(ckpt_root: Path) -> None:
    """Raise CheckpointError when ``ckpt_root`` holds no complete checkpoint (``train.resume=true`` has nothing to
    continue). Every rank reads the same directory."""
    if checkpoint.latest(ckpt_root) is None:
        raise CheckpointError(f"train.resume=true but no complete checkpoint under {ckpt_root}: nothing to continue; "
                              f"start afresh without train.resume (with train.overwrite=true where the directory "
                              f"already holds a trace), or choose another train.out_dir")


def resume(run: Run) -> None:
    """Load the newest good checkpoint into the engine (skipping damaged ones, with a warning) and keep the trace
    up to it. Raises CheckpointError when there is none, or it lies past ``train.steps``, or it was trained with
    another global batch."""
    cfg, env, engine, t = run.cfg, run.env, run.engine, run.cfg.train
    ckpt_root = run.ckpt_root  # train() has checked it holds a checkpoint (check_resumable)
    state, harness, last, skipped = checkpoint.load_newest_good(
        ckpt_root, lambda: checkpoint.to_cpu_tree(engine.state_dict(), share_pinned=True))
    for why in skipped:  # one line each, the reason after the decision
        if env.rank == 0:
            name, reason = why.split(": ", 1)
            print(f"warning: checkpoint {name} is damaged; resuming from {last.name} instead ({reason})",
                  file=sys.stderr)
    engine.load_state_dict(state)
    start = int(harness["step"])
    if start > t.steps:
        raise CheckpointError(f"the checkpoint {last} is at step {start}, beyond train.steps={t.steps}; "
                              f"raise train.steps to continue it")
    if harness.get("global_batch_size", t.global_batch_size) != t.global_batch_size:
        # Megatron-LM refuses this too: the LR schedule counts iterations, so a new batch size silently
        # re-times warmup and decay (and the data order of every later step changes)
        raise CheckpointError(f"the checkpoint {last} was trained with train.global_batch_size="
                              f"{harness['global_batch_size']}; this resume asks for {t.global_batch_size}. "
                              f"Resume with the same global batch")
    if harness.get("config_hash") != config_hash(cfg):
        changed = config_changes(harness["config"], hashed_config(cfg)) if "config" in harness else []
        if env.rank == 0:
            what = "; ".join(changed) if changed else f"config hash {harness.get('config_hash')} -> {config_hash(cfg)}"
            print(f"warning: resuming {last.name} with settings different from the checkpoint's: {what}",
                  file=sys.stderr)
    if "engine_settings" in harness:
        changed = config_changes(harness["engine_settings"], engine_settings(cfg))
        if changed and env.rank == 0:
            print(f"warning: resuming {last.name} with engine settings different from the checkpoint's: "
                  f"{'; '.join(changed)} (the steps after the resume are computed another way)", file=sys.stderr)
    try:
        recorded = read_trace(run.trace_dir)[1]
    except FileNotFoundError:
        recorded = []
    run.start = start
    run.existing = [r for r in recorded if r["step"] <= start]
    run.wandb_id = harness.get("wandb_run_id")
    if recorded and recorded[-1]["step"] > start:  # steps past the checkpoint ran before and are redone
        run.rewound = (start + 1, recorded[-1]["step"])
    if env.rank == 0 and start == t.steps:
        print(f"the run is already complete (train.steps={t.steps}, checkpoint {last.name}); nothing to do, nothing "
              f"was written: raise train.steps to train further", file=sys.stderr)
    elif env.rank == 0:
        print(f"resumed from {last} at step {start}", file=sys.stderr)


def resume_hint(ckpt_root: Path, out: Path) -> str:
    """Where a stopped run can continue from: the last checkpoint and the command (:func:`resume_command`), or
    that there is none."""
    last = checkpoint.latest(ckpt_root)
    if last is None:
        return ("no checkpoint was written yet (train.save_interval; none at all under train.save=false), so there is "
                "nothing to resume: start again, the same command with train.overwrite=true")
    return f"last checkpoint: {last.name} (continue with: {resume_command(out)})"


def _hydra_value(v: str) -> str:
    """``v`` as a Hydra override value: as it is when it has only path-safe characters, else single-quoted, with a
    quote escaped and the backslashes before a quote or at the end doubled (Hydra's override grammar: "Escaped
    characters in quoted values", hydra.cc/docs/advanced/override_grammar/basic). The result still needs shell
    quoting."""
    import re

    if re.fullmatch(r"[A-Za-z0-9_./:+@%-]+", v):
        return v
    esc = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
    esc = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, esc)
    return f"'{esc}'"


def resume_command(out: Path) -> str:
    """The command that continues this run: under ``python -m forgetrain`` (or torchrun ``-m forgetrain``), this
    process's launcher and its command-line overrides (Hydra's), each shell-quoted, less ``train.resume``,
    ``train.out_dir``, ``train.overwrite`` and ``train.stop_after``, then ``train.resume=true
    train.out_dir=<out>``: a resume with other settings re-times the schedule (the run's own ``train.steps``,
    ``train.save_interval``, ... are part of it). Elsewhere (train() called from Python, another entry point)
    the two keys alone."""
    import shlex

    keys = f"train.resume=true {shlex.quote('train.out_dir=' + _hydra_value(str(out)))}"
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if main is None or main.name != "__main__.py" or main.parent.name != "forgetrain":
        return keys
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under Hydra
        return keys
    drop = ("train.resume=", "train.out_dir=", "train.overwrite=", "train.stop_after=")
    kept = [shlex.quote(o) for o in task if not o.lstrip("+~").startswith(drop)]
    n = os.environ.get("LOCAL_WORLD_SIZE")
    launcher = f"torchrun --nproc-per-node {n} -m forgetrain" if n and "TORCHELASTIC_RUN_ID" in os.environ \
        else "python -m forgetrain"
    return " ".join([launcher, *kept, keys])
