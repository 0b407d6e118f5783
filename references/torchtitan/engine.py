"""A reference trainer built from torchtitan's own pieces (torchtitan 0.3.0, used as a library).

Everything numeric is torchtitan's code, assembled the way its ``llama3`` model registry and ``Trainer`` do:

* the model is ``torchtitan.models.llama3.Llama3Model`` built from a ``Llama3Model.Config`` made of torchtitan's
  config helpers (``make_gqa_config`` with a fused ``wqkv``, ``make_ffn_config``, ``RMSNorm``, ``Embedding``,
  ``Linear``), ``ComplexRoPE`` with ``scaling="none"`` and ``theta = model.rotary_base``, and
  ``ScaledDotProductAttention`` (causal) as the inner attention. Initialisation is torchtitan's llama3 recipe
  (``init_states``; README.md, "Initialisation");
* it is wrapped the way ``parallelize_llama`` wraps a dense model without TP/CP/PP, in its order: activation
  checkpointing when ``engine.recompute=full`` (torchtitan's ``FullAC`` policy, the ``full`` choice of its
  ``Trainer.Config.activation_checkpoint``, whose default is ``SelectiveAC``: every decoder block wrapped by
  PyTorch's non-reentrant ``checkpoint_wrapper``, so each block keeps only its input ``[b, s, h]`` and runs its
  forward again in the backward), then per-block ``torch.compile``
  (``apply_compile``) when ``engine.compile`` is set on CUDA, then FSDP2 over a one-axis data-parallel mesh
  (``apply_fsdp_to_decoder`` with a ``MixedPrecisionPolicy``: param dtype bf16 under ``train.precision=bf16``,
  fp32 reductions). torchtitan always applies FSDP2, also on one device, which is also its only mixed-precision
  path; this engine does the same, on one process or under torchrun (gloo on CPU, nccl on CUDA);
* the loss is torchtitan's ``CrossEntropyLoss`` (``F.cross_entropy`` summed over tokens, divided by the step's
  token count), one backward per micro-batch, as in ``Trainer.train_step``;
* the gradient norm and clipping are ``torchtitan.distributed.utils.clip_grad_norm_``;
* the optimizer is torchtitan's ``OptimizersContainer`` with torch ``AdamW`` and two ``ParamGroupConfig`` entries
  (RMSNorm weights without weight decay, everything else with ``train.weight_decay``: Megatron's grouping;
  torchtitan's own ``default_adamw`` decays every parameter).

Recompute repeats the same ops on the same inputs: on CPU (eager) every loss, gradient and weight is bitwise that of
``recompute=none`` (``tests/test_baseline_recompute.py``). The wrapper adds ``_checkpoint_wrapped_module`` to the
module path; parameters are named by torchtitan's ``canonical_fqn`` (the path without it), so weights, checkpoints
and optimizer state are the same with and without recompute. ``engine.bf16_weights`` is the forged engine's switch:
FSDP2's mixed-precision policy casts weights per block here either way. ``bench_info`` says which mode ran.

The one piece written here is the learning rate: each update uses ``forgetrain.schedule.lr_for_step`` (Megatron
semantics), not torchtitan's ``LRSchedulersContainer`` (README.md, "Learning rate").

Weights cross the boundary through torchtitan's ``Llama3StateDictAdapter`` (``to_hf`` / ``from_hf``) and
``FusedQKVLinear``'s split/merge hooks. torchtitan's RoPE rotates adjacent pairs (Meta's complex form); the
adapter's q/k row permutation is exactly the map between that order and the rotate-half order of the neutral
layout (verified by ``tests/test_torchtitan_ref.py``: the same step-1 loss as the Megatron reference from the same
weights; without the permutation the logits move by ~8e-3 relative L2 and the step-1 loss by 7e-6 on llama_micro,
7x the fp32 loss threshold).

Shapes: a micro-batch is ``[b, s+1]`` int64; the model sees ``tokens [b, s]`` and predicts ``labels [b, s]``;
activations are batch-first ``[b, s, h]``.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from forgetrain.config import RunConfig, grad_accum_steps
from forgetrain.distributed import use_device
from forgetrain.engine import StepResult, check_tokens, eval_mode, forward_names, hf_param_names
from forgetrain.levers import EngineSpec
from forgetrain.schedule import lr_for_step

# Names of the RMSNorm weights in torchtitan's llama3 FQNs (attention_norm, ffn_norm, final norm): the
# no-weight-decay group.
NO_DECAY_PATTERN = r"(^|\.)(attention_norm|ffn_norm|norm)\.weight$"


def _init_process_group(cfg: RunConfig, device: torch.device) -> None:
    """A world-1 process group when none exists (FSDP2 needs a device mesh; torchrun has already made one)."""
    from forgetrain.distributed import ensure_process_group

    ensure_process_group(cfg.parallel, device)


def llama3_config(model_cfg):
    """``torchtitan.models.llama3.Llama3Model.Config`` for a :class:`forgetrain.config.ModelConfig`.

    Assembled like torchtitan's llama3 flavours (fused ``wqkv``, ``ComplexRoPE``, torchtitan's llama3 init
    recipe), with four deliberate choices: the FFN width is ``ffn_hidden_size`` as given (no
    ``compute_ffn_hidden_dim`` rounding), RoPE has no llama frequency scaling, embeddings and LM head are untied,
    and the inner attention is causal SDPA (torchtitan's registry offers flex/varlen for language models because
    its data loader packs documents; our batches are plain causal windows, which SDPA computes exactly).
    The base init std is ``model.init_method_std`` (torchtitan hard-codes 0.02, the config default).
    """
    from torch import nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    m = model_cfg
    dim, std = m.hidden_size, m.init_method_std

    def trunc_normal(s: float, **kw) -> dict:
        return {"weight": partial(nn.init.trunc_normal_, std=s, **kw), "bias": nn.init.zeros_}

    def rms_norm():
        return RMSNorm.Config(normalized_shape=dim, eps=m.norm_epsilon, param_init={"weight": nn.init.ones_})

    rope = ComplexRoPE.Config(dim=m.head_dim, max_seq_len=m.seq_length, theta=m.rotary_base, scaling="none")
    layers = []
    for layer_id in range(m.num_layers):
        depth = trunc_normal(depth_scaled_std(std, layer_id))  # torchtitan: std / sqrt(2 (layer_id + 1))
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=rms_norm(), ffn_norm=rms_norm(),
            attention=make_gqa_config(dim=dim, n_heads=m.num_attention_heads, n_kv_heads=m.num_query_groups,
                                      wqkv_param_init=trunc_normal(std), wo_param_init=depth,
                                      inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True,
                                      rope=rope),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=m.ffn_hidden_size, w1_param_init=trunc_normal(std),
                                         w2w3_param_init=depth)))
    out_std = dim ** -0.5
    return Llama3Model.Config(
        dim=dim, vocab_size=m.vocab_size, enable_weight_tying=False, layers=layers, norm=rms_norm(),
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        lm_head=Linear.Config(in_features=dim, out_features=m.vocab_size,
                              param_init=trunc_normal(out_std, a=-3 * out_std, b=3 * out_std)))


class Engine:
    """torchtitan Llama3 reference engine; implements :class:`forgetrain.engine.TrainEngine`.

    Attributes: ``model`` (the FSDP2-wrapped ``Llama3Model``), ``model_config``, ``optimizers`` (torchtitan's
    ``OptimizersContainer``), ``loss_fn`` (torchtitan's ``CrossEntropyLoss``), ``adapter``
    (``Llama3StateDictAdapter``), ``mesh`` (the one-axis FSDP mesh), ``steps_done``.
    """

    extra = ("torchtitan", ("torchtitan",))  # the optional install it needs (forgetrain.extras)
    bench_label = "torchtitan 0.3.0 as a library (Llama3Model, FSDP2)"
    spec = EngineSpec(recompute=True)  # engine.recompute=full: torchtitan's FullAC (module doc)

    def __init__(self, cfg: RunConfig, device: torch.device):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        self.device = torch.device(device)
        m, t, p = cfg.model, cfg.train, cfg.parallel
        if t.precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be fp32 or bf16, got {t.precision!r}")
        if cfg.engine.recompute not in ("none", "full"):
            raise ValueError(f"engine.recompute must be none|full, got {cfg.engine.recompute!r}")
        if p.tensor_parallel_size != 1 or p.pipeline_parallel_size != 1 or p.context_parallel_size != 1:
            raise ValueError("the torchtitan reference runs data parallelism (FSDP2) only: TP = PP = CP = 1 "
                             "(torchtitan's TP/CP/PP wrappers are not wired in yet)")
        self.device = use_device(self.device, t.deterministic)

        _init_process_group(cfg, self.device)
        self.world = dist.get_world_size()
        if self.world != p.data_parallel_size:
            raise ValueError(f"world size {self.world} != parallel.data_parallel_size={p.data_parallel_size}")
        self.grad_accum = grad_accum_steps(cfg)
        self.mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("fsdp",))

        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.models.llama3 import Llama3StateDictAdapter

        self.model_config = llama3_config(m)
        self.adapter = Llama3StateDictAdapter(self.model_config, None)
        with torch.device(self.device):
            model = self.model_config.build()
        self.model = self._parallelize(model)
        self.loss_fn = CrossEntropyLoss.Config().build(compile_config=None)
        self.optimizers = self._build_optimizers()
        self._names = hf_param_names(m.num_layers)
        self.init_weights()

    # ------------------------------------------------------------------ construction
    def _parallelize(self, model):
        """``parallelize_llama``'s dense data-parallel path (no TP/CP/PP), in its order: activation checkpointing
        (``engine.recompute=full``: torchtitan's ``FullAC`` over every block, as ``ac_config.build().apply``),
        then compile, then FSDP2.

        Composed from the same torchtitan functions that ``parallelize_llama`` calls, because its
        ``ParallelDims`` builds meshes on ``torchtitan.tools.utils.device_type``, which is ``"cuda"`` on a machine
        without an accelerator."""
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        if self.cfg.engine.recompute == "full":
            from torchtitan.distributed.activation_checkpoint import FullAC

            FullAC.Config().build(dump_folder="").apply(model)
        if self.cfg.engine.compile and self.device.type == "cuda":
            from torchtitan.config import CompileConfig
            from torchtitan.distributed import ParallelDims
            from torchtitan.distributed.compile import apply_compile

            dims = ParallelDims(dp_replicate=1, dp_shard=self.world, cp=1, tp=1, pp=1, ep=1,
                                world_size=self.world)
            apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"]),
                          parallel_dims=dims)
        param_dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float32
        apply_fsdp_to_decoder(model, self.mesh, param_dtype=param_dtype, reduce_dtype=torch.float32,
                              pp_enabled=False)
        if self.world > 1 and self.device.type == "cpu":
            # torchtitan turns FSDP's gradient division off (factor 1: the loss is already divided by the global
            # token count), which FSDP2 implements as a PREMUL_SUM reduce-scatter; gloo has no PREMUL_SUM. A plain
            # SUM is the same arithmetic (the pre-multiplier is exactly 1.0).
            from torch.distributed.fsdp import FSDPModule

            for mod in model.modules():
                if isinstance(mod, FSDPModule):
                    mod.set_force_sum_reduction_for_comms(True)
        return model

    def _build_optimizers(self):
        """torchtitan's ``OptimizersContainer``: AdamW, norms without decay. CPU: the for-loop (single-tensor)
        implementation, what the Megatron reference runs on CPU; CUDA: torchtitan's default, fused."""
        from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
        from torchtitan.components.optimizer.utils import init_optim_state

        t = self.cfg.train

        def adamw(wd: float) -> dict:
            return {"lr": t.lr, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_eps, "weight_decay": wd}

        conf = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=NO_DECAY_PATTERN, optimizer_name="AdamW",
                                           optimizer_kwargs=adamw(0.0)),
                          ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                           optimizer_kwargs=adamw(t.weight_decay))],
            implementation="fused" if self.device.type == "cuda" else "for-loop")
        opts = conf.build(model_parts=[self.model])
        # Materialise AdamW's state now (torchtitan's own helper: one zero-gradient, zero-lr step; parameters are
        # re-initialised afterwards) so that state_dict() has its full structure from step 0, then put the step
        # counters back to 0: from here the state is exactly torch's fresh AdamW state.
        for opt in opts.optimizers:
            init_optim_state(opt)
        self._reset_optimizer_state(opts)
        return opts

    @staticmethod
    @torch.no_grad()
    def _reset_optimizer_state(opts) -> None:
        for opt in opts.optimizers:
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        v.zero_()

    # ------------------------------------------------------------------ layout exchange
    def _qkv_modules(self) -> dict[str, torch.nn.Module]:
        return {f"layers.{i}.attention.qkv_linear.": blk.attention.qkv_linear
                for i, blk in self.model.layers.items()}

    def _params_tt(self) -> dict[str, torch.nn.Parameter]:
        """torchtitan FQNs -> parameters (FSDP2-sharded DTensors). FQNs are torchtitan's ``canonical_fqn``: without
        the activation-checkpoint wrapper's ``_checkpoint_wrapped_module`` segment, the same with and without
        recompute (what torchtitan's optimizer and checkpointer key their state by)."""
        from torchtitan.components.checkpointer.utils import canonical_fqn

        return {canonical_fqn(n): q for n, q in self.model.named_parameters()}

    @property
    def bench_info(self) -> dict:
        """What ``forgetrain.bench`` records under "engine_info": ``recompute`` is "full" when every decoder block
        is wrapped by the activation-checkpoint wrapper, "none" when none is (read from the model itself)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        wrapped = [isinstance(b, CheckpointWrapper) for b in self.model.layers.values()]
        return {"recompute": "full" if all(wrapped) else "none" if not any(wrapped) else "partial"}

    def _to_neutral(self, tt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """torchtitan-FQN full tensors (fused ``wqkv``) -> neutral HF layout, through torchtitan's split hook and
        ``Llama3StateDictAdapter.to_hf`` (its HF q/k permutation: adjacent pairs -> rotate-half)."""
        from torchtitan.models.common.attention import FusedQKVLinear

        sd = dict(tt)
        for prefix, mod in self._qkv_modules().items():
            FusedQKVLinear._split_qkv_on_save(mod, sd, prefix, None)
        hf = self.adapter.to_hf(sd)
        # copies: on CPU at DP=1 ``.float().cpu()`` of an unpermuted tensor is the live parameter itself
        return {n: hf[n].detach().to("cpu", torch.float32, copy=True).contiguous() for n in self._names}

    def _from_neutral(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Neutral HF layout -> torchtitan-FQN full tensors (``from_hf`` then ``_merge_qkv_on_load``)."""
        from torchtitan.models.common.attention import FusedQKVLinear

        sd = self.adapter.from_hf(dict(hf))
        for prefix, mod in self._qkv_modules().items():
            FusedQKVLinear._merge_qkv_on_load(mod, sd, prefix)
        return sd

    @staticmethod
    def _full(x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return x.full_tensor() if isinstance(x, DTensor) else x

    # ------------------------------------------------------------------ TrainEngine
    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's init (``Llama3Model.init_states`` after ``torch.manual_seed(train.seed)``), zeroed AdamW
        state (step 0), step count 0. The draws are made on full tensors and sharded, so they do not depend on the
        DP size."""
        torch.manual_seed(self.cfg.train.seed)
        with torch.device(self.device):
            fresh = self.model_config.build()
            fresh.init_states()
        self._load_tt({n: q.detach() for n, q in fresh.named_parameters()})
        self._reset_optimizer_state(self.optimizers)
        self.steps_done = 0
        self._last_grads: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def _load_tt(self, full: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        for n, prm in self._params_tt().items():
            src = full[n].to(device=prm.device, dtype=prm.dtype)
            if isinstance(prm, DTensor):
                prm.copy_(distribute_tensor(src, prm.device_mesh, prm.placements))
            else:
                prm.copy_(src)

    @torch.no_grad()
    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Set the (fp32, sharded) parameters to ``state`` exactly. Adam state is not touched.
        Raises KeyError for a missing tensor, ValueError for a wrong shape."""
        for n in self._names:
            if n not in state:
                raise KeyError(f"load_hf_weights: missing {n}")
        ref = self.export_shapes()
        for n in self._names:
            if tuple(state[n].shape) != ref[n]:
                raise ValueError(f"{n}: shape {tuple(state[n].shape)} != {ref[n]}")
        self._load_tt(self._from_neutral({n: state[n].to(torch.float32) for n in self._names}))

    def export_shapes(self) -> dict[str, tuple[int, ...]]:
        """Neutral-layout shapes of this model (no data movement)."""
        m = self.cfg.model
        h, d, v, f = m.hidden_size, m.head_dim, m.vocab_size, m.ffn_hidden_size
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                           p + "self_attn.q_proj.weight": (m.num_attention_heads * d, h),
                           p + "self_attn.k_proj.weight": (m.num_query_groups * d, h),
                           p + "self_attn.v_proj.weight": (m.num_query_groups * d, h),
                           p + "self_attn.o_proj.weight": (h, m.num_attention_heads * d),
                           p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
        return shapes

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """fp32 neutral-layout weights on CPU (the fp32 sharded parameters, gathered: a collective at DP > 1,
        which every rank must call, as the harness does)."""
        with torch.no_grad():
            return self._to_neutral({n: self._full(q.detach()) for n, q in self._params_tt().items()})

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """fp32 neutral-layout gradients of the last step, **before clipping** (snapshot taken after the last
        micro-batch's backward, before ``clip_grad_norm_``). Raises RuntimeError before any step, or when the
        snapshot is off (CUDA without ``train.digests``: the copy would distort benchmark timings)."""
        if self._last_grads is None:
            raise RuntimeError("export_hf_grads: no gradient snapshot (no train_step yet, or CUDA without "
                               "train.digests=true)")
        return self._to_neutral(self._last_grads)

    def _check_batch(self, micro_batches: list[torch.Tensor]) -> None:
        t, m = self.cfg.train, self.cfg.model
        if not micro_batches:
            raise ValueError("need at least one micro-batch")
        want = (t.micro_batch_size, m.seq_length + 1)
        for i, mb in enumerate(micro_batches):
            if not isinstance(mb, torch.Tensor) or tuple(mb.shape) != want or mb.dtype != torch.int64:
                got = (tuple(mb.shape), mb.dtype) if isinstance(mb, torch.Tensor) else type(mb)
                raise ValueError(f"micro-batch {i}: expected int64 {list(want)}, got {got}")

    def _keep_grads(self) -> bool:
        return self.device.type == "cpu" or bool(self.cfg.train.digests)

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """One optimizer step, as torchtitan's ``Trainer.train_step`` runs it at DP=1 without PP: count the
        step's valid tokens, then per micro-batch forward -> ``CrossEntropyLoss(pred, labels, n_tokens)`` (token
        sum / the step's token count) -> backward; ``clip_grad_norm_``; ``optimizers.step()``.

        ``loss`` is the sum of the per-micro-batch scaled losses, torchtitan's reported ``global_avg_loss`` (at
        DP=1): with equal-size micro-batches and no ignored labels that is the mean over micro-batches of each
        micro-batch's token mean, StepResult's definition. At DP > 1: this rank's own token mean
        (torchtitan's ``local_avg_loss``), or with ``parallel.report_loss=dp_mean`` the global mean."""
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed.utils import clip_grad_norm_

        self._check_batch(micro_batches)
        t = self.cfg.train
        self.model.train()
        self.optimizers.zero_grad(set_to_none=True)
        mbs = [mb.to(self.device) for mb in micro_batches]
        local_tokens = sum(int((mb[:, 1:] != IGNORE_INDEX).sum()) for mb in mbs)
        global_valid_tokens = torch.tensor(local_tokens, dtype=torch.int64, device=self.device)
        if self.world > 1:  # torchtitan: loss / global token count, FSDP gradient division disabled (a sum)
            import torch.distributed as dist

            dist.all_reduce(global_valid_tokens, op=dist.ReduceOp.SUM)
        accumulated, per_token = None, []
        keep = self._keep_grads()  # the per-token losses feed digests only: not in a timed CUDA step
        for mb in mbs:
            tokens, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
            pred = self.model(tokens)  # [b, s, V]
            loss, _ = self.loss_fn(pred, labels, global_valid_tokens)
            if not keep:
                del pred  # torchtitan's trainer keeps no logits through the backward
            loss.backward()
            loss = loss.detach()
            accumulated = loss.clone() if accumulated is None else accumulated.add_(loss)
            if keep:
                with torch.no_grad():
                    per_token.append(F.cross_entropy(pred.detach().float().flatten(0, 1), labels.flatten(0, 1),
                                                     reduction="none").view(labels.shape))
                del pred
        params = list(self.model.parameters())
        named = self._params_tt()
        self._last_grads = ({n: self._full(q.grad.detach()).float().clone() for n, q in named.items()}
                            if self._keep_grads() else None)
        max_norm = float(t.clip_grad) if t.clip_grad > 0 else math.inf  # clip_grad=0 disables clipping
        grad_norm = clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        lr = lr_for_step(t, self.steps_done)
        for opt in self.optimizers.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        self.optimizers.step()
        self.steps_done += 1
        if self.world > 1:
            import torch.distributed as dist

            if self.cfg.parallel.report_loss == "dp_mean":  # torchtitan's global_avg_loss
                dist.all_reduce(accumulated, op=dist.ReduceOp.SUM)
            else:  # this rank's own token mean (torchtitan's local_avg_loss)
                accumulated = accumulated * global_valid_tokens / local_tokens
        return StepResult(loss=float(accumulated.item()), grad_norm=float(self._full(grad_norm).item()), lr=lr,
                          per_token_loss=torch.stack(per_token).float().cpu() if per_token else None)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        """Mean over micro-batches of torchtitan's token-mean loss (no grad, eval mode)."""
        from torchtitan.components.loss import IGNORE_INDEX

        self._check_batch(micro_batches)
        with eval_mode(self.model):
            vals = []
            for mb in micro_batches:
                mb = mb.to(self.device)
                tokens, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
                n = (labels != IGNORE_INDEX).sum()
                vals.append(self.loss_fn(self.model(tokens), labels, n)[0].float())
        return float(torch.stack(vals).mean().item())

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[b, s, vocab]`` for int64 tokens ``[b, s]`` (s <= seq_length). Raises ValueError."""
        check_tokens(tokens, self.cfg.model.seq_length)
        with eval_mode(self.model):
            out = self.model(tokens.to(self.device, dtype=torch.long))
        return out.float()

    def module_probes(self) -> dict[str, torch.nn.Module]:
        """Neutral names -> torchtitan submodules. Outputs are **batch-first** ``[b, s, h]`` (Megatron: ``[s, b,
        h]``), so module digests never equal a sequence-first engine's; the L2 magnitudes stay comparable."""
        mdl = self.model
        probes: dict[str, torch.nn.Module] = {"embedding": mdl.tok_embeddings}
        for i, blk in mdl.layers.items():
            probes[f"layers.{i}.input_norm"] = blk.attention_norm
            probes[f"layers.{i}.self_attention"] = blk.attention
            probes[f"layers.{i}.pre_mlp_norm"] = blk.ffn_norm
            probes[f"layers.{i}.mlp"] = blk.feed_forward
        probes["final_norm"] = mdl.norm
        probes["output_layer"] = mdl.lm_head
        return {n: probes[n] for n in forward_names(self.cfg.model.num_layers)}

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """torchtitan's own state, savable with ``torch.distributed.checkpoint`` (sharded DTensors, as torchtitan's
        checkpointer saves them): ``model`` = parameter FQN -> sharded parameter; ``optimizer`` =
        ``OptimizersContainer.state_dict()`` (flat, FQN-keyed); ``step`` = completed optimizer steps."""
        return {"step": int(self.steps_done),
                "model": {n: q.detach() for n, q in self._params_tt().items()},
                "optimizer": self.optimizers.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (weights, AdamW state and hyper-parameters, step count)."""
        for n, prm in self._params_tt().items():
            prm.copy_(state["model"][n])
        self.optimizers.load_state_dict(dict(state["optimizer"]))
        self.steps_done = int(state["step"])
        self._last_grads = None

