"""The forged training engine of ``llama_tiny_cpu``: one optimizer step, end to end, in plain PyTorch.

It composes the shared Llama parts (``scenarios/_llama``: the model, the grad buffer and ``ParallelState``, the
optimizer arithmetic, the weight layouts); what is its own is the CPU step: fp32 (or autocast bf16) grads in
``param.grad``, TP and FSDP2, and the checkpoint layouts of every parallel form.

Step arithmetic (each line mirrors megatron-core 0.16.1 + torch AdamW, see scenarios/_llama/README.md):

1. for each of the G micro-batches: per-token loss ``[b, s]`` -> mean -> ``/ G`` -> backward; gradients
   accumulate in fp32 in ``param.grad`` (micro-batch order).
2. grad norm: per-tensor ``torch.norm`` over the Megatron-shaped grads (fused QKV, fused fc1), 2-D weights first
   then 1-D norm weights; total = ``norm(tensor(norms))``, squared in fp32, ``.item() ** 0.5``.
3. clipping: ``coeff = clip_grad / (norm + 1e-6)``; grads ``*= coeff`` only when ``coeff < 1``.
4. AdamW (torch's single-tensor arithmetic): ``p *= 1 - lr*wd``; ``m.lerp_(g, 1-b1)``;
   ``v = b2*v + (1-b2)*g*g``; ``denom = sqrt(v)/sqrt(1-b2^t) + eps``; ``p -= lr/(1-b1^t) * m/denom``.
   Weight decay applies to 2-D weights only (Megatron's scheduler sets wd_mult=0 for 1-D params).
5. lr: Megatron's OptimizerParamScheduler semantics (``forgetrain.schedule``): step k uses ``lr_at(k-1)``.

bf16 (``train.precision=bf16``) runs the forward/backward under ``torch.autocast(bfloat16)`` with fp32 weights,
grads and optimizer state; it targets the tolerance tier.

Data parallelism (``parallel.data_parallel_size`` = DP > 1, launched with torchrun; see ``_llama/parallel.py``):

6. grads accumulate into one flat fp32 buffer in Megatron's layout; after the last micro-batch's backward each
   bucket is scaled by ``1/DP`` and all-reduced with SUM (Megatron DDP, ``finalize_model_grads``). Steps 2-5 then
   run on every rank on identical grads. ``StepResult.loss`` is rank-local (the reference's report);
   ``parallel.report_loss=dp_mean`` averages it over DP instead.
7. ``parallel.zero_stage=1`` (ZeRO-1, Megatron's distributed optimizer): reduce-scatter instead of all-reduce;
   each rank owns 1/DP of the padded buffer, computes the grad norm over its pieces in the distributed
   optimizer's order (all-reduced), clips and updates only those pieces (AdamW state is sharded), then
   all-gathers the params.

8. ``parallel.tensor_parallel_size=2`` (TP, Megatron's layout, see ``_llama/model.py``): the grad norm counts the
   replicated norm weights on TP rank 0 only and all-reduces the squares over TP.
9. ``parallel.zero_stage=3``: torch FSDP2 over the DP ranks (tolerance tier; see ``_setup_fsdp``).

Checkpoints hold full, unsharded per-parameter tensors keyed by parameter name (model weights and AdamW state),
whatever DP, TP and ZeRO stage wrote them, so ``torch.distributed.checkpoint`` can load them into another
layout (DP=2 ZeRO-1 -> DP=1, TP=2 -> TP=1, ...); FSDP2 saves its DTensor shards, which DCP reshards on load.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from forgetrain.engine import StepResult
from forgetrain.levers import EngineSpec
from forgetrain.schedule import lr_for_step
from scenarios._llama import layout, optim
from scenarios._llama.model import Llama
from scenarios._llama.parallel import (GradBuffer, ParallelState, megatron_registration_order, tp_all_gather,
                                       tp_merge, tp_split)


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class Engine:
    """Forged engine. ``Engine(cfg: RunConfig, device)``; see forgetrain.engine.TrainEngine for the protocol."""

    spec = EngineSpec(modes=("exact",))  # one fp32 path, no lever of its own (config.validate refuses the rest)

    def __init__(self, cfg, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.mcfg, self.tcfg = cfg.model, cfg.train
        self.pcfg = cfg.parallel
        self.par = ParallelState.build(self.pcfg)
        self.dp_size, self.zero_stage, self.tp = self.par.dp_size, self.par.zero_stage, self.par.tp
        self.tp_size, self._dp_group = self.tp.size, self.par.dp_group
        self.model = Llama(self.mcfg, deterministic=self.tcfg.deterministic, tp=self.tp).to(self.device)
        self.completed_steps = 0
        self.adam_state: dict[str, dict] = {}
        self._last_grads: dict[str, torch.Tensor] | None = None
        self._last_clipped: dict[str, torch.Tensor] | None = None  # the update's grads (digests, no ZeRO/FSDP)
        self.ddp: GradBuffer | None = None
        self.fsdp = self.zero_stage == 3  # torch FSDP2
        self.init_weights()
        if self.fsdp:
            self._setup_fsdp()
        else:
            self._setup_data_parallel()

    def _setup_fsdp(self) -> None:
        """``parallel.zero_stage=3``: torch FSDP2 ``fully_shard`` on each block and on the root, over a 1-D DP mesh.

        Params, grads and AdamW state are DTensors sharded on dim 0; FSDP2 all-gathers params per block in the
        forward and backward and reduce-scatters (averages) grads after the last micro-batch's backward.
        Checkpoints hold the DTensors themselves, so DCP writes one shard per rank and reshards on load.
        A different reduction (FSDP's reduce-scatter, per-shard norms): judged at the tolerance tier vs DP.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("parallel.zero_stage=3 (FSDP2) needs a process group: launch with torchrun")
        self._mesh = init_device_mesh(self.device.type, (self.dp_size,))
        for blk in self.model.layers:
            fully_shard(blk, mesh=self._mesh)
        fully_shard(self.model, mesh=self._mesh)
        self.adam_state = optim.fresh_state(self._named())

    def _setup_data_parallel(self) -> None:
        """Build the flat grad buffer for DP > 1 or ZeRO-1 (DP=1 ZeRO-0 keeps autograd's own ``.grad``)."""
        p = self.pcfg
        if self.dp_size == 1 and self.zero_stage == 0:
            return
        if self.zero_stage == 1 and self.tp_size > 1:
            raise NotImplementedError("llama_tiny_cpu: ZeRO-1 with TP > 1 is not implemented")
        bucket = p.bucket_size
        if bucket is None and p.overlap_grad_reduce:
            bucket = max(40_000_000, 1_000_000 * self.dp_size)  # Megatron's default with overlap on
        self.ddp = GradBuffer(self._named(), megatron_registration_order(self.mcfg.num_layers),
                              group=self._dp_group, zero1=self.zero_stage == 1, bucket_size=bucket,
                              overlap=p.overlap_grad_reduce)
        if self.zero_stage == 1:
            self._shard_adam_state()

    def _shard_adam_state(self) -> None:
        """ZeRO-1: AdamW moments live in two flat fp32 buffers of this rank's shard size; ``adam_state`` maps
        each owned piece's parameter name to views of them."""
        self._m_shard, self._v_shard, self.adam_state = optim.shard_state(self.ddp, self.device, self.completed_steps)

    # ---------------------------------------------------------------- parameters
    def _named(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def _norm_order(self) -> list[str]:
        """Megatron's grad-norm order (:func:`scenarios._llama.layout.norm_order`)."""
        return layout.norm_order(self.mcfg.num_layers)

    def init_weights(self) -> None:
        """Deterministic N(0, init_method_std) init from ``train.seed``; resets the optimizer. Under TP every
        rank draws the full (TP=1) model and keeps its shards, so the weights do not depend on the TP size."""
        g = torch.Generator(device="cpu").manual_seed(self.tcfg.seed)
        if self.tp.size == 1:
            self.model.to("cpu").reset_parameters(g)
            self.model.to(self.device)
        else:
            full = Llama(self.mcfg, deterministic=self.tcfg.deterministic)
            full.reset_parameters(g)
            self._load_full({k: v.detach() for k, v in full.named_parameters()})
        # optimizer state exists from the start so checkpoints have a fixed structure
        self.completed_steps = 0
        if getattr(self, "ddp", None) is not None and self.ddp.zero1:
            self.ddp.rebind_params()
            self._shard_adam_state()
            return
        self.adam_state = optim.fresh_state(self._named())

    # ---------------------------------------------------------------- HF layout exchange
    def _to_hf(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return layout.to_hf(self.mcfg, t)

    def _from_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return layout.from_hf(self.mcfg, sd)

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-Llama-layout fp32 weights (e.g. the reference's exported init). Raises KeyError/ValueError."""
        self._load_full(self._from_hf(state))

    def _load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Copy full (TP=1-shaped) forged-layout tensors into the params, keeping this TP rank's shards."""
        named = self._named()
        for k, v in full.items():
            v = tp_split(k, v, self.tp.size, self.tp.rank)
            if named[k].shape != v.shape:
                raise ValueError(f"shape mismatch for {k}: {tuple(v.shape)} vs {tuple(named[k].shape)}")
            with torch.no_grad():
                if _is_dtensor(named[k]):  # FSDP2: keep this rank's dim-0 shard (no communication)
                    from torch.distributed.tensor import distribute_tensor

                    v = distribute_tensor(v.to(named[k].dtype), named[k].device_mesh, named[k].placements,
                                          src_data_rank=None)
                named[k].copy_(v)

    def _full(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors -> full (TP=1-shaped) ones: all-gather over TP, or FSDP's DTensor
        ``full_tensor()`` (a collective; identity at TP=1 without FSDP)."""
        if self.fsdp:
            return {k: v.detach().full_tensor() if _is_dtensor(v) else v for k, v in t.items()}
        if self.tp.size == 1:
            return t
        return {k: tp_merge(k, tp_all_gather(v.detach(), self.tp.size, self.tp.group)) for k, v in t.items()}

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """fp32 HF-layout weights on CPU. Under TP every rank must call it (shards are all-gathered)."""
        return self._to_hf(self._full({k: p for k, p in self._named().items()}))

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """Accumulated grads of the last step, pre-clip, HF layout (all-gathered under TP). Raises RuntimeError
        before any step."""
        if self._last_grads is None:
            raise RuntimeError("no step has run yet")
        return self._to_hf(self._full(self._last_grads))

    def export_hf_clipped_grads(self) -> dict[str, torch.Tensor] | None:
        """The grads the last step's AdamW applied (after clipping), HF layout (all-gathered under TP); None when
        not kept: ``train.digests=false``, before any step, or under ZeRO-1 / FSDP (only shards are clipped), where
        the harness derives them (``forgetrain.train.clipped_grads``)."""
        if self._last_clipped is None:
            return None
        return self._to_hf(self._full(self._last_clipped))

    # ---------------------------------------------------------------- step
    def _autocast(self):
        if self.tcfg.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _check(self, mb: torch.Tensor) -> torch.Tensor:
        return layout.check_micro_batch(mb, self.mcfg.seq_length, self.device)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """One optimizer step over ``micro_batches`` (each ``[b, s+1]`` int64). Returns StepResult.

        Under DP every rank calls this with its own micro-batches; the gradient reduction is collective, so a
        rank that does not arrive makes the others fail after ``parallel.timeout_s``.
        """
        self.model.train()
        named = self._named()
        if self.ddp is not None:
            self.ddp.zero_grad()
        else:
            for p in named.values():
                p.grad = None
        n = len(micro_batches)
        losses, per_token = [], []
        for i, mb in enumerate(micro_batches):
            mb = self._check(mb)
            if self.ddp is not None:
                self.ddp.arm(i == n - 1)
            if self.fsdp:  # accumulate unsharded grads locally; reduce-scatter after the last micro-batch
                self.model.set_requires_gradient_sync(i == n - 1)
            with self._autocast():
                tok_loss = self.model(mb[:, :-1], mb[:, 1:])  # [b, s] fp32
            loss = tok_loss.mean()
            (loss / n).backward()
            losses.append(loss.detach())
            per_token.append(tok_loss.detach())
        if self.ddp is not None:
            self._sync_grads()
        lr = lr_for_step(self.tcfg, self.completed_steps)
        if self.ddp is not None and self.ddp.zero1:
            grad_norm = self._zero1_step(lr)
        elif self.fsdp:
            grad_norm = self._fsdp_step(self._named(), lr)  # the sharded params, as registered after backward
        else:
            grads = {k: named[k].grad for k in self._norm_order()}
            self._last_grads = {k: g.clone() for k, g in grads.items()} if self.tcfg.digests else grads
            grad_norm = self._grad_norm(grads)
            self._clip(grads.values(), grad_norm)
            self._adamw(named, lr)
            self._last_clipped = grads if self.tcfg.digests else None  # in place: what the update applied
        self.completed_steps += 1
        loss_mean = torch.stack(losses).mean() if n > 1 else losses[0]
        if self.pcfg.report_loss == "dp_mean" and self.dp_size > 1:
            loss_mean = loss_mean.detach().clone().reshape(1)
            dist.all_reduce(loss_mean, op=dist.ReduceOp.SUM, group=self._dp_group)
            loss_mean = loss_mean[0] / self.dp_size
        return StepResult(loss=float(loss_mean), grad_norm=grad_norm, lr=lr,
                          per_token_loss=torch.stack(per_token).float())

    def _fsdp_step(self, named: dict[str, torch.nn.Parameter], lr: float) -> float:
        """FSDP2 after the reduce-scatter: norm = sqrt(all-reduced sum of the local shards' squared norms),
        Megatron's clip and torch AdamW arithmetic on the local shards (elementwise, so shard-local)."""
        grads = {k: named[k].grad for k in self._norm_order()}
        self._last_grads = {k: g.clone() for k, g in grads.items()} if self.tcfg.digests else grads
        local = [g.to_local() for g in grads.values()]
        total_sq = torch.stack([torch.norm(g) for g in local]).square().sum().reshape(1)
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=self._mesh.get_group())
        grad_norm = total_sq.item() ** 0.5
        self._clip(local, grad_norm)
        items = []
        for name, p in named.items():
            st = self.adam_state[name]
            view = {"step": st["step"], "exp_avg": st["exp_avg"].to_local(), "exp_avg_sq": st["exp_avg_sq"].to_local()}
            items.append((view, p.to_local(), p.grad.to_local(), p.dim() > 1))
        with torch.no_grad():
            self._adam_update(items, lr)
        for (view, *_), st in zip(items, self.adam_state.values()):
            st["step"] = view["step"]
        return grad_norm

    def _grad_norm(self, grads: dict[str, torch.Tensor]) -> float:
        """Global L2 norm of ``grads`` (in ``_norm_order``), Megatron's arithmetic (:func:`scenarios._llama.optim.
        grad_norm`; under TP the replicated norm weights count once)."""
        return optim.grad_norm(list(grads.values()), self.tp)

    def _sync_grads(self) -> None:
        """DP gradient reduction (scale by 1/DP, then all-reduce or reduce-scatter each bucket)."""
        self.ddp.finish_grad_sync()

    def _clip(self, grads, grad_norm: float) -> None:
        """Megatron's clip_grad_by_total_norm_fp32: ``g.copy_(g * coeff)`` only when ``coeff < 1``."""
        optim.clip_(grads, grad_norm, self.tcfg.clip_grad)

    def _zero1_step(self, lr: float) -> float:
        """ZeRO-1 after the reduce-scatter: sharded norm, clip and AdamW on this rank's pieces, then all-gather.

        The pre-clip grads exported for digests are the whole local buffer, as the reference's snapshot of
        ``main_grad`` is: this rank's shard holds the reduced sum, the rest this rank's own scaled gradients.
        """
        d = self.ddp
        grads = {k: d.view(d.grad_data, k) for k in self._norm_order()}
        self._last_grads = {k: g.clone() for k, g in grads.items()} if self.tcfg.digests else grads
        grad_norm = d.grad_norm_sq_shards().item() ** 0.5
        pieces = [(pc, d.grad_data[pc.buf_start:pc.buf_end]) for pc in d.pieces]
        self._clip([g for _, g in pieces], grad_norm)
        with torch.no_grad():
            self._adam_update([(self.adam_state[pc.name], d.param_data[pc.buf_start:pc.buf_end], g, pc.group == 0)
                               for pc, g in pieces], lr)
        d.gather_params()
        return grad_norm

    @torch.no_grad()
    def _adamw(self, named: dict[str, torch.nn.Parameter], lr: float) -> None:
        self._adam_update([(self.adam_state[name], p, p.grad, p.dim() > 1) for name, p in named.items()], lr)

    @torch.no_grad()
    def _adam_update(self, items, lr: float) -> None:
        """torch AdamW single-tensor arithmetic over ``(state, param, grad, decayed)`` items
        (:func:`scenarios._llama.optim.adamw_single`)."""
        optim.adamw_single(items, lr, self.tcfg)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        """Mean per-token loss (nats) over ``micro_batches``, no grad."""
        self.model.eval()
        vals = []
        for mb in micro_batches:
            mb = self._check(mb)
            with self._autocast():
                vals.append(self.model(mb[:, :-1], mb[:, 1:]).mean())
        self._reshard()
        return float(torch.stack(vals).mean())

    def _reshard(self) -> None:
        """FSDP2 keeps the root's params unsharded after a forward (the backward would reshard them); after a
        no-grad forward, reshard explicitly so the params are the sharded DTensors again."""
        if self.fsdp:
            self.model.reshard()

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [b, s]`` -> logits ``[b, s, V]`` fp32."""
        self.model.eval()
        with self._autocast():
            out = self.model(tokens.to(self.device))  # [s, b, V/tp]
        self._reshard()
        if self.tp.size > 1:  # every TP rank must call logits(): the vocabulary slices are all-gathered
            out = torch.cat(tp_all_gather(out, self.tp.size, self.tp.group), dim=-1)
        return out.transpose(0, 1).float()

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Model + AdamW state + completed steps, plain tensors (torch.distributed.checkpoint-friendly).

        Layout, identical for every DP size and ZeRO stage (so DCP can load it into another layout):
        ``{"model": {name: full param}, "optimizer": {name: {"step": float64 0-dim, "exp_avg": full,
        "exp_avg_sq": full}}, "completed_steps": int64 0-dim}``. Under ZeRO-1 the moments are all-gathered first
        (a collective: every rank must call this).
        """
        opt = {}
        if self.fsdp:  # DTensors: DCP writes each rank's shard and reshards on load
            return {"model": dict(self.model.state_dict()), "optimizer": optim.state_to_dict(self.adam_state),
                    "completed_steps": torch.tensor(self.completed_steps, dtype=torch.int64)}
        if self.tp.size > 1:
            model = self._full(dict(self.model.state_dict()))
            for name, st in self.adam_state.items():
                m_full, v_full = self._full({name: st["exp_avg"]}), self._full({name: st["exp_avg_sq"]})
                opt[name] = {"step": torch.tensor(st["step"], dtype=torch.float64), "exp_avg": m_full[name],
                             "exp_avg_sq": v_full[name]}
            return {"model": model, "optimizer": opt,
                    "completed_steps": torch.tensor(self.completed_steps, dtype=torch.int64)}
        if self.ddp is not None and self.ddp.zero1:
            opt = optim.gather_zero1_state(self.ddp, self._m_shard, self._v_shard, self._named(), self.completed_steps)
        else:
            opt = optim.state_to_dict(self.adam_state)
        return {"model": self.model.state_dict(), "optimizer": opt,
                "completed_steps": torch.tensor(self.completed_steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` written under any DP / TP size or ZeRO stage (params copied in place)."""
        self.completed_steps = int(state["completed_steps"])
        if self.fsdp:
            self.model.load_state_dict(state["model"])
            self.adam_state = {name: {"step": float(st["step"]), "exp_avg": st["exp_avg"],
                                      "exp_avg_sq": st["exp_avg_sq"]} for name, st in state["optimizer"].items()}
            return
        if self.tp.size > 1:
            self._load_full(state["model"])
            self.adam_state = {}
            for name, st in state["optimizer"].items():
                self.adam_state[name] = {
                    "step": float(st["step"]),
                    "exp_avg": tp_split(name, st["exp_avg"], self.tp.size, self.tp.rank).to(self.device),
                    "exp_avg_sq": tp_split(name, st["exp_avg_sq"], self.tp.size, self.tp.rank).to(self.device)}
            return
        self.model.load_state_dict(state["model"])
        if self.ddp is not None and self.ddp.zero1:
            self._shard_adam_state()
            optim.load_zero1_state(self.ddp, self.adam_state, state["optimizer"])
            return
        self.adam_state = {}
        for name, st in state["optimizer"].items():
            self.adam_state[name] = {"step": float(st["step"]), "exp_avg": st["exp_avg"].to(self.device),
                                     "exp_avg_sq": st["exp_avg_sq"].to(self.device)}

    # ---------------------------------------------------------------- probes
    def module_probes(self) -> dict[str, torch.nn.Module]:
        return layout.module_probes(self.model)
