"""``torch_compile``: a strong user's plain-PyTorch training script under ``torch.compile``, the strongest-peer
stand-in for benchmarks.

What a strong PyTorch user writes in about 150 lines for one GPU, without a framework:

* **bf16 parameters**, with **fp32 master weights and fp32 master gradients** held beside them (20 bytes per
  parameter with AdamW's two fp32 moments; the model itself computes in bf16, nothing is cast per micro-batch);
* fused QKV (one ``nn.Linear`` whose output rows are ``[q; k; v]``) and fused gate/up (``[gate; up]``) linears,
  separate ``o`` and ``down``; batch-first activations; ``F.scaled_dot_product_attention(is_causal=True,
  enable_gqa=True)``; ``F.rms_norm``; rotate-half RoPE;
* cross-entropy on the full logits cast to fp32 (token mean);
* ``torch.compile`` of the whole model (on CUDA; eager on CPU, where the tests run it);
* one optimizer step: each micro-batch's ``loss / grad_accum`` is back-propagated, so the gradients accumulate in
  the bf16 ``.grad``; once per step they are copied to the fp32 master gradients, clipped by their global L2 norm
  (``train.clip_grad``, 1.0 by default), ``torch.optim.AdamW(fused=True)`` (fused on CUDA) steps the masters, and
  the masters are copied back into the bf16 parameters.

Where the reference (Megatron-core) has an observable training semantic, this side follows it: the init
distributions (Megatron's: every matrix from N(0, ``init_method_std``), the attention output and MLP down
projections from N(0, ``init_method_std / sqrt(2 * num_layers)``), RMSNorm weights at 1; drawn from
``train.seed``), Megatron's weight-decay groups (decay on every matrix, none on the 1-D norm weights), and the LR
schedule the harness uses (``forgetrain.schedule.lr_for_step``, Megatron's semantics). ``train.precision=fp32``
keeps fp32 parameters (the masters are then an fp32 copy of them: plain fp32 AdamW arithmetic).

``engine.recompute=full``: one ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` per decoder
block in train steps (the first ``engine.recompute_num_layers`` blocks when set), as the autocast side
(``references/torch_compile_autocast``) does; in eager mode the run is bitwise the run without it.

A baseline for ``forgetrain.bench`` (``bench.against=[torch_compile]``), never a golden reference (its spec's
``bench_only``). ``references/torchao_float8_tensorwise`` and ``..._rowwise`` are this script with torchao's float8
training on the decoder linears (:mod:`references.torch_compile.float8`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from forgetrain.engine import StepResult
from forgetrain.levers import EngineSpec
from forgetrain.schedule import lr_for_step


class Block(nn.Module):
    """One decoder block on ``[b, s, h]`` activations: fused ``qkv_proj`` ``[(nq + 2 nkv) d, h]`` and
    ``gate_up_proj`` ``[2 ffn, h]``, ``o_proj`` ``[h, nq d]``, ``down_proj`` ``[h, ffn]``."""

    def __init__(self, c):
        super().__init__()
        d = c.hidden_size // c.num_attention_heads
        self.nq, self.nkv, self.d, self.ffn, self.eps = (c.num_attention_heads, c.num_query_groups, d,
                                                         c.ffn_hidden_size, c.norm_epsilon)
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(c.hidden_size, (self.nq + 2 * self.nkv) * d, bias=False)
        self.o_proj = nn.Linear(self.nq * d, c.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), self.input_layernorm, self.eps)
        q, k, v = self.qkv_proj(h).split([self.nq * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = q.view(b, s, self.nq, self.d).transpose(1, 2)
        k = k.view(b, s, self.nkv, self.d).transpose(1, 2)
        v = v.view(b, s, self.nkv, self.d).transpose(1, 2)

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, s, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, self.eps)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class Llama(nn.Module):
    """The whole model: ``forward(ids [b, s] int64, labels [b, s] int64 | None)`` gives the cross-entropy (nats)
    of the fp32-cast logits -- the token mean (0-d fp32), or per token ``[b * s]`` with ``reduction="none"`` --
    or the logits ``[b, s, vocab]`` without labels. ``block`` builds each decoder block (default :class:`Block`,
    the fused one; ``references/torch_compile_autocast`` passes its HF-layout block)."""

    def __init__(self, c, recompute: bool = False, recompute_layers: int | None = None, block=None,
                 reduction: str = "mean"):
        super().__init__()
        self.c, self.recompute, self.reduction = c, recompute, reduction
        block = Block if block is None else block
        self.recompute_layers = c.num_layers if recompute_layers is None else recompute_layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(block(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        d = c.hidden_size // c.num_attention_heads
        inv = 1.0 / (c.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        f = torch.outer(torch.arange(c.seq_length, dtype=torch.float32), inv)
        emb = torch.cat((f, f), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids, labels=None):
        s = ids.shape[1]
        x = self.embed_tokens(ids)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        ckpt = self.recompute and torch.is_grad_enabled()  # engine.recompute=full: one block per checkpoint
        for i, blk in enumerate(self.layers):  # engine.recompute_num_layers: only the first N blocks
            if ckpt and i < self.recompute_layers:
                x = checkpoint(blk, x, cos, sin, use_reentrant=False)
            else:
                x = blk(x, cos, sin)
        logits = self.lm_head(F.rms_norm(x, (x.shape[-1],), self.norm, self.c.norm_epsilon))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction=self.reduction)


def megatron_std(name: str, c) -> float:
    """Megatron-core's init std of parameter ``name`` of :class:`Llama`: ``init_method_std``, scaled by
    ``1 / sqrt(2 * num_layers)`` for the two matrices that write into the residual stream (o_proj, down_proj)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return c.init_method_std / math.sqrt(2.0 * c.num_layers)
    return c.init_method_std


def hf_slices(model: Llama) -> dict[str, tuple[str, int, int]]:
    """HF-Llama key -> (parameter name of ``model``, first row, end row): the fused ``qkv_proj`` and
    ``gate_up_proj`` are row ranges of one tensor each; every other key is a whole parameter."""
    c = model.c
    d = c.hidden_size // c.num_attention_heads
    q, kv, f = c.num_attention_heads * d, c.num_query_groups * d, c.ffn_hidden_size
    out = {"model.embed_tokens.weight": ("embed_tokens.weight", 0, c.vocab_size),
           "model.norm.weight": ("norm", 0, c.hidden_size), "lm_head.weight": ("lm_head.weight", 0, c.vocab_size)}
    for i in range(c.num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = (m + "input_layernorm", 0, c.hidden_size)
        out[p + "post_attention_layernorm.weight"] = (m + "post_attention_layernorm", 0, c.hidden_size)
        for key, a, b in (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)):
            out[p + f"self_attn.{key}.weight"] = (m + "qkv_proj.weight", a, b)
        out[p + "self_attn.o_proj.weight"] = (m + "o_proj.weight", 0, c.hidden_size)
        out[p + "mlp.gate_proj.weight"] = (m + "gate_up_proj.weight", 0, f)
        out[p + "mlp.up_proj.weight"] = (m + "gate_up_proj.weight", f, 2 * f)
        out[p + "mlp.down_proj.weight"] = (m + "down_proj.weight", 0, c.hidden_size)
    return out


class Engine:
    """The strong plain-PyTorch side (module doc); implements forgetrain.engine.TrainEngine without module
    probes or digests. Attributes: ``model`` (:class:`Llama`, bf16 under ``train.precision=bf16``), ``masters``
    (parameter name -> fp32 master weight, its ``.grad`` the fp32 master gradient), ``opt`` (AdamW over the
    masters), ``fwd`` (the compiled model on CUDA, else ``model``)."""

    name = "torch_compile"  # the side's name (references/<name>), in error lines
    bench_label = "strong plain-PyTorch script: bf16 params + fp32 masters (at bf16), fused QKV/gate-up, torch.compile"
    spec = EngineSpec(
        bench_only=True,  # verify refuses it: no per-token losses to judge
        recompute=True,  # engine.recompute=full: torch.utils.checkpoint per block (module doc)
        recompute_num_layers=True,  # engine.recompute_num_layers: the first N blocks only
    )

    def __init__(self, cfg, device):
        from forgetrain.errors import ConfigError

        p = cfg.parallel
        if p.data_parallel_size * p.tensor_parallel_size > 1:
            raise ConfigError(f"references/{self.name} is a single-device baseline (no gradient reduction); "
                              "bench it with parallel=single, or against megatron / deepspeed under torchrun")
        if cfg.engine.recompute not in ("none", "full"):
            raise ConfigError(f"engine.recompute must be none|full, got '{cfg.engine.recompute}'")
        self.cfg, self.device, self.t = cfg, torch.device(device), cfg.train
        with torch.device(self.device):
            self.model = Llama(cfg.model, recompute=cfg.engine.recompute == "full",
                               recompute_layers=cfg.engine.recompute_num_layers)
        self._init(torch.Generator(device=self.device).manual_seed(self.t.seed))
        self.param_dtype = torch.bfloat16 if self.t.precision == "bf16" else torch.float32
        self.masters = {n: q.detach().float().clone().requires_grad_(True)
                        for n, q in self.model.named_parameters()}
        self.model.to(self.param_dtype)
        self.convert_model()
        named = dict(self.model.named_parameters())
        self.params = [named[n] for n in self.masters]  # the masters' order
        self.master_list = list(self.masters.values())
        for m in self.master_list:
            m.grad = torch.zeros_like(m)
        decay = [m for m in self.master_list if m.dim() > 1]  # Megatron: no decay on 1-D (norm) weights
        no_decay = [m for m in self.master_list if m.dim() == 1]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.t.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=self.t.lr,
                                     betas=(self.t.adam_beta1, self.t.adam_beta2), eps=self.t.adam_eps,
                                     fused=self.device.type == "cuda")
        self.fwd = torch.compile(self.model) if self.device.type == "cuda" else self.model
        self.steps = 0

    def convert_model(self) -> None:
        """Hook for subclasses: change the bf16 model's modules before it is compiled (the torchao float8
        sides swap the decoder linears); nothing here."""

    @torch.no_grad()
    def _init(self, g: torch.Generator) -> None:
        """Megatron-core's distributions (module doc), drawn in parameter order from ``g``."""
        for n, q in self.model.named_parameters():
            if q.dim() == 1:
                q.fill_(1.0)
            else:
                q.normal_(0.0, megatron_std(n, self.cfg.model), generator=g)

    @property
    def bench_info(self) -> dict:
        """What ``forgetrain.bench`` records under "engine_info": ``recompute`` ("full" when the blocks run under
        ``torch.utils.checkpoint`` in train steps, the first ``recompute_num_layers`` of them; else "none") and
        the parameters' dtype (``param_dtype``; the masters are fp32)."""
        return {"recompute": "full" if self.model.recompute else "none",
                "recompute_num_layers": self.cfg.engine.recompute_num_layers if self.model.recompute else None,
                "param_dtype": str(self.param_dtype).removeprefix("torch.")}

    def init_weights(self):
        pass

    @torch.no_grad()
    def _sync_params(self) -> None:
        """The model's parameters := the masters (cast to the parameter dtype)."""
        torch._foreach_copy_(self.params, self.master_list)

    @torch.no_grad()
    def load_hf_weights(self, state):
        for key, (name, a, b) in hf_slices(self.model).items():
            self.masters[name][a:b].copy_(state[key])
        self._sync_params()

    def export_hf_weights(self):
        """fp32 HF-layout copies of the master weights, on CPU."""
        return {k: self.masters[n][a:b].detach().to("cpu", torch.float32, copy=True)
                for k, (n, a, b) in hf_slices(self.model).items()}

    def export_hf_grads(self):
        """fp32 HF-layout copies of the last step's master gradients (after clipping), on CPU."""
        return {k: self.masters[n].grad[a:b].detach().to("cpu", torch.float32, copy=True)
                for k, (n, a, b) in hf_slices(self.model).items()}

    def train_step(self, micro_batches):
        """One optimizer step over ``micro_batches`` (each ``[mb, seq + 1]`` int64; module doc)."""
        n = len(micro_batches)
        for q in self.params:
            q.grad = None
        losses = []
        for mb in micro_batches:
            mb = mb.to(self.device, non_blocking=True)
            loss = self.fwd(mb[:, :-1], mb[:, 1:])
            (loss / n).backward()  # accumulates in the parameters' (bf16) .grad
            losses.append(loss.detach())
        with torch.no_grad():
            torch._foreach_copy_([m.grad for m in self.master_list], [q.grad for q in self.params])
        gn = float(torch.nn.utils.clip_grad_norm_(self.master_list, self.t.clip_grad or float("inf"), foreach=True))
        lr = lr_for_step(self.t, self.steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self._sync_params()
        self.steps += 1
        return StepResult(loss=float(torch.stack(losses).mean()), grad_norm=gn, lr=lr)

    @torch.no_grad()
    def eval_loss(self, micro_batches):
        vals = [self.fwd(mb[:, :-1].to(self.device), mb[:, 1:].to(self.device)) for mb in micro_batches]
        return float(torch.stack(vals).mean())

    def state_dict(self):
        return {"masters": {n: m.detach().clone() for n, m in self.masters.items()},
                "optimizer": self.opt.state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        with torch.no_grad():
            for n, m in self.masters.items():
                m.copy_(state["masters"][n])
        self.opt.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        self._sync_params()

    def module_probes(self):
        return {}

    @torch.no_grad()
    def logits(self, tokens):
        return self.model(tokens.to(self.device)).float()
