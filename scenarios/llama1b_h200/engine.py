"""Forged engine for Llama on Hopper: the scenarios ``llama1b_h200``, ``llama3b_h200``, ``llama8b_h100`` and
``llama8b_h200`` all name it (``scenario.engine: scenarios.llama1b_h200.engine:Engine``); only the model shape differs.

It composes the shared Llama parts of ``scenarios/_llama`` (the exact model, ``ParallelState`` and the flat grad
buffer, the optimizer arithmetic, the weight layouts) with its own fast model (``fast.py``) and gradient
accumulation fusion (``wgrad.py``); it inherits from no other engine.

Precision (``train.precision=bf16``): bf16 model weights, fp32 main weights, fp32 gradient accumulation buffers
(``main_grad``), fp32 AdamW state -- Megatron's mixed-precision recipe. ``fp32`` keeps everything in fp32.

Two modes, chosen by ``engine.mode`` (every lever and its declared tier: ``levers.py``; the evidence:
``optimisations.yaml``):

* ``exact`` -- the op-by-op Megatron mirror (``scenarios/_llama/model.py``, whose alignment notes apply),
  torch-AdamW arithmetic in its foreach form on CUDA (single-tensor on CPU), Megatron's grad-norm and clipping
  arithmetic. Target: **bitwise** vs the Megatron-core reference in deterministic mode.
* ``fast`` -- ``fast.FastLlama``: batch-first, SDPA attention, chunked LM-head cross-entropy, optional
  ``torch.compile`` per block, fused AdamW (``kernels.adamw=fused``), foreach grad norm with one host sync.
  Target: **loss-curve**, then **surpass**. ``engine.grad_accum_fusion=true`` (fast mode only) sends the weight
  gradients of the linear layers, LM head and embedding straight into the fp32 ``main_grad`` (``wgrad.py``).

Memory layout (both modes, declared bitwise): ``engine.recompute=full`` reruns each decoder layer's forward in the
backward instead of storing its activations; with it, ``engine.bf16_weights=per_layer`` keeps no bf16 copy of the
layers between steps (their parameters are the fp32 main weights; ``scenarios/_llama/recompute.py``). The
``llama8b_h200`` scenario needs both to fit full-depth Llama-3-8B on one H200.

``engine.optimizer_offload_fraction=F`` keeps the AdamW moments of the largest tensors (at least F of the
elements) in host memory and streams them through the GPU, chunk by chunk, for the update
(``scenarios/_llama/optim.HostMoments``; declared bitwise). On one H200 it frees room for stored activations.

Data parallelism (``parallel.data_parallel_size > 1``, under torchrun): the fp32 ``main_grad`` tensors are views
of one flat buffer laid out as Megatron's DDP lays out its fp32 grad buffer (reverse registration order, one
bucket: ``scenarios/_llama/parallel.GradBuffer``); after the last micro-batch the buffer is scaled by 1/DP
and all-reduced (SUM), Megatron's ``grad_reduce_in_fp32`` DDP arithmetic. ``parallel.zero_stage=1`` is Megatron's
distributed optimizer: the buffer is reduce-scattered instead, the grad norm is the sum of the shards' squared
norms, AdamW state exists only for this rank's shard, and the updated fp32 main weights are all-gathered before
the bf16 copy. TP and FSDP are not implemented in this engine (ConfigError).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from forgetrain import memory
from forgetrain.config import inductor_options
from forgetrain.engine import StepResult
from forgetrain.errors import ConfigError
from forgetrain.schedule import lr_for_step
from scenarios._llama import layout, optim, recompute
from scenarios._llama.model import Llama
from scenarios._llama.parallel import GradBuffer, ParallelState, megatron_registration_order
from scenarios.llama1b_h200.levers import SPEC
from scenarios.llama1b_h200.wgrad import WGradAccum, probe_path


class Engine:
    """``Engine(cfg: RunConfig, device)``; protocol in forgetrain.engine.TrainEngine.

    Parts: ``model`` (``fast.FastLlama`` or the exact ``_llama.model.Llama``), ``par``
    (:class:`~scenarios._llama.parallel.ParallelState`), ``ddp`` (the flat fp32 grad buffer under DP / ZeRO-1,
    else None), ``main`` / ``main_grad`` (fp32 main weights and gradients by forged name) and ``adam_state``.
    Raises ConfigError for TP > 1, ZeRO stages other than 0 and 1, or ``parallel.overlap_grad_reduce`` /
    ``parallel.bucket_size`` (its DP buffer is reduced once, after the last micro-batch).
    """

    # what it implements: modes, recompute, optimizer offload, the kernel switches it honours, and its engine.*
    # levers with their tiers (levers.py, the one table; config.validate reads it)
    spec = SPEC

    def __init__(self, cfg, device: torch.device | str = "cuda"):
        self.cfg, self.device = cfg, torch.device(device)
        self.mcfg, self.tcfg, self.pcfg = cfg.model, cfg.train, cfg.parallel
        self.opts, self.kernels = cfg.engine, cfg.kernels
        self.bf16 = self.tcfg.precision == "bf16"
        self.fast = self.opts.mode == "fast"
        tp_size, zero_stage = self.pcfg.tensor_parallel_size, self.pcfg.zero_stage
        if tp_size != 1 or zero_stage not in (0, 1):
            raise ConfigError(f"{cfg.scenario.name}: the Hopper engine implements only data parallelism "
                              f"(parallel.zero_stage 0 or 1, TP=1); got TP={tp_size} zero_stage={zero_stage} "
                              f"(llama_tiny_cpu has TP and FSDP2)")
        if self.pcfg.overlap_grad_reduce or self.pcfg.bucket_size is not None:
            raise ConfigError(f"{cfg.scenario.name}: the Hopper engine reduces the gradients once, after the last "
                              f"micro-batch (one bucket); parallel.overlap_grad_reduce and parallel.bucket_size are "
                              f"not implemented here (llama_tiny_cpu has them); got overlap_grad_reduce="
                              f"{self.pcfg.overlap_grad_reduce}, bucket_size={self.pcfg.bucket_size}")
        self.par = ParallelState.build(self.pcfg)
        self.dp_size, self.zero_stage = self.par.dp_size, self.par.zero_stage
        self.ddp: GradBuffer | None = None
        if self.fast and self.opts.fp8 != "none":
            self._check_fp8()
        with torch.device(self.device):
            if self.fast:
                from scenarios.llama1b_h200.fast import FastLlama

                self.model = FastLlama(self.mcfg, self.kernels, self.opts)
            else:
                self.model = Llama(self.mcfg, deterministic=self.tcfg.deterministic)
        self._last_grads = None
        # Gradient accumulation fusion: the GEMM path (probed once on CUDA for bf16) and the weights it routes.
        self.fusion = self.fast and self.opts.grad_accum_fusion
        self.grad_accum_path = None
        if self.fusion:
            self.grad_accum_path = probe_path(self.device)[0] if self.bf16 else "fp32_upcast"  # fp32: one addmm_
        self._fused: list[str] = []
        self.onepass = self.fast and self.opts.onepass_optimizer
        self.per_layer = self.bf16 and self.opts.bf16_weights == "per_layer"
        self._own: list[str] = []  # per-layer weights: the recompute writes their main_grad itself
        self.init_weights()

    def _check_fp8(self) -> None:
        """engine.fp8's needs (fp8.py): FP8 GEMMs on the device (CUDA compute capability 8.9 or later; on CPU torch
        runs ``_scaled_mm`` itself) and weight dimensions that are multiples of 16 (any token count is padded,
        fp8.py). Raises ConfigError."""
        from scenarios.llama1b_h200 import fp8

        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            cap = ".".join(map(str, torch.cuda.get_device_capability(self.device)))
            raise ConfigError(f"engine.fp8={self.opts.fp8} needs FP8 GEMMs (CUDA compute capability 8.9 or later: "
                              f"Ada, Hopper); this GPU has {cap}; set engine.fp8=none")
        m = self.mcfg
        d = m.head_dim
        qkv = m.num_query_groups * (m.num_attention_heads // m.num_query_groups + 2) * d
        try:
            for i, o in ((m.hidden_size, qkv), (m.num_attention_heads * d, m.hidden_size),
                         (m.hidden_size, 2 * m.ffn_hidden_size), (m.ffn_hidden_size, m.hidden_size)):
                fp8.check_shape(i, o)
            if self.opts.fp8_lm_head:
                fp8.check_shape(m.hidden_size, m.vocab_size)
        except ValueError as e:
            raise ConfigError(f"{e}; set engine.fp8=none") from None

    # ------------------------------------------------------------------ weights
    def init_weights(self) -> None:
        """N(0, init_method_std) from ``train.seed`` on the device's generator; fp32 main weights, zero state."""
        g = torch.Generator(device=self.device).manual_seed(self.tcfg.seed)
        self.model.float()
        self.model.reset_parameters(g)
        self._make_main()

    def _make_main(self) -> None:
        named = self._named()
        if self.per_layer:  # the layers' fp32 parameters are the main weights; the rest get a bf16 copy
            own = recompute.per_layer_names(self.model)
            self.main = {k: p.data if k in own else p.detach().float().clone() for k, p in named.items()}
            for name, child in self.model.named_children():
                if name != "layers":
                    child.to(torch.bfloat16)
            self._own = [k for k in self.main if k in own]
        elif self.bf16:
            self.main = {k: p.detach().float().clone() for k, p in named.items()}
            self.model.to(torch.bfloat16)
        else:
            self.main = {k: p.data for k, p in named.items()}
        self.completed_steps = 0
        # engine.optimizer_offload_fraction: these moments are made in (pinned) host memory, never on the device
        self._host_moments = memory.offload_names({k: v.numel() for k, v in self.main.items()},
                                                 self.opts.optimizer_offload_fraction)
        if self.dp_size > 1 or self.zero_stage == 1:
            self._setup_dp_buffer()  # also shards the AdamW state under ZeRO-1
        else:
            self.main_grad = {k: torch.zeros_like(v) for k, v in self.main.items()}
            self.adam_state = self._fresh_state()
        self.offload = None
        if self._host_moments:  # AdamW moments in host memory (optim.HostMoments)
            self.offload = optim.HostMoments(self.adam_state, self._host_moments, self.device)
        if self.fusion:  # under DP these are views of the flat buffer: the GEMMs write into it directly
            self._fused = self.model.attach_main_grad(self.main_grad)
        if self.opts.recompute == "full":
            self._attach_runner()

    def _fresh_state(self) -> dict:
        return optim.fresh_state(self.main, host=self._host_moments, pin=self.device.type == "cuda")

    def _attach_runner(self) -> None:
        """``engine.recompute=full``: the model runs its layers through a :class:`recompute.LayerRunner`, with
        just-in-time bf16 weights under ``engine.bf16_weights=per_layer`` (module doc there)."""
        context = None
        if self.fast:
            from scenarios.llama1b_h200.fast import sdpa_priority

            backend, device = self.opts.attention_backend, self.device
            context = lambda: sdpa_priority(backend, device)  # noqa: E731 - the recompute picks the same kernels
        self.model.layer_runner = recompute.LayerRunner(
            self.model.layers, per_layer_dtype=torch.bfloat16 if self.per_layer else None,
            main_grad=self.main_grad if self.per_layer else None, fused=self._fused,
            compile=self.fast and self.opts.compile, compile_options=inductor_options(self.opts), context=context,
            recompute_layers=self.opts.recompute_num_layers)

    @property
    def bench_info(self) -> dict:
        """What ``forgetrain.bench`` records about this engine: the gradient-accumulation path (None: unfused), the
        activation recompute (and how many layers it covers; None: all), where the layers' bf16 weights live and
        the GEMM precision of the decoder layers' linear layers (``fp8``: engine.fp8, "none" for bf16) and whether the
        LM head's GEMMs run in FP8 too (``fp8_lm_head``)."""
        return {"grad_accum_fusion": self.grad_accum_path, "recompute": self.opts.recompute,
                "fp8": self.opts.fp8 if self.fast else "none",
                "fp8_lm_head": bool(self.fast and self.opts.fp8 != "none" and self.opts.fp8_lm_head),
                "recompute_num_layers": self.opts.recompute_num_layers,
                "optimizer_offload_fraction": self.opts.optimizer_offload_fraction,
                "bf16_weights": self.opts.bf16_weights if self.bf16 else None}

    def _setup_dp_buffer(self) -> None:
        """DP > 1: ``main_grad[k]`` become views of one flat fp32 buffer in Megatron DDP's layout (reverse
        registration order, one bucket), reduced by ``GradBuffer.finish_grad_sync`` after the last micro-batch."""
        order = megatron_registration_order(self.mcfg.num_layers)
        if sorted(order) != sorted(self.main):  # fast mode's own parameter names: its registration order
            order = list(self.main)
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
            self.adam_state = self._fresh_state()

    def _sync_model_from_main(self) -> None:
        if self.bf16:
            named = self._named()
            ks = [k for k in self.main if named[k].data.data_ptr() != self.main[k].data_ptr()]
            torch._foreach_copy_([named[k].data for k in ks], [self.main[k] for k in ks])

    def _named(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

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
        if self._fused or self._own:  # fused GEMMs and per-layer recompute wrote main_grad themselves
            skip = set(self._fused) | set(self._own)
            keys = [k for k in keys if k not in skip]
        runner = getattr(self.model, "layer_runner", None)
        for i, mb in enumerate(micro_batches):
            mb = self._check(mb)
            if runner is not None:
                runner.begin_micro_batch(i == 0)
            if self.fusion:  # first micro-batch: the GEMMs overwrite main_grad (beta 0), then accumulate
                loss, tok = self.model(mb[:, :-1], mb[:, 1:], self._accum(i, n))
            elif self.fast:
                loss, tok = self.model(mb[:, :-1], mb[:, 1:])
            else:
                tok = self.model(mb[:, :-1], mb[:, 1:])
                loss = tok.mean()
            (loss / n).backward()
            stray = [k for k in self._fused + self._own if named[k].grad is not None]
            if stray:
                raise RuntimeError(f"fused or per-layer weights got an autograd .grad as well: {stray}")
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
        order = layout.norm_order(self.mcfg.num_layers)
        if self.tcfg.digests:  # under ZeRO-1 the whole local buffer, as the reference's main_grad snapshot
            self._last_grads = {k: self.main_grad[k].clone() for k in order}
        lr = lr_for_step(self.tcfg, self.completed_steps)
        if self.onepass:
            grad_norm = self._onepass_update(order, lr)  # it writes the bf16 weights itself
        else:
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

    def _accum(self, i: int, n: int) -> WGradAccum:
        """Micro-batch ``i`` of ``n``: overwrite main_grad on the first, and the loss is backpropagated as loss / n
        (the scale the LM head's forward-time dW needs)."""
        return WGradAccum(first=i == 0, scale=1.0 / n, path=self.grad_accum_path)

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
        if self.fast:
            grad_norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        else:  # Megatron: norm of per-tensor norms (host), squared on device, .item() ** 0.5
            grad_norm = optim.grad_norm(grads, device=self.device)
        if not self.fast:
            optim.clip_(grads, grad_norm, self.tcfg.clip_grad)
        elif (coeff := optim.clip_coeff(self.tcfg.clip_grad, grad_norm)) is not None:
            torch._foreach_mul_(grads, coeff)
        groups = []
        for decay in (True, False):  # Megatron's two param groups: 2-D weights (wd) and 1-D norms (no wd)
            ks = [k for k in self.main if (self.main[k].dim() > 1) == decay]
            groups.append((decay, [self.main[k] for k in ks], [self.main_grad[k] for k in ks],
                           [self.adam_state[k] for k in ks]))
        self._adamw_groups(groups, lr)
        return grad_norm

    def _onepass_update(self, order: list[str], lr: float) -> float:
        """``engine.onepass_optimizer``: :func:`scenarios._llama.optim.onepass_update` (it writes the bf16 weights)."""
        return optim.onepass_update(self.main, self.main_grad, self._named(), self.adam_state, order, lr, self.tcfg,
                                    self.bf16, self.completed_steps + 1)

    @torch.no_grad()
    def _adamw_groups(self, groups, lr: float) -> None:
        """AdamW over ``[(decayed, params, grads, states)]`` with the ``kernels.adamw`` arithmetic
        (:func:`scenarios._llama.optim.adamw_groups`)."""
        optim.adamw_groups(groups, lr, self.tcfg, self.kernels.adamw, self.device, self.completed_steps + 1,
                           offload=self.offload)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        self.model.eval()
        vals = []
        for mb in micro_batches:
            mb = self._check(mb)
            out = self.model(mb[:, :-1], mb[:, 1:])
            vals.append(out[0] if self.fast else out.mean())
        return float(torch.stack(vals).mean())

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        tokens = tokens.to(self.device)
        if self.fast:
            return self.model.logits(tokens)
        return self.model(tokens).transpose(0, 1).float()

    # ------------------------------------------------------------------ checkpoint / probes
    def state_dict(self) -> dict:
        """``{"main": {name: fp32 main weight}, "optimizer": {name: {"step", "exp_avg", "exp_avg_sq"}},
        "completed_steps"}``, full tensors for every DP size and ZeRO stage (so DCP loads it into another layout).
        Under ZeRO-1 the moment shards are all-gathered first: a collective, every rank must call it."""
        if self.zero1:
            opt = optim.gather_zero1_state(self.ddp, self._m_shard, self._v_shard, self.main, self.completed_steps)
        else:
            if self.offload is not None:
                self.offload.synchronize()  # the host moments' last copies back have landed
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
                if self.offload is not None:
                    self.offload.synchronize()
                for k, st in state["optimizer"].items():
                    self.adam_state[k]["step"] = float(st["step"])
                    self.adam_state[k]["exp_avg"].copy_(st["exp_avg"])
                    self.adam_state[k]["exp_avg_sq"].copy_(st["exp_avg_sq"])
        self.completed_steps = int(state["completed_steps"])
        self._sync_model_from_main()

    def module_probes(self) -> dict[str, torch.nn.Module]:
        """The exact model's modules by Megatron name; none in fast mode (its blocks fuse them)."""
        return {} if self.fast else layout.module_probes(self.model)
