"""A reference trainer built on DeepSpeed (ZeRO stage 1 or 2) and HF transformers' ``LlamaForCausalLM``.

Everything numeric is the two frameworks' own code, used the way their documentation shows:

* the model is ``transformers.LlamaForCausalLM`` built from ``cfg.model`` (eager attention, untied embeddings, no
  biases), its loss is HF's own ``ForCausalLMLoss`` (``model.loss_function``, a token mean of
  ``F.cross_entropy`` on fp32 logits);
* ``deepspeed.initialize`` wraps it with ZeRO ``cfg.parallel.zero_stage`` (1, the default, or 2), bf16 when
  ``train.precision=bf16``, ``gradient_accumulation_steps``, ``gradient_clipping`` and DeepSpeed's ``AdamW``
  optimizer config with ``torch_adam: true`` (``torch.optim.AdamW``, the implementation the Megatron reference
  falls back to as well);
* each micro-batch runs ``engine(...)`` -> loss -> ``engine.backward(loss)`` -> ``engine.step()``; DeepSpeed divides
  the loss by the accumulation steps, accumulates, and steps the optimizer (norm, clip, AdamW) at the boundary.

The one piece written here is the learning-rate scheduler (:class:`MegatronLR`): DeepSpeed's ``WarmupCosineLR``
has different warmup semantics (README.md, "Learning rate"), so a client scheduler that applies
``forgetrain.schedule.lr_for_step`` is passed to ``deepspeed.initialize``; DeepSpeed calls its ``step()`` after
every applied optimizer step, as it does for its own schedulers.

Shapes: a micro-batch is ``[b, s+1]`` int64; the model sees ``input_ids [b, s]`` and predicts ``labels [b, s]``;
activations are batch-first ``[b, s, h]`` (HF), unlike Megatron's and the forged engines' ``[s, b, h]``.

**The run config's memory layout** is mapped onto DeepSpeed's and HF's own mechanisms, as the torch_compile and
torchtitan sides map ``engine.recompute`` onto theirs:

* ``engine.recompute=full``: HF activation checkpointing of every decoder layer
  (``activation_checkpointing_enable`` with ``use_reentrant=False``; ``gradient_checkpointing_enable`` on older
  transformers). Each layer keeps its input and runs its forward again in the backward: the same ops on the same
  inputs, so on CPU losses, grads and weights are bitwise those of ``recompute=none``. ``recompute_num_layers`` is
  not mapped (HF checkpoints every layer; the bench prints a warning).
* ``engine.optimizer_offload_fraction > 0``: **ZeRO-Offload** (README.md, "Memory layout"), DeepSpeed's documented
  setup: ZeRO stage 2 with
  ``offload_optimizer: {device: cpu, pin_memory: true}`` and DeepSpeed's ``DeepSpeedCPUAdam`` (the ``cpu_adam`` C++
  op, JIT-compiled with ninja and the C++ compiler on first use, then cached under ``TORCH_EXTENSIONS_DIR``) in
  AdamW mode, with the same betas, eps, weight decay and param groups. ZeRO-Offload is all-or-nothing (the fp32
  master weights, fp32 grads and both moments of every parameter live on the host and CPU Adam updates them
  there), so **any** fraction > 0 means "offload the optimizer"; the forged engine's fraction (the share of moments
  it streams) has no counterpart. ``parallel.zero_stage`` is not consulted then: ZeRO-Offload runs stage 2. CPU
  Adam is DeepSpeed's own AdamW arithmetic (vectorised C++), not torch's: the same update up to rounding
  (tests/test_deepspeed_offload.py measures it). Its host-memory need (:func:`zero_offload_host_parts`) is checked
  before anything is built; a machine that cannot hold it gets :class:`forgetrain.errors.CannotRunHere` (one line,
  which the bench prints as ``deepspeed: cannot run here: ...``).

**Bench side** (``Engine(cfg, device, bench_side=True)``: what ``forgetrain.bench.make_side`` builds, since the
class's spec declares ``bench_side``): the strongest general configuration a DeepSpeed user runs, timed without
the harness's measurement aids: HF's SDPA attention (``attn_implementation="sdpa"``: flash / cuDNN / memory-efficient kernels on
a GPU) instead of the eager form; no pre-clip gradient snapshot (``export_hf_grads`` raises) and no per-token
losses (``StepResult.per_token_loss`` is None). The choice lives in the bench (which knows it is timing) and is
defined here (which knows what DeepSpeed's fast form is), not in ``engine.mode``: that is the forged engine's
switch, and a ``verify`` of a fast forged config must still meet this reference's eager, snapshotting form (the
equivalence harness never passes ``bench_side``, so its behaviour is unchanged).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from forgetrain.config import RunConfig, grad_accum_steps
from forgetrain.distributed import use_device
from forgetrain.engine import StepResult, check_tokens, eval_mode, forward_names, hf_param_names
from forgetrain.levers import EngineSpec
from forgetrain.schedule import lr_for_step

GIB = 2**30


def zero_offload_host_parts(cfg: RunConfig, pinned: bool) -> dict[str, int]:
    """Host bytes that ZeRO-Offload (stage 2, ``offload_optimizer: {device: cpu, pin_memory: true}``, CPU Adam)
    keeps for ``cfg``, per part, summed over the ``parallel.data_parallel_size`` ranks of one host; ``pinned``: round
    every pinned buffer as torch's CUDA caching host allocator does (:func:`forgetrain.memory.pinned_alloc_bytes`,
    powers of two; on a CPU device DeepSpeed pins nothing).

    From DeepSpeed 0.19.8's ``deepspeed/runtime/zero/stage_1_and_2.py`` (``DeepSpeedZeroOptimizer``) and
    ``deepspeed/ops/adam/cpu_adam.py``, per rank and per param group (two here: the matrices and the norm weights;
    P = the group's elements / DP, a = 2 under bf16, 4 under fp32):

    * ``fp32_master``   4 P, pinned: ``__init__``, "A partition of the fp32 master weights" (``weights_partition``,
      ``.to(device="cpu", dtype=fp32)`` then ``get_accelerator().pin_memory``);
    * ``fp32_grads``    4 P, pinned: ``initialize_optimizer_states`` (``single_partition_of_fp32_groups[i].grad``);
    * ``adam_moments``  8 P, not pinned: ``DeepSpeedCPUAdam.step`` creates ``exp_avg`` and ``exp_avg_sq`` with
      ``torch.zeros_like`` of the fp32 partition on the CPU (fp32: ``fp32_optimizer_states`` defaults to true);
    * ``weight_copy``   a P, pinned: ``param_buffer_of_bit16_for_cpu_offload_groups``, the model-dtype copy of the
      partition that the updated weights cross to the GPU in;
    * ``grad_staging``  a x the largest parameter, pinned: ``temp_grad_buffer_for_cpu_offload``;
    * ``fp32_grad_accum`` (fp32 precision with gradient accumulation only) 4 x each parameter, pinned one by one:
      ``async_accumulate_grad_in_cpu_via_gpu``'s ``accumulated_grads_in_cpu``. Under bf16 with
      ``grad_accum_dtype=fp32`` DeepSpeed accumulates in an fp32 partition on the GPU instead
      (``_use_compact_grad_partition_buffer``), so there is none on the host.

    Under bf16 that is 18 bytes per parameter plus the staging buffer: Llama-3-8B (8.03 B parameters) 135.6 GiB
    (145.6 GB), 140.8 GiB with the CUDA rounding; the 8B proxy (4 layers, 1.92 B) 33.2 GiB, rounded 35.3 GiB. Not
    counted: the process itself, the transient pageable copy of each fp32 partition before it is pinned
    (initialisation), and whatever the caller holds (the bench keeps one fp32 copy of the initial weights, 4 bytes
    per parameter)."""
    from forgetrain.memory import pinned_alloc_bytes
    from forgetrain.metrics import param_counts, param_tensor_sizes

    m, dp = cfg.model, max(1, cfg.parallel.data_parallel_size)
    a = 2 if cfg.train.precision == "bf16" else 4
    pin = pinned_alloc_bytes if pinned else (lambda n: n)
    norms = (2 * m.num_layers + 1) * m.hidden_size
    groups = [param_counts(m)["total"] - norms, norms]  # the two param groups: matrices (decayed), norm weights
    parts = dict.fromkeys(("fp32_master", "fp32_grads", "adam_moments", "weight_copy", "grad_staging",
                           "fp32_grad_accum"), 0)
    sizes = param_tensor_sizes(m)
    for g in groups:
        p = -(-g // dp)
        parts["fp32_master"] += pin(4 * p)
        parts["fp32_grads"] += pin(4 * p)
        parts["adam_moments"] += 8 * p
        parts["weight_copy"] += pin(a * p)
    parts["grad_staging"] = pin(a * max(sizes))
    if a == 4 and grad_accum_steps(cfg) > 1:
        parts["fp32_grad_accum"] = sum(pin(4 * n) for n in sizes) // dp  # each rank: the params of its partition
    return {k: v * dp for k, v in parts.items()}


def zero_offload_refusal(cfg: RunConfig, device: torch.device) -> str | None:
    """The one-line reason ZeRO-Offload of ``cfg`` cannot run on this machine, else None: its host need
    (:func:`zero_offload_host_parts`, pinned buffers rounded on a GPU) exceeds the host's physical memory
    (``forgetrain.memory.host_memory_bytes``) less ``forgetrain.memory.HOST_RESERVE_BYTES`` for the process and the
    operating system. None when the platform does not say how much memory it has, or with
    ``train.skip_memory_check``."""
    from forgetrain import memory

    if cfg.train.skip_memory_check:
        return None
    ram = memory.host_memory_bytes()
    if ram is None:
        return None
    need = sum(zero_offload_host_parts(cfg, pinned=torch.device(device).type == "cuda").values())
    if need <= ram - memory.HOST_RESERVE_BYTES:
        return None
    bf16 = cfg.train.precision == "bf16"
    what = "fp32 master weights + fp32 grads + Adam m and v + a " + ("bf16 weight copy, 18 B/param" if bf16 else
                                                                      "fp32 weight copy, 20 B/param")
    if not bf16 and grad_accum_steps(cfg) > 1:
        what += " + 4 B/param of fp32 grad accumulation"
    rounded = ", pinned buffers rounded up to powers of two by torch" if torch.device(device).type == "cuda" else ""
    return (f"needs ~{need / GIB:.1f} GiB of host memory for ZeRO-Offload ({what}{rounded}), the machine has "
            f"{ram / GIB:.1f} GiB less a {memory.HOST_RESERVE_BYTES / GIB:.0f} GiB reserve (references/deepspeed/"
            f"engine.py has the estimate; train.skip_memory_check=true runs anyway)")


def _init_process_group(cfg: RunConfig, device: torch.device) -> None:
    """World-1 process group when none exists (a torchrun launch has already created one).

    DeepSpeed reuses an initialised torch.distributed group; it insists on ``LOCAL_RANK`` being set (its
    launchers set it), so a single process gets ``LOCAL_RANK=0`` when the variable is absent.
    """
    from forgetrain.distributed import ensure_process_group

    ensure_process_group(cfg.parallel, device)
    os.environ.setdefault("LOCAL_RANK", "0")


def _import_deepspeed(device: torch.device):
    """Import deepspeed with the accelerator matching ``device`` (``DS_ACCELERATOR`` is read once, at first use)."""
    want = "cpu" if device.type == "cpu" else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", want)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    got = get_accelerator().device_name()
    if got != want:
        raise RuntimeError(f"DeepSpeed's accelerator is '{got}' but the engine runs on {device}; set "
                           f"DS_ACCELERATOR={want} before deepspeed is first imported")
    if want == "cpu" and os.environ.get("FORGETRAIN_DS_SHM_COMM", "0") != "1":
        # DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce op (C++, ~1-2 min on first
        # use) that serves its inference all-reduce only; training collectives go through torch.distributed
        # (gloo) either way. Marking the op incompatible (DeepSpeed keeps this dict editable) skips the build.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed logs its config, memory use and timers at INFO on every engine; keep the harness's output readable.
    logging.getLogger("DeepSpeed").setLevel(int(os.environ.get("FORGETRAIN_DS_LOG_LEVEL", logging.WARNING)))
    return deepspeed


class MegatronLR:
    """DeepSpeed client LR scheduler with Megatron's ``OptimizerParamScheduler`` semantics (iteration units).

    ``num_steps`` counts applied optimizer steps; the groups always hold ``lr_for_step(train, num_steps)``, so
    update k (1-based) applies ``lr_at(k - 1)`` -- 0.0 for the first update under warmup, as in Megatron-LM.
    DeepSpeed calls :meth:`step` after each applied (non-skipped) optimizer step.
    """

    def __init__(self, optimizer, train_cfg):
        self.optimizer, self.train_cfg, self.num_steps = optimizer, train_cfg, 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_for_step(self.train_cfg, self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(self, increment: int = 1) -> None:
        self.num_steps += int(increment) if isinstance(increment, int) and increment > 0 else 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


def hf_llama_config(model_cfg, *, attn_implementation: str = "eager"):
    """``transformers.LlamaConfig`` for a :class:`forgetrain.config.ModelConfig` (untied, no biases, SiLU)."""
    from transformers import LlamaConfig

    m = model_cfg
    return LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, head_dim=m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon, rope_theta=m.rotary_base,
        hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        tie_word_embeddings=False, initializer_range=m.init_method_std, use_cache=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, attn_implementation=attn_implementation)


class Engine:
    """DeepSpeed + HF-Llama reference engine; implements :class:`forgetrain.engine.TrainEngine`.

    Attributes: ``ds`` (the ``DeepSpeedEngine``), ``model`` (the ``LlamaForCausalLM`` it trains), ``scheduler``
    (:class:`MegatronLR`), ``zero_stage``, ``offload`` (ZeRO-Offload with CPU Adam), ``recompute`` (HF activation
    checkpointing), ``attention`` ("eager", or "sdpa" as a bench side), ``bench_side``, ``steps_done``.
    """

    extra = ("deepspeed", ("deepspeed", "transformers"))  # the optional install it needs (forgetrain.extras)
    bench_label = "DeepSpeed 0.19.8 with the HF Llama, bf16 + fp32 masters"
    spec = EngineSpec(
        recompute=True,  # engine.recompute=full: HF activation checkpointing of every layer (module doc)
        bench_side=True,  # forgetrain.bench builds it with bench_side=True: SDPA, no snapshots (module doc)
        fixed_grad_accum=True,  # gradient_accumulation_steps is fixed at build: bench.interleave=once rebuilds it
    )

    def __init__(self, cfg: RunConfig, device: torch.device, *, bench_side: bool = False):
        self.cfg = cfg
        self.device = torch.device(device)
        m, t, p, e = cfg.model, cfg.train, cfg.parallel, cfg.engine
        if t.precision not in ("fp32", "bf16"):
            raise ValueError(f"train.precision must be fp32 or bf16, got {t.precision!r}")
        if p.tensor_parallel_size != 1 or p.pipeline_parallel_size != 1 or p.context_parallel_size != 1:
            raise ValueError("the DeepSpeed reference runs data parallelism only (TP = PP = CP = 1)")
        if p.zero_stage not in (0, 1, 2):
            raise ValueError(f"the DeepSpeed reference runs ZeRO stage 1 or 2, got parallel.zero_stage={p.zero_stage}")
        if e.recompute not in ("none", "full"):
            raise ValueError(f"engine.recompute must be none|full, got {e.recompute!r}")
        self.recompute = e.recompute == "full"
        # ZeRO-Offload is all-or-nothing: any fraction of the forged engine's offload switch means "offload" here
        self.offload = (e.optimizer_offload_fraction or 0.0) > 0
        # forgetrain's zero_stage=0 means "plain DDP" (the config default, Megatron's non-distributed optimizer);
        # this reference is a ZeRO reference, and at stage 0 it runs its default, stage 1. ZeRO-Offload: stage 2.
        self.zero_stage = 2 if self.offload else (p.zero_stage or 1)
        self.bench_side = bool(bench_side)
        self.attention = "sdpa" if self.bench_side else "eager"
        self.bf16 = t.precision == "bf16"
        if self.offload:
            why = zero_offload_refusal(cfg, self.device)
            if why:  # before anything is built: the process group, deepspeed, the model
                from forgetrain.errors import CannotRunHere

                raise CannotRunHere(why)
        use_device(self.device, t.deterministic)

        _init_process_group(cfg, self.device)
        deepspeed = _import_deepspeed(self.device)
        import torch.distributed as dist

        self.dp_size = dist.get_world_size()
        self.grad_accum = grad_accum_steps(cfg)
        self.model = self._build_hf()  # seeded: deterministic in cfg.train.seed
        if self.recompute:
            self._enable_recompute()
        named = dict(self.model.named_parameters())
        self._names = hf_param_names(m.num_layers)
        if set(named) != set(self._names):
            diff = sorted(set(named) ^ set(self._names))
            raise RuntimeError(f"HF parameter names differ from the neutral layout: {diff}")
        # Megatron's (and HF Trainer's) weight-decay groups: every matrix decays, no 1-D (norm) weight does.
        groups = [{"params": [q for q in named.values() if q.dim() > 1], "weight_decay": t.weight_decay},
                  {"params": [q for q in named.values() if q.dim() <= 1], "weight_decay": 0.0}]
        self.ds, _, _, _ = deepspeed.initialize(
            model=self.model, model_parameters=groups, config=self.ds_config(),
            lr_scheduler=lambda opt: MegatronLR(opt, t))
        self.scheduler: MegatronLR = self.ds.lr_scheduler
        self._init_optimizer_state()
        self.steps_done = 0
        self._last_grads: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ construction
    def ds_config(self) -> dict:
        """The DeepSpeed config dict this engine runs (README.md, "DeepSpeed configuration")."""
        t = self.cfg.train
        adamw = {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps,
                 "weight_decay": t.weight_decay}
        zero: dict = {"stage": self.zero_stage}
        if self.offload:
            # ZeRO-Offload: without torch_adam DeepSpeed builds DeepSpeedCPUAdam (type AdamW: adamw_mode=True)
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        else:
            # torch_adam: torch.optim.AdamW (single-tensor on CPU, foreach on CUDA) instead of DeepSpeed's
            # FusedAdam op
            adamw["torch_adam"] = True
        conf = {
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": t.micro_batch_size * self.grad_accum * self.dp_size,
            "gradient_clipping": float(t.clip_grad),
            "zero_optimization": zero,
            # lr is a placeholder that MegatronLR overwrites before the first step
            "optimizer": {"type": "AdamW", "params": adamw},
            "steps_per_print": 2 ** 31 - 1,
            "wall_clock_breakdown": False,
        }
        if self.bf16:
            # bf16 params and activations, fp32 master weights; gradients accumulate in fp32 as in Megatron's
            # main_grad buffers (ZeRO-1: DeepSpeed's BF16_Optimizer; ZeRO-2: fp32 partitioned grad buffers).
            conf["bf16"] = {"enabled": True}
            conf["data_types"] = {"grad_accum_dtype": "fp32"}
        return conf

    def _build_hf(self):
        """Seed and build a fresh fp32 ``LlamaForCausalLM`` (HF's init: N(0, init_method_std), norms at 1) with
        :attr:`attention`, directly on the engine's device: on a GPU no fp32 copy of the model ever exists in host
        memory (for Llama-3-8B that would be 32 GB beside ZeRO-Offload's own host buffers); on CPU it is the same
        construction as ever. The init is seeded on the device's generator (CPU and CUDA streams differ)."""
        from transformers import LlamaForCausalLM

        torch.manual_seed(self.cfg.train.seed)
        with torch.device(self.device):
            model = LlamaForCausalLM(hf_llama_config(self.cfg.model, attn_implementation=self.attention))
        if model.config._attn_implementation != self.attention:
            raise RuntimeError(f"expected {self.attention} attention, got {model.config._attn_implementation}")
        return model.to(dtype=torch.float32)

    def _enable_recompute(self) -> None:
        """``engine.recompute=full``: HF's activation checkpointing of every decoder layer, non-reentrant (the
        default of transformers 5, and what the torch_compile side uses), passed explicitly because older
        transformers default to reentrant. Older transformers also name it ``gradient_checkpointing_enable``."""
        kw = {"use_reentrant": False}
        enable = getattr(self.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kw)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)

    @property
    def bench_info(self) -> dict:
        """What ``forgetrain.bench`` records under "engine_info": ``recompute`` ("full" when every decoder layer
        checkpoints, read from the model), ``attention``, ``optimizer`` and ``zero_stage``."""
        layers = self.model.model.layers
        on = [bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers]
        return {"recompute": "full" if all(on) else "none" if not any(on) else "partial",
                "attention": self.model.config._attn_implementation,
                "optimizer": "DeepSpeedCPUAdam (ZeRO-Offload)" if self.offload else "torch AdamW",
                "zero_stage": self.zero_stage}

    def _init_optimizer_state(self) -> None:
        """Create the optimizer's state (zeros, step 0) for every flat fp32 partition up front and let DeepSpeed
        link it to the parameters. torch's AdamW and DeepSpeedCPUAdam (which initialises exactly these when a
        state is empty: ``step`` an int 0, fp32 ``exp_avg`` / ``exp_avg_sq`` beside the partition, on the CPU under
        offload) treat such state like fresh state; having it from the start gives :meth:`state_dict` a fixed
        structure and lets :meth:`load_state_dict` restore it before any step."""
        opt = self.ds.basic_optimizer
        for group in opt.param_groups:
            for q in group["params"]:
                if not opt.state.get(q):
                    step = 0 if self.offload else torch.tensor(0.0, dtype=torch.float32)
                    opt.state[q] = {"step": step,
                                    "exp_avg": torch.zeros_like(q, memory_format=torch.preserve_format),
                                    "exp_avg_sq": torch.zeros_like(q, memory_format=torch.preserve_format)}
        link = getattr(self.ds.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is None:
            raise RuntimeError(f"unexpected DeepSpeed optimizer {type(self.ds.optimizer).__name__}")
        link()

    def _params(self) -> dict[str, torch.nn.Parameter]:
        named = dict(self.model.named_parameters())
        return {n: named[n] for n in self._names}

    # ------------------------------------------------------------------ TrainEngine
    def init_weights(self) -> None:
        """Reset to the initial state: the seeded HF init, zeroed Adam state, scheduler at step 0."""
        self.load_hf_weights({n: q.detach() for n, q in self._build_hf().named_parameters()})
        for st in self.ds.basic_optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v):
                    v.zero_()
                elif k == "step":  # DeepSpeedCPUAdam counts in a Python int
                    st[k] = 0
        self.scheduler.load_state_dict({"num_steps": 0})
        self.steps_done = 0
        self._last_grads = None

    @torch.no_grad()
    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Set the fp32 master weights (DeepSpeed's hp partitions) to ``state`` exactly and the model params to
        their cast (bf16 under bf16). Adam state is not touched. Raises KeyError / ValueError."""
        from deepspeed.utils import safe_set_full_fp32_param

        for n, prm in self._params().items():
            src = state[n]
            if tuple(src.shape) != tuple(prm.shape):
                raise ValueError(f"{n}: shape {tuple(src.shape)} != {tuple(prm.shape)}")
            src = src.to(device=prm.device, dtype=torch.float32)
            prm.data.copy_(src.to(prm.dtype))
            safe_set_full_fp32_param(prm, src)

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """fp32 HF-layout weights on CPU: the fp32 master weights DeepSpeed's optimizer updates.

        fp32: the model params themselves (after each step DeepSpeed copies the fp32 partitions into them and
        all-gathers, so they equal the master bit for bit, on every rank; no collective). bf16: the fp32 master
        partitions, gathered with ``safe_get_full_fp32_param``; at DP > 1 that is a collective, which the harness
        (rank 0 only) cannot call, so it raises NotImplementedError there, as the Megatron reference does.
        """
        if not self.bf16:
            return {n: prm.detach().float().cpu().clone() for n, prm in self._params().items()}
        if self.dp_size > 1:
            raise NotImplementedError("bf16 fp32-master export of a DP-sharded ZeRO optimizer needs a collective")
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(prm).detach().float().cpu().clone() for n, prm in self._params().items()}

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """fp32 gradients of the last step, **before clipping**: DeepSpeed's accumulated (and DP-averaged)
        gradients read with ``safe_get_full_grad`` after the last micro-batch's backward and before
        ``engine.step()`` (which norms, clips and steps in one call). Raises RuntimeError before any step."""
        if self._last_grads is None:
            raise RuntimeError("export_hf_grads: no gradient snapshot (no train_step yet, or a bench side: the copy "
                               "would distort its timing)")
        return {n: g.cpu() for n, g in self._last_grads.items()}

    def _check_batch(self, micro_batches: list[torch.Tensor]) -> None:
        t, m = self.cfg.train, self.cfg.model
        if len(micro_batches) != self.grad_accum:
            raise ValueError(f"expected {self.grad_accum} micro-batches per step (DeepSpeed's "
                             f"gradient_accumulation_steps), got {len(micro_batches)}")
        want = (t.micro_batch_size, m.seq_length + 1)
        for i, mb in enumerate(micro_batches):
            if not isinstance(mb, torch.Tensor) or tuple(mb.shape) != want or mb.dtype != torch.int64:
                got = (tuple(mb.shape), mb.dtype) if isinstance(mb, torch.Tensor) else type(mb)
                raise ValueError(f"micro-batch {i}: expected int64 {list(want)}, got {got}")

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor,
              per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """HF's causal-LM loss (token mean, fp32) and the per-token losses ``[b, s]`` (fp32, no grad; None
        without ``per_token``)."""
        v = self.cfg.model.vocab_size
        loss = self.model.loss_function(logits=logits, labels=None, vocab_size=v, shift_labels=labels)
        if not per_token:
            return loss, None
        with torch.no_grad():
            tok = F.cross_entropy(logits.detach().float().view(-1, v), labels.reshape(-1),
                                  reduction="none").view(labels.shape)
        return loss, tok

    def train_step(self, micro_batches: list[torch.Tensor]) -> StepResult:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches. As a bench side no gradient
        snapshot and no per-token losses are taken (module doc)."""
        from deepspeed.utils import safe_get_full_grad

        self._check_batch(micro_batches)
        self.ds.train()
        n = len(micro_batches)
        losses, per_token = [], []
        lr = None
        keep = not self.bench_side  # the harness's measurement aids: not in a timed step
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device)
            tokens, labels = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()  # [b, s] each
            logits = self.ds(input_ids=tokens).logits  # [b, s, V]
            loss, tok = self._loss(logits, labels, per_token=keep)
            self.ds.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
            losses.append(loss.detach().float())
            if keep:
                per_token.append(tok)
            if i == n - 1:
                # The accumulation boundary: the gradients are reduced; engine.step() norms, clips and steps.
                self._last_grads = {nm: safe_get_full_grad(prm).detach().float().clone()
                                    for nm, prm in self._params().items()} if keep else None
                lr = float(self.ds.basic_optimizer.param_groups[0]["lr"])
            self.ds.step()
        if not self.ds.was_step_applied():
            raise FloatingPointError("DeepSpeed skipped the update (non-finite gradients)")
        self.steps_done += 1
        grad_norm = self.ds.get_global_grad_norm()
        grad_norm = float(grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm)
        loss = torch.stack(losses).mean()  # mean over micro-batches of each micro-batch's token mean
        if self.dp_size > 1 and getattr(self.cfg.parallel, "report_loss", "local") == "dp_mean":
            import torch.distributed as dist

            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss = loss / self.dp_size
        return StepResult(loss=float(loss.item()), grad_norm=grad_norm, lr=lr,
                          per_token_loss=torch.stack(per_token).float().cpu() if per_token else None)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[torch.Tensor]) -> float:
        """Mean over micro-batches of HF's token-mean loss (no grad, eval mode)."""
        t, m = self.cfg.train, self.cfg.model
        with eval_mode(self.model):
            losses = []
            for i, mb in enumerate(micro_batches):
                if tuple(mb.shape) != (t.micro_batch_size, m.seq_length + 1):
                    raise ValueError(f"micro-batch {i}: expected [{t.micro_batch_size}, {m.seq_length + 1}]")
                mb = mb.to(self.device)
                logits = self.model(input_ids=mb[:, :-1].contiguous()).logits
                losses.append(self._loss(logits, mb[:, 1:].contiguous())[0].float())
        return float(torch.stack(losses).mean().item())

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[b, s, vocab]`` for int64 tokens ``[b, s]`` (s <= seq_length). Raises ValueError."""
        check_tokens(tokens, self.cfg.model.seq_length)
        with eval_mode(self.model):
            out = self.model(input_ids=tokens.to(self.device, dtype=torch.long)).logits
        return out.float()

    def module_probes(self) -> dict[str, torch.nn.Module]:
        """Neutral names -> HF submodules. Outputs are **batch-first** ``[b, s, h]`` (Megatron: ``[s, b, h]``), so
        module digests never equal a sequence-first engine's; ``self_attention`` returns ``(out, weights)``."""
        hf = self.model.model
        probes: dict[str, torch.nn.Module] = {"embedding": hf.embed_tokens}
        for i, layer in enumerate(hf.layers):
            probes[f"layers.{i}.input_norm"] = layer.input_layernorm
            probes[f"layers.{i}.self_attention"] = layer.self_attn
            probes[f"layers.{i}.pre_mlp_norm"] = layer.post_attention_layernorm
            probes[f"layers.{i}.mlp"] = layer.mlp
        probes["final_norm"] = hf.norm
        probes["output_layer"] = self.model.lm_head
        return {n: probes[n] for n in forward_names(self.cfg.model.num_layers)}

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """Plain nested dict (torch.distributed.checkpoint-friendly), full (gathered) tensors in HF names.

        ``model``: fp32 master weights; ``optimizer``: name -> {exp_avg, exp_avg_sq} (fp32); ``adam_step``: torch
        AdamW's step count (one for every flat partition); ``scheduler``: {num_steps}; ``step``: steps done.
        """
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        opt = {}
        for n, prm in self._params().items():
            opt[n] = {k: safe_get_full_optimizer_state(prm, k).detach().float().clone()
                      for k in ("exp_avg", "exp_avg_sq")}
        return {"step": int(self.steps_done), "scheduler": dict(self.scheduler.state_dict()),
                "model": {n: safe_get_full_fp32_param(prm).detach().float().clone()
                          for n, prm in self._params().items()},
                "optimizer": opt, "adam_step": self._adam_step().clone()}

    def _adam_step(self) -> torch.Tensor:
        """The optimizer's step count as an fp32 0-dim CPU tensor (torch AdamW keeps a tensor, DeepSpeedCPUAdam an
        int)."""
        steps = {float(st["step"]) for st in self.ds.basic_optimizer.state.values()}
        if len(steps) != 1:
            raise RuntimeError(f"AdamW step counts differ across partitions: {sorted(steps)}")
        return torch.tensor(steps.pop(), dtype=torch.float32)

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (weights, Adam moments and step, scheduler, step count)."""
        from deepspeed.utils import safe_set_full_optimizer_state

        self.load_hf_weights(state["model"])
        with torch.no_grad():
            for n, prm in self._params().items():
                for k in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(prm, state["optimizer"][n][k].to(prm.device, torch.float32), k)
            for st in self.ds.basic_optimizer.state.values():
                if torch.is_tensor(st["step"]):
                    st["step"].copy_(state["adam_step"].to(st["step"].device, st["step"].dtype))
                else:  # DeepSpeedCPUAdam
                    st["step"] = int(state["adam_step"])
        self.scheduler.load_state_dict(dict(state["scheduler"]))
        self.steps_done = int(state["step"])
        self._last_grads = None
