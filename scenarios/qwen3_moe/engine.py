"""Forged engine for the Qwen3-MoE family (scenario ``qwen3_moe_tiny_cpu``): the op-by-op Megatron-core 0.16.1
mirror (``engine.mode=exact``), bitwise against the reference's MoE GPTModel (local spec, SequentialMLP experts,
allgather dispatcher, softmax top-k router, aux-loss load balancing, dropless) on one process.

The model is :class:`.model.Qwen3MoE` (the dense Qwen3 attention from ``._llama`` and the mixture of experts of
:mod:`.moe`, whose docstring lists each step and its Megatron source). The step is the dense Qwen3 engine's:
each micro-batch's mean loss / n is back-propagated (the aux loss's gradient scaled by 1 / n as well, Megatron's
``MoEAuxLossAutoScaler`` scale), the gradients copied (first micro-batch) or added into fp32 ``main_grad``,
Megatron's grad norm and clip, AdamW with Megatron's two parameter groups (2-D weights decayed, norms not).

Precision: ``fp32``, or ``bf16`` (bf16 weights, router and activations, fp32 main weights and gradients:
Megatron's recipe); both bitwise at the ``qwen3_moe_micro`` shape (tests/test_moe.py). Each step reports its
routing statistics in ``StepResult.extra`` (``moe_tokens_per_expert``, ``moe_load_balancing_loss``), as the
reference does.

Not implemented (ConfigError): data / tensor / expert parallelism, ZeRO, recompute, optimizer offload, fast mode.
"""

from __future__ import annotations

import torch

from forgetrain.engine import StepResult
from forgetrain.errors import ConfigError
from forgetrain.schedule import lr_for_step
from . import layout
from ._llama import optim
from .levers import SPEC
from .model import Qwen3MoE


class Engine:
    """``Engine(cfg: RunConfig, device)``; protocol in forgetrain.engine.TrainEngine.

    Parts: ``model`` (:class:`.model.Qwen3MoE`), ``main`` / ``main_grad`` (fp32 main weights and gradients by
    forged name, :mod:`.layout`) and ``adam_state``. Raises ConfigError for a dense model (``model.num_experts``
    null), DP / TP > 1 or a ZeRO stage."""

    spec = SPEC  # levers.py: exact mode, Qwen3's features and num_experts

    def __init__(self, cfg, device: torch.device | str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self.mcfg, self.tcfg, self.pcfg = cfg.model, cfg.train, cfg.parallel
        self.kernels = cfg.kernels
        self.bf16 = self.tcfg.precision == "bf16"
        p = self.pcfg
        if self.mcfg.num_experts is None:
            raise ConfigError(f"{cfg.scenario.name}: the Qwen3-MoE engine runs a mixture of experts; set "
                              f"model.num_experts (or choose a dense Qwen3 scenario)")
        if p.data_parallel_size != 1 or p.tensor_parallel_size != 1 or p.zero_stage != 0:
            raise ConfigError(f"{cfg.scenario.name}: the Qwen3-MoE engine runs on one process (DP=1, TP=1, "
                              f"zero_stage 0); got DP={p.data_parallel_size} TP={p.tensor_parallel_size} "
                              f"zero_stage={p.zero_stage}")
        with torch.device(self.device):
            self.model = Qwen3MoE(self.mcfg, deterministic=self.tcfg.deterministic)
        self._last_grads = None
        self.init_weights()

    # ------------------------------------------------------------------ weights
    def init_weights(self) -> None:
        """N(0, std) from ``train.seed`` on the device's generator (:func:`.model.init_std`); fp32 main weights,
        zero AdamW state."""
        g = torch.Generator(device=self.device).manual_seed(self.tcfg.seed)
        self.model.float()
        self.model.reset_parameters(g)
        named = self._named()
        if self.bf16:
            self.main = {k: p.detach().float().clone() for k, p in named.items()}
            self.model.to(torch.bfloat16)
        else:
            self.main = {k: p.data for k, p in named.items()}
        self.completed_steps = 0
        self.main_grad = {k: torch.zeros_like(v) for k, v in self.main.items()}
        self.adam_state = optim.fresh_state(self.main)

    def _sync_model_from_main(self) -> None:
        if self.bf16:
            named = self._named()
            torch._foreach_copy_([named[k].data for k in self.main], [self.main[k] for k in self.main])

    def _named(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def _check(self, mb: torch.Tensor) -> torch.Tensor:
        """A micro-batch must be ``[b, seq_length + 1]`` token ids; returned on the device. Raises ValueError."""
        s = self.mcfg.seq_length
        if mb.dim() != 2 or mb.shape[1] != s + 1:
            raise ValueError(f"micro-batch must be [b, {s + 1}], got {tuple(mb.shape)}")
        return mb.to(self.device)

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF Qwen3-MoE fp32 weights into the fp32 main weights (and the bf16 copies). Raises KeyError /
        ValueError."""
        for k, v in layout.from_hf(self.mcfg, state).items():
            if self.main[k].shape != v.shape:
                raise ValueError(f"shape mismatch for {k}: {tuple(v.shape)} vs {tuple(self.main[k].shape)}")
            self.main[k].copy_(v.to(self.device))
        self._sync_model_from_main()

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 main weights in HF Qwen3-MoE layout (CPU copies)."""
        return layout.to_hf(self.mcfg, self.main)

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """The last step's fp32 main grads, pre-clip, HF layout (recorded when ``train.digests``). Raises
        RuntimeError before any step."""
        if self._last_grads is None:
            raise RuntimeError("no step has run yet")
        return layout.to_hf(self.mcfg, self._last_grads)

    # ------------------------------------------------------------------ step
    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        self.model.train()
        named = self._named()
        keys = list(self.main)
        n = len(micro_batches)
        moe = self.model.moe_layers()
        scale = torch.ones(1, device=self.device) * 1 / n  # Megatron: grad_scale_func(ones(1)) * cp / n, fp32
        for layer in moe:
            layer.aux_scale = scale
            layer.stats.clear()
        losses, per_token = [], []
        for i, mb in enumerate(micro_batches):
            mb = self._check(mb)
            tok = self.model(mb[:, :-1], mb[:, 1:])
            loss = tok.mean()
            (loss / n).backward()
            # Megatron's DDP hook: main_grad (zeroed) += grad; the first micro-batch copies (0 + g == g)
            if i == 0:
                torch._foreach_copy_([self.main_grad[k] for k in keys], [named[k].grad for k in keys])
            else:
                torch._foreach_add_([self.main_grad[k] for k in keys], [named[k].grad for k in keys])
            for k in keys:
                named[k].grad = None
            losses.append(loss.detach())
            per_token.append(tok.detach())
        order = layout.norm_order(self.mcfg)
        if self.tcfg.digests:
            self._last_grads = {k: self.main_grad[k].clone() for k in order}
        lr = lr_for_step(self.tcfg, self.completed_steps)
        grads = [self.main_grad[k] for k in order]
        grad_norm = optim.grad_norm(grads, device=self.device)
        optim.clip_(grads, grad_norm, self.tcfg.clip_grad)
        groups = []
        for decay in (True, False):  # Megatron's two param groups: 2-D weights (wd) and 1-D norms (no wd)
            ks = [k for k in self.main if (self.main[k].dim() > 1) == decay]
            groups.append((decay, [self.main[k] for k in ks], [self.main_grad[k] for k in ks],
                           [self.adam_state[k] for k in ks]))
        with torch.no_grad():
            optim.adamw_groups(groups, lr, self.tcfg, self.kernels.adamw, self.device, self.completed_steps + 1)
        self._sync_model_from_main()
        self.completed_steps += 1
        loss_mean = torch.stack(losses).mean() if n > 1 else losses[0]
        return StepResult(loss=float(loss_mean), grad_norm=grad_norm, lr=lr,
                          per_token_loss=torch.stack(per_token).float(), extra=self._moe_stats(moe, n))

    def _moe_stats(self, moe, n: int) -> dict:
        """The step's routing statistics, as the reference reports them: ``moe_tokens_per_expert`` ``[L][E]``
        (summed over micro-batches) and, with the aux loss, ``moe_load_balancing_loss`` ``[L]``: Megatron's
        tracker arithmetic, fp32 zeros += aux / coeff per micro-batch, then / n. Clears each layer's stats."""
        extra = {"moe_tokens_per_expert": [torch.stack([c for c, _ in layer.stats]).sum(dim=0).tolist()
                                           for layer in moe]}
        if all(a is not None for layer in moe for _, a in layer.stats):
            vals = torch.zeros(len(moe))
            for i, layer in enumerate(moe):
                for _, a in layer.stats:
                    vals[i] += a.cpu()
            extra["moe_load_balancing_loss"] = (vals / n).tolist()
        for layer in moe:
            layer.stats.clear()
        return extra

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        self.model.eval()
        vals = [self.model(mb[:, :-1], mb[:, 1:]).mean() for mb in map(self._check, micro_batches)]
        for layer in self.model.moe_layers():
            layer.stats.clear()
        return float(torch.stack(vals).mean())

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[b, s, V]`` for int64 tokens ``[b, s]``."""
        self.model.eval()
        out = self.model(tokens.to(self.device)).transpose(0, 1).float()
        for layer in self.model.moe_layers():
            layer.stats.clear()
        return out

    # ------------------------------------------------------------------ checkpoint / probes
    def state_dict(self) -> dict:
        """``{"main": {name: fp32 main weight}, "optimizer": {name: {"step", "exp_avg", "exp_avg_sq"}},
        "completed_steps"}``."""
        return {"main": dict(self.main), "optimizer": optim.state_to_dict(self.adam_state),
                "completed_steps": torch.tensor(self.completed_steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (copied in place)."""
        with torch.no_grad():
            for k, v in state["main"].items():
                self.main[k].copy_(v)
            for k, st in state["optimizer"].items():
                self.adam_state[k]["step"] = float(st["step"])
                self.adam_state[k]["exp_avg"].copy_(st["exp_avg"])
                self.adam_state[k]["exp_avg_sq"].copy_(st["exp_avg_sq"])
        self.completed_steps = int(state["completed_steps"])
        self._sync_model_from_main()

    def module_probes(self) -> dict[str, torch.nn.Module]:
        """The model's modules by Megatron name (:func:`.layout.module_probes`)."""
        return layout.module_probes(self.model)
