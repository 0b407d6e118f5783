"""FLOPs, MFU, throughput and the metric sinks (console progress is in ``forgetrain.train``; W&B here).

MFU formulas (stated once, here; never changed silently). Two conventions, both reported and each labelled, so a
figure compares with any published anchor (the ratio between two systems is the same under either):

    palm             model FLOPs per token = 6 * (N_params - N_embedding) + 12 * L * h * s
                     (PaLM, Chowdhery et al. 2022, appendix B; torchtitan): attention without causal halving
    megatron_causal  model FLOPs per token = 6 * (N_params - N_embedding) +  6 * L * h * s
                     (Megatron-LM's newer accounting: the causal mask halves the attention score/value FLOPs)

where ``N_params - N_embedding`` counts every weight except the input embedding (the LM head is counted), L is
layers, h hidden size, s sequence length. For a mixture of experts (``model.num_experts``) N counts the **active
parameters**: of each layer's experts only the ``moe_router_topk`` a token runs (the router counted whole), the
convention of Switch Transformer / Megatron-LM's ``num_floating_point_operations`` (``moe_router_topk`` x expert
FLOPs) and of the "A3B" in Qwen3-30B-A3B; the label says so (:func:`mfu_formula_label`). Then

    MFU = FLOPs per token * tokens per step / step_s / (peak FLOP/s per device * devices).

Pinned by a hand count in ``tests/test_metrics.py`` (h 64, L 2, 4/2 heads, FFN 176, V 1000, s 128: 1,135,488
FLOPs per token under palm, 1,037,184 under megatron_causal). ``mfu_pct`` in traces and bench rows is the palm
convention; ``mfu_causal_pct`` beside it is megatron_causal.

Peaks come from ``conf/hardware`` (H100/H200 SXM dense BF16: 989.4 TFLOP/s). On CPU there is no datasheet peak:
the peak is a measured fp32 matmul rate on this machine, cached in the ForgeTrain cache, and the MFU is labelled
``(vs measured CPU matmul peak)``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch


def param_tensor_sizes(model_cfg) -> list[int]:
    """Element counts of a Llama config's parameter tensors, in the Hopper engine's layout: the embedding
    ``[V, h]``; per layer the input norm ``[h]``, the fused QKV ``[(nq + 2*nkv)*d, h]``, the output projection
    ``[h, nq*d]``, with ``qk_layernorm`` the query and key norms ``[d]`` each, the MLP norm ``[h]``, the fused fc1
    ``[2f, h]`` and fc2 ``[h, f]`` (with ``num_experts`` E instead the router ``[E, h]`` and per expert fc1
    ``[2 f_e, h]`` and fc2 ``[h, f_e]``, f_e = ``expert_ffn_hidden_size``); the final norm ``[h]``; the LM head
    ``[V, h]`` unless it is the embedding (``share_embeddings_and_output_weights``: one tensor, counted once). :func:`param_counts` sums them; the
    offload's host-memory estimate (``forgetrain.memory``) selects from them."""
    m = model_cfg
    d = m.head_dim
    h, f = m.hidden_size, m.ffn_hidden_size
    qk = [d, d] if m.qk_layernorm else []
    if m.num_experts is None:
        mlp = [2 * f * h, h * f]
    else:  # the router [E, h], then each expert's fc1 [2 f_e, h] and fc2 [h, f_e]
        fe = m.expert_ffn_hidden_size
        mlp = [m.num_experts * h, *[2 * fe * h, h * fe] * m.num_experts]
    layer = [h, (m.num_attention_heads + 2 * m.num_query_groups) * d * h, h * m.num_attention_heads * d, *qk, h,
             *mlp]
    head = [] if m.share_embeddings_and_output_weights else [m.vocab_size * h]
    return [m.vocab_size * h, *layer * m.num_layers, h, *head]


def param_counts(model_cfg) -> dict[str, int]:
    """Parameter counts of a Llama / Qwen3 / Qwen3-MoE config: total, embedding (input), non-embedding (incl. an
    untied LM head) and ``active_non_embedding``, the non-embedding parameters one token runs: with
    ``num_experts`` E and top-k k, each layer's E - k idle experts (3 h f_e each) are left out; dense, it equals
    ``non_embedding``. A tied LM head is the embedding: counted once, in ``embedding``, so it is not in the MFU's
    ``6 (N - N_emb)`` (as PaLM, whose input and output embeddings are shared, counts them)."""
    m = model_cfg
    total = sum(param_tensor_sizes(m))
    emb = m.vocab_size * m.hidden_size
    idle = 0
    if m.num_experts is not None:
        idle = m.num_layers * (m.num_experts - m.moe_router_topk) * 3 * m.hidden_size * m.expert_ffn_hidden_size
    return {"total": total, "embedding": emb, "non_embedding": total - emb,
            "active_non_embedding": total - emb - idle}


# convention -> (attention FLOPs per token per layer per h*s, label)
MFU_CONVENTIONS = {
    "palm": (12.0, "6*(N-N_emb)+12*L*h*s per token (PaLM, no causal halving)"),
    "megatron_causal": (6.0, "6*(N-N_emb)+6*L*h*s per token (Megatron-LM, causal halving)"),
}
MFU_KEYS = {"palm": "mfu_pct", "megatron_causal": "mfu_causal_pct"}  # metric key of each convention


def flops_per_token(model_cfg, convention: str = "palm") -> float:
    """Model FLOPs per trained token (fwd + bwd) under ``convention`` (module doc); N is the active non-embedding
    count (:func:`param_counts`: all of them for a dense model). Raises KeyError for an unknown convention."""
    m = model_cfg
    attn = MFU_CONVENTIONS[convention][0]
    return 6.0 * param_counts(m)["active_non_embedding"] + attn * m.num_layers * m.hidden_size * m.seq_length


def mfu_pct(model_cfg, tokens_per_s: float, peak_flops: float, devices: int = 1, convention: str = "palm") -> float:
    """MFU in percent for ``tokens_per_s`` (all devices) against ``peak_flops`` FLOP/s per device."""
    if peak_flops <= 0:
        return float("nan")
    return 100.0 * flops_per_token(model_cfg, convention) * tokens_per_s / (peak_flops * devices)


def mfu_metrics(model_cfg, tokens_per_s: float, peak_flops: float, devices: int = 1) -> dict[str, float]:
    """``{"mfu_pct": palm, "mfu_causal_pct": megatron_causal}`` in percent: the two labelled conventions."""
    return {key: mfu_pct(model_cfg, tokens_per_s, peak_flops, devices, conv) for conv, key in MFU_KEYS.items()}


MOE_MFU_NOTE = "N: active parameters (top-k of the experts)"  # the label's addition for a mixture of experts


def mfu_formula_label(peak_label: str, model_cfg=None) -> str:
    """One line naming both conventions and the peak, for traces, tables and summaries; for a mixture of experts
    (``model_cfg.num_experts`` set) it adds :data:`MOE_MFU_NOTE`."""
    moe = f"; {MOE_MFU_NOTE}" if model_cfg is not None and model_cfg.num_experts is not None else ""
    return (f"mfu_pct: {MFU_CONVENTIONS['palm'][1]}; mfu_causal_pct: {MFU_CONVENTIONS['megatron_causal'][1]}"
            f"{moe}; {peak_label}")


MOE_METRIC_KEYS = ("moe_lb_loss", "moe_max_load", "moe_dropped_tokens")  # :func:`moe_metrics`'s keys, in order


def moe_metrics(rec: dict, model_cfg) -> dict[str, float | int]:
    """A mixture of experts' per-step scalars for the progress line and W&B, from a step's trace record ``rec``
    (its ``StepResult.extra``) and the run's ModelConfig; empty for a dense model (``num_experts`` None and no
    ``moe_*`` value in ``rec``). Each key is present only where its source is:

    * ``moe_lb_loss``: the mean over layers of ``moe_load_balancing_loss`` (``[L]``, Megatron's Switch loss
      before the ``moe_aux_loss_coeff`` weight; dimensionless, 1.0 at a uniform routing);
    * ``moe_max_load``: the expert load imbalance, max / mean of ``moe_tokens_per_expert`` (``[L][E]`` tokens)
      over every layer and expert; a dimensionless ratio, 1.0 when perfectly balanced, ``E / topk`` at worst. A
      dropless layer routes the same ``tokens x topk`` as every other, so this is also the worst layer's own
      max / mean. Absent when no token was routed;
    * ``moe_dropped_tokens``: tokens dropped by a capacity limit this step, summed over layers: the engine's own
      ``moe_dropped_tokens`` (an int, or ``[L]`` ints) where it reports one; else 0 where the config is dropless
      (``moe_expert_capacity_factor`` None: each expert takes every token routed to it); else absent (a
      capacity factor and no count reported: unknown, never shown as 0)."""
    out: dict[str, float | int] = {}
    moe = getattr(model_cfg, "num_experts", None) is not None
    lb = rec.get("moe_load_balancing_loss")
    if lb:
        out["moe_lb_loss"] = sum(float(x) for x in lb) / len(lb)
    tpe = rec.get("moe_tokens_per_expert")
    counts = [int(c) for layer in tpe for c in layer] if tpe else []
    if counts and sum(counts) > 0:
        out["moe_max_load"] = max(counts) / (sum(counts) / len(counts))
    dropped = rec.get("moe_dropped_tokens")
    if dropped is not None:
        out["moe_dropped_tokens"] = int(sum(dropped)) if isinstance(dropped, (list, tuple)) else int(dropped)
    elif moe and getattr(model_cfg, "moe_expert_capacity_factor", None) is None:
        out["moe_dropped_tokens"] = 0
    return out


def moe_progress_fields(metrics: dict) -> dict[str, str]:
    """:func:`moe_metrics`'s values formatted for the progress line, same keys: ``moe_lb_loss`` to 4 decimals,
    ``moe_max_load`` as a multiple of the mean load (``1.37x``), ``moe_dropped_tokens`` as an integer count."""
    fmt = {"moe_lb_loss": "{:.4f}", "moe_max_load": "{:.2f}x", "moe_dropped_tokens": "{:d}"}
    return {k: fmt[k].format(metrics[k]) for k in MOE_METRIC_KEYS if k in metrics}


def cpu_model() -> str:
    """The CPU's identity as the matrix library sees it: ``/proc/cpuinfo``'s "model name", its "cpu family" and
    "model" numbers and the widest vector ISA it offers, e.g. "AMD EPYC (family 25 model 17, avx512)"; else the
    platform's processor or machine string. CPU goldens and the cached CPU peak are keyed by it: the matrix library
    picks its kernels per microarchitecture and ISA, so the last bits of a product can differ between two CPUs of one
    marketing name (a virtual machine may report only "AMD EPYC" for Zen 3 without AVX-512 and Zen 4 with it)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    return cpu_ident(text) or platform.processor() or platform.machine()


def cpu_ident(cpuinfo: str) -> str | None:
    """:func:`cpu_model`'s string from the text of ``/proc/cpuinfo`` (its first processor's block); None when that
    has no "model name"."""
    info = {}
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        k, _, v = line.partition(":")
        info.setdefault(k.strip().lower(), v.strip())
    name = info.get("model name")
    if not name:
        return None
    flags = set(info.get("flags", "").split())
    isa = next((i for i, f in (("amx", "amx_tile"), ("avx512", "avx512f"), ("avx2", "avx2")) if f in flags), None)
    ident = ", ".join(x for x in (f"family {info['cpu family']} model {info['model']}"
                                  if "cpu family" in info and "model" in info else None, isa) if x)
    return f"{name} ({ident})" if ident else name


def cache_dir() -> Path:
    return Path(os.environ.get("FORGETRAIN_CACHE", Path.home() / ".cache" / "forgetrain"))


_RUN_PEAK: dict[str, float] = {}  # this process's peak per cache key: one run's tables share one denominator
_RUN_PEAK_LOAD: dict[str, float] = {}  # the load average of a peak measured under load (not cached), per key


def measured_cpu_peak_flops(n: int = 2048, reps: int = 6) -> float:
    """Best fp32 matmul FLOP/s over square products of 512, 1024 and ``n`` on this CPU at torch's current thread count, cached on disk.

    The cache key holds the CPU model, thread count and torch version, so a different machine re-measures;
    ``FORGETRAIN_REMEASURE_PEAK=1`` forces a new measurement. Other jobs can only lower a measured peak (which
    would overstate MFU), so a measurement taken while the 1-minute load average exceeds the core count is used
    for this run but not cached, and a re-measurement keeps the higher of the old and new values. Within one
    process the first value is reused (a bench's headline and single-micro-batch rows share their MFU peak).
    """
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    if key in _RUN_PEAK:
        return _RUN_PEAK[key]
    _RUN_PEAK[key] = _measure_or_cached(key, n, reps)
    return _RUN_PEAK[key]


def cpu_peak_load() -> float | None:
    """The 1-minute load average under which this process measured its CPU peak, when that exceeded the core
    count (the peak is then low and MFU overstated); None when the peak was cached or measured on a quiet
    machine."""
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    return _RUN_PEAK_LOAD.get(key)


def _measure_or_cached(key: str, n: int, reps: int) -> float:
    path = cache_dir() / "cpu_peak.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache and not os.environ.get("FORGETRAIN_REMEASURE_PEAK"):
        return float(cache[key])
    peak = 0.0
    for size in (512, 1024, n):  # the best rate over sizes: small products can beat large ones on CPU caches
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        peak = max(peak, 2.0 * size**3 / best)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        _RUN_PEAK_LOAD[key] = load
        return max(peak, float(cache.get(key, 0.0)))  # measured under load: use, do not cache
    cache[key] = max(peak, float(cache.get(key, 0.0)))
    from forgetrain.trace import atomic_write_json

    try:
        atomic_write_json(path, cache)
    except OSError:
        pass
    return cache[key]


def peak_flops(hardware_cfg) -> tuple[float, str]:
    """(peak FLOP/s per device, label) for the MFU denominator. The label names the device actually present when
    it is not the one ``hardware`` describes (the ``llama8b_h100`` proxy timed on an H200 says so)."""
    if hardware_cfg.peak_tflops:
        label = f"vs {hardware_cfg.peak_tflops:g} TFLOP/s {hardware_cfg.peak_source}"
        present = _cuda_device_name() if hardware_cfg.device == "cuda" else None
        if present and hardware_cfg.name.lower() not in present.lower().replace(" ", ""):
            label += f" (hardware={hardware_cfg.name}; the device is {present})"
        return hardware_cfg.peak_tflops * 1e12, label
    p = measured_cpu_peak_flops()
    label = f"vs measured CPU matmul peak {p / 1e9:.1f} GFLOP/s"
    load = cpu_peak_load()
    if load is not None:
        label += (f" (measured under load {load:.1f} on {os.cpu_count()} cores, so MFU is overstated; not cached: "
                  f"a quiet run measures it again)")
    return p, label


def implausible_mfu(hardware_cfg, mfu: float) -> str | None:
    """A ``warning:`` line when ``mfu`` (%, PaLM's convention, the larger of the two) exceeds 100% against a
    measured CPU peak (:func:`measured_cpu_peak_flops`), else None. The measured rate then beat the "peak": the peak
    was measured while other work shared the cores, which the load-average check can miss (a 1-minute average lags
    the load). The low value is dropped from this process and from the cache, so the next run measures it again.
    A datasheet peak (``hardware.peak_tflops``) is never dropped."""
    if hardware_cfg.peak_tflops or mfu <= 100.0:
        return None
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    peak = _RUN_PEAK.pop(key, None)
    path = cache_dir() / "cpu_peak.json"
    try:
        cache = json.loads(path.read_text())
        if cache.pop(key, None) is not None:
            from forgetrain.trace import atomic_write_json

            atomic_write_json(path, cache)
    except (OSError, ValueError):
        pass
    was = f" ({peak / 1e9:.1f} GFLOP/s)" if peak else ""
    return (f"warning: MFU {mfu:.1f}% is above 100%: the CPU matmul peak{was} was measured while other work shared "
            f"the cores; it is dropped from {path}, so the next run measures it again (on a quiet machine)")


def _cuda_device_name() -> str | None:
    import torch

    try:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no usable CUDA: nothing to compare
        return None


class WandbLogger:
    """Thin W&B sink; offline unless ``logger.mode`` says otherwise. Keys carry units."""

    def __init__(self, logger_cfg, run_cfg_dict: dict, out_dir: str, run_id: str | None = None):
        """``run_id``: continue that W&B run (``resume="allow"``), as a resumed training run does with the id its
        checkpoint stored; None starts a new run. ``self.run.id`` is what the checkpoints store."""
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=logger_cfg.project, mode=logger_cfg.mode, dir=out_dir,
                              config=run_cfg_dict, reinit=True, id=run_id, resume="allow" if run_id else None)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def write_plots(records: list[dict], out_path: str) -> None:
    """Loss / val-loss / tokens_per_s / mfu_pct vs step as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [r["loss"] for r in records], label="train loss")
    ev = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if ev:
        ax[0].plot(*zip(*ev), "o-", label="val loss")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("loss (nats)")
    ax[0].legend()
    ax[1].plot(steps, [r.get("tokens_per_s", float("nan")) for r in records])
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("tokens/s")
    fig.tight_layout()
    from forgetrain.trace import atomic_write_bytes
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(out_path, buf.getvalue())
