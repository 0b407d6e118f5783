"""The phases of one training run around the loop (:mod:`forgetrain.run.loop`): :func:`setup` (data, engine,
initial weights), :func:`open_sinks` (trace writer, W&B, the banner) and :func:`finish` (final weights, sample,
summary); :class:`Run` is what they share."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from forgetrain import checkpoint, registry
from forgetrain.config import RunConfig, grad_accum_steps
from forgetrain.distributed import DistEnv, set_deterministic
from forgetrain.metrics import WandbLogger, mfu_formula_label, param_counts, peak_flops, write_plots
from forgetrain.run.identity import config_hash, hashed_config, versions
from forgetrain.run.outdir import claim_out_dir
from forgetrain.run.resume import resume_hint
from forgetrain.trace import TraceWriter


@dataclasses.dataclass
class Run:
    """What the phases of one training run share: set by :func:`setup`, then advanced by the later phases."""

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
    # resume
    start: int = 0  # steps already done
    existing: list = dataclasses.field(default_factory=list)  # trace records kept from before the resume
    wandb_id: str | None = None
    rewound: tuple[int, int] | None = None  # steps past the checkpoint that ran before and are run again
    # open_sinks
    meta: dict = dataclasses.field(default_factory=dict)
    writer: TraceWriter | None = None  # rank 0 only
    wandb_logger: Any = None
    # run_loop
    stop: int = 0  # the step this run stops after (train.steps, or train.stop_after)
    first_loss: float | None = None
    val_loss: float | None = None

    @property
    def trace_dir(self) -> Path:
        return self.out / "trace"

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"


def busy_cpu_hint(device: str, threads: int, load: float | None = None, cores: int | None = None) -> str | None:
    """One ``note:`` line when a CPU run with several threads starts on a machine whose 1-minute load average
    (``os.getloadavg``, or ``load``) already exceeds its cores (``os.cpu_count``, or ``cores``): there, torch's
    threads wait on each other and one thread runs several times faster (measured: 15-25 s against 0.75 s per
    step of the default run on 2 loaded cores). None otherwise, or where the load cannot be read."""
    import os

    if device != "cpu" or threads <= 1:
        return None
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    cores = cores or os.cpu_count() or 1
    if load <= cores:
        return None
    return (f"note: the load average is {load:.1f} on {cores} cores and this run uses {threads} threads; on a "
            f"busy machine train.threads=1 is usually several times faster")


def setup(cfg: RunConfig, env: DistEnv, out: Path, *, kind: str, engine_name: str | None, init_hf, engine_cls,
           export_init: bool, progress: bool) -> Run:
    """Threads and determinism, the output directory claimed, the data prepared (rank 0 first), the engine built
    with its initial weights (exported when asked), and the batch and peak arithmetic."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    set_deterministic(cfg.train.deterministic, cfg.hardware.device)
    device = torch.device(cfg.hardware.device if cfg.hardware.device == "cpu" else f"cuda:{env.local_rank}")
    claim_out_dir(cfg, out, env)

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
    # once the run is set up (bad input has had its one error line by now): the hint for a busy CPU
    if progress and env.rank == 0 and (hint := busy_cpu_hint(cfg.hardware.device, torch.get_num_threads())):
        print(hint, file=sys.stderr, flush=True)
    return Run(cfg=cfg, env=env, out=out, kind=kind, name=name, device=device, data=data, tokenizer=tokenizer,
                train_w=train_w, valid_w=valid_w, engine=engine, ga=ga, dp=p.data_parallel_size,
                dp_rank=env.rank // p.tensor_parallel_size, tokens_per_step=t.global_batch_size * cfg.model.seq_length,
                peak=peak, peak_label=peak_label)


def build_engine(cfg: RunConfig, device: torch.device, engine_cls):
    """The engine of a run, with its initial weights: the global torch seed set to ``train.seed``, then
    ``engine_cls(cfg, device)``. Every run builds its engine here, so an init rebuilt from a seed without data or
    training (``forgetrain.equivalence.inits.reference_init``) is the run's own."""
    torch.manual_seed(cfg.train.seed)
    return engine_cls(cfg, device)


def open_sinks(run: Run) -> None:
    """The trace writer (rank 0, keeping the records before a resume) and W&B, and the run's banner."""
    cfg, env, out, t, p = run.cfg, run.env, run.out, run.cfg.train, run.cfg.parallel
    kind, name, start, wandb_id, rewound = run.kind, run.name, run.start, run.wandb_id, run.rewound
    run.meta = {"side": f"{kind}/{name}", "scenario": cfg.scenario.name, "config_hash": config_hash(cfg),
                "config": hashed_config(cfg),
                "precision": t.precision, "platform": cfg.hardware.name, "versions": versions(), "steps": t.steps,
                "world_size": env.world_size, "mfu_formula": mfu_formula_label(run.peak_label, cfg.model)}
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
        where = "the decoder layers and the LM head" if cfg.engine.fp8_lm_head else "the decoder layers"
        fp8 = (f" (FP8 GEMMs in {where}: engine.fp8={cfg.engine.fp8})"
               if kind == "scenarios" and cfg.engine.mode == "fast" and cfg.engine.fp8 != "none" else "")
        print(f"forgetrain: {who} | {n['total'] / 1e6:.2f}M params | DP{dp} TP{p.tensor_parallel_size} | "
              f"micro-batch {t.micro_batch_size} x grad-accum {ga} x DP {dp} = global batch {t.global_batch_size} | "
              f"{t.precision}{fp8} on {run.device} | out: {out}", file=sys.stderr)


def finish(run: Run, *, final_params: bool, progress: bool) -> None:
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
        sample = sample_text(engine, run.tokenizer, cfg, run.device)
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
            print_summary(summary)
        from forgetrain.metrics import implausible_mfu

        if recs and (warn := implausible_mfu(cfg.hardware, summary["median_mfu_pct"])):
            print(warn, file=sys.stderr, flush=True)
    if env.rank == 0 and stop < t.steps and progress:  # a deliberate stop: say how to go on
        print(f"stopped after step {stop} of {t.steps} (train.stop_after={t.stop_after}); "
              f"{resume_hint(run.ckpt_root, out)}", file=sys.stderr, flush=True)
    if run.wandb_logger:
        run.wandb_logger.finish()


def sample_text(engine, tok, cfg: RunConfig, device) -> str:
    ids = tok.encode(cfg.train.sample_prompt) or [0]
    gen = torch.Generator().manual_seed(cfg.train.seed)
    s = cfg.model.seq_length
    for _ in range(cfg.train.sample_tokens):
        ctx = torch.tensor([ids[-s:]], dtype=torch.long, device=device)
        logits = engine.logits(ctx)[0, -1].float().cpu()
        probs = torch.softmax(logits / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return tok.render_documents(ids)


def print_summary(s: dict) -> None:
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
