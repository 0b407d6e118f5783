"""The golden reference: a thin training loop over megatron-core 0.16.1 (see README.md next to this file).

Everything numeric is Megatron's own code: ``GPTModel`` with the local layer spec (no TE/Apex), Megatron's
``DistributedDataParallel`` grad buffers, its ``forward_backward_no_pipelining`` schedule and
``finalize_model_grads``, ``get_megatron_optimizer`` (torch ``AdamW`` inside Megatron's FP32 / Float16 wrappers,
or the distributed optimizer when ``parallel.zero_stage >= 1``) and ``OptimizerParamScheduler``. This file only
wires them together the way Megatron-LM's ``pretrain_gpt.py`` / ``training.py`` do, converts weights to the neutral
HF layout (``convert.py``) and, on CPU, installs the device shim (``shim.py``) first.

Shapes: a micro-batch is ``[b, s+1]`` int64 token ids; the model sees tokens ``[b, s]`` and returns per-token
losses ``[b, s]``; activations inside are sequence-first ``[s, b, h]``.
"""

from __future__ import annotations

import warnings
from typing import Iterator

import torch
import torch.nn.functional as F

from forgetrain.config import RunConfig
from forgetrain.distributed import use_device
from forgetrain.engine import StepResult, check_tokens, eval_mode, forward_names
from forgetrain.levers import EngineSpec
from references.megatron import convert, moe

# megatron-core 0.16.1's TransformerConfig defaults cuda_graph_scope to "full", then warns on every construction that
# "full" is deprecated (it means the same as its replacement, []); this engine sets no CUDA graphs. Exactly that
# warning is silenced, for as long as this reference is imported; every other warning still shows.
warnings.filterwarnings("ignore", message=r"full scope is deprecated\. Use empty cuda_graph_scope",
                        category=UserWarning, module=r"megatron\.core\.transformer\.transformer_config")


def _init_process_group(cfg: RunConfig, device: torch.device) -> None:
    """World-1 process group when none exists (a torchrun launch has already created one)."""
    from forgetrain.distributed import ensure_process_group

    ensure_process_group(cfg.parallel, device)


def _init_model_parallel(cfg: RunConfig) -> None:
    """(Re)initialise Megatron's global parallel state for cfg.parallel (kept when it already matches)."""
    from megatron.core import parallel_state as ps

    p = cfg.parallel
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() == p.tensor_parallel_size
                and ps.get_pipeline_model_parallel_world_size() == p.pipeline_parallel_size
                and ps.get_context_parallel_world_size() == p.context_parallel_size):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=p.tensor_parallel_size,
                                 pipeline_model_parallel_size=p.pipeline_parallel_size,
                                 context_parallel_size=p.context_parallel_size,
                                 distributed_timeout_minutes=max(1, p.timeout_s // 60))


def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """Megatron-LM's ``get_ltor_masks_and_position_ids`` mask: bool ``[1, 1, s, s]``, True = masked (j > i)."""
    m = torch.tril(torch.ones((1, seq_length, seq_length), device=device)).view(1, 1, seq_length, seq_length)
    return m < 0.5


class Engine:
    """Megatron-core reference engine; implements :class:`forgetrain.engine.TrainEngine`.

    Attributes worth knowing: ``model`` (the DDP-wrapped chunk Megatron trains), ``gpt`` (the bare ``GPTModel``),
    ``optimizer`` (Megatron's ``ChainedOptimizer``), ``scheduler`` (``OptimizerParamScheduler``), ``steps_done``.
    """

    bench_label = "Megatron-core 0.16.1 local spec (no Transformer Engine)"  # forgetrain.bench's side legend
    # the ModelConfig features beyond Llama it runs (forgetrain.levers.MODEL_FEATURES): Megatron's qk_layernorm,
    # share_embeddings_and_output_weights and kv_channels (the Qwen3 dense family); it maps neither engine.recompute
    # nor the optimizer offload, and the bench builds it as verify does
    # and Megatron's MoE (num_experts: the Qwen3-MoE family, TP=1)
    spec = EngineSpec(model_features=("qk_layernorm", "share_embeddings_and_output_weights", "kv_channels",
                                      "num_experts"))

    def __init__(self, cfg: RunConfig, device: torch.device):
        self.cfg = cfg
        self.device = torch.device(device)
        m, t, p = cfg.model, cfg.train, cfg.parallel
        if p.pipeline_parallel_size != 1 or p.context_parallel_size != 1:
            raise ValueError("the Megatron reference engine runs PP=1 and CP=1 only")
        if p.zero_stage not in (0, 1):
            raise ValueError(f"the Megatron reference engine runs zero_stage 0 (DDP) or 1 (distributed optimizer), "
                             f"got {p.zero_stage}")
        if t.precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be fp32 or bf16, got {t.precision!r}")
        if m.num_experts is not None and p.tensor_parallel_size != 1:
            raise ValueError("the Megatron reference engine runs a mixture of experts (model.num_experts) at TP=1 "
                             "only (the weight exchange has no expert-parallel / expert-TP layout)")
        decay_steps = t.lr_decay_steps or t.steps
        if t.lr_warmup_steps >= decay_steps:
            raise ValueError(f"Megatron's OptimizerParamScheduler needs lr_warmup_steps < lr_decay_steps, got "
                             f"{t.lr_warmup_steps} >= {decay_steps}")
        self.bf16 = t.precision == "bf16"

        use_device(self.device, t.deterministic)  # Megatron-LM's --deterministic-mode requirements on CUDA
        if self.device.type == "cpu":
            from references.megatron import shim

            shim.install()

        _init_process_group(cfg, self.device)
        _init_model_parallel(cfg)
        if m.num_experts is not None:
            moe.define_missing_te_names()

        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        self._ps = ps
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()

        self.tcfg = self._transformer_config()
        self.gpt = self._build_gpt()  # seeded: deterministic in cfg.train.seed
        model: torch.nn.Module = self.gpt
        if self.bf16:
            model = Float16Module(self.tcfg, model)  # Megatron-LM's --bf16 wrapper (fp32 in/out, bf16 inside)
        if self.device.type == "cuda":
            model = model.cuda(torch.cuda.current_device())
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            use_distributed_optimizer=p.zero_stage >= 1, check_for_nan_in_grad=False)
        self.model = DistributedDataParallel(self.tcfg, self.ddp_config, model)

        self.opt_config = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=self.bf16, fp16=False,
            params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
            use_distributed_optimizer=p.zero_stage >= 1, log_num_zeros_in_grad=False)
        # config_overrides=None -> Megatron's standard overrides: wd_mult=0 for 1-D params and biases.
        self.optimizer = get_megatron_optimizer(self.opt_config, [self.model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_steps,
            lr_decay_steps=decay_steps, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=t.steps, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)

        # What Megatron-LM's training.setup_model_and_optimizer wires into the model config.
        self.tcfg.grad_scale_func = self.optimizer.scale_loss
        self.tcfg.no_sync_func = self.model.no_sync
        self.tcfg.finalize_model_grads_func = finalize_model_grads

        self.steps_done = 0
        self._names = {id(prm): n for n, prm in self.gpt.named_parameters()}
        self._last_grads: dict[str, torch.Tensor] | None = None
        s = m.seq_length
        self._mask = causal_mask(s, self.device)
        self._position_ids = torch.arange(s, dtype=torch.long, device=self.device).unsqueeze(0)

    # ------------------------------------------------------------------ construction helpers
    def _transformer_config(self):
        from megatron.core.transformer.transformer_config import TransformerConfig

        m, t = self.cfg.model, self.cfg.train
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        return TransformerConfig(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
            kv_channels=m.head_dim, qk_layernorm=m.qk_layernorm,
            normalization="RMSNorm", layernorm_epsilon=m.norm_epsilon, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=m.init_method_std,
            tensor_model_parallel_size=self.cfg.parallel.tensor_parallel_size,
            pipeline_model_parallel_size=1, sequence_parallel=False,
            bf16=self.bf16, fp16=False, params_dtype=dtype, pipeline_dtype=dtype,
            # CPU initialisation (Megatron's --use-cpu-initialization): the initial weights depend only on the
            # seed and the torch CPU generator, whatever the device and the TP size.
            use_cpu_initialization=True, perform_initialization=True,
            deterministic_mode=bool(t.deterministic),
            # Megatron-core defaults, spelled out: no fused kernels (none exist without TE/Apex on CPU).
            masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            cross_entropy_loss_fusion=False, attention_softmax_in_fp32=True,
            apply_query_key_layer_scaling=False, rotary_interleaved=False, **moe.moe_config(self.cfg.model))

    def _build_gpt(self):
        """Seed and build a fresh GPTModel (CPU-initialised, then moved to the device by the caller)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        m, t = self.cfg.model, self.cfg.train
        # Megatron-LM's _set_random_seed: torch.manual_seed, then the model-parallel RNG tracker.
        torch.manual_seed(t.seed)
        model_parallel_cuda_manual_seed(t.seed)
        return GPTModel(
            config=self.tcfg,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=m.qk_layernorm,
                                                            num_experts=m.num_experts, moe_grouped_gemm=False),
            vocab_size=m.vocab_size, max_sequence_length=m.seq_length, pre_process=True, post_process=True,
            fp16_lm_cross_entropy=False, parallel_output=True,
            share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=m.rotary_base)

    # ------------------------------------------------------------------ parameter access
    def _named_params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.gpt.named_parameters())

    def _opt_tensor_names(self) -> dict[int, str]:
        """id(tensor the torch optimizer steps) -> Megatron param name, for every optimizer flavour."""
        out: dict[int, str] = {}
        for n, prm in self.gpt.named_parameters():
            out[id(prm)] = n  # FP32Optimizer steps the model params themselves
            if hasattr(prm, "main_param"):  # Float16Optimizer / DistributedOptimizer fp32 main copy of a bf16 param
                out[id(prm.main_param)] = n
        for inner in self.optimizer.chained_optimizers:
            if hasattr(inner, "shard_fp32_groups"):  # DistributedOptimizer: fp32 params are stepped via shard views
                for mg, sg in zip(inner.model_fp32_groups, inner.shard_fp32_groups):
                    for mp, sp in zip(mg, sg):
                        out[id(sp)] = self._names[id(mp)]
        return out

    def _main_param(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 values the optimizer updates for model param p, shaped like p (p itself under fp32).

        Under the distributed optimizer at DP > 1 each rank holds a flat shard of it: the full tensor is
        assembled over the DP group (a collective: every rank must call this) and is a copy, so writes go
        through :meth:`_set_main_param`."""
        if not self.bf16:
            return p
        main = getattr(p, "main_param", None)  # None on a rank that owns no element of p
        if not self._main_sharded():
            return main.view(p.shape)
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if main is not None:
            start, end = self._main_shard_range(p)
            full[start:end] = main  # each element is owned by exactly one rank: the SUM assembles, exactly
        torch.distributed.all_reduce(full, group=self._ps.get_data_parallel_group())
        return full.view(p.shape)

    def _set_main_param(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Write fp32 ``value`` (shaped like p) into p's main param (this rank's shard of it, if sharded)."""
        main = getattr(p, "main_param", None)
        if main is None:  # this rank owns no element of p
            return
        if not self._main_sharded():
            main.copy_(value.view(main.shape))
            return
        start, end = self._main_shard_range(p)
        main.copy_(value.reshape(-1)[start:end])

    def _main_sharded(self) -> bool:
        """bf16 main params are split over the DP ranks (the distributed optimizer at DP > 1)."""
        return self.ddp_config.use_distributed_optimizer and self.dp_size > 1

    def _main_shard_range(self, p: torch.nn.Parameter) -> tuple[int, int]:
        """[start, end) of p's flattened elements whose fp32 main copy this rank's distributed optimizer owns."""
        for inner in self.optimizer.chained_optimizers:
            if hasattr(inner, "model_param_gbuf_map") and p in inner.model_param_gbuf_map:
                r = inner._get_model_param_range_map(p)["param"]
                return r.start, r.end
        raise KeyError("parameter not managed by a distributed optimizer")

    def _optimizer_params(self) -> list[tuple[str, torch.Tensor]]:
        """(model param name, the tensor the torch optimizer steps) in the optimizer's own order."""
        names = self._opt_tensor_names()
        return [(names[id(q)], q) for group in self.optimizer.param_groups for q in group["params"]]

    def grad_norm_param_order(self) -> list[str]:
        """Megatron parameter names in the order their gradients enter the grad norm (= optimizer order)."""
        return [n for n, _ in self._optimizer_params()]

    def param_groups_summary(self) -> list[dict]:
        """Per optimizer param group: its names (in order), wd_mult and the current weight_decay / lr."""
        names = self._opt_tensor_names()
        return [{"params": [names[id(q)] for q in g["params"]], "wd_mult": g.get("wd_mult", 1.0),
                 "weight_decay": g["weight_decay"], "lr": g["lr"]} for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ TrainEngine
    def init_weights(self) -> None:
        """Reset to the initial state: the seeded initial weights, empty optimizer state, scheduler at step 0."""
        if self.tp_size != 1:
            raise NotImplementedError("init_weights re-initialisation is implemented for TP=1")
        fresh = dict(self._build_gpt().named_parameters())  # same seed, same RNG draws as the constructor
        with torch.no_grad():
            for n, prm in self._named_params().items():
                prm.copy_(fresh[n])
                if self.bf16:
                    self._set_main_param(prm, prm.float())
        self._reset_training_state()

    def _reset_training_state(self) -> None:
        from collections import defaultdict

        for opt in self.optimizer.chained_optimizers:
            opt.optimizer.state = defaultdict(dict)
        self.scheduler.num_steps = 0
        self.scheduler.step(0)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.steps_done = 0
        self._last_grads = None

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Set the weights from an HF-layout dict (fp32 recommended). bf16: model params get the bf16 rounding,
        the fp32 main params get the values as given (so export_hf_weights returns them exactly)."""
        msd = convert.hf_to_megatron(state, self.cfg.model)
        if self.tp_size > 1:  # this rank's shards (pure slicing, convert.tp_split)
            msd = {n: convert.tp_split(n, t, self.tp_size, self.tp_rank) for n, t in msd.items()}
        with torch.no_grad():
            for n, prm in self._named_params().items():
                src = msd[n]
                if tuple(src.shape) != tuple(prm.shape):
                    raise ValueError(f"{n}: shape {tuple(src.shape)} != {tuple(prm.shape)}")
                prm.copy_(src.to(device=prm.device, dtype=prm.dtype))
                if self.bf16:
                    self._set_main_param(prm, src.to(device=prm.device, dtype=torch.float32))

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """fp32 HF-layout weights on CPU (bf16: the fp32 main params the optimizer updates). Under TP every rank
        must call it (the shards are all-gathered over the TP group)."""
        sd = {n: self._main_param(prm).detach().float().cpu().clone() for n, prm in self._named_params().items()}
        return convert.megatron_to_hf(self._tp_merged(sd), self.cfg.model)

    def _tp_merged(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-rank Megatron tensors -> full (TP=1) tensors: all-gather over the TP group, then
        ``convert.tp_merge``. Identity at TP=1."""
        if self.tp_size == 1:
            return sd
        import torch.distributed as dist

        group = self._ps.get_tensor_model_parallel_group()
        out = {}
        for n, t in sd.items():
            shards = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.all_gather(shards, t.contiguous(), group=group)
            out[n] = convert.tp_merge(n, shards)
        return out

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """fp32 HF-layout gradients used by the last step: the DDP ``main_grad`` buffers after the last
        micro-batch's backward and ``finalize_model_grads``, **before** clipping (snapshot taken right before
        ``optimizer.step()``; Megatron clips the same buffers in place afterwards)."""
        if self._last_grads is None:
            raise RuntimeError("export_hf_grads: no train_step has run yet")
        return convert.megatron_to_hf(self._tp_merged({n: g.cpu() for n, g in self._last_grads.items()}),
                                      self.cfg.model)

    def _check_batch(self, micro_batches: list[torch.Tensor]) -> None:
        t, m = self.cfg.train, self.cfg.model
        if not micro_batches:
            raise ValueError("need at least one micro-batch")
        want = (t.micro_batch_size, m.seq_length + 1)
        for i, mb in enumerate(micro_batches):
            if not isinstance(mb, torch.Tensor) or tuple(mb.shape) != want or mb.dtype != torch.int64:
                got = (tuple(mb.shape), mb.dtype) if isinstance(mb, torch.Tensor) else type(mb)
                raise ValueError(f"micro-batch {i}: expected int64 {list(want)}, got {got}")

    def _forward_step_func(self, per_token_out: list, loss_out: list):
        """Megatron-LM style forward_step(data_iterator, model) -> (output, loss_func)."""

        def forward_step(data_iterator: Iterator[torch.Tensor], model):
            mb = next(data_iterator).to(self.device, non_blocking=False)
            tokens = mb[:, :-1].contiguous()  # [b, s]
            labels = mb[:, 1:].contiguous()  # [b, s]
            output = model(tokens, self._position_ids, self._mask, labels=labels)  # per-token loss [b, s]

            def loss_func(output_tensor: torch.Tensor):
                per_token = output_tensor.float()  # [b, s]
                loss = per_token.mean()  # micro-batch loss: token mean in [b, s] order
                per_token_out.append(per_token.detach().clone())
                loss_out.append(loss.detach().clone())
                # 2-tuple = Megatron's legacy averaging: the schedule divides this by num_microbatches.
                return loss, {"lm loss": loss.detach().clone()}

            return output, loss_func

        return forward_step

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._check_batch(micro_batches)
        t, m = self.cfg.train, self.cfg.model
        n_micro = len(micro_batches)
        self.model.train()
        # Megatron-LM train_step: zero the DDP grad buffers and the optimizer's grads.
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        per_token: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        forward_backward = get_forward_backward_func()
        with moe.moe_stats(self.gpt, self.cfg.model, n_micro) as extra:
            forward_backward(forward_step_func=self._forward_step_func(per_token, losses),
                             data_iterator=iter(micro_batches), model=[self.model], num_microbatches=n_micro,
                             seq_length=m.seq_length, micro_batch_size=t.micro_batch_size, forward_only=False)
        # finalize_model_grads (DP all-reduce; identity for DP=1) ran inside the schedule.

        # Pre-clip snapshot of the accumulated fp32 grads (Megatron clips main_grad in place in step()).
        # (under TP each rank keeps its shards; export_hf_grads all-gathers them)
        self._last_grads = {n: prm.main_grad.detach().float().clone() for n, prm in self._named_params().items()}
        lr = get_canonical_lr_for_logging(self.optimizer.param_groups)  # the lr this update applies
        update_successful, grad_norm, _ = self.optimizer.step()
        if not update_successful:
            raise FloatingPointError("Megatron optimizer skipped the update (non-finite gradients)")
        self.scheduler.step(increment=1)
        self.steps_done += 1

        loss = torch.stack(losses).mean()  # Megatron-LM training_log: mean over micro-batch losses
        return StepResult(loss=float(loss.item()), grad_norm=float(grad_norm), lr=float(lr),
                          per_token_loss=torch.stack(per_token).float().cpu(), extra=extra or None)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        """Mean over micro-batches of each micro-batch's per-token mean loss (no grad, model in eval mode)."""
        self._check_batch(micro_batches)
        with eval_mode(self.model):
            losses = []
            for mb in micro_batches:
                mb = mb.to(self.device)
                out = self.model(mb[:, :-1].contiguous(), self._position_ids, self._mask,
                                 labels=mb[:, 1:].contiguous())
                losses.append(out.float().mean())
        return float(torch.stack(losses).mean().item())

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[b, s, vocab]`` for int64 tokens ``[b, s]`` (s <= seq_length). Raises ValueError."""
        check_tokens(tokens, self.cfg.model.seq_length)
        s = tokens.shape[1]
        tokens = tokens.to(self.device, dtype=torch.long)
        pos = torch.arange(s, dtype=torch.long, device=self.device).unsqueeze(0)
        with eval_mode(self.model):
            out = self.model(tokens, pos, causal_mask(s, self.device))  # [b, s, V/tp]
        if self.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            out = gather_from_tensor_model_parallel_region(out)
        return out.float()

    def module_probes(self) -> dict[str, torch.nn.Module]:
        g = self.gpt
        probes: dict[str, torch.nn.Module] = {"embedding": g.embedding}
        for i, layer in enumerate(g.decoder.layers):
            probes[f"layers.{i}.input_norm"] = layer.input_layernorm
            probes[f"layers.{i}.self_attention"] = layer.self_attention
            probes[f"layers.{i}.pre_mlp_norm"] = layer.pre_mlp_layernorm
            probes[f"layers.{i}.mlp"] = layer.mlp
        probes["final_norm"] = g.decoder.final_layernorm
        probes["output_layer"] = g.output_layer
        return {n: probes[n] for n in forward_names(self.cfg.model.num_layers)}

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Plain nested dict of tensors and Python scalars (torch.distributed.checkpoint-friendly).

        ``model``: Megatron param name -> model param (fp32, or bf16 under bf16); ``main_params``: name -> fp32
        main param (bf16 only); ``optimizer``: name -> {exp_avg, exp_avg_sq, step} (zeros / step 0 before the
        first update, which torch's AdamW treats exactly like fresh state); ``scheduler``: Megatron's scheduler
        state dict; ``step``: optimizer steps done. Under TP every tensor is the full (TP=1) one, all-gathered
        over the TP group (every rank must call this), so the layout does not depend on the TP size.
        """
        sd: dict = {"step": int(self.steps_done), "scheduler": dict(self.scheduler.state_dict())}
        if self.ddp_config.use_distributed_optimizer:
            return self._distributed_optimizer_state_dict(sd)
        sd["model"] = self._tp_merged({n: prm.detach().clone() for n, prm in self._named_params().items()})
        if self.bf16:
            sd["main_params"] = self._tp_merged({n: prm.main_param.detach().clone()
                                                 for n, prm in self._named_params().items()})
        opt_state = {}
        torch_opt = self.optimizer.chained_optimizers[0].optimizer
        for n, q in self._optimizer_params():
            st = torch_opt.state.get(q, {})
            if st:
                opt_state[n] = {"exp_avg": st["exp_avg"].detach().clone(),
                                "exp_avg_sq": st["exp_avg_sq"].detach().clone(),
                                "step": st["step"].detach().clone()}
            else:
                opt_state[n] = {"exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q),
                                "step": torch.tensor(0.0, dtype=torch.float32)}
        if self.tp_size > 1:
            for key in ("exp_avg", "exp_avg_sq"):
                full = self._tp_merged({n: st[key] for n, st in opt_state.items()})
                for n in opt_state:
                    opt_state[n][key] = full[n]
        sd["optimizer"] = opt_state
        return sd

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` through Megatron's own optimizer / scheduler ``load_state_dict``."""
        if self.ddp_config.use_distributed_optimizer:
            self._load_distributed_optimizer_state_dict(state)
            return

        def local(n: str, t: torch.Tensor) -> torch.Tensor:  # this TP rank's shard of a full tensor
            return convert.tp_split(n, t, self.tp_size, self.tp_rank) if self.tp_size > 1 else t

        with torch.no_grad():
            for n, prm in self._named_params().items():
                prm.copy_(local(n, state["model"][n]).to(device=prm.device, dtype=prm.dtype))
        inner = self.optimizer.chained_optimizers[0]
        torch_sd = inner.optimizer.state_dict()  # live param_groups (index lists, hyper-parameters)
        torch_sd["state"] = {}
        for idx, (n, q) in enumerate(self._optimizer_params()):
            st = state["optimizer"][n]
            torch_sd["state"][idx] = {"step": st["step"].detach().clone().to(torch.float32).cpu(),
                                      "exp_avg": local(n, st["exp_avg"]).to(q.device, q.dtype).clone(),
                                      "exp_avg_sq": local(n, st["exp_avg_sq"]).to(q.device, q.dtype).clone()}
        if self.bf16:
            groups = [[local(self._names[id(prm)], state["main_params"][self._names[id(prm)]]).to(
                prm.device, torch.float32) for prm in group] for group in inner.float16_groups]
            self.optimizer.load_state_dict({"optimizer": torch_sd, "fp32_from_fp16_params": groups})
        else:
            self.optimizer.load_state_dict(torch_sd)
        self._finish_load(state)

    def _finish_load(self, state: dict) -> None:
        # Megatron's scheduler.load_state_dict *adds* num_steps to the current count: start from 0.
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(dict(state["scheduler"]))
        self.steps_done = int(state["step"])
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._last_grads = None

    # ------------------------------------------------------------------ distributed optimizer (ZeRO-1) state
    def _shard_ranges(self) -> dict[str, tuple[torch.Tensor, object]]:
        """name -> (the shard tensor the torch optimizer steps, its Range in the flattened param) for every
        param that has elements on this DP rank (Megatron's ``_get_model_param_range_map(...)["param"]``)."""
        if self.tp_size != 1:
            raise NotImplementedError("distributed-optimizer state dicts are implemented for TP=1 only")
        inner = self.optimizer.chained_optimizers[0]
        named = self._named_params()
        return {n: (q, inner._get_model_param_range_map(named[n])["param"]) for n, q in self._optimizer_params()}

    def _distributed_optimizer_state_dict(self, sd: dict) -> dict:
        """The same DP-independent layout as the plain optimizer's: each rank writes its shard of every Adam
        moment (and bf16 main param) into a zero full-size tensor, and a SUM all-reduce over the DP group
        assembles them (disjoint ranges: adding zeros is exact). A collective: every rank must call it."""
        import torch.distributed as dist

        group = self._ps.get_data_parallel_group()
        torch_opt = self.optimizer.chained_optimizers[0].optimizer
        shards = self._shard_ranges()
        step = torch.zeros(1, dtype=torch.float32)
        opt_state, mains = {}, {}
        for n, prm in self._named_params().items():
            full = {k: torch.zeros(prm.numel(), dtype=torch.float32, device=prm.device)
                    for k in ("exp_avg", "exp_avg_sq", "main")}
            if n in shards:
                q, r = shards[n]
                st = torch_opt.state.get(q, {})
                if st:
                    full["exp_avg"][r.start:r.end] = st["exp_avg"]
                    full["exp_avg_sq"][r.start:r.end] = st["exp_avg_sq"]
                    step = torch.maximum(step, st["step"].detach().float().reshape(1).cpu())
                if self.bf16:
                    full["main"][r.start:r.end] = prm.main_param.detach()
            for k in ("exp_avg", "exp_avg_sq") + (("main",) if self.bf16 else ()):
                dist.all_reduce(full[k], op=dist.ReduceOp.SUM, group=group)
            opt_state[n] = {"exp_avg": full["exp_avg"].view(prm.shape), "exp_avg_sq": full["exp_avg_sq"].view(prm.shape)}
            if self.bf16:
                mains[n] = full["main"].view(prm.shape)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=group)
        for st in opt_state.values():
            st["step"] = step[0].clone()
        sd["model"] = {n: prm.detach().clone() for n, prm in self._named_params().items()}
        if self.bf16:
            sd["main_params"] = mains
        sd["optimizer"] = opt_state
        return sd

    def _load_distributed_optimizer_state_dict(self, state: dict) -> None:
        """Restore the layout above: full model params, then this rank's slice of each moment and main param
        into the torch optimizer state of its shard (no communication)."""
        torch_opt = self.optimizer.chained_optimizers[0].optimizer
        named = self._named_params()
        with torch.no_grad():
            for n, prm in named.items():
                prm.copy_(state["model"][n].to(device=prm.device, dtype=prm.dtype))
            for n, (q, r) in self._shard_ranges().items():
                st = state["optimizer"][n]
                torch_opt.state[q] = {
                    "step": st["step"].detach().clone().to(torch.float32).cpu(),
                    "exp_avg": st["exp_avg"].reshape(-1)[r.start:r.end].to(q.device, q.dtype).clone(),
                    "exp_avg_sq": st["exp_avg_sq"].reshape(-1)[r.start:r.end].to(q.device, q.dtype).clone()}
                if self.bf16:
                    named[n].main_param.copy_(state["main_params"][n].reshape(-1)[r.start:r.end])
        self._finish_load(state)
