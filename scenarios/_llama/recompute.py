"""Full activation recompute of the decoder layers (all of them, or the first N), optionally with just-in-time bf16
weights.

``engine.recompute=full`` is Megatron-LM's ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``: each decoder layer keeps only its input ``x`` for the backward; the backward runs the
layer's forward again (with autograd on) and backpropagates through that. Recompute repeats the same ops on the
same inputs, so the gradients are bitwise those of the stored-activation path (deterministic kernels assumed, as
Megatron assumes them for its own recompute).

Unlike Megatron's ``CheckpointFunction`` (which runs the first forward under ``no_grad``), the first forward also
runs with autograd on, from the same detached leaves as the recompute, and drops its graph when the layer is done
(as ``torch.utils.checkpoint``'s non-reentrant form keeps the grad mode): torch chooses kernels by that state --
SDPA by ``requires_grad``, dynamo by the grad mode (under ``engine.compile`` a no-grad forward and a grad-mode
recompute are two compiled graphs, an inference one and a training one, and past dynamo's recompile limit one of
them runs eagerly) -- so only the same state guarantees that the recompute reproduces the forward's bits. The
graph lives for one layer, as the recompute's does, so the peak memory is unchanged. With autograd off
(evaluation, sampling) a layer simply runs; there is nothing to recompute.

``engine.bf16_weights=per_layer`` (needs ``recompute=full`` and ``train.precision=bf16``): the layers' parameters
*are* the fp32 main weights; no bf16 copy of them lives between steps. A layer's bf16 copy is made when its
forward starts and again when its recompute starts, and freed when that layer is done. The cast is round to
nearest even, as the resident copy's ``copy_`` from the main weights is, so the bf16 values are the same bits.
The layer's bf16 weight gradients go into the engine's fp32 ``main_grad`` right where the recompute forms them
(copied on the step's first micro-batch, added on the others: Megatron DDP's ``main_grad.add_(grad)``
arithmetic, the same as the engine's own post-backward pass). Without it, the resident bf16 weights are used and
their gradients land in ``.grad`` as usual.

``engine.recompute_num_layers=N`` recomputes only the first N layers (Megatron's ``--recompute-method block
--recompute-num-layers N``); each later layer runs the same tracked forward and keeps its graph, and with it its
activations (and, in per-layer mode, its bf16 working copy), until its backward. The backward differentiates that
graph, so its gradients are the same bits as the recompute's: both differentiate the same tracked forward on the
same leaves. The memory freed by recomputing fewer layers is traded for speed, chosen by measurement.

Weights are substituted with ``torch.func.functional_call``; under ``engine.compile`` each layer's
``functional_call`` is compiled once (a compiled *module* cannot take non-Parameter weights).

Why: the single-GPU 8B scenario (``llama8b_h200``) cannot hold fp32 main weights, fp32 grads, fp32 Adam moments
(128 GB for 8.03 B parameters), a 16 GB bf16 copy and the stored activations of 32 layers at seq 8192 on 141 GB.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call


class _Recompute(torch.autograd.Function):
    """``y = layer_i(x, *args)`` keeping only ``x``; ``weights`` are layer i's parameters (for autograd's
    bookkeeping: their gradients are routed by the runner, never returned)."""

    @staticmethod
    def forward(ctx, runner: "LayerRunner", i: int, args: tuple, x: torch.Tensor, *weights: torch.Tensor):
        with torch.enable_grad():  # the recompute's state (module doc); the graph dies with this statement
            y = runner.run_tracked(i, x, weights, args)[0].detach()
        ctx.runner, ctx.i, ctx.args = runner, i, args
        ctx.save_for_backward(x, *weights)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *weights = ctx.saved_tensors
        runner, i = ctx.runner, ctx.i
        with torch.enable_grad():
            y, xd, leaves = runner.run_tracked(i, x, weights, ctx.args)
            dx = _backprop(runner, i, y, xd, leaves, dy)
        return (None, None, None, dx) + (None,) * len(weights)


class _Stored(torch.autograd.Function):
    """``y = layer_i(x, *args)`` storing its activations: a layer past ``recompute_num_layers``. The forward is the
    recompute's tracked forward; its graph is kept on ``ctx`` until the backward differentiates it (module doc)."""

    @staticmethod
    def forward(ctx, runner: "LayerRunner", i: int, args: tuple, x: torch.Tensor, *weights: torch.Tensor):
        with torch.enable_grad():
            y, xd, leaves = runner.run_tracked(i, x, weights, args)
        ctx.runner, ctx.i, ctx.graph, ctx.n_weights = runner, i, (y, xd, leaves), len(weights)
        return y.detach()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, xd, leaves = ctx.graph
        del ctx.graph  # the activations die with this backward, as autograd's own saved tensors do
        dx = _backprop(ctx.runner, ctx.i, y, xd, leaves, dy)
        return (None, None, None, dx) + (None,) * ctx.n_weights


def _backprop(runner: "LayerRunner", i: int, y: torch.Tensor, xd: torch.Tensor, leaves: list, dy: torch.Tensor):
    """Differentiate layer ``i``'s tracked forward ``y`` at ``dy``: route its weight gradients (``runner.route``)
    and return the gradient of its input ``xd``."""
    wanted = [xd] + [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(y, wanted, dy, allow_unused=True)
    wgrads = iter(grads[1:])
    runner.route(i, [next(wgrads) if t.requires_grad else None for t in leaves])
    return grads[0]


class LayerRunner:
    """Runs ``layers[i](x, *args)`` under full recompute (module doc); set as ``model.layer_runner``.

    layers: the decoder layers (uncompiled modules), named ``{prefix}{i}.`` in the engine's parameter dicts.
    per_layer_dtype: the just-in-time working dtype (``torch.bfloat16``) or None for the resident weights.
    main_grad: name -> fp32 tensor; needed with ``per_layer_dtype``. Names of weights fused into ``main_grad`` by
        gradient accumulation fusion (``fused``) get no gradient here (their GEMMs wrote it).
    compile: compile each layer's ``functional_call`` (``engine.compile``), with inductor ``compile_options``
        (``engine.compile_tuning``: ``forgetrain.config.inductor_options``).
    context: a factory of the context every layer call runs in (the SDPA backend priority): the recompute runs in
        the backward, outside the model's forward, and must pick the same kernels.
    recompute_layers: how many layers, the first ones, are recomputed (``engine.recompute_num_layers``); None:
        all. The others store their activations (:class:`_Stored`).
    Raises ValueError when ``per_layer_dtype`` is given without ``main_grad``, or for ``recompute_layers`` outside
    0..len(layers).
    """

    def __init__(self, layers, prefix: str = "layers.", per_layer_dtype: torch.dtype | None = None,
                 main_grad: dict[str, torch.Tensor] | None = None, fused: list[str] | tuple = (),
                 compile: bool = False, compile_options: dict | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] | None = None,
                 recompute_layers: int | None = None):
        if per_layer_dtype is not None and main_grad is None:
            raise ValueError("per-layer working weights need the fp32 main_grad to write their gradients into")
        self.layers = list(layers)
        if recompute_layers is not None and not 0 <= recompute_layers <= len(self.layers):
            raise ValueError(f"recompute_layers must be in 0..{len(self.layers)}, got {recompute_layers}")
        self.recompute_layers = len(self.layers) if recompute_layers is None else recompute_layers
        self.names = [[n for n, _ in layer.named_parameters()] for layer in self.layers]
        self.prefix, self.dtype, self.main_grad = prefix, per_layer_dtype, main_grad
        self.fused = set(fused)
        self.context = context or contextlib.nullcontext
        self.first = True
        self._fns = []
        for layer in self.layers:
            def fn(params, x, *args, _layer=layer):
                return functional_call(_layer, params, (x, *args))
            self._fns.append(torch.compile(fn, options=compile_options) if compile else fn)

    def begin_micro_batch(self, first: bool) -> None:
        """Called by the engine before each micro-batch: on the step's first, gradients overwrite ``main_grad``."""
        self.first = first

    def working_copy(self, w: torch.Tensor) -> torch.Tensor:
        """The tensor a layer computes with: the bf16 rounding of an fp32 main weight (per-layer mode) or the
        weight itself, detached."""
        return w.detach().to(self.dtype) if self.dtype is not None else w.detach()

    def run(self, i: int, x: torch.Tensor, weights, args: tuple, cast: bool = True) -> torch.Tensor:
        params = {n: (self.working_copy(w) if cast else w) for n, w in zip(self.names[i], weights)}
        with self.context():
            return self._fns[i](params, x, *args)

    def run_tracked(self, i: int, x: torch.Tensor, weights, args: tuple):
        """Layer ``i`` on fresh leaves, as both the forward and the recompute run it (call with autograd on):
        ``x`` detached and requiring grad, each weight's :meth:`working_copy` requiring grad as the weight does.
        Returns ``(y, x leaf, weight leaves)``."""
        xd = x.detach().requires_grad_(True)
        leaves = [self.working_copy(w).requires_grad_(w.requires_grad) for w in weights]
        return self.run(i, xd, leaves, args, cast=False), xd, leaves

    def route(self, i: int, grads: list[torch.Tensor | None]) -> None:
        """Layer ``i``'s weight gradients from one recompute: into ``main_grad`` (per-layer mode) or the
        parameters' ``.grad``. Raises RuntimeError when a weight fused into ``main_grad`` also got a gradient."""
        layer = self.layers[i]
        for n, (_, p), g in zip(self.names[i], layer.named_parameters(), grads):
            full = f"{self.prefix}{i}.{n}"
            if g is None:
                continue
            if full in self.fused:
                raise RuntimeError(f"grad_accum_fusion: fused weight {full} got an autograd gradient as well")
            if self.dtype is not None:
                mg = self.main_grad[full]
                mg.copy_(g) if self.first else mg.add_(g)
            elif p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def __call__(self, i: int, x: torch.Tensor, *args) -> torch.Tensor:
        weights = [p for _, p in self.layers[i].named_parameters()]
        if not torch.is_grad_enabled():  # evaluation or sampling: no backward, nothing to recompute
            return self.run(i, x, weights, args)
        fn = _Recompute if i < self.recompute_layers else _Stored
        return fn.apply(self, i, args, x, *weights)


def per_layer_names(model: nn.Module, prefix: str = "layers.") -> set[str]:
    """The parameter names of ``model`` that belong to its decoder layers (held in fp32 under per-layer mode)."""
    return {n for n, _ in model.named_parameters() if n.startswith(prefix)}
