"""Deliberately wrong forged engines: each tier must reject them and name the right place.

Each mutant is a subclass of the correct llama_tiny_cpu engine with one defect, paired with where the defect must
be reported (the verdict's ``first_divergence``).
"""

from __future__ import annotations

import dataclasses

import torch

from scenarios._llama import model as M
from scenarios.llama_tiny_cpu.engine import Engine as Good


class ChangedEpsilon(Good):
    """RMSNorm epsilon 1e-6 instead of the config's 1e-5."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        for mod in self.model.modules():
            if isinstance(mod, M.RMSNorm):
                mod.eps = mod.eps / 10


class MissingScale(Good):
    """Attention scores without the 1/sqrt(head_dim) scale."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        for blk in self.model.layers:
            blk.attn.scale = 1.0


class WrongClipping(Good):
    """Clips each gradient tensor to clip_grad on its own instead of clipping by the global norm."""

    def train_step(self, micro_batches):
        orig = self.tcfg.clip_grad
        self._pending_clip = orig
        object.__setattr__(self.tcfg, "clip_grad", 0.0)  # disable the correct global clip inside super()
        try:
            return super().train_step(micro_batches)
        finally:
            object.__setattr__(self.tcfg, "clip_grad", orig)

    def _adamw(self, named, lr):
        for p in named.values():
            coeff = self._pending_clip / (float(torch.norm(p.grad)) + 1.0e-6)
            if coeff < 1.0:
                p.grad.mul_(coeff)
        super()._adamw(named, lr)


class _GradScale(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``k`` in backward."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class UnscaledAccumulation(Good):
    """Sums the micro-batch losses instead of averaging them: the 1/gradient_accumulation_steps of Megatron's
    schedule (and of DeepSpeed's ``engine.backward``) is missing. The reported loss is unchanged and, with clipping
    active, so is the update direction: the gradient of the loss (the output layer's output gradient) is the first
    place it shows, then the pre-clip gradient norm (x2 here)."""

    def train_step(self, micro_batches):
        n, fwd = float(len(micro_batches)), self.model.forward
        self.model.forward = lambda ids, labels=None: _GradScale.apply(fwd(ids, labels), n)
        try:
            return super().train_step(micro_batches)
        finally:
            del self.model.forward


class DroppedMicroBatch(Good):
    """Skips the last micro-batch of every step (but still divides by the full count)."""

    def train_step(self, micro_batches):
        return super().train_step(micro_batches[:-1])


class WrongRopeBase(Good):
    """RoPE theta 500000 instead of the config's 10000 (the model reads rotary_base from its own config)."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.model.cfg = dataclasses.replace(self.mcfg, rotary_base=500000.0)
        self.model._freqs.clear()


class WrongQKVPermutation(Good):
    """Loads HF weights with a [Q; K; V] concatenation instead of Megatron's per-group interleave."""

    def _from_hf(self, sd):
        out = super()._from_hf(sd)
        m = self.mcfg
        for i in range(m.num_layers):
            hp = f"model.layers.{i}.self_attn."
            out[f"layers.{i}.attn.qkv"] = torch.cat([sd[hp + "q_proj.weight"], sd[hp + "k_proj.weight"],
                                                    sd[hp + "v_proj.weight"]])
        return out


# mutant -> (kind of first divergence, module/tensor it must name or None, step): where the difference enters
EXPECTED = {
    ChangedEpsilon: ("module_fwd", "layers.0.input_norm", 1),
    MissingScale: ("module_fwd", "layers.0.self_attention", 1),
    # the grads the update applies differ at step 1, every tensor (each is scaled by its own coefficient), named in
    # backward order; the params only move at step 2 (step 1 runs at lr 0, Megatron's warmup)
    WrongClipping: ("clipped_grad", "lm_head.weight", 1),
    # the loss's gradient (the output layer's output gradient, computed by the loss) is the first wrong tensor
    UnscaledAccumulation: ("module_grad", "output_layer", 1),
    DroppedMicroBatch: ("per_token_loss", None, 1),
    WrongRopeBase: ("module_fwd", "layers.0.self_attention", 1),
    WrongQKVPermutation: ("module_fwd", "layers.0.self_attention", 1),
}
