"""The training loop around an engine: ``train(cfg) -> out_dir``. Pure function; ``forgetrain.cli`` wraps it.

The harness owns data order, the trace, checkpoints, evaluation, progress and metric sinks; the engine owns the
optimizer step (see ``forgetrain.engine``). The same loop drives forged scenarios and references, which is what
makes their traces comparable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from forgetrain import checkpoint, registry
from forgetrain.config import RunConfig, grad_accum_steps, validate
from forgetrain.distributed import DistEnv, init_distributed, set_deterministic
from forgetrain.errors import CheckpointError
from forgetrain.metrics import WandbLogger, cpu_model, mfu_formula_label, mfu_metrics, param_counts, peak_flops, write_plots
from forgetrain.trace import TraceWriter, read_trace, tensor_digest, tensor_digests

log = logging.getLogger("forgetrain")


def config_hash(cfg: RunConfig) -> str:
    """Hash of everything that changes the numbers (model, train minus logging/io fields, data, parallel): the
    sha256 of :func:`hashed_config`, first 12 hex digits."""
    import hashlib
    import json

    blob = json.dumps(hashed_config(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The settings that differ between two :func:`hashed_config` dicts, as ``"section.key old -> new"`` lines
    (nested sections dotted, sorted by key; a key present on one side only shows ``<absent>`` on the other)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, "<absent>"), new.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k} {a} -> {b}")
    return out


def hashed_config(cfg: RunConfig) -> dict:
    """The settings :func:`config_hash` covers, as a JSON-able dict (traces store it, so a stale golden can name
    what changed)."""
    import json

    t = dataclasses.asdict(cfg.train)
    for k in ("eval_interval", "log_interval", "save_interval", "save", "resume", "overwrite", "stop_after", "out_dir",
              "sample_tokens", "sample_prompt", "threads", "eval_iters", "skip_memory_check",
              "final_params", "skip_disk_check"):
        t.pop(k, None)
    p = dataclasses.asdict(cfg.parallel)
    for k in ("timeout_s", "backend"):  # how ranks talk, not what they compute
        p.pop(k, None)
    return json.loads(json.dumps({"model": dataclasses.asdict(cfg.model), "train": t,
                                  "data": dataclasses.asdict(cfg.data), "parallel": p}, default=str))


def engine_settings(cfg: RunConfig) -> dict:
    """How the forged engine computes (``engine.*`` and ``kernels.*``), as a JSON-able dict: kept out of
    :func:`hashed_config` (a golden is the reference's, whatever engine is judged against it) but stored with each
    checkpoint, so a resume with another engine setting (``engine.fp8``, a kernel switch) is named."""
    import json

    return json.loads(json.dumps({"engine": dataclasses.asdict(cfg.engine), "kernels": dataclasses.asdict(cfg.kernels)},
                                 default=str))


def _claim_out_dir(cfg: RunConfig, out: Path, env: DistEnv) -> None:
    """A fresh run refuses a directory that holds another run's checkpoints or trace (they would be overwritten,
    and pruning would delete this run's own checkpoints), unless ``train.overwrite=true`` clears them first.
    Raises ConfigError."""
    import shutil

    from forgetrain.errors import ConfigError

    if cfg.train.resume:
        return
    ckpts, trace = out / "checkpoints", out / "trace"
    held = any(ckpts.glob("step_*")) or (trace / "trace.jsonl").exists()
    if held and not cfg.train.overwrite:
        raise ConfigError(f"{out} already holds a run (checkpoints or trace); continue it with train.resume=true, "
                          f"replace it with train.overwrite=true, or choose another train.out_dir")
    if held:
        env.barrier()  # every rank has looked before rank 0 deletes
        if env.rank == 0:
            shutil.rmtree(ckpts, ignore_errors=True)
            shutil.rmtree(trace, ignore_errors=True)
        env.barrier()


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
         "cpu": cpu_model(), "threads": torch.get_num_threads()}
    try:
        from importlib.metadata import version

        v["megatron-core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - optional
        pass
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        v["gpu"] = torch.cuda.get_device_name()
    return v


class _Probe:
    """Records, for the first micro-batch of a step, each probed module's first-tensor output digest and the
    digest of the gradient flowing into that output (one step only; later micro-batches are ignored so that a
    data-order bug shows as a loss divergence, not as a module one).

    The output digest is the module's first call's. The gradient is the first one that reaches a hooked output:
    every output that requires grad is hooked until one has arrived, because under activation recompute
    (``engine.recompute=full``) the first forward's graph is dropped when its layer is done (its hook never
    fires) and the gradient flows through the recomputed output of the same micro-batch, which comes next."""

    def __init__(self, probes: dict[str, torch.nn.Module]):
        self.records: dict[str, dict] = {}
        self.handles = [mod.register_forward_hook(self._hook(name)) for name, mod in probes.items()]

    def _hook(self, name):
        def fwd(_mod, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            rec = self.records.get(name)
            if rec is None:
                rec = self.records[name] = {"fwd": tensor_digest(t), "fwd_l2": float(t.detach().float().norm())}
            elif "grad" in rec:
                return
            if t.requires_grad:
                def on_grad(g, rec=rec):
                    if "grad" not in rec:
                        rec["grad"] = tensor_digest(g)
                        rec["grad_l2"] = float(g.detach().float().norm())
                t.register_hook(on_grad)
        return fwd

    def close(self):
        for h in self.handles:
            h.remove()


def _out_dir(cfg: RunConfig) -> Path:
    if cfg.train.out_dir:
        return Path(cfg.train.out_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not under Hydra
        return Path("runs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def _sample_text(engine, tok, cfg: RunConfig, device) -> str:
    ids = tok.encode(cfg.train.sample_prompt) or [0]
    gen = torch.Generator().manual_seed(cfg.train.seed)
    s = cfg.model.seq_length
    for _ in range(cfg.train.sample_tokens):
        ctx = torch.tensor([ids[-s:]], dtype=torch.long, device=device)
        logits = engine.logits(ctx)[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tok.render_documents(ids)


def _lock_out_dir(out: Path, env: DistEnv):
    """Take ``<out>/.lock`` (an exclusive ``flock``, rank 0) for the run's lifetime, so a second run on the same
    directory -- a fresh one, a resume or an overwrite -- is refused while the first lives. The OS drops the lock
    when the holder dies, even by kill -9. Returns the open lock file (None off rank 0); :func:`_unlock_out_dir`
    gives it back. Raises ConfigError on every rank when the directory is in use.

    The holder unlinks the file when it ends (a run that wrote nothing leaves no directory behind), so a run that
    opened the file before that unlink may then lock an inode no path names any more, while a third run creates
    and locks a new ``.lock``: both would hold "the" lock. So a lock counts only when the path still names the
    locked inode afterwards; otherwise it is dropped and taken again on the file the path names now (the
    protocol of lock files that are removed by their holders, e.g. ``flufl.lock``, ``lockfile``)."""
    from forgetrain.errors import ConfigError

    fh, busy = None, None
    if env.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        fh, busy = _flock_current(out / ".lock")
    busy = env.broadcast_object(busy)
    if busy is not None:
        raise ConfigError(f"{out} is in use by another run (pid {busy}); wait for it to end, or choose another "
                          f"train.out_dir")
    return fh


def _flock_current(path: Path):
    """``(open file, None)`` holding an exclusive flock on the inode ``path`` names once it is held, with this pid
    written into it; or ``(None, pid)`` of the holder (``"?"`` when unreadable) when another process holds it."""
    import fcntl

    while True:
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            busy = fh.read().strip() or "?"
            fh.close()
            return None, busy
        try:
            current = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:  # unlinked by the holder that just let go
            current = False
        if current:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
            return fh, None
        fh.close()  # a stale inode: its holder has ended; take the file the path names now


def _unlock_out_dir(out: Path, fh) -> None:
    """Give back :func:`_lock_out_dir`'s lock: unlink ``<out>/.lock`` while still holding it, then release it. A run
    that locks the old inode after the unlink finds it stale and retries (:func:`_flock_current`)."""
    (out / ".lock").unlink(missing_ok=True)
    fh.close()


def _missing_dirs(out: Path) -> list[Path]:
    """``out`` and those of its parents that do not exist yet, innermost first."""
    missing, d = [], out.absolute()
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    return missing


def train(cfg: RunConfig, *, record=None, **kw) -> Path:
    """Train ``cfg.scenario.name`` holding the output directory's lock; see :func:`_train` for the arguments, the
    outputs and the errors. A second run on a directory in use raises ConfigError. ``record``: the composed Hydra
    config, written to ``<out>/.hydra/config.yaml`` (``config.resume.yaml`` on a resume) once the run owns
    ``out``, so a rejected run writes nothing and a refused second run leaves the first run's record alone."""
    env: DistEnv = init_distributed(cfg.parallel)
    ref = kw.get("kind", "scenarios") != "scenarios"
    validate(cfg, world_size=env.world_size, engine_cls=None if ref else kw.get("engine_cls"), reference=ref)
    out = Path(env.broadcast_object(str(_out_dir(cfg))))  # rank 0's run directory on every rank (torchrun)
    made = _missing_dirs(out)  # what the directory lock will create: removed again if the run writes nothing
    _check_disk(cfg, out, env, final_params=kw.get("final_params", True))
    lock = _lock_out_dir(out, env)
    try:
        if cfg.train.resume:  # after the lock (a live run's directory is refused as in use), before the data and
            _check_resumable(out / "checkpoints")  # the engine are prepared: nothing to resume fails fast
        return _train(cfg, env, out, record=record, **kw)
    finally:
        if lock is not None:
            _unlock_out_dir(out, lock)
            for d in made:  # the lock made these directories: a run that wrote nothing leaves none behind
                try:
                    d.rmdir()  # innermost first; a directory the run wrote into is not empty and stays
                except OSError:
                    break


def _check_disk(cfg: RunConfig, out: Path, env: DistEnv, *, final_params: bool) -> None:
    """``forgetrain.disk.check`` on rank 0 before the run writes anything (a resume counts the checkpoints already
    under ``out``); its refusal is raised on every rank as ConfigError."""
    from forgetrain import disk
    from forgetrain.errors import ConfigError
    from forgetrain.trace import stale_temp_files

    line = None
    if env.rank == 0:
        root = out / "checkpoints"
        have = sorted(root.glob("step_*")) if cfg.train.resume and root.is_dir() else []
        done = 0
        if have:
            last = checkpoint.latest(root)
            done = int(last.name.split("_")[-1]) if last is not None else 0
        c = cfg if final_params else _with_train(cfg, final_params=False)
        # what the run deletes before it writes: a killed run's temp files (the trace writer removes them), and
        # with train.overwrite the previous run's checkpoints and trace
        freed = sum(f.stat().st_size for f in stale_temp_files(out / "trace"))
        if cfg.train.overwrite and not cfg.train.resume:
            freed = sum(f.stat().st_size for d in (root, out / "trace") if d.is_dir()
                        for f in d.rglob("*") if f.is_file())
        try:
            disk.check(c, out, existing_checkpoints=len(have), done=done, freed=freed)
        except ConfigError as e:
            line = str(e)
    line = env.broadcast_object(line)
    if line:
        raise ConfigError(line)


def _with_train(cfg: RunConfig, **changes) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def _record_config(out: Path, record, resume: bool) -> None:
    """Write the composed config (and Hydra's overrides, when under Hydra) into ``<out>/.hydra/``, atomically."""
    from omegaconf import OmegaConf

    from forgetrain.trace import atomic_write_bytes

    name = "config.resume.yaml" if resume else "config.yaml"
    atomic_write_bytes(out / ".hydra" / name, OmegaConf.to_yaml(record).encode())
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under Hydra
        return
    atomic_write_bytes(out / ".hydra" / name.replace("config", "overrides"), OmegaConf.to_yaml(task).encode())


def _train(cfg: RunConfig, env: DistEnv, out: Path, *, record=None, kind: str = "scenarios", engine_name: str | None = None,
           init_hf: dict[str, torch.Tensor] | None = None, progress: bool = True, final_params: bool = True,
           engine_cls=None, export_init: bool = False) -> Path:
    """Train ``cfg.scenario.name`` (or ``kind/engine_name``) and return the output directory.

    Writes ``<out>/trace/{meta.json,trace.jsonl,final.safetensors[,modules.json]}``, checkpoints under
    ``<out>/checkpoints`` and ``<out>/summary.json``. ``init_hf`` (HF-layout fp32 weights) replaces the engine's
    own init, e.g. the reference's exported weights; ``export_init`` writes the weights the run starts from to
    ``<out>/init.safetensors``. ``engine_cls`` bypasses the registry (tests feed mutant engines). Raises ConfigError / DataError / CheckpointError on bad input.

    Phases, in order: :func:`_setup` (data, engine, initial weights), :func:`_resume` (``train.resume``: the newest
    good checkpoint and the trace up to it; a run already at ``train.steps`` ends here, having written nothing),
    the config record, :func:`_open_sinks` (trace writer, W&B, the run's
    banner), :func:`_loop` (the steps, checkpoints) and :func:`_finish` (final parameters, sample, summary).
    """
    run = _setup(cfg, env, out, kind=kind, engine_name=engine_name, init_hf=init_hf, engine_cls=engine_cls,
                 export_init=export_init, progress=progress)
    if cfg.train.resume:
        _resume(run)
        if run.start == cfg.train.steps:  # finished already: nothing to do, so nothing is written (no config record,
            env.barrier()  # trace rewrite, W&B run, export or summary)
            return out
    if record is not None and env.rank == 0:  # the data, engine and checkpoint all loaded: the run is on
        _record_config(out, record, cfg.train.resume)
    _open_sinks(run)
    _loop(run, progress)
    _finish(run, final_params=final_params and cfg.train.final_params, progress=progress)
    env.barrier()
    return out


@dataclasses.dataclass
class _Run:
    """What the phases of one training run share: set by :func:`_setup`, then advanced by the later phases."""

    cfg: RunConfig
    env: DistEnv
    out: Path
    kind: str
    name: str  # the engine's name under ``kind``
    device: torch.device
    data: Any  # forgetrain.data.prepare's result
    tokenizer: Any  # loaded only when the run ends with a sample
    train_w: Any
    valid_w: Any
    engine: Any
    ga: int  # gradient-accumulation steps (micro-batches per step per data-parallel rank)
    dp: int
    dp_rank: int
    tokens_per_step: int
    peak: float  # peak FLOP/s of one device
    peak_label: str
    # _resume
    start: int = 0  # steps already done
    existing: list = dataclasses.field(default_factory=list)  # trace records kept from before the resume
    wandb_id: str | None = None
    rewound: tuple[int, int] | None = None  # steps past the checkpoint that ran before and are run again
    # _open_sinks
    meta: dict = dataclasses.field(default_factory=dict)
    writer: TraceWriter | None = None  # rank 0 only
    wandb_logger: Any = None
    # _loop
    stop: int = 0  # the step this run stops after (train.steps, or train.stop_after)
    first_loss: float | None = None
    val_loss: float | None = None

    @property
    def trace_dir(self) -> Path:
        return self.out / "trace"

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"


def _setup(cfg: RunConfig, env: DistEnv, out: Path, *, kind: str, engine_name: str | None, init_hf, engine_cls,
           export_init: bool, progress: bool) -> _Run:
    """Threads and determinism, the output directory claimed, the data prepared (rank 0 first), the engine built
    with its initial weights (exported when asked), and the batch and peak arithmetic."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    set_deterministic(cfg.train.deterministic, cfg.hardware.device)
    device = torch.device(cfg.hardware.device if cfg.hardware.device == "cpu" else f"cuda:{env.local_rank}")
    _claim_out_dir(cfg, out, env)

    from forgetrain.data import TokenWindows, load_tokenizer, prepare

    if env.rank == 0:
        data = prepare(cfg.data, progress=progress)
    env.barrier()
    data = prepare(cfg.data, progress=False) if env.rank != 0 else data
    if data.vocab_size > cfg.model.vocab_size:
        from forgetrain.errors import ConfigError

        raise ConfigError(f"tokenizer vocabulary {data.vocab_size} exceeds model.vocab_size={cfg.model.vocab_size}")
    # the end-of-run sample needs the tokenizer: load it now, so a broken one fails before training, not after
    tokenizer = load_tokenizer(data.tokenizer_path) if cfg.train.sample_tokens and kind == "scenarios" else None
    train_w = TokenWindows(data.train_prefix, cfg.model.seq_length, cfg.train.seed)
    valid_w = TokenWindows(data.valid_prefix, cfg.model.seq_length, cfg.train.seed) if data.valid_prefix else None

    name = engine_name or cfg.scenario.name
    if engine_cls is None:
        engine_cls = (registry.resolve_engine(cfg.scenario.engine) if kind == "scenarios"
                      else registry.load_engine_class(kind, name))
    engine = build_engine(cfg, device, engine_cls)
    if init_hf is not None:
        engine.load_hf_weights(init_hf)
    if export_init and not cfg.train.resume:
        from safetensors.torch import save

        from forgetrain.trace import atomic_write_bytes

        init_sd = engine.export_hf_weights()  # every rank: a TP engine all-gathers its shards
        if env.rank == 0:
            atomic_write_bytes(out / "init.safetensors", save(init_sd))

    t, p = cfg.train, cfg.parallel
    ga = grad_accum_steps(cfg)
    peak, peak_label = peak_flops(cfg.hardware)
    return _Run(cfg=cfg, env=env, out=out, kind=kind, name=name, device=device, data=data, tokenizer=tokenizer,
                train_w=train_w, valid_w=valid_w, engine=engine, ga=ga, dp=p.data_parallel_size,
                dp_rank=env.rank // p.tensor_parallel_size, tokens_per_step=t.global_batch_size * cfg.model.seq_length,
                peak=peak, peak_label=peak_label)


def build_engine(cfg: RunConfig, device: torch.device, engine_cls):
    """The engine of a run, with its initial weights: the global torch seed set to ``train.seed``, then
    ``engine_cls(cfg, device)``. Every run builds its engine here, so an init rebuilt from a seed without data or
    training (``forgetrain.verify.reference_init``) is the run's own."""
    torch.manual_seed(cfg.train.seed)
    return engine_cls(cfg, device)


def _check_resumable(ckpt_root: Path) -> None:
    """Raise CheckpointError when ``ckpt_root`` holds no complete checkpoint (``train.resume=true`` has nothing to
    continue). Every rank reads the same directory."""
    if checkpoint.latest(ckpt_root) is None:
        raise CheckpointError(f"train.resume=true but no complete checkpoint under {ckpt_root}: nothing to continue; "
                              f"start afresh without train.resume (with train.overwrite=true where the directory "
                              f"already holds a trace), or choose another train.out_dir")


def _resume(run: _Run) -> None:
    """Load the newest good checkpoint into the engine (skipping damaged ones, with a warning) and keep the trace
    up to it. Raises CheckpointError when there is none, or it lies past ``train.steps``, or it was trained with
    another global batch."""
    cfg, env, engine, t = run.cfg, run.env, run.engine, run.cfg.train
    ckpt_root = run.ckpt_root  # train() has checked it holds a checkpoint (_check_resumable)
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


def _open_sinks(run: _Run) -> None:
    """The trace writer (rank 0, keeping the records before a resume) and W&B, and the run's banner."""
    cfg, env, out, t, p = run.cfg, run.env, run.out, run.cfg.train, run.cfg.parallel
    kind, name, start, wandb_id, rewound = run.kind, run.name, run.start, run.wandb_id, run.rewound
    run.meta = {"side": f"{kind}/{name}", "scenario": cfg.scenario.name, "config_hash": config_hash(cfg),
                "config": hashed_config(cfg),
                "precision": t.precision, "platform": cfg.hardware.name, "versions": versions(), "steps": t.steps,
                "world_size": env.world_size, "mfu_formula": mfu_formula_label(run.peak_label)}
    run.writer = TraceWriter(run.trace_dir, run.meta, run.existing) if env.rank == 0 else None
    if env.rank == 0 and rewound:
        print(f"resuming at step {start}: steps {rewound[0]}-{rewound[1]} ran before the stop and are run again "
              f"(the trace keeps the new values)" + (f"; W&B run {wandb_id} already has them and keeps its first "
                                                     f"values for those steps" if wandb_id else ""), file=sys.stderr)
    if env.rank == 0 and cfg.logger.name == "wandb":
        wandb_logger = run.wandb_logger = WandbLogger(cfg.logger, dataclasses.asdict(cfg), str(out), run_id=wandb_id)
        where = f"{out / 'wandb'} (offline; upload with: wandb sync {out / 'wandb'}/offline-run-*)" \
            if cfg.logger.mode == "offline" else wandb_logger.run.url
        print(f"W&B run {wandb_logger.run.id} ({'resumed' if wandb_id else 'new'}): {where}", file=sys.stderr)

    if env.rank == 0:
        n = param_counts(cfg.model)
        dp, ga = run.dp, run.ga
        who = f"scenario {name}, engine {cfg.scenario.engine}" if kind == "scenarios" else f"{kind}/{name}"
        fp8 = (f" (FP8 GEMMs in the decoder layers: engine.fp8={cfg.engine.fp8})"
               if kind == "scenarios" and cfg.engine.mode == "fast" and cfg.engine.fp8 != "none" else "")
        print(f"forgetrain: {who} | {n['total'] / 1e6:.2f}M params | DP{dp} TP{p.tensor_parallel_size} | "
              f"micro-batch {t.micro_batch_size} x grad-accum {ga} x DP {dp} = global batch {t.global_batch_size} | "
              f"{t.precision}{fp8} on {run.device} | out: {out}", file=sys.stderr)


def _loop(run: _Run, progress: bool) -> None:
    """Steps ``start`` .. ``stop``: one engine step on this rank's micro-batches, its trace record (timings, MFU,
    digests, step-1 module probes, evaluation), the progress bar, W&B, checkpoints. Raises DivergenceError on a
    non-finite loss and Interrupted on Ctrl-C, each naming where the run can resume from."""
    from forgetrain.data import eval_batches, micro_batch

    cfg, env, engine, t, writer = run.cfg, run.env, run.engine, run.cfg.train, run.writer
    device, train_w, valid_w, ga, dp, dp_rank = run.device, run.train_w, run.valid_w, run.ga, run.dp, run.dp_rank
    out, ckpt_root, start, wandb_logger, wandb_id = run.out, run.ckpt_root, run.start, run.wandb_logger, run.wandb_id
    tokens_per_step, devices = run.tokens_per_step, env.world_size
    stop = run.stop = min(t.steps, t.stop_after) if t.stop_after else t.steps
    bar = None
    if env.rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    probe = _Probe(engine.module_probes()) if (t.digests and start == 0) else None
    run.first_loss = run.existing[0]["loss"] if run.existing else None
    ctrl_c, completed = _CtrlC(), None
    try:
        for step in range(start, stop):
            mbs = [micro_batch(train_w, step, m, dp_rank, t.micro_batch_size, dp, t.global_batch_size) for m in range(ga)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = engine.train_step(mbs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            tps = tokens_per_step / step_s
            rec = {"step": step + 1, "loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr,
                   "tokens": (step + 1) * tokens_per_step, "step_s": step_s, "tokens_per_s": tps,
                   **mfu_metrics(cfg.model, tps, run.peak, devices)}
            if device.type == "cuda":  # the peak of allocated device memory so far (torch's allocator), GiB
                rec["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if t.digests:
                rec["digests"] = _step_digests(engine, res, t.clip_grad)
            if probe is not None:
                if writer:
                    writer.write_modules(probe.records)
                probe.close()
                probe = None
            if run.first_loss is None:
                run.first_loss = res.loss
            if valid_w is not None and t.eval_interval and ((step + 1) % t.eval_interval == 0 or step + 1 == t.steps):
                run.val_loss = engine.eval_loss(eval_batches(valid_w, t.eval_iters, t.micro_batch_size))
                rec["val_loss"] = run.val_loss
            if writer:
                writer.append(rec)
            if not math.isfinite(res.loss):  # NaN or inf
                if writer:
                    writer.flush()
                from forgetrain.errors import DivergenceError

                if bar is not None:
                    bar.close()  # the error line goes on a line of its own, not into the bar
                raise DivergenceError(f"loss is {res.loss} at step {step + 1}: training diverged (lower train.lr, "
                                      f"check train.adam_eps / train.clip_grad); {_resume_hint(ckpt_root, out)}")
            if bar is not None:  # this step's metrics first, then the count: the redraw shows both together
                if (step + 1) % t.log_interval == 0:
                    post = {"loss": f"{res.loss:.4f}", "gnorm": f"{res.grad_norm:.3f}", "lr": f"{res.lr:.2e}",
                            "tok/s": f"{tps:,.0f}", "mfu%": f"{rec['mfu_pct']:.1f}"}
                    if "mem_gib" in rec:
                        post["mem"] = f"{rec['mem_gib']:.1f}G"
                    if run.val_loss is not None:
                        post["val"] = f"{run.val_loss:.4f}"
                    bar.set_postfix(post, refresh=False)
                bar.update(1)
            if wandb_logger:
                wandb_logger.log({k: v for k, v in rec.items() if k not in ("digests", "step")}, step=step + 1)
            # the first Ctrl-C: this step is finished, so it is saved (as Megatron's exit signal handler saves before it
            # exits) and the run stops here. Every rank stops after the same step: the request is agreed over the ranks
            # at each step boundary (under torchrun the signal reaches the workers one by one, and a rank already in
            # the next step would wait on its peers' collectives); the save is collective, so it comes after
            stopping = env.any_rank(ctrl_c.requested)
            save_now = t.save and ((t.save_interval and (step + 1) % t.save_interval == 0) or step + 1 == stop
                                   or stopping)
            if save_now:
                if writer:
                    writer.flush()
                harness = {"step": step + 1, "config_hash": config_hash(cfg), "config": run.meta["config"],
                           "engine_settings": engine_settings(cfg), "scenario": cfg.scenario.name,
                           "side": run.meta["side"], "global_batch_size": t.global_batch_size,
                           "wandb_run_id": wandb_logger.run.id if wandb_logger else wandb_id}
                try:
                    checkpoint.save(ckpt_root, step + 1, engine.state_dict(), harness)
                except BaseException:
                    if bar is not None:
                        bar.close()  # the error line goes on a line of its own, not into the bar
                    raise
                checkpoint.prune(ckpt_root)
            elif writer and (step + 1) % 10 == 0:
                writer.flush()
            if stopping:
                completed = step + 1
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        if writer:
            writer.flush()
        from forgetrain.errors import Interrupted

        when = f"after step {completed} (Ctrl-C)" if completed is not None else f"during step {step + 1}"
        raise Interrupted(f"interrupted {when}; {_resume_hint(ckpt_root, out)}") from None
    finally:
        ctrl_c.restore()
    if bar is not None:
        bar.close()
    if writer:
        writer.flush()


def _step_digests(engine, res, clip_grad: float) -> dict:
    """The step's digests (``forgetrain.trace``): per-token losses, pre-clip gradients, the gradients the update
    applied (:func:`clipped_grads`) and the parameters after the step. Every rank calls it (a TP engine's exports
    are collectives)."""
    pre = engine.export_hf_grads()
    dg = {"per_token_loss": tensor_digest(res.per_token_loss), "grads": tensor_digests(pre)}
    post = clipped_grads(engine, pre, res.grad_norm, clip_grad)
    dg["clipped_grads"] = dg["grads"] if post is pre else tensor_digests(post)
    dg["params"] = tensor_digests(engine.export_hf_weights())
    return dg


def clipped_grads(engine, pre: dict[str, torch.Tensor], grad_norm: float,
                  clip_grad: float) -> dict[str, torch.Tensor]:
    """The gradients the last step's update applied (after clipping), HF layout, fp32, name -> tensor of the
    parameter's shape.

    An engine that has ``export_hf_clipped_grads()`` reports its own (None there: not available in this layout,
    e.g. ZeRO-1 or FSDP shards). Otherwise they are derived from ``pre`` (:meth:`export_hf_grads`, pre-clip) the
    way Megatron clips (``clip_grad_by_total_norm_fp32``): ``coeff = clip_grad / (grad_norm + 1e-6)`` from the
    step's reported pre-clip ``grad_norm``, and ``g * coeff`` (a Python float scale) only when ``clip_grad > 0``
    and ``coeff < 1`` -- exactly the reference's clipped gradients, which its engine does not export (it is never
    edited). Returns ``pre`` itself when no clipping applies."""
    own = getattr(engine, "export_hf_clipped_grads", None)
    got = own() if own is not None else None
    if got is not None:
        return got
    coeff = clip_grad / (grad_norm + 1.0e-6) if clip_grad > 0 else 1.0
    if not coeff < 1.0:  # NaN norm: nothing clipped either (Megatron's test is the same)
        return pre
    return {k: g * coeff for k, g in pre.items()}


class _CtrlC:
    """Ctrl-C during the training loop, in the main thread: the first SIGINT only sets :attr:`requested` (the loop
    finishes its step, then stops with the one-line Interrupted error); a second one raises KeyboardInterrupt at
    once. Stopping at the step boundary leaves the trace and the checkpoints holding whole steps only, and no
    KeyboardInterrupt is raised inside library code (Megatron-LM's exit-signal handler also stops at an iteration
    boundary; its distributed handler agrees across ranks as the loop does with :meth:`DistEnv.any_rank`).
    :func:`forgetrain.checkpoint.save` holds the signal during a save and hands it to this handler afterwards.
    Elsewhere (not the main thread, or SIGINT ignored from the start) it does nothing."""

    def __init__(self):
        import threading

        self.requested = False
        self._previous = None
        # a process started with SIGINT ignored (nohup, a background job of a script) keeps ignoring it
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        sys.stderr.write("\nCtrl-C: stopping when this step is finished (and checkpointed, under train.save=true); "
                         "Ctrl-C again to stop now\n")
        sys.stderr.flush()

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _finish(run: _Run, *, final_params: bool, progress: bool) -> None:
    """At the end of ``train.steps`` (not at ``stop_after``): the final parameters, the sample text,
    ``summary.json``, the loss plot and the printed summary (rank 0 writes); then W&B is closed."""
    cfg, env, engine, t, p, writer = run.cfg, run.env, run.engine, run.cfg.train, run.cfg.parallel, run.writer
    stop, out = run.stop, run.out
    summary = {}
    # Exports and the sample are collectives for a TP or FSDP engine: every rank takes part, rank 0 writes.
    tp_collective = p.tensor_parallel_size > 1 or p.zero_stage == 3
    final_sd = engine.export_hf_weights() if stop == t.steps and final_params else None
    sample = None
    if stop == t.steps and t.sample_tokens and run.kind == "scenarios" and (env.rank == 0 or tp_collective):
        sample = _sample_text(engine, run.tokenizer, cfg, run.device)
    failed = None
    if env.rank == 0 and stop == t.steps and final_params:
        try:
            writer.write_final_params(final_sd)
        except OSError as e:  # a full disk after the last step: one line, the last checkpoint stands
            last = checkpoint.latest(run.ckpt_root) if run.ckpt_root.is_dir() else None
            failed = (f"cannot write the final weights to {writer.dir / 'final.safetensors'}: "
                      f"{e.strerror or e}; the trace is complete and the last checkpoint is "
                      f"{last if last is not None else 'none (train.save=false)'}")
    if stop == t.steps and final_params and env.world_size > 1:
        failed = env.broadcast_object(failed)  # every rank ends with rank 0's line, none waits on a dead peer
    if failed:
        from forgetrain.errors import ForgeTrainError

        raise ForgeTrainError(failed)
    if env.rank == 0 and stop == t.steps:
        recs = writer.records
        summary = {"first_loss": run.first_loss, "last_loss": recs[-1]["loss"] if recs else None,
                   "val_loss": run.val_loss, "steps": t.steps, "ln_vocab": float(torch.log(torch.tensor(
                       float(run.data.vocab_size)))), "out_dir": str(out), "peak": run.peak_label}
        if recs:
            steady = recs[min(len(recs) - 1, 2):]
            summary["median_tokens_per_s"] = sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2]
            for key in ("mfu_pct", "mfu_causal_pct"):
                summary[f"median_{key}"] = sorted(r[key] for r in steady)[len(steady) // 2]
        if sample is not None:
            summary["sample"] = sample
        from forgetrain.trace import atomic_write_json

        atomic_write_json(out / "summary.json", summary)
        if cfg.logger.plots and recs:
            write_plots(recs, str(out / "loss.png"))
        if progress:
            _print_summary(summary)
        from forgetrain.metrics import implausible_mfu

        if recs and (warn := implausible_mfu(cfg.hardware, summary["median_mfu_pct"])):
            print(warn, file=sys.stderr, flush=True)
    if env.rank == 0 and stop < t.steps and progress:  # a deliberate stop: say how to go on
        print(f"stopped after step {stop} of {t.steps} (train.stop_after={t.stop_after}); "
              f"{_resume_hint(run.ckpt_root, out)}", file=sys.stderr, flush=True)
    if run.wandb_logger:
        run.wandb_logger.finish()


def _resume_hint(ckpt_root: Path, out: Path) -> str:
    """Where a stopped run can continue from: the last checkpoint and the command (:func:`_resume_command`), or
    that there is none."""
    last = checkpoint.latest(ckpt_root)
    if last is None:
        return ("no checkpoint was written yet (train.save_interval; none at all under train.save=false), so there is "
                "nothing to resume: start again, the same command with train.overwrite=true")
    return f"last checkpoint: {last.name} (continue with: {_resume_command(out)})"


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


def _resume_command(out: Path) -> str:
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


def _print_summary(s: dict) -> None:
    lines = ["", "=== summary ===",
             f"loss: first {s['first_loss']:.4f} -> last {s['last_loss']:.4f}  (ln vocab = {s['ln_vocab']:.3f})"]
    if s.get("val_loss") is not None:
        lines.append(f"validation loss: {s['val_loss']:.4f}")
    if "median_tokens_per_s" in s:
        lines.append(f"throughput (median step): {s['median_tokens_per_s']:,.0f} tokens/s, MFU {s['median_mfu_pct']:.1f}% PaLM "
                     f"/ {s['median_mfu_causal_pct']:.1f}% Megatron causal "
                     f"({s['peak']})")
    if s.get("sample"):
        lines += ["sample:", "-" * 60, s["sample"], "-" * 60]
    lines.append(f"outputs: {s['out_dir']}  (trace/, checkpoints/, summary.json, loss.png)")
    print("\n".join(lines), file=sys.stderr, flush=True)


if __name__ == "__main__":  # ``python -m forgetrain.train`` is ``python -m forgetrain`` (it silently did nothing)
    import runpy

    runpy.run_module("forgetrain", run_name="__main__", alter_sys=True)
