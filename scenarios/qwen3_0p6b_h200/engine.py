"""Forged engine for the Qwen3 dense family (``qwen3_micro_cpu``, ``qwen3_0p6b_h200``): the op-by-op Megatron-core
mirror (``engine.mode=exact``), bitwise against the reference in fp32 and bf16, on one device or data-parallel.

The model (``_llama/model.py``, its alignment notes in ``_llama/README.md``) is the Llama decoder of the Hopper
engine with Qwen3's three differences: RMSNorm on each query and key head after the QKV projection and before
RoPE (``model.qk_layernorm``), one matrix for the embedding and the LM head
(``model.share_embeddings_and_output_weights``: autograd sums its two gradients, the LM head's first, as in
Megatron on one pipeline stage) and a head dim of its own (``model.kv_channels``).

Precision (``train.precision=bf16``): bf16 model weights, fp32 main weights, fp32 gradient accumulation
(``main_grad``), fp32 AdamW state -- Megatron's mixed-precision recipe; ``fp32`` keeps everything in fp32.

Data parallelism (``parallel.data_parallel_size > 1``, under torchrun): the fp32 ``main_grad`` tensors are views
of one flat buffer in Megatron DDP's layout (reverse registration order, one bucket); after the last micro-batch it
is scaled by 1/DP and all-reduced (SUM). ``parallel.zero_stage=1`` reduce-scatters instead, shards the AdamW
state and all-gathers the updated main weights. TP, FSDP, recompute, optimizer offload and the fast path are not
implemented here (ConfigError).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forgetrain.engine import StepResult
from forgetrain.errors import ConfigError
from forgetrain.schedule import lr_for_step
from ._llama import layout, optim
from ._llama.model import Qwen3
from ._llama.parallel import GradBuffer, ParallelState, megatron_registration_order
from .levers import SPEC


class Engine:
    """``Engine(cfg: RunConfig, device)``; protocol in forgetrain.engine.TrainEngine.

    Parts: ``model`` (:class:`~._llama.model.Qwen3`), ``par`` (:class:`~._llama.parallel.ParallelState`), ``ddp``
    (the flat fp32 grad buffer under DP / ZeRO-1, else None), ``main`` / ``main_grad`` (fp32 main weights and
    gradients by forged name; a tied LM head is ``embedding.weight``) and ``adam_state``. Raises ConfigError for
    TP > 1, ZeRO stages other than 0 and 1, or ``parallel.overlap_grad_reduce`` / ``parallel.bucket_size``.
    """

    spec = SPEC  # levers.py: exact mode, Qwen3's model features

    def __init__(self, cfg, device: torch.device | str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self.mcfg, self.tcfg, self.pcfg = cfg.model, cfg.train, cfg.parallel
        self.kernels = cfg.kernels
        self.bf16 = self.tcfg.precision == "bf16"
        tp_size, zero_stage = self.pcfg.tensor_parallel_size, self.pcfg.zero_stage
        if tp_size != 1 or zero_stage not in (0, 1):
            raise ConfigError(f"{cfg.scenario.name}: the Qwen3 engine implements only data parallelism "
                              f"(parallel.zero_stage 0 or 1, TP=1); got TP={tp_size} zero_stage={zero_stage}")
        if self.pcfg.overlap_grad_reduce or self.pcfg.bucket_size is not None:
            raise ConfigError(f"{cfg.scenario.name}: the Qwen3 engine reduces the gradients once, after the last "
                              f"micro-batch (one bucket); set parallel.overlap_grad_reduce=false and "
                              f"parallel.bucket_size=null")
        self.par = ParallelState.build(self.pcfg)
        self.dp_size, self.zero_stage = self.par.dp_size, self.par.zero_stage
        self.ddp: GradBuffer | None = None
        with torch.device(self.device):
            self.model = Qwen3(self.mcfg, deterministic=self.tcfg.deterministic)
        self._last_grads = None
        self.init_weights()

    # ------------------------------------------------------------------ weights
    def init_weights(self) -> None:
        """N(0, init_method_std) from ``train.seed`` on the device's generator; fp32 main weights, zero state."""
        g = torch.Generator(device=self.device).manual_seed(self.tcfg.seed)
        self.model.float()
        self.model.reset_parameters(g)
        self._make_main()

    def _make_main(self) -> None:
        named = self._named()
        if self.bf16:
            self.main = {k: p.detach().float().clone() for k, p in named.items()}
            self.model.to(torch.bfloat16)
        else:
            self.main = {k: p.data for k, p in named.items()}
        self.completed_steps = 0
        if self.dp_size > 1 or self.zero_stage == 1:
            self._setup_dp_buffer()  # also shards the AdamW state under ZeRO-1
        else:
            self.main_grad = {k: torch.zeros_like(v) for k, v in self.main.items()}
            self.adam_state = optim.fresh_state(self.main)

    def _setup_dp_buffer(self) -> None:
        """DP > 1: ``main_grad[k]`` become views of one flat fp32 buffer in Megatron DDP's layout (reverse
        registration order, one bucket), reduced by ``GradBuffer.finish_grad_sync`` after the last micro-batch."""
        order = megatron_registration_order(self.mcfg)
        # fp32: the buffer holds the model's own Parameters (ZeRO-1 re-points their .data into its flat fp32 param
        # buffer, so the all-gather writes the model weights); bf16: the fp32 main weights.
        params = self.main if self.bf16 else self._named()
        self.ddp = GradBuffer(params, order, group=self.par.dp_group, zero1=self.zero_stage == 1, bucket_size=None,
                              overlap=False)
        if not self.bf16:
            self.main = {k: p.data for k, p in params.items()}
        self.main_grad = {k: self.ddp.view(self.ddp.grad_data, k) for k in self.main}
        if self.zero_stage == 1:
            self._m_shard, self._v_shard, self.adam_state = optim.shard_state(self.ddp, self.device,
                                                                              self.completed_steps)
        else:
            self.adam_state = optim.fresh_state(self.main)

    def _sync_model_from_main(self) -> None:
        if self.bf16:
            named = self._named()
            torch._foreach_copy_([named[k].data for k in self.main], [self.main[k] for k in self.main])

    def _named(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())  # a tied LM head once, as embedding.weight

    def _check(self, mb: torch.Tensor) -> torch.Tensor:
        return layout.check_micro_batch(mb, self.mcfg.seq_length, self.device)

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-layout fp32 weights into the fp32 main weights (and the bf16 copies). Raises KeyError /
        ValueError."""
        for k, v in layout.from_hf(self.mcfg, state).items():
            if self.main[k].shape != v.shape:
                raise ValueError(f"shape mismatch for {k}: {tuple(v.shape)} vs {tuple(self.main[k].shape)}")
            self.main[k].copy_(v.to(self.device))
        self._sync_model_from_main()

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 main weights in HF layout (CPU copies)."""
        return layout.to_hf(self.mcfg, self.main)

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """The last step's reduced fp32 main grads, pre-clip, in HF layout (recorded when ``train.digests``).
        Raises RuntimeError before any step."""
        if self._last_grads is None:
            raise RuntimeError("no step has run yet")
        return layout.to_hf(self.mcfg, self._last_grads)

    # ------------------------------------------------------------------ step
    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        self.model.train()
        named = self._named()
        keys = list(self.main)
        n = len(micro_batches)
        losses, per_token = [], []
        if self.ddp is not None:
            self.ddp.new_step()
        for i, mb in enumerate(micro_batches):
            mb = self._check(mb)
            tok = self.model(mb[:, :-1], mb[:, 1:])
            loss = tok.mean()
            (loss / n).backward()
            # Megatron's DDP hook: main_grad (zeroed) += grad, fp32 += bf16/fp32, then drop the model grad.
            # 0 + g == g exactly (up to the sign of zero), so the first micro-batch copies instead: one pass less.
            if i == 0:
                torch._foreach_copy_([self.main_grad[k] for k in keys], [named[k].grad for k in keys])
            else:
                torch._foreach_add_([self.main_grad[k] for k in keys], [named[k].grad for k in keys])
            for k in keys:
                named[k].grad = None
            losses.append(loss.detach())
            per_token.append(tok.detach())
        if self.ddp is not None:
            self.ddp.finish_grad_sync()  # x 1/DP, all-reduce SUM over the flat fp32 buffer
        order = layout.norm_order(self.mcfg)
        if self.tcfg.digests:  # under ZeRO-1 the whole local buffer, as the reference's main_grad snapshot
            self._last_grads = {k: self.main_grad[k].clone() for k in order}
        lr = lr_for_step(self.tcfg, self.completed_steps)
        grad_norm = self._zero1_update(lr) if self.zero1 else self._replicated_update(order, lr)
        self._sync_model_from_main()
        self.completed_steps += 1
        loss_mean = torch.stack(losses).mean() if n > 1 else losses[0]
        if self.pcfg.report_loss == "dp_mean" and self.dp_size > 1:
            loss_mean = loss_mean.detach().float().reshape(1).clone()
            dist.all_reduce(loss_mean, op=dist.ReduceOp.SUM, group=self.par.dp_group)
            loss_mean = loss_mean[0] / self.dp_size
        return StepResult(loss=float(loss_mean), grad_norm=grad_norm, lr=lr,
                          per_token_loss=torch.stack(per_token).float())

    @property
    def zero1(self) -> bool:
        return self.ddp is not None and self.ddp.zero1

    def _zero1_update(self, lr: float) -> float:
        """ZeRO-1 after the reduce-scatter: the norm of the shards, clip and AdamW on this rank's pieces of the fp32
        main weights (``ddp.param_data``), then the all-gather of the updated main weights."""
        d = self.ddp
        grad_norm = d.grad_norm_sq_shards().item() ** 0.5
        pieces = [(pc, d.grad_data[pc.buf_start:pc.buf_end]) for pc in d.pieces]
        optim.clip_([g for _, g in pieces], grad_norm, self.tcfg.clip_grad)
        groups = []
        for decay in (True, False):  # the distributed optimizer's groups: 2-D (wd) pieces, then 1-D norm pieces
            sel = [(pc, g) for pc, g in pieces if (pc.group == 0) == decay]
            groups.append((decay, [d.param_data[pc.buf_start:pc.buf_end] for pc, _ in sel], [g for _, g in sel],
                           [self.adam_state[pc.name] for pc, _ in sel]))
        self._adamw_groups(groups, lr)
        d.gather_params()
        return grad_norm

    def _replicated_update(self, order: list[str], lr: float) -> float:
        grads = [self.main_grad[k] for k in order]
        grad_norm = optim.grad_norm(grads, device=self.device)  # Megatron: norm of per-tensor norms, .item()**0.5
        optim.clip_(grads, grad_norm, self.tcfg.clip_grad)
        groups = []
        for decay in (True, False):  # Megatron's two param groups: 2-D weights (wd) and 1-D norms (no wd)
            ks = [k for k in self.main if (self.main[k].dim() > 1) == decay]
            groups.append((decay, [self.main[k] for k in ks], [self.main_grad[k] for k in ks],
                           [self.adam_state[k] for k in ks]))
        self._adamw_groups(groups, lr)
        return grad_norm

    @torch.no_grad()
    def _adamw_groups(self, groups, lr: float) -> None:
        """AdamW over ``[(decayed, params, grads, states)]`` with the ``kernels.adamw`` arithmetic
        (:func:`._llama.optim.adamw_groups`)."""
        optim.adamw_groups(groups, lr, self.tcfg, self.kernels.adamw, self.device, self.completed_steps + 1)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        self.model.eval()
        vals = [self.model(mb[:, :-1], mb[:, 1:]).mean() for mb in map(self._check, micro_batches)]
        return float(torch.stack(vals).mean())

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[b, s, V]`` for int64 tokens ``[b, s]``."""
        self.model.eval()
        return self.model(tokens.to(self.device)).transpose(0, 1).float()

    # ------------------------------------------------------------------ checkpoint / probes
    def state_dict(self) -> dict:
        """``{"main": {name: fp32 main weight}, "optimizer": {name: {"step", "exp_avg", "exp_avg_sq"}},
        "completed_steps"}``, full tensors for every DP size and ZeRO stage (so DCP loads it into another layout).
        Under ZeRO-1 the moment shards are all-gathered first: a collective, every rank must call it."""
        if self.zero1:
            opt = optim.gather_zero1_state(self.ddp, self._m_shard, self._v_shard, self.main, self.completed_steps)
        else:
            opt = optim.state_to_dict(self.adam_state)
        return {"main": dict(self.main), "optimizer": opt,
                "completed_steps": torch.tensor(self.completed_steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` written under any DP size or ZeRO stage (copied in place)."""
        with torch.no_grad():
            for k, v in state["main"].items():
                self.main[k].copy_(v)
            if self.zero1:
                optim.load_zero1_state(self.ddp, self.adam_state, state["optimizer"])
            else:
                for k, st in state["optimizer"].items():
                    self.adam_state[k]["step"] = float(st["step"])
                    self.adam_state[k]["exp_avg"].copy_(st["exp_avg"])
                    self.adam_state[k]["exp_avg_sq"].copy_(st["exp_avg_sq"])
        self.completed_steps = int(state["completed_steps"])
        self._sync_model_from_main()

    def module_probes(self) -> dict[str, torch.nn.Module]:
        """The model's modules by Megatron name (:func:`._llama.layout.module_probes`)."""
        return layout.module_probes(self.model)
