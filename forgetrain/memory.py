"""The device-memory estimate of a training step, and the loud check that refuses a config that cannot fit.

One owner for the estimate (as ``forgetrain.metrics`` owns FLOPs/MFU): ``bench`` reads it to choose interleaved or
sequential timing, ``config.validate`` runs :func:`check` before any engine is built.

**What is modelled:** the forged Hopper engine (``scenarios/llama1b_h200/engine.py`` and ``fast.py``;
``scenarios/llama8b_h100`` reuses it) with Megatron's mixed-precision recipe. All parts are bytes per GPU; ``a`` is
the bytes of one compute element (2 under ``train.precision=bf16``, 4 under fp32); N the parameter count
(``metrics.param_counts``); b micro-batch, s sequence, h hidden, f FFN width, L layers, V vocab, nq/nkv query/KV
heads, d head dim; T = b*s tokens per micro-batch.

=================  ===================================================================================
model_weights      a * N                          (the bf16 working copy; under fp32 it *is* the main copy);
                   ``engine.bf16_weights=per_layer``: a * (N - L*N_layer + C*N_layer), C = L - R + [R > 0]
                   layers' copies alive at once: the stored layers keep theirs to their backward, the
                   recomputed ones exist one at a time (N_layer = one decoder layer's parameters; R below)
main_weights       4 * N under bf16, 0 under fp32 (fp32 main weights)
main_grads         4 * N                          (fp32 ``main_grad``; not sharded: the engine's DP buffer is full)
adam_moments       8 * N / DP under ZeRO-1, else 8 * N (fp32 exp_avg and exp_avg_sq);
                   ``engine.optimizer_offload_fraction=F``: 8 * N * (1 - F) on the device (an upper bound: whole
                   tensors go to the host until at least F of the elements have) plus the staging,
                   16 * min(:data:`OFFLOAD_CHUNK_ELEMS`, P), P the largest parameter's elements (the largest is
                   offloaded first): max(V*h, 2*f*h, (nq + 2*nkv)*d*h), the embedding and LM head, fc1 or QKV
autograd_grads     a * N unfused (per_layer: a * (N - L*N_layer + N_layer)); with ``engine.grad_accum_fusion`` only the norm weights' a * (2L+1) * h
                   (plus the LM head's a * V * h under ``kernels.cross_entropy=triton``, which keeps it on autograd)
activations        L * T * [a * (4h + 2*nq*d + nkv*d + v + 3f) + 4*nq]  +  2 * a * T * h        (fast mode);
                   v = (nq + 2*nkv)*d, the whole QKV output that a view of V keeps alive, or nkv*d under
                   ``engine.free_qkv`` (V copied out);
                   ``engine.recompute=full`` over R layers (``engine.recompute_num_layers``, default all L):
                   (L - R + [R > 0]) layers' term instead of L -- the stored layers and the one being
                   recomputed -- plus R * T * h * a (the recomputed layers' saved inputs)
lm_head_ce         see below
workspace          1 GiB (:data:`WORKSPACE_BYTES`)
=================  ===================================================================================

*Activations* count the tensors ``FastBlock.forward`` saves for backward, per token: the input-norm input x and the
normed x fed to the QKV GEMM (2h); SDPA's saved q and k (RoPE's outputs, nq*d + nkv*d), v, its output (nq*d) and its
fp32 logsumexp (4*nq bytes), where v is a view into the fused QKV GEMM's output and so keeps all of it, (nq +
2*nkv)*d, alive to the backward, unless ``engine.free_qkv`` copies V out (nkv*d); the pre-MLP-norm input and the
normed x fed to fc1 (2h); fc1's output [gate; up] saved by SiLU*up (2f) and SwiGLU's output fed to fc2 (f). Outside
the blocks: the final-norm input and the chunked CE's saved ``dh`` (2h). RoPE saves only its shared cos/sin tables.
``tests/test_memory.py`` checks the per-layer term against the storages a compiled block saves on CPU;
``experiments/free_qkv/saved_tensors.py`` does the same on a GPU. Before the term counted the whole QKV buffer, the H200
peaks of ``llama8b_h200``'s offload layouts ran about 2.5 GiB above the estimate, which is that buffer's uncounted
part for Llama-3-8B (32 layers x 8192 tokens x (nq + nkv)*d x 2 B).
In exact mode (Megatron's unfused attention,
``scenarios/_llama/model.py``) K and V are repeated to nq heads before the bmm, so the per-token attention
term is 4*nq*d, and each layer also saves the fp32 softmax and its compute-dtype copy: b * nq * s^2 * (4 + a).

*LM head and cross-entropy* (alive together with every activation: the CE is the last op of the forward and the
first of the backward). With c = min(engine.ce_chunk_tokens, T):

* ``chunked`` (fast): c * V * 4 -- the chunk's logits and its (softmax - onehot) grad, both in the compute dtype
  (on CUDA the chunk's softmax is one compiled kernel; on CPU the eager chunk holds fp32 temporaries too, not
  counted) -- plus, when there is more than one chunk and no fusion, the fp32 dW accumulator 4 * V * h (with one
  chunk dW is the head's bf16 grad, already in autograd_grads);
* ``triton``: c * V * 6 (its docstring: fp32 logits c*V*4 in the forward, about 1.5x that in the backward);
* ``torch`` (fast) and exact mode: the full [T, V] logits, T * V * 12 -- compute-dtype logits, their fp32 copy,
  the fp32 log-softmax (exact: softmax) saved for backward, and in the backward its fp32 grad (2 + 4 + 4 + 4 B,
  rounded down to 12 because the bf16 logits are freed before the backward's grad exists).

*Workspace* (1 GiB): cuBLAS workspaces (32 MiB per handle on Hopper), cuDNN attention workspace, the transient
backward buffers of one block (dY of fc1 at [T, 2f]: 0.47 GiB for the 8B shape) and torch.compile scratch.

**Not counted:** the CUDA context and allocator fragmentation (:func:`check` keeps :data:`RESERVE_BYTES` of the
device for them); NCCL buffers under DP; tensor parallelism (the Hopper engine has none; for
``llama_tiny_cpu``'s TP the estimate is not divided); under ZeRO-3 (FSDP2, ``llama_tiny_cpu`` only) the static
parts are divided by DP. Every part is counted as alive at the same time, so the estimate errs high by up to the
bf16 grads that in fact appear only as the backward frees activations.

**Calibration:** ``docs/design.md`` ("Memory estimate") compares the estimate with every peak measured on the H200
(``max_memory_allocated``): within about 10% on each row (+10.1% at most).

**The check** (:func:`check`): a config whose estimate exceeds the device's total memory (on CPU: the host's
physical memory, with the offloaded AdamW moments counted back: :func:`host_estimate`) less :data:`RESERVE_BYTES`
raises one-line ``ConfigError``; so does, on a GPU, an optimizer offload
whose pinned host memory (:func:`host_offload_bytes`) exceeds the host's physical memory less
:data:`HOST_RESERVE_BYTES`;
``train.skip_memory_check=true`` skips it. ``FORGETRAIN_FAKE_DEVICE_GIB=<GiB>`` (read only by :func:`check`)
stands in for the device's capacity, so the refusal can be tested on a machine without a GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields, replace

from forgetrain.errors import ConfigError

GIB = 2**30
WORKSPACE_BYTES = 1 * GIB  # cuBLAS / cuDNN workspaces, one block's backward transients, compile scratch
# engine.optimizer_offload_fraction: elements per chunk streamed through the device (the Hopper engine's
# scenarios/_llama/optim.HostMoments reads it); 2 slots x 2 fp32 moments x 2^25 = 512 MiB of staging
OFFLOAD_CHUNK_ELEMS = 1 << 25
RESERVE_BYTES = 3 * GIB  # kept free of the estimate: CUDA context (~0.5 GiB) and allocator fragmentation
# kept free of the offload's pinned moments in host memory: the process itself (Python, the torch and CUDA
# libraries, torch.compile's worker processes, the data) and the operating system
HOST_RESERVE_BYTES = 16 * GIB
FAKE_DEVICE_ENV = "FORGETRAIN_FAKE_DEVICE_GIB"  # capacity in GiB that stands in for the device's (tests)

LABELS = {  # part -> how the check's message names it
    "model_weights": "model weights", "main_weights": "fp32 main weights", "main_grads": "fp32 main grads",
    "adam_moments": "Adam m and v", "autograd_grads": "autograd grads", "activations": "activations",
    "lm_head_ce": "LM head + CE", "workspace": "workspace",
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of each part of a training step (module doc for each formula)."""

    model_weights: int
    main_weights: int
    main_grads: int
    adam_moments: int
    autograd_grads: int
    activations: int
    lm_head_ce: int
    workspace: int

    def parts(self) -> dict[str, int]:
        """Part name -> bytes, in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def total_bytes(self) -> int:
        return sum(self.parts().values())

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def biggest(self, n: int = 3) -> list[tuple[str, int]]:
        """The ``n`` largest parts as (name, bytes), largest first (ties in declaration order)."""
        return sorted(self.parts().items(), key=lambda kv: -kv[1])[:n]


def layer_bytes_per_token(m, a: int, fast: bool, free_qkv: bool = False) -> int:
    """Bytes one decoder layer saves for its backward per token (the activation term of :func:`estimate`, module
    doc): ``m`` a ModelConfig (hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, head_dim), ``a``
    the compute element's bytes. Fast mode: RoPE'd q and SDPA's output (nq*d each), RoPE'd k (nkv*d), V as a view
    that keeps the whole QKV GEMM output ((nq + 2*nkv)*d) alive, or nkv*d under ``engine.free_qkv``, SDPA's fp32
    logsumexp (4*nq bytes); exact mode: K and V repeated to nq heads (4*nq*d; its [s, s] softmax is per sequence
    and counted by :func:`estimate`)."""
    h, f, nq, nkv, d = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    v = nkv * d if free_qkv else (nq + 2 * nkv) * d
    attn = 2 * nq * d + nkv * d + v if fast else 4 * nq * d
    return a * (4 * h + attn + 3 * f) + (4 * nq if fast else 0)


def estimate(cfg) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of one training step of ``cfg`` (a RunConfig) on one GPU; module doc for the
    formulas, their sources and what is not counted. Works for any config and device (pure arithmetic)."""
    from forgetrain.metrics import param_counts

    m, t, p, e, k = cfg.model, cfg.train, cfg.parallel, cfg.engine, cfg.kernels
    n = param_counts(m)["total"]
    bf16 = t.precision == "bf16"
    a = 2 if bf16 else 4
    h, f, L, V = m.hidden_size, m.ffn_hidden_size, m.num_layers, m.vocab_size
    nq, nkv, d = m.num_attention_heads, m.num_query_groups, m.head_dim
    b, s = t.micro_batch_size, m.seq_length
    tokens = b * s
    fast = e.mode == "fast"
    fused = fast and e.grad_accum_fusion
    ce = k.cross_entropy if fast else "exact"
    dp = p.data_parallel_size
    static_div = dp if p.zero_stage == 3 else 1

    recompute = getattr(e, "recompute", "none") == "full"
    per_layer = bf16 and getattr(e, "bf16_weights", "resident") == "per_layer"
    heads = 1 if m.share_embeddings_and_output_weights else 2  # embedding and LM head: one tensor when tied
    n_layer = (n - heads * V * h - h) // L  # one decoder layer's parameters (metrics.param_counts' sum)
    rnl = getattr(e, "recompute_num_layers", None)
    recomputed = (L if rnl is None else rnl) if recompute else 0  # the first `recomputed` layers
    # layers holding their activations (and, per-layer, their bf16 working copies) at the loss: the stored ones,
    # which keep both until their backward, plus the one being recomputed
    live_layers = (L - recomputed) + (1 if recomputed else 0)
    if fused:
        grads = a * (2 * L + 1) * h + (a * V * h if ce == "triton" else 0)
    elif per_layer:  # the layers' bf16 grads exist one layer at a time, in its recompute
        grads = a * (n - L * n_layer) + a * n_layer
    else:
        grads = a * n
    per_token_layer = layer_bytes_per_token(m, a, fast, getattr(e, "free_qkv", False))
    acts = live_layers * tokens * per_token_layer + 2 * a * tokens * h
    acts += recomputed * tokens * h * a  # each recomputed layer's saved input
    if not fast:
        acts += live_layers * b * nq * s * s * (4 + a)
    moments = 8 * n // (dp if p.zero_stage in (1, 3) else 1)
    off = getattr(e, "optimizer_offload_fraction", 0.0) or 0.0
    if off > 0:
        largest = max(V * h, 2 * f * h, (nq + 2 * nkv) * d * h)  # embedding / LM head, fc1 [2f, h], QKV
        moments = int(8 * n * (1 - off)) + 16 * min(OFFLOAD_CHUNK_ELEMS, largest)
    chunk = min(e.ce_chunk_tokens or tokens, tokens)
    if ce == "chunked":
        head = chunk * V * 2 * a
        if math.ceil(tokens / chunk) > 1 and not fused:
            head += 4 * V * h
    elif ce == "triton":
        head = chunk * V * 6
    else:
        head = tokens * V * 12
    return MemoryEstimate(
        model_weights=(a * (n - L * n_layer + live_layers * n_layer) if per_layer else a * n) // static_div,
        main_weights=(4 * n if bf16 else 0) // static_div,
        main_grads=4 * n // static_div,
        adam_moments=moments,
        autograd_grads=grads // static_div,
        activations=acts,
        lm_head_ce=head,
        workspace=WORKSPACE_BYTES,
    )


def device_capacity_bytes(cfg) -> int | None:
    """The capacity :func:`check` compares against: ``FORGETRAIN_FAKE_DEVICE_GIB`` GiB when set, else the CUDA
    device's ``total_memory`` when ``hardware.device=cuda``, the host's physical memory when ``hardware.device=cpu``
    (:func:`host_memory_bytes`), else None (nothing to check). Raises ConfigError for a
    fake capacity that is not a positive number."""
    fake = os.environ.get(FAKE_DEVICE_ENV)
    if fake:
        try:
            gib = float(fake)
        except ValueError:
            gib = float("nan")
        if not (math.isfinite(gib) and gib > 0):
            raise ConfigError(f"{FAKE_DEVICE_ENV} must be a positive number of GiB, got '{fake}'")
        return int(gib * GIB)
    if cfg.hardware.device == "cpu":
        return host_memory_bytes()
    if cfg.hardware.device != "cuda":
        return None
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


def host_memory_bytes() -> int | None:
    """The machine's physical memory in bytes (``sysconf``), or None where the platform does not say. On CPU the
    estimate is checked against it: a model far too large for the machine is refused in one line instead of being
    killed by the kernel's out-of-memory killer minutes later."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def offload_names(sizes: dict[str, int], fraction: float) -> list[str]:
    """The parameters whose AdamW moments go to host memory under ``engine.optimizer_offload_fraction``: by size,
    largest first (ties in ``sizes`` order), until at least ``fraction`` of all elements is chosen (0: none,
    1: all). ``sizes``: name -> element count. The engine (``scenarios/_llama/optim.HostMoments``) and
    :func:`host_offload_bytes` both choose with it."""
    if fraction <= 0:
        return []
    total = sum(sizes.values())
    chosen, n = [], 0
    for k in sorted(sizes, key=lambda k: -sizes[k]):
        if n >= fraction * total:
            break
        chosen.append(k)
        n += sizes[k]
    return chosen


def pinned_alloc_bytes(nbytes: int) -> int:
    """Host bytes that torch's CUDA caching host allocator takes for one pinned tensor of ``nbytes`` bytes: the
    request rounded up to a power of two (its default rounding, ``ATen/core/CachingHostAllocator.h``, the
    ``allocate`` path, which indexes its free lists by power-of-two size). For Llama-3-8B's 2.10 GB (1.96 GiB)
    embedding moment that is 2 GiB; for its 470 MB fc1 moment, 512 MiB."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def host_offload_bytes(cfg) -> int:
    """Host bytes the offloaded AdamW moments of ``cfg`` pin, summed over the ``parallel.data_parallel_size``
    ranks of one host (each rank holds whole moments: the offload needs ``zero_stage=0``): two fp32 moments per
    chosen tensor (:func:`offload_names` over ``metrics.param_tensor_sizes``), each rounded as
    :func:`pinned_alloc_bytes`. Llama-3-8B at F = 1: 68.0 GiB for 59.8 GiB of moments. 0 without offload."""
    from forgetrain.metrics import param_tensor_sizes

    off = getattr(cfg.engine, "optimizer_offload_fraction", 0.0) or 0.0
    if off <= 0:
        return 0
    sizes = {str(i): n for i, n in enumerate(param_tensor_sizes(cfg.model))}
    per_rank = sum(2 * pinned_alloc_bytes(4 * sizes[k]) for k in offload_names(sizes, off))
    return per_rank * cfg.parallel.data_parallel_size


def host_estimate(cfg) -> MemoryEstimate:
    """:func:`estimate` for a run whose "device" is the host (``hardware.device=cpu``): the AdamW moments that
    ``engine.optimizer_offload_fraction`` sends to host memory are still in the same memory, so they are counted
    back (8 bytes per offloaded element, :func:`offload_names`; no pinned rounding on CPU)."""
    from forgetrain.metrics import param_tensor_sizes

    est = estimate(cfg)
    off = getattr(cfg.engine, "optimizer_offload_fraction", 0.0) or 0.0
    if off <= 0:
        return est
    sizes = {str(i): n for i, n in enumerate(param_tensor_sizes(cfg.model))}
    host = sum(8 * sizes[k] for k in offload_names(sizes, off))
    return replace(est, adam_moments=est.adam_moments + host)


def per_layer_weights_possible(cfg) -> bool:
    """Whether ``engine.bf16_weights=per_layer`` can run with ``cfg``'s precision and layout (with
    ``engine.recompute=full``), as the ``bf16_weights`` lever's own rule says (the engine's lever table,
    ``scenarios/llama1b_h200/levers.py``: bf16 on one GPU without ZeRO). False when no table declares the lever.
    The memory check's remedies read it."""
    from forgetrain import levers, registry

    lv = {x.name: x for x in levers.merge(registry.lever_specs())}.get("bf16_weights")
    if lv is None or lv.rule is None:
        return False
    per_layer = replace(cfg, engine=replace(cfg.engine, bf16_weights="per_layer", recompute="full"))
    return lv.rule(per_layer, False) is None


def remedies(cfg, where: str = "device") -> list[str]:
    """The settings that would lower :func:`estimate` for ``cfg`` and are not in effect yet, in the order the
    refusal names them: a smaller micro-batch, gradient accumulation fusion and the V copy (``engine.free_qkv``;
    both fast mode), recompute (then per-layer bf16 weights, or fewer stored layers), the optimizer offload (only
    where the capacity is a GPU's: on the host it moves nothing), a shorter sequence, fewer layers."""
    e, t = cfg.engine, cfg.train
    out = []
    if t.micro_batch_size > 1:
        out.append("lower train.micro_batch_size")
    if e.mode == "fast" and not e.grad_accum_fusion:
        out.append("set engine.grad_accum_fusion=true")
    if e.mode == "fast" and not e.free_qkv:
        out.append("set engine.free_qkv=true")
    if e.recompute != "full":
        out.append("set engine.recompute=full")
    elif e.recompute_num_layers is not None and e.recompute_num_layers < cfg.model.num_layers:
        out.append("raise engine.recompute_num_layers (or null: every layer)")
    if per_layer_weights_possible(cfg) and e.bf16_weights != "per_layer":
        out.append("set engine.bf16_weights=per_layer (with recompute)")
    if where == "device" and (e.optimizer_offload_fraction or 0) < 1:
        out.append("raise engine.optimizer_offload_fraction")
    out.append("shorten model.seq_length or use fewer model.num_layers")
    return out


def leanest(cfg, where: str = "device"):
    """``cfg`` with every layout remedy of :func:`remedies` in effect (micro-batch 1, gradient accumulation fusion
    and the V copy in fast mode, full recompute of every layer, per-layer bf16 weights where they can run
    (:func:`per_layer_weights_possible`), the whole optimizer offloaded
    where the capacity is a GPU's): the smallest footprint without changing the model or the sequence."""
    e, t = cfg.engine, cfg.train
    eng = replace(e, recompute="full", recompute_num_layers=None,
                  grad_accum_fusion=e.grad_accum_fusion or e.mode == "fast",
                  free_qkv=e.free_qkv or e.mode == "fast",
                  bf16_weights="per_layer" if per_layer_weights_possible(cfg) else e.bf16_weights,
                  optimizer_offload_fraction=1.0 if where == "device" else e.optimizer_offload_fraction)
    return replace(cfg, engine=eng, train=replace(t, micro_batch_size=1))


def _lean_words(cfg, lean) -> str:
    """The overrides that turn ``cfg`` into ``lean`` (:func:`leanest`), as ``key=value`` words."""
    words = ["train.micro_batch_size=1"] if cfg.train.micro_batch_size != 1 else []
    for f in fields(lean.engine):
        a, b = getattr(cfg.engine, f.name), getattr(lean.engine, f.name)
        if a != b:
            words.append(f"engine.{f.name}={'null' if b is None else str(b).lower() if isinstance(b, bool) else b}")
    return " ".join(words) or "as configured"


def refusal(est: MemoryEstimate, capacity: int, where: str, cfg) -> str | None:
    """The one-line refusal when ``est`` (the estimate of ``cfg``) exceeds ``capacity`` (bytes) of ``where`` (the
    device, or the host's memory on CPU) less :data:`RESERVE_BYTES`, else None. It names the :func:`remedies`
    not yet in effect for ``cfg``."""
    usable = capacity - RESERVE_BYTES
    if est.total_bytes <= usable:
        return None
    parts = ", ".join(f"{LABELS[k]} {v / GIB:.1f} GiB ({v / 1e9:.1f} GB)" for k, v in est.biggest(3))
    per = "per GPU" if where == "device" else "on this machine"
    todo = remedies(cfg, where)
    lean = leanest(cfg, where)
    lean_bytes = (estimate if where == "device" else host_estimate)(lean).total_bytes
    if len(todo) > 1 and lean_bytes > usable:  # no layout switch is enough: say so instead of listing them
        todo = [f"even the leanest layout ({_lean_words(cfg, lean)}) needs an estimated {lean_bytes / GIB:.1f} "
                f"GiB, so shorten model.seq_length or use fewer model.num_layers"]
    return (f"this config needs an estimated {est.total_gib:.1f} GiB {per} (biggest parts: {parts}) but the "
            f"{where} has {capacity / GIB:.1f} GiB less a {RESERVE_BYTES / GIB:.0f} GiB reserve; "
            f"{'; '.join(todo)} (forgetrain/memory.py has the estimate; train.skip_memory_check=true runs anyway)")


def check(cfg) -> None:
    """Refuse ``cfg`` before any engine is built when its :func:`estimate` cannot fit the device (module doc).
    Raises ConfigError with one line: the estimate, its three biggest parts, the capacity and what to change.
    On CPU the capacity is the host's memory. Nothing happens with ``train.skip_memory_check``."""
    if cfg.train.skip_memory_check:
        return
    capacity = device_capacity_bytes(cfg)
    if capacity is None:
        return
    host = cfg.hardware.device == "cpu" and not os.environ.get(FAKE_DEVICE_ENV)
    line = refusal(host_estimate(cfg) if host else estimate(cfg), capacity, "host memory" if host else "device", cfg)
    if line:
        raise ConfigError(line)
    pinned = 0 if host else host_offload_bytes(cfg)
    ram = host_memory_bytes() if pinned else None
    if ram is not None and pinned > ram - HOST_RESERVE_BYTES:
        raise ConfigError(
            f"engine.optimizer_offload_fraction={cfg.engine.optimizer_offload_fraction} pins an estimated "
            f"{pinned / GIB:.1f} GiB of host memory for the AdamW moments (each tensor's rounded up to a power of "
            f"two by torch's pinned allocator) but this machine has {ram / GIB:.1f} GiB less a "
            f"{HOST_RESERVE_BYTES / GIB:.0f} GiB reserve; lower engine.optimizer_offload_fraction"
            f"{_without_offload_hint(cfg, capacity)} "
            f"(forgetrain/memory.py has the estimate; train.skip_memory_check=true runs anyway)")


def _without_offload_hint(cfg, capacity: int) -> str:
    """For the host-memory refusal: when the config without offload no longer fits the device, the layout that
    does (full recompute, and per-layer bf16 weights under bf16), as overrides; "" when no offload fits as it is
    or nothing does."""
    import dataclasses

    def fits(**engine) -> bool:
        c = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, optimizer_offload_fraction=0.0, **engine))
        return refusal(estimate(c), capacity, "device", c) is None

    if fits():
        return ""
    lean = {"recompute": "full", "recompute_num_layers": None}
    if per_layer_weights_possible(cfg):
        lean["bf16_weights"] = "per_layer"
    if not fits(**lean):
        return ""
    return (" (at 0 this model fits the device only with "
            + " ".join(f"engine.{k}={v}" for k, v in
                       {"optimizer_offload_fraction": 0, **{k: v for k, v in lean.items() if v is not None}}.items())
            + ")")


def saved_storages(fn, *args, exclude=(), **kwargs) -> tuple[object, list[dict]]:
    """Run ``fn(*args, **kwargs)`` and record what autograd saves for its backward: the measured counterpart of
    :func:`estimate`'s activation term (``experiments/free_qkv/saved_tensors.py`` on a GPU; ``tests/test_memory.py`` on
    CPU). Returns (fn's output, rows), one row per distinct storage, largest first: ``{"bytes", "dtype",
    "shapes"}``. A storage is counted whole and once, because a saved view keeps its whole base alive; storages of
    the tensors in ``exclude`` (weights, main grads: counted by other parts) are left out. Uses
    ``torch.autograd.graph.saved_tensors_hooks``, which also sees what a compiled graph saves."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, dict] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in skip:
                row = seen.setdefault(st.data_ptr(), {"bytes": st.nbytes(), "dtype": str(t.dtype), "shapes": set()})
                row["shapes"].add(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    rows = [{"bytes": r["bytes"], "dtype": r["dtype"], "shapes": sorted(r["shapes"])} for r in seen.values()]
    return out, sorted(rows, key=lambda r: -r["bytes"])
