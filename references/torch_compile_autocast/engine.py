"""``torch_compile_autocast``: a plain-PyTorch Llama under ``torch.compile`` with fp32 weights under autocast.

The autocast form of the plain-PyTorch baseline (``references/torch_compile`` is the stronger form: bf16
parameters with fp32 master weights beside them): HF-layout ``nn.Linear`` modules (separate q/k/v/o and
gate/up/down), batch-first activations, ``F.scaled_dot_product_attention`` (causal, GQA), ``F.rms_norm``, fp32
weights under ``torch.autocast(bfloat16)`` (every weight is cast to bf16 in every micro-batch), ``F.cross_entropy``
on full logits, ``torch.optim.AdamW`` (fused on CUDA), and ``torch.compile`` of the whole model. It is a baseline
for ``forgetrain.bench`` (``bench.against=[torch_compile_autocast]``), not a golden reference: it is never used
for bitwise or tolerance gates.

``engine.recompute=full``: full activation checkpointing, one decoder block per checkpoint, written the way a
PyTorch user writes it: ``torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)`` for every
block while autograd is on (train steps; ``eval_loss`` and ``logits`` run without grad and store nothing anyway).
Each block keeps only its input ``x`` ``[b, s, h]`` (fp32: the residual stream under autocast) and runs its forward
again in the backward; the autocast state of the forward is replayed there. Under ``torch.compile`` the
checkpointed regions are traced as such and the compiler's partitioner recomputes them. Recompute repeats the same
ops on the same inputs, so in eager mode (CPU) losses, gradients and weights are bitwise those of
``recompute=none`` (``tests/test_baseline_recompute.py``). ``engine.recompute_num_layers=N`` checkpoints only the
first N blocks (Megatron's block method), as the forged engine does. ``engine.bf16_weights`` is the forged engine's
switch: this baseline keeps its fp32 weights either way. ``bench_info`` says which mode ran.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from forgetrain.engine import StepResult
from forgetrain.levers import EngineSpec
from forgetrain.schedule import lr_for_step
from references.torch_compile.engine import Llama


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.hidden_size // c.num_attention_heads
        self.nq, self.nkv, self.d, self.eps = c.num_attention_heads, c.num_query_groups, d, c.norm_epsilon
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.q_proj = nn.Linear(c.hidden_size, self.nq * d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nq * d, c.hidden_size, bias=False)
        self.gate_proj = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        q = self.q_proj(h).view(b, s, self.nq, self.d).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.nkv, self.d).transpose(1, 2)

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=self.nq != self.nkv)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Engine:
    """Benchmark baseline implementing forgetrain.engine.TrainEngine (no module probes, no digests)."""

    bench_label = "plain PyTorch, fp32 weights under bf16 autocast, torch.compile"
    spec = EngineSpec(
        bench_only=True,  # verify refuses it: no per-token losses to judge
        recompute=True,  # engine.recompute=full: torch.utils.checkpoint per block (module doc)
        recompute_num_layers=True,  # engine.recompute_num_layers: the first N blocks only
    )

    def __init__(self, cfg, device):
        from forgetrain.errors import ConfigError

        p = cfg.parallel
        if p.data_parallel_size * p.tensor_parallel_size > 1:
            raise ConfigError("references/torch_compile_autocast is a single-device baseline (no gradient reduction); "
                              "bench it with parallel=single, or against megatron / deepspeed under torchrun")
        if cfg.engine.recompute not in ("none", "full"):
            raise ConfigError(f"engine.recompute must be none|full, got '{cfg.engine.recompute}'")
        self.cfg, self.device, self.t = cfg, torch.device(device), cfg.train
        with torch.device(self.device):
            self.model = Llama(cfg.model, recompute=cfg.engine.recompute == "full", block=_Block, reduction="none",
                                recompute_layers=cfg.engine.recompute_num_layers)
        g = torch.Generator(device=self.device).manual_seed(self.t.seed)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if p.dim() > 1:
                    p.normal_(0.0, cfg.model.init_method_std, generator=g)
        decay = [p for p in self.model.parameters() if p.dim() > 1]
        no_decay = [p for p in self.model.parameters() if p.dim() == 1]
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.t.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=self.t.lr,
                                     betas=(self.t.adam_beta1, self.t.adam_beta2), eps=self.t.adam_eps,
                                     fused=fused)
        self.fwd = torch.compile(self.model) if self.device.type == "cuda" else self.model
        self.steps = 0

    @property
    def bench_info(self) -> dict:
        """What ``forgetrain.bench`` records under "engine_info": ``recompute`` is "full" when the blocks run
        under ``torch.utils.checkpoint`` in the train step (the first ``recompute_num_layers`` of them), else "none"."""
        return {"recompute": "full" if self.model.recompute else "none",
                "recompute_num_layers": self.cfg.engine.recompute_num_layers if self.model.recompute else None}

    def _ac(self):
        if self.t.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _hf_map(self):
        m = {"model.embed_tokens.weight": self.model.embed_tokens.weight, "model.norm.weight": self.model.norm,
             "lm_head.weight": self.model.lm_head.weight}
        for i, b in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            m[p + "input_layernorm.weight"] = b.input_layernorm
            m[p + "post_attention_layernorm.weight"] = b.post_attention_layernorm
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                m[p + f"self_attn.{n}.weight"] = getattr(b, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                m[p + f"mlp.{n}.weight"] = getattr(b, n).weight
        return m

    def init_weights(self):
        pass

    def load_hf_weights(self, state):
        with torch.no_grad():
            for k, p in self._hf_map().items():
                p.copy_(state[k])

    def export_hf_weights(self):
        """fp32 HF-layout weights on CPU: copies, also on CPU (``.float().cpu()`` of an fp32 CPU parameter would be
        the live parameter itself, which later steps overwrite)."""
        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in self._hf_map().items()}

    def export_hf_grads(self):
        return {k: v.grad.detach().float().cpu() for k, v in self._hf_map().items()}

    def train_step(self, micro_batches):
        n = len(micro_batches)
        self.opt.zero_grad(set_to_none=True)
        losses = []
        for mb in micro_batches:
            mb = mb.to(self.device)
            with self._ac():
                tok = self.fwd(mb[:, :-1], mb[:, 1:])
            loss = tok.mean()
            (loss / n).backward()
            losses.append(loss.detach())
        gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.clip_grad or float("inf")))
        lr = lr_for_step(self.t, self.steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.steps += 1
        return StepResult(loss=float(torch.stack(losses).mean()), grad_norm=gn, lr=lr)

    @torch.no_grad()
    def eval_loss(self, micro_batches):
        vals = []
        for mb in micro_batches:
            mb = mb.to(self.device)
            with self._ac():
                vals.append(self.fwd(mb[:, :-1], mb[:, 1:]).mean())
        return float(torch.stack(vals).mean())

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])

    def module_probes(self):
        return {}

    @torch.no_grad()
    def logits(self, tokens):
        with self._ac():
            return self.model(tokens.to(self.device)).float()
