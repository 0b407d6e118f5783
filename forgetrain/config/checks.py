"""The one up-front check of a composed config (:func:`validate`), before any work: each group's values, the
layout against the world size, what the engine implements, the memory the run needs (``forgetrain.memory.check``)
and the kernel switches (``forgetrain.kernels.switches.check``). Raises ConfigError with a one-line, actionable
message."""

from __future__ import annotations

import dataclasses
import math
import os

from forgetrain.config.schema import SEED_MAX, DataConfig, RunConfig
from forgetrain.errors import ConfigError


def validate(cfg: RunConfig, world_size: int = 1, engine_cls=None, reference: bool = False,
             template: bool = False) -> RunConfig:
    """Check the whole config once, before any work. Raises ConfigError with a one-line, actionable message.

    ``engine_cls``: the engine that will run (default: the scenario's); its spec's ``kernel_switches`` say which
    ``kernels.*`` switches it honours (:func:`forgetrain.kernels.switches.check`). ``reference``: a reference
    engine runs this config (verify's other side); it ignores ``kernels.*``, so the switches are not checked for
    it (the candidate's run of the same config checks them), and ``engine_cls``, when given, is that reference.
    ``template``: ``engine_cls`` (or the scenario's engine) is the forge's seed, which the agent adapts: the model
    features it does not implement yet are its task (the brief names them), not a refusal."""
    from forgetrain import registry
    from forgetrain.kernels import switches

    _check_scenario(cfg)
    _check_model_and_train(cfg)
    _check_data(cfg.data)
    _check_parallel(cfg, world_size)
    _check_hardware(cfg)
    _check_kernel_values(cfg)
    _check_engine_options(cfg, reference)
    _check_logger(cfg)
    if reference and engine_cls is not None:
        _check_model_features(cfg, engine_cls)
    engine_cls = engine_cls or registry.resolve_engine(cfg.scenario.engine)
    if not reference and not template:
        _check_model_features(cfg, engine_cls)
    _check_engine_implements(cfg, engine_cls, reference)
    from forgetrain import memory

    # before the kernel switches: a model that cannot fit this machine is the first thing to learn (one error, not
    # a switch fix and then the refusal); still before any engine is built
    memory.check(cfg)
    if not reference and cfg.engine.compile and cfg.hardware.device == "cpu":
        tri = [f"kernels.{x.name}=triton" for x in switches.SWITCHES
               if x.in_layers and getattr(cfg.kernels, x.name, None) == "triton"]
        if tri:
            raise ConfigError(f"engine.compile=true cannot run Triton kernels on CPU ({', '.join(tri)}: Triton's CPU "
                              "interpreter does not run inside torch.compile); set engine.compile=false, or those "
                              "kernels to torch")
    if not reference:
        switches.check(cfg.kernels, engine_cls, f"{engine_cls.__module__}:{engine_cls.__qualname__}",
                       cfg.engine.mode, cfg.hardware.device)
    return cfg


def _check_scenario(cfg: RunConfig) -> None:
    """The scenario is known and its engine string names an engine class."""
    from forgetrain import registry

    known = registry.scenarios()
    if cfg.scenario.name not in known:
        raise ConfigError(f"unknown scenario '{cfg.scenario.name}'; known scenarios: {', '.join(sorted(known))}")
    registry.resolve_engine(cfg.scenario.engine)


def _check_model_and_train(cfg: RunConfig) -> None:
    """``model.*`` and ``train.*``: finite numbers first (NaN / inf pass every ordering test), then the shape and the schedule."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for group, obj in (("model", m), ("train", t)):  # NaN / inf pass every ordering test below: reject them first
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{group}.{f.name} must be a finite number, got {v}")
    if not m.init_method_std > 0:
        raise ConfigError(f"model.init_method_std must be positive, got {m.init_method_std}")
    if not 0 <= t.seed <= SEED_MAX:
        raise ConfigError(f"train.seed must lie in [0, {SEED_MAX}] (numpy's and Megatron's seeding), got {t.seed}")
    for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                 "ffn_hidden_size", "seq_length"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name} must be positive, got {getattr(m, name)}")
    if m.kv_channels is not None and m.kv_channels <= 0:
        raise ConfigError(f"model.kv_channels must be positive or null (hidden_size // num_attention_heads), "
                          f"got {m.kv_channels}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} does not divide model.hidden_size={m.hidden_size} "
            f"(or set model.kv_channels, the head dim)")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"model.num_query_groups={m.num_query_groups} does not divide "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"head dim {m.head_dim} must be even for RoPE")
    _check_moe(m)
    if m.norm_epsilon <= 0 or m.rotary_base <= 0:
        raise ConfigError("model.norm_epsilon and model.rotary_base must be positive")
    for name in ("micro_batch_size", "global_batch_size", "steps"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
    dp = p.data_parallel_size
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x DP = {t.micro_batch_size} x {dp} = {t.micro_batch_size * dp}")
    if t.precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision must be fp32 or bf16, got '{t.precision}'")
    if t.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"train.lr_decay_style must be cosine|linear|constant, got '{t.lr_decay_style}'")
    if not (0 <= t.min_lr <= t.lr) or not math.isfinite(t.lr):
        raise ConfigError(f"need 0 <= train.min_lr <= train.lr, got min_lr={t.min_lr} lr={t.lr}")
    if t.lr_decay_steps is not None and t.lr_decay_steps <= 0:
        raise ConfigError(f"train.lr_decay_steps must be positive or null (= train.steps), got {t.lr_decay_steps}")
    decay_steps = t.lr_decay_steps or t.steps
    if t.lr_warmup_steps < 0 or t.lr_warmup_steps >= decay_steps:
        raise ConfigError(f"train.lr_warmup_steps={t.lr_warmup_steps} must lie in [0, {decay_steps}) "
                          f"(train.lr_decay_steps, default train.steps; Megatron requires warmup < decay): set "
                          f"train.lr_warmup_steps={max(0, decay_steps - 1) if t.lr_warmup_steps >= 0 else 0}"
                          f"{' or fewer, or raise train.steps' if t.lr_warmup_steps >= 0 else ''}")
    if t.clip_grad < 0 or t.weight_decay < 0:
        raise ConfigError("train.clip_grad and train.weight_decay must be >= 0")
    if not (0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1) or not t.adam_eps > 0:
        raise ConfigError(f"need 0 <= train.adam_beta1, train.adam_beta2 < 1 and train.adam_eps > 0, got "
                          f"{t.adam_beta1}, {t.adam_beta2}, {t.adam_eps}")
    if t.log_interval <= 0:
        raise ConfigError(f"train.log_interval must be positive, got {t.log_interval}")
    for name in ("eval_interval", "save_interval", "sample_tokens"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name} must be >= 0 (0 switches it off), got {getattr(t, name)}")
    if t.eval_interval and t.eval_iters <= 0:
        raise ConfigError(f"train.eval_iters must be positive when train.eval_interval > 0, got {t.eval_iters}")
    if t.threads is not None and t.threads <= 0:
        raise ConfigError(f"train.threads must be positive or null (torch's default), got {t.threads}")
    if t.stop_after is not None and not (0 < t.stop_after <= t.steps):
        raise ConfigError(f"train.stop_after must lie in [1, train.steps={t.steps}] or be null, got {t.stop_after}")
    if t.init_weights is not None and not os.path.isfile(os.path.expanduser(t.init_weights)):
        raise ConfigError(f"train.init_weights={t.init_weights} is not a file (an HF-layout safetensors file)")
    if t.stop_after is not None and not t.save:
        raise ConfigError("train.stop_after checkpoints the run to be resumed: it needs train.save=true")


def _check_data(d: DataConfig) -> None:
    """``data.*``: an indexed dataset and a tokenizer that exist, a validation fraction in [0, 1)."""
    if d.path is not None:
        import os

        missing = [x for x in (d.path + ".bin", d.path + ".idx") if not os.path.isfile(x)]
        if missing:
            raise ConfigError(f"data path '{d.path}' not found: expected {d.path}.bin and {d.path}.idx")
    if d.tokenizer is not None:
        import os

        from forgetrain.data.tokenizer import backend_for
        from forgetrain.errors import DataError

        try:  # exists and is of a known format (by its first bytes); prepare parses it and checks its EOD
            backend_for(os.path.expanduser(d.tokenizer))
        except DataError as e:
            raise ConfigError(str(e)) from None
    if not (0.0 <= d.valid_fraction < 1.0):
        raise ConfigError(f"data.valid_fraction must lie in [0, 1), got {d.valid_fraction}")


def _check_parallel(cfg: RunConfig, world_size: int) -> None:
    """``parallel.*``: the layout matches the world size and the model; the ZeRO stage, loss report, buckets, timeout and backend are known."""
    m, p = cfg.model, cfg.parallel
    sizes = p.data_parallel_size * p.tensor_parallel_size * p.pipeline_parallel_size * p.context_parallel_size
    if sizes != world_size:
        raise ConfigError(
            f"parallel layout DP{p.data_parallel_size} x TP{p.tensor_parallel_size} x "
            f"PP{p.pipeline_parallel_size} x CP{p.context_parallel_size} = {sizes} does not match the world "
            f"size {world_size}; launch with torchrun --nproc-per-node {sizes} or change parallel.*")
    if p.tensor_parallel_size > 1 and (m.num_query_groups % p.tensor_parallel_size
                                       or m.ffn_hidden_size % p.tensor_parallel_size
                                       or m.vocab_size % p.tensor_parallel_size):
        raise ConfigError(f"TP={p.tensor_parallel_size} must divide model.num_query_groups, "
                          f"model.ffn_hidden_size and model.vocab_size")
    if p.zero_stage not in (0, 1, 3):
        raise ConfigError(f"parallel.zero_stage must be 0 (DDP), 1 (distributed optimizer) or 3 (FSDP2), "
                          f"got {p.zero_stage}")
    if p.report_loss not in ("local", "dp_mean"):
        raise ConfigError(f"parallel.report_loss must be local or dp_mean, got '{p.report_loss}'")
    if p.bucket_size is not None and p.bucket_size <= 0:
        raise ConfigError(f"parallel.bucket_size must be positive or null, got {p.bucket_size}")
    if p.zero_stage == 3 and p.tensor_parallel_size != 1:
        raise ConfigError("parallel.zero_stage=3 (FSDP2) is implemented with TP=1 only; set "
                          "parallel.tensor_parallel_size=1")
    if p.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive, got {p.timeout_s}")
    if p.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"parallel.backend must be auto|gloo|nccl, got '{p.backend}'")
    if p.backend == "nccl" and cfg.hardware.device != "cuda":
        raise ConfigError("parallel.backend=nccl needs hardware.device=cuda; use auto or gloo on CPU")
    if p.pipeline_parallel_size > 1 or p.context_parallel_size > 1:
        raise ConfigError("PP and CP are not supported by the forged engines yet; set them to 1")


def _check_hardware(cfg: RunConfig) -> None:
    """``hardware.*``: a positive peak (or null) and a device that is there."""
    peak = cfg.hardware.peak_tflops
    if peak is not None and not (math.isfinite(peak) and peak > 0):
        raise ConfigError(f"hardware.peak_tflops must be a positive number of TFLOP/s or null (measured on CPU), "
                          f"got {peak}")
    if cfg.hardware.device not in ("cpu", "cuda"):
        raise ConfigError(f"hardware.device must be cpu or cuda, got '{cfg.hardware.device}'")
    if cfg.hardware.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("hardware.device=cuda but no CUDA device is visible; use hardware=cpu")


def _check_kernel_values(cfg: RunConfig) -> None:
    """``kernels.*``: each switch's value is one it knows, and one that switches a part of another switch's path has that path."""
    from forgetrain.kernels import switches

    for sw in switches.SWITCHES:
        if getattr(cfg.kernels, sw.name) not in sw.names:
            raise ConfigError(f"kernels.{sw.name} must be one of {'|'.join(sw.names)}, "
                              f"got '{getattr(cfg.kernels, sw.name)}'")
    for sw in switches.SWITCHES:  # a value that switches a part of another switch's value needs that value
        val = getattr(cfg.kernels, sw.name)
        for other, want in sw.required(val).items():
            if getattr(cfg.kernels, other) != want:
                raise ConfigError(f"kernels.{sw.name}={val} needs kernels.{other}={want} (it replaces a part of "
                                  f"that path), got kernels.{other}={getattr(cfg.kernels, other)}; set "
                                  f"kernels.{other}={want} or kernels.{sw.name}={sw.default}")


def _check_engine_options(cfg: RunConfig, reference: bool) -> None:
    """``engine.*``: lever by lever in table order, its value one the lever allows, then its rule; then each lever
    table's own check (``<engine package>/levers.py``; ``reference``: a reference runs the config, which ignores the
    forged engine's layout levers). The rules hold whichever engine runs: the group is shared by every engine."""
    from forgetrain import levers, registry

    specs = registry.lever_specs()
    table = levers.merge(specs)
    for lv in table:
        msg = levers.value_error(lv, getattr(cfg.engine, lv.name))
        if not msg and lv.rule is not None:
            msg = lv.rule(cfg, reference)
        if msg:
            raise ConfigError(msg)
    for spec in specs:
        if spec.check is not None:
            spec.check(cfg, reference)


def _check_moe(m) -> None:
    """The mixture-of-experts fields (``model.num_experts`` and ``model.moe_*``): a dense model sets none of the
    ``moe_*`` fields away from its default; an MoE one has at least one expert, 1 <= top-k <= experts, a positive
    expert width, a non-negative aux-loss weight, Megatron's ``aux_loss`` (or ``none``) balancing with softmax
    scores, and no capacity factor (dropless: the only routing implemented)."""
    from forgetrain.config.schema import ModelConfig
    from forgetrain.levers import MOE_FIELDS

    if m.num_experts is None:
        off = [f"model.{k}={getattr(m, k)}" for k in MOE_FIELDS if getattr(m, k) != getattr(ModelConfig, k)]
        if off:
            raise ConfigError(f"{', '.join(off)} needs model.num_experts (null: a dense model); set "
                              f"model.num_experts or drop the moe_* override")
        return
    if m.num_experts <= 0:
        raise ConfigError(f"model.num_experts must be positive or null (dense), got {m.num_experts}")
    if not 1 <= m.moe_router_topk <= m.num_experts:
        raise ConfigError(f"model.moe_router_topk must lie in [1, model.num_experts={m.num_experts}], "
                          f"got {m.moe_router_topk}")
    if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size <= 0:
        raise ConfigError(f"model.moe_ffn_hidden_size must be positive or null (= model.ffn_hidden_size), "
                          f"got {m.moe_ffn_hidden_size}")
    if m.moe_aux_loss_coeff < 0:
        raise ConfigError(f"model.moe_aux_loss_coeff must be >= 0, got {m.moe_aux_loss_coeff}")
    if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
        raise ConfigError(f"model.moe_router_load_balancing_type must be aux_loss|none, got "
                          f"'{m.moe_router_load_balancing_type}'")
    if m.moe_router_score_function != "softmax":
        raise ConfigError(f"model.moe_router_score_function must be softmax (the one implemented), got "
                          f"'{m.moe_router_score_function}'")
    if m.moe_expert_capacity_factor is not None:
        raise ConfigError(f"model.moe_expert_capacity_factor must be null: only dropless routing is implemented, "
                          f"got {m.moe_expert_capacity_factor}")


def _check_logger(cfg: RunConfig) -> None:
    """``logger.*``: none or wandb, in one of W&B's modes."""
    if cfg.logger.name not in ("none", "wandb"):
        raise ConfigError(f"logger must be none or wandb, got '{cfg.logger.name}'")
    if cfg.logger.mode not in ("offline", "online", "disabled"):
        raise ConfigError(f"logger.mode must be offline|online|disabled (W&B's modes), got '{cfg.logger.mode}'")


def _check_model_features(cfg: RunConfig, engine_cls) -> None:
    """The model features beyond Llama that ``cfg.model`` sets (:data:`forgetrain.levers.MODEL_FEATURES`) are ones
    the engine's spec declares it implements; an engine that lacks one would run another model."""
    from forgetrain.levers import missing_features, spec_of

    missing = missing_features(cfg.model, spec_of(engine_cls))
    if missing:
        raise ConfigError(f"{', '.join(missing)} is not implemented by engine {engine_cls.__module__}:"
                          f"{engine_cls.__qualname__} (model {cfg.model.name}); choose an engine that implements it "
                          f"(the Qwen3 scenarios: conf/scenario/qwen3_*.yaml; MoE: qwen3_moe_*)")


def _check_engine_implements(cfg: RunConfig, engine_cls, reference: bool) -> None:
    """What the engine's spec declares it implements (:func:`forgetrain.levers.spec_of`: its modes, recompute, a
    block of recomputed layers, the optimizer offload) covers the settings it is asked to run."""
    from forgetrain.levers import spec_of

    spec = spec_of(engine_cls)
    off = cfg.engine.optimizer_offload_fraction
    modes = spec.modes  # an engine that declares its modes; None: not checked
    if not reference and modes is not None and cfg.engine.mode not in modes:
        raise ConfigError(f"engine.mode={cfg.engine.mode} is not implemented by engine "
                          f"{engine_cls.__module__}:{engine_cls.__qualname__} (it "
                          f"runs: {'|'.join(modes)}); "
                          + ("drop mode=fast_base / engine.mode=fast" if cfg.engine.mode == "fast"
                             else f"set engine.mode={modes[0]}"))
    if not reference and cfg.engine.recompute != "none" and not spec.recompute:
        raise ConfigError(f"engine.recompute={cfg.engine.recompute} is not implemented by engine "
                          f"{cfg.scenario.engine}; set engine.recompute=none")
    if not reference and cfg.engine.recompute_num_layers is not None and not spec.recompute_num_layers:
        raise ConfigError(f"engine.recompute_num_layers is not implemented by engine {cfg.scenario.engine}; "
                          f"set it to null (every layer)")
    if not reference and off > 0 and not spec.optimizer_offload:
        raise ConfigError(f"engine.optimizer_offload_fraction is not implemented by engine {cfg.scenario.engine}; "
                          f"set it to 0")
