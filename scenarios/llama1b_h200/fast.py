"""The fast path of the Hopper Llama engines: batch-first, SDPA attention, chunked LM head + cross-entropy.

Parameters have exactly the shapes of the exact model (``scenarios/_llama/model.py``): fused grouped QKV
``[nkv*(nq/nkv+2)*d, h]``, fused ``[gate; up]``, so weight exchange and the grad-norm order are shared. Each
departure from the exact path changes reduction order, so this model targets the loss-curve tier:

* ``[b, s, h]`` activations (weight-gradient sums run in a different token order);
* ``F.scaled_dot_product_attention`` (cuDNN / flash backends, causal, GQA without repeating K/V);
* ``F.linear`` everywhere (cuBLAS picks its own algorithm per shape);
* cross-entropy fused with the LM head and chunked over tokens (``kernels.cross_entropy=chunked|triton``):
  the ``[tokens, vocab]`` logits never exist whole, and the backward of each chunk is computed in the forward;
  with ``chunked``, ``kernels.ce_chunk=triton`` computes each chunk's loss and d(logits) with the forged kernel
  ``forgetrain.kernels.ce_chunk`` instead of the compiled torch ops;
* with ``engine.grad_accum_fusion`` the weight gradients of the linear layers, the LM head and the embedding go
  straight into the engine's fp32 ``main_grad`` (``wgrad.py``; tolerance tier);
* with ``engine.fp8=tensorwise`` the decoder layers' four linear layers run their GEMMs with FP8 operands
  (``fp8.py``; loss-curve tier); with ``engine.fp8_lm_head=true`` also the LM head's, chunk by chunk.

Shapes: b micro-batch, s sequence, h hidden, d head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forgetrain.config import inductor_options
from forgetrain.kernels import torch_ops
from scenarios.llama1b_h200 import fp8, wgrad
from scenarios.llama1b_h200.wgrad import WGradAccum


def rope_cos_sin(s: int, d: int, base: float, device, dtype):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    f = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(dtype)[None, :, None, :], emb.sin().to(dtype)[None, :, None, :]


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``t [b, s, n, d]``."""
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


def sdpa_priority(backend: str, device):
    """Prefer cuDNN attention on Hopper (about 2x flash's fwd+bwd at B1 H32 KV8 S4096 d128 on the H200: 1.07 ms
    against 2.0 ms), falling back to flash / efficient / math. Active while the blocks are traced,
    so compiled blocks bake the chosen kernel in."""
    import contextlib

    if device.type != "cuda" or backend != "cudnn":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch without set_priority
        return sdpa_kernel(order)


class FastBlock(nn.Module):
    """One transformer block, ``x [b, s, h] -> [b, s, h]``; parameter names match the exact model's Block."""

    def __init__(self, cfg, kernels, free_qkv: bool = False, fp8_recipe: str = "none"):
        super().__init__()
        from scenarios._llama.model import RMSNorm

        self.free_qkv = free_qkv  # engine.free_qkv: V copied out of the QKV output (see forward)
        self.fp8 = fp8_recipe  # engine.fp8: none | tensorwise (fp8.py)
        self.nq, self.nkv, self.d = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.attn = nn.Module()
        self.attn.qkv = nn.Parameter(torch.empty(self.nkv * (self.nq // self.nkv + 2) * self.d, cfg.hidden_size))
        self.attn.proj = nn.Parameter(torch.empty(cfg.hidden_size, self.nq * self.d))
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Parameter(torch.empty(2 * cfg.ffn_hidden_size, cfg.hidden_size))
        self.mlp.fc2 = nn.Parameter(torch.empty(cfg.hidden_size, cfg.ffn_hidden_size))
        self.kernels = kernels
        self.eps = cfg.norm_epsilon
        self.main_grad: dict[str, torch.Tensor] = {}  # FastLlama.attach_main_grad: name -> fp32 [out, in]

    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _linear(self, x: torch.Tensor, name: str, w: torch.Tensor, acc: WGradAccum | None) -> torch.Tensor:
        if self.fp8 != "none":
            mg = self.main_grad.get(name) if acc is not None else None
            return fp8.linear(x, w, mg, acc is not None and acc.first)
        return wgrad.linear(x, w, self.main_grad.get(name), acc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope32=None,
                acc: WGradAccum | None = None) -> torch.Tensor:
        """``x [b, s, h]``; ``cos``/``sin`` ``[1, s, 1, d]`` in x's dtype; ``rope32`` fp32 ``[s, d]`` tables for
        the Triton RoPE kernel. Per-op kernels follow ``kernels.*`` (torch | triton). With ``acc`` the four
        weight gradients accumulate into ``self.main_grad`` (gradient accumulation fusion)."""
        b, s, _ = x.shape
        qpg = self.nq // self.nkv
        k_ = self.kernels
        if k_.rmsnorm == "triton":
            from forgetrain.kernels import rmsnorm_residual

            h, _ = rmsnorm_residual(x, None, self.input_norm.weight, self.eps)
        else:
            h = self._norm(x, self.input_norm.weight)
        mixed = self._linear(h, "attn.qkv", self.attn.qkv, acc).view(b, s, self.nkv, qpg + 2, self.d)
        q = mixed[:, :, :, :qpg].reshape(b, s, self.nq, self.d)
        k, v = mixed[:, :, :, qpg], mixed[:, :, :, qpg + 1]
        if self.free_qkv:  # V saved for SDPA's backward as its own [b, s, nkv, d] tensor, not as a view that keeps
            v = v.contiguous()  # the whole [b, s, (nq + 2 nkv) d] QKV output alive to the backward (q, k: RoPE copies)
        if k_.rope == "triton":
            from forgetrain.kernels import apply_rope

            q, k = apply_rope(q, *rope32), apply_rope(k, *rope32)
        else:
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=qpg > 1)
        attn = self._linear(o.transpose(1, 2).reshape(b, s, self.nq * self.d), "attn.proj", self.attn.proj, acc)
        if k_.rmsnorm == "triton":  # fused: x = x + attn; h = rmsnorm(x)
            h, x = rmsnorm_residual(attn, x, self.pre_mlp_norm.weight, self.eps)
        else:
            x = x + attn
            h = self._norm(x, self.pre_mlp_norm.weight)
        fc1 = self._linear(h, "mlp.fc1", self.mlp.fc1, acc)
        if k_.swiglu == "triton":  # on [gate | up] itself: its backward writes d(fc1) whole, no concatenation
            from forgetrain.kernels import swiglu_packed

            act = swiglu_packed(fc1)
        else:
            gate, up = fc1.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return x + self._linear(act, "mlp.fc2", self.mlp.fc2, acc)


_ce_chunk = torch_ops.ce_chunk  # one chunk's loss and (softmax - onehot) * inv_n; the math is defined there
_ce_chunk_compiled: dict = {}  # inductor options (as a sorted tuple) -> the compiled _ce_chunk


def _ce_fn(device: torch.device, options: dict | None = None, kernel: str = "torch"):
    """The per-chunk cross-entropy ``(logits [n, V], labels [n], inv_n) -> (loss [n] fp32, dlogits [n, V])``:
    the forged Triton kernel ``forgetrain.kernels.ce_chunk`` for ``kernel="triton"`` (``kernels.ce_chunk``; on
    CPU under Triton's interpreter), else ``_ce_chunk`` (``torch_ops.ce_chunk``), compiled on CUDA with inductor
    ``options`` (``forgetrain.config.inductor_options``)."""
    if kernel == "triton":
        from forgetrain.kernels import ce_chunk

        return ce_chunk
    if device.type != "cuda":
        return _ce_chunk
    key = tuple(sorted((options or {}).items()))
    if key not in _ce_chunk_compiled:
        _ce_chunk_compiled[key] = torch.compile(_ce_chunk, dynamic=False, options=options)
    return _ce_chunk_compiled[key]


class ChunkedLinearCE(torch.autograd.Function):
    """Mean cross-entropy of ``h [N, h] @ W[V, h]^T`` against ``labels [N]``, chunked over tokens.

    The forward computes each chunk's logits, its loss and (softmax - onehot) / N, and immediately the chunk's
    ``dh`` and its ``dW`` contribution, so only one chunk of logits is alive and nothing is recomputed. With one
    chunk (``ce_chunk_tokens >= N``) dW is a single bf16 GEMM; with several it accumulates in fp32.
    With ``main_grad`` (fp32 ``[V, h]``) and ``acc`` (gradient accumulation fusion) each chunk's dW GEMM goes
    straight into ``main_grad`` instead, scaled by ``acc.scale`` -- which must be the ``dloss`` the backward will
    receive (``train_step``'s ``1 / n``): dW is formed before ``dloss`` exists -- and ``w`` gets no gradient.
    ``ce_kernel`` (``kernels.ce_chunk``) picks the per-chunk cross-entropy (:func:`_ce_fn`). With ``fp8_head``
    (``engine.fp8_lm_head``) each chunk's three GEMMs run with FP8 operands (``fp8.HeadWeight``); the
    cross-entropy itself stays fp32 on the bf16 logits.
    Returns (mean loss, per-token loss [N] fp32 detached). Formula: Megatron's max-shifted CE.
    """

    @staticmethod
    def forward(ctx, h, w, labels, chunk: int, main_grad=None, acc: WGradAccum | None = None,
                options: dict | None = None, ce_kernel: str = "torch", fp8_head: bool = False):
        n = h.shape[0]
        fn = _ce_fn(h.device, options, ce_kernel)
        dh = torch.empty_like(h)
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        dw = None
        head = fp8.HeadWeight(w) if fp8_head else None
        for i in range(0, n, chunk):
            hc, lc = h[i:i + chunk], labels[i:i + chunk]
            if head is not None:
                logits, x8, sx = head.logits(hc)
                loss, g = fn(logits, lc, 1.0 / n)
                losses[i:i + chunk] = loss
                dh[i:i + chunk], g8, sg = head.dh(g)
                part = head.dw(g8, sg, x8, sx)  # fp32 [V, h]
                if acc is not None:  # main_grad (+)= dloss * dW, as wgrad.gemm_accumulate forms it
                    if acc.first and i == 0:
                        torch.mul(part, acc.scale, out=main_grad)
                    else:
                        main_grad.add_(part, alpha=acc.scale)
                    continue
                dw = part if dw is None else dw.add_(part)
                continue
            loss, g = fn(hc @ w.t(), lc, 1.0 / n)
            losses[i:i + chunk] = loss
            dh[i:i + chunk] = g @ w
            if acc is not None:
                wgrad.gemm_accumulate(main_grad, g, hc, acc.first and i == 0, acc.scale, acc.path)
                continue
            part = g.t() @ hc
            if dw is None:
                dw = part if chunk >= n else part.float()
            else:
                dw.add_(part)  # fp32 accumulation across chunks
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return losses.mean(), losses

    @staticmethod
    def backward(ctx, dloss, _dlosses):
        dh, dw = ctx.saved_tensors
        dw = None if dw is None else (dw * dloss).to(ctx.w_dtype)
        return dh * dloss.to(dh.dtype), dw, None, None, None, None, None, None, None


class FastLlama(nn.Module):
    """``forward(ids [b, s], labels [b, s])`` -> (mean loss, per-token loss [b, s]); ``logits(ids)`` -> [b, s, V]."""

    def __init__(self, cfg, kernels, engine_opts):
        super().__init__()
        from scenarios._llama.model import Embedding, OutputLayer, RMSNorm

        self.cfg, self.kernels, self.opts = cfg, kernels, engine_opts
        self.embedding = Embedding(cfg.vocab_size, cfg.hidden_size, index_lookup=False)
        self.layers = nn.ModuleList(FastBlock(cfg, kernels, getattr(engine_opts, "free_qkv", False),
                                              getattr(engine_opts, "fp8", "none"))
                                    for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.output_layer = OutputLayer(cfg.vocab_size, cfg.hidden_size)
        self._rope: dict = {}
        self._blocks = list(self.layers)
        self.attention_backend = getattr(engine_opts, "attention_backend", "cudnn")
        self.main_grad: dict[str, torch.Tensor] = {}  # attach_main_grad: the weights fused into main_grad
        self.layer_runner = None  # set by the engine under engine.recompute=full (it compiles the layers itself)
        if engine_opts.compile and getattr(engine_opts, "recompute", "none") == "none":
            self._blocks = [torch.compile(b, options=inductor_options(engine_opts)) for b in self.layers]

    def reset_parameters(self, generator):
        from scenarios._llama.model import megatron_init

        megatron_init(self, self.cfg, generator)

    def attach_main_grad(self, main_grad: dict[str, torch.Tensor]) -> list[str]:
        """Route the weight gradients of the linear layers, the embedding and (unless ``kernels.cross_entropy=
        triton``, whose kernel owns its dW) the LM head into ``main_grad`` (parameter name -> fp32 tensor of the
        parameter's shape) whenever ``forward`` gets a :class:`WGradAccum`. Returns the routed names; the other
        parameters (the norm weights) keep autograd's ``.grad``."""
        names = [n for n, p in self.named_parameters() if p.dim() == 2]
        if self.kernels.cross_entropy == "triton":
            names.remove("output_layer.weight")
        self.main_grad = {n: main_grad[n] for n in names}
        for i, blk in enumerate(self.layers):
            p = f"layers.{i}."
            blk.main_grad = {n[len(p):]: t for n, t in self.main_grad.items() if n.startswith(p)}
        return names

    def hidden(self, ids: torch.Tensor, acc: WGradAccum | None = None) -> torch.Tensor:
        s = ids.shape[1]
        key = (s, ids.device, self.embedding.weight.dtype)
        if key not in self._rope:
            self._rope[key] = rope_cos_sin(s, self.cfg.head_dim, self.cfg.rotary_base, ids.device,
                                            self.embedding.weight.dtype)
        cos, sin = self._rope[key]
        rope32 = None
        if self.kernels.rope == "triton":
            rk = ("fp32", s, ids.device)
            if rk not in self._rope:
                from forgetrain.kernels import rope_tables

                self._rope[rk] = rope_tables(s, self.cfg.head_dim, self.cfg.rotary_base, ids.device)
            rope32 = self._rope[rk]
        x = wgrad.embedding(ids, self.embedding.weight, self.main_grad.get("embedding.weight"), acc)
        with sdpa_priority(self.attention_backend, ids.device):
            run = self.layer_runner  # engine.recompute=full: a scenarios._llama.recompute.LayerRunner
            for i, blk in enumerate(self._blocks):
                x = run(i, x, cos, sin, rope32, acc) if run is not None else blk(x, cos, sin, rope32, acc)
        return F.rms_norm(x, (x.shape[-1],), self.final_norm.weight, self.cfg.norm_epsilon)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, acc: WGradAccum | None = None):
        """With ``acc`` the routed weight gradients (:meth:`attach_main_grad`) go to ``main_grad``."""
        h = self.hidden(ids, acc)
        b, s, hd = h.shape
        mode = self.kernels.cross_entropy
        if mode == "triton":
            from forgetrain.kernels import fused_linear_cross_entropy

            tok = fused_linear_cross_entropy(h.reshape(-1, hd), self.output_layer.weight, labels.reshape(-1),
                                             self.opts.ce_chunk_tokens)
            return tok.mean(), tok.detach().view(b, s)
        if mode == "chunked":
            mg = self.main_grad.get("output_layer.weight") if acc is not None else None
            loss, tok = ChunkedLinearCE.apply(h.reshape(-1, hd), self.output_layer.weight, labels.reshape(-1),
                                               self.opts.ce_chunk_tokens, mg, acc if mg is not None else None,
                                               inductor_options(self.opts), self.kernels.ce_chunk,
                                               getattr(self.opts, "fp8_lm_head", False))
            return loss, tok.view(b, s)
        logits = wgrad.linear(h, self.output_layer.weight, self.main_grad.get("output_layer.weight"), acc).float()
        tok = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return tok.mean(), tok.detach().view(b, s)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.hidden(ids), self.output_layer.weight).float()
