"""The training loop: steps ``start`` .. ``stop`` of one run, each an engine step on this rank's micro-batches and
its trace record, with the progress bar, evaluation, W&B and checkpoints. The phases before and after it are in
:mod:`forgetrain.run.phases`; :func:`forgetrain.train.train` runs them in order.

Ctrl-C is taken at the step boundary (:class:`CtrlC`): the step in hand finishes, is checkpointed and the run stops
with one line naming where it can resume. A non-finite loss stops the run the same way (DivergenceError).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from typing import TYPE_CHECKING

import torch

from forgetrain import checkpoint
from forgetrain.metrics import mfu_metrics, moe_metrics, moe_progress_fields
from forgetrain.run.identity import config_hash, engine_settings
from forgetrain.run.resume import resume_hint
from forgetrain.trace import tensor_digest, tensor_digests

if TYPE_CHECKING:
    from forgetrain.run.phases import Run


def run_loop(run: Run, progress: bool) -> None:
    """Steps ``start`` .. ``stop``: one engine step on this rank's micro-batches, its trace record (timings, MFU,
    digests, step-1 module probes, evaluation), the progress bar, W&B (the record without its digests, plus a
    mixture of experts' scalars: :func:`forgetrain.metrics.moe_metrics`), checkpoints. Raises DivergenceError on a
    non-finite loss and Interrupted on Ctrl-C, each naming where the run can resume from."""
    env, t, writer = run.env, run.cfg.train, run.writer
    run.stop = min(t.steps, t.stop_after) if t.stop_after else t.steps
    bar = None
    if env.rank == 0 and progress:
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=run.start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    probe = Probe(run.engine.module_probes()) if (t.digests and run.start == 0) else None
    run.first_loss = run.existing[0]["loss"] if run.existing else None
    ctrl_c, completed = CtrlC(), None
    try:
        for step in range(run.start, run.stop):
            res, rec = _timed_step(run, step)
            if probe is not None:
                if writer:
                    writer.write_modules(probe.records)
                probe.close()
                probe = None
            if run.first_loss is None:
                run.first_loss = res.loss
            _evaluate(run, step, rec)
            if writer:
                writer.append(rec)
            if not math.isfinite(res.loss):  # NaN or inf
                _diverged(run, step, res.loss, bar)
            moe = moe_metrics(rec, run.cfg.model)  # {} for a dense model
            _show_progress(run, bar, step, rec, moe)
            if run.wandb_logger:
                run.wandb_logger.log({**{k: v for k, v in rec.items() if k not in ("digests", "step")}, **moe},
                                     step=step + 1)
            # the first Ctrl-C: this step is finished, so it is saved (as Megatron's exit signal handler saves before it
            # exits) and the run stops here. Every rank stops after the same step: the request is agreed over the ranks
            # at each step boundary (under torchrun the signal reaches the workers one by one, and a rank already in
            # the next step would wait on its peers' collectives); the save is collective, so it comes after
            stopping = env.any_rank(ctrl_c.requested)
            _save_or_flush(run, step, stopping, bar)
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
        raise Interrupted(f"interrupted {when}; {resume_hint(run.ckpt_root, run.out)}") from None
    finally:
        ctrl_c.restore()
    if bar is not None:
        bar.close()
    if writer:
        writer.flush()


def _timed_step(run: Run, step: int) -> tuple:
    """One engine step on this rank's micro-batches of ``step`` (0-based), timed: (the engine's result, the step's
    trace record without evaluation: loss, grad norm, lr, tokens, timings, MFU, memory on CUDA, digests)."""
    from forgetrain.data import micro_batch

    cfg, t, device, engine = run.cfg, run.cfg.train, run.device, run.engine
    mbs = [micro_batch(run.train_w, step, m, run.dp_rank, t.micro_batch_size, run.dp, t.global_batch_size)
           for m in range(run.ga)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = engine.train_step(mbs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    tps = run.tokens_per_step / step_s
    rec = {"step": step + 1, "loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr,
           "tokens": (step + 1) * run.tokens_per_step, "step_s": step_s, "tokens_per_s": tps,
           **mfu_metrics(cfg.model, tps, run.peak, run.env.world_size)}
    if device.type == "cuda":  # the peak of allocated device memory so far (torch's allocator), GiB
        rec["mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    extra = getattr(res, "extra", None) or {}  # the engine's own per-step values (StepResult.extra)
    if clash := sorted(set(extra) & (set(rec) | {"digests", "val_loss"})):
        raise ValueError(f"StepResult.extra may not replace the trace record's own keys: {clash}")
    rec.update(extra)
    if t.digests:
        rec["digests"] = _step_digests(engine, res, t.clip_grad)
    return res, rec


def _evaluate(run: Run, step: int, rec: dict) -> None:
    """The validation loss into ``rec`` (and ``run.val_loss``) every ``train.eval_interval`` steps and at the last."""
    t = run.cfg.train
    if run.valid_w is not None and t.eval_interval and ((step + 1) % t.eval_interval == 0 or step + 1 == t.steps):
        from forgetrain.data import eval_batches

        run.val_loss = run.engine.eval_loss(eval_batches(run.valid_w, t.eval_iters, t.micro_batch_size))
        rec["val_loss"] = run.val_loss


def _diverged(run: Run, step: int, loss: float, bar) -> None:
    """A non-finite loss at ``step``: the trace flushed, then DivergenceError naming where to resume."""
    if run.writer:
        run.writer.flush()
    from forgetrain.errors import DivergenceError

    if bar is not None:
        bar.close()  # the error line goes on a line of its own, not into the bar
    raise DivergenceError(f"loss is {loss} at step {step + 1}: training diverged (lower train.lr, "
                          f"check train.adam_eps / train.clip_grad); {resume_hint(run.ckpt_root, run.out)}")


def _show_progress(run: Run, bar, step: int, rec: dict, moe: dict | None = None) -> None:
    """This step's metrics first (every ``train.log_interval`` steps), then the count: the redraw shows both.
    ``moe``: a mixture of experts' scalars (:func:`forgetrain.metrics.moe_metrics`; empty or None for a dense
    model), shown as ``moe_lb_loss``, ``moe_max_load`` and ``moe_dropped_tokens``."""
    if bar is None:
        return
    if (step + 1) % run.cfg.train.log_interval == 0:
        post = {"loss": f"{rec['loss']:.4f}", "gnorm": f"{rec['grad_norm']:.3f}", "lr": f"{rec['lr']:.2e}",
                "tok/s": f"{rec['tokens_per_s']:,.0f}", "mfu%": f"{rec['mfu_pct']:.1f}"}
        if "mem_gib" in rec:
            post["mem"] = f"{rec['mem_gib']:.1f}G"
        post.update(moe_progress_fields(moe or {}))
        if run.val_loss is not None:
            post["val"] = f"{run.val_loss:.4f}"
        bar.set_postfix(post, refresh=False)
    bar.update(1)


def _save_or_flush(run: Run, step: int, stopping: bool, bar) -> None:
    """A checkpoint after ``step`` every ``train.save_interval`` steps, at the stop and when ``stopping`` (Ctrl-C),
    then the older ones pruned; otherwise the trace flushed every 10 steps."""
    cfg, t, writer = run.cfg, run.cfg.train, run.writer
    if t.save and ((t.save_interval and (step + 1) % t.save_interval == 0) or step + 1 == run.stop or stopping):
        if writer:
            writer.flush()
        logger = run.wandb_logger
        harness = {"step": step + 1, "config_hash": config_hash(cfg), "config": run.meta["config"],
                   "engine_settings": engine_settings(cfg), "scenario": cfg.scenario.name,
                   "side": run.meta["side"], "global_batch_size": t.global_batch_size,
                   "wandb_run_id": logger.run.id if logger else run.wandb_id}
        try:
            checkpoint.save(run.ckpt_root, step + 1, run.engine.state_dict(), harness)
        except BaseException:
            if bar is not None:
                bar.close()  # the error line goes on a line of its own, not into the bar
            raise
        checkpoint.prune(run.ckpt_root)
    elif writer and (step + 1) % 10 == 0:
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


class CtrlC:
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


class Probe:
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
