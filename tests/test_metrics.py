"""FLOPs and MFU pinned by a hand count, under both labelled conventions (forgetrain.metrics owns the formulas)."""

import pytest

from forgetrain import metrics
from forgetrain.config import ModelConfig

# h 64, L 2, 4 query heads / 2 KV groups (d 16), FFN 176, V 1000, s 128.
M = ModelConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                vocab_size=1000, seq_length=128)


def hand_count(attention_per_layer_hs: int) -> int:
    """Counted by hand: per layer QKV 64 x (64 + 2*2*16) = 8192, proj 64 x 64 = 4096, SwiGLU 3 x 64 x 176 = 33792,
    two norms 128 -> 46208; two layers 92416; final norm 64; LM head 1000 x 64 = 64000 (the input embedding is not
    counted): N - N_emb = 156480, x 6 = 938880. Attention: attention_per_layer_hs x L x h x s."""
    return 938_880 + attention_per_layer_hs * 2 * 64 * 128


def test_flops_per_token_palm_hand_count():
    assert hand_count(12) == 1_135_488
    assert metrics.flops_per_token(M) == 1_135_488
    assert metrics.flops_per_token(M, "palm") == 1_135_488


def test_flops_per_token_megatron_causal_hand_count():
    assert metrics.flops_per_token(M, "megatron_causal") == hand_count(6) == 1_037_184


def test_param_counts_hand_count():
    n = metrics.param_counts(M)
    assert n["embedding"] == 64_000 and n["non_embedding"] == 156_480 and n["total"] == 220_480


def test_mfu_both_conventions():
    tps, peak = 1.0e6, 1.0e12  # 1M tokens/s on one 1 TFLOP/s device
    m = metrics.mfu_metrics(M, tps, peak, devices=2)
    assert m["mfu_pct"] == pytest.approx(100 * 1_135_488 * tps / (2 * peak))
    assert m["mfu_causal_pct"] == pytest.approx(100 * 1_037_184 * tps / (2 * peak))
    label = metrics.mfu_formula_label("peak X")
    assert "12*L*h*s" in label and "6*L*h*s" in label and "peak X" in label


def test_counting_the_embedding_is_caught(monkeypatch):
    """The mutant the hand count exists for: 6 x N with the input embedding counted."""
    real = metrics.param_counts
    monkeypatch.setattr(metrics, "param_counts", lambda m: {**real(m), "non_embedding": real(m)["total"],
                                                             "active_non_embedding": real(m)["total"]})
    assert metrics.flops_per_token(M) != hand_count(12)


def test_peak_label_names_a_different_device(monkeypatch):
    """The llama8b_h100 proxy timed on an H200: the datasheet peak is the configured hardware's, and the label
    says which device actually ran; on the configured device (or off CUDA) the label is the plain one."""
    from forgetrain import metrics
    from forgetrain.config import HardwareConfig

    h100 = HardwareConfig(name="h100", device="cuda", peak_tflops=989.4, peak_source="H100 SXM dense BF16 (datasheet)")
    monkeypatch.setattr(metrics, "_cuda_device_name", lambda: "NVIDIA H200")
    peak, label = metrics.peak_flops(h100)
    assert peak == 989.4e12 and label.endswith("(hardware=h100; the device is NVIDIA H200)"), label
    monkeypatch.setattr(metrics, "_cuda_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert metrics.peak_flops(h100)[1] == "vs 989.4 TFLOP/s H100 SXM dense BF16 (datasheet)"
    monkeypatch.setattr(metrics, "_cuda_device_name", lambda: None)
    assert metrics.peak_flops(h100)[1] == "vs 989.4 TFLOP/s H100 SXM dense BF16 (datasheet)"


def _fresh_peak(monkeypatch, tmp_path, load: float):
    """A CPU peak cache in ``tmp_path``, nothing measured in this process yet, and the load average ``load``."""
    from forgetrain import metrics

    monkeypatch.setenv("FORGETRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(metrics, "_RUN_PEAK", {})
    monkeypatch.setattr(metrics, "_RUN_PEAK_LOAD", {})
    monkeypatch.setattr(metrics.os, "getloadavg", lambda: (load, 0.0, 0.0))


def test_peak_measured_under_load_says_so(monkeypatch, tmp_path):
    """A CPU peak measured while the load average exceeds the cores is used but not cached, and the MFU label
    says it is overstated; a quiet measurement is cached and labelled plainly."""
    from forgetrain import metrics
    from forgetrain.config import HardwareConfig

    cpu = HardwareConfig()
    _fresh_peak(monkeypatch, tmp_path, 99.0)
    label = metrics.peak_flops(cpu)[1]
    assert "measured under load 99.0" in label and "overstated" in label, label
    assert not (tmp_path / "cpu_peak.json").exists()
    _fresh_peak(monkeypatch, tmp_path, 0.0)
    label = metrics.peak_flops(cpu)[1]
    assert "load" not in label and (tmp_path / "cpu_peak.json").is_file(), label


def test_mfu_above_100_drops_the_measured_cpu_peak(monkeypatch, tmp_path):
    """An MFU above 100% against a measured CPU peak means the peak was measured while other work shared the
    cores (a load average can miss it): one warning line, and the cached value is gone so the next run re-measures.
    At or under 100%, or against a datasheet peak, nothing is said or dropped."""
    import json

    from forgetrain import metrics
    from forgetrain.config import HardwareConfig

    cpu = HardwareConfig()
    _fresh_peak(monkeypatch, tmp_path, 0.0)
    peak = metrics.peak_flops(cpu)[0]
    key = next(iter(json.loads((tmp_path / "cpu_peak.json").read_text())))
    assert metrics.implausible_mfu(cpu, 99.9) is None
    assert metrics.implausible_mfu(HardwareConfig(peak_tflops=989.4), 118.5) is None
    assert key in json.loads((tmp_path / "cpu_peak.json").read_text())
    warn = metrics.implausible_mfu(cpu, 118.5)
    assert warn.startswith("warning: MFU 118.5% is above 100%") and f"{peak / 1e9:.1f} GFLOP/s" in warn, warn
    assert key not in json.loads((tmp_path / "cpu_peak.json").read_text()) and not metrics._RUN_PEAK


ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2\n\nprocessor\t: 1\nmodel name\t: other\n"
ZEN4 = ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace("avx2\n", "avx2 avx512f avx512dq\n")
SPR = "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: avx2 avx512f amx_tile\n"


def test_cpu_identity_separates_microarchitectures_of_one_name():
    """Two CPUs that a virtual machine names alike ("AMD EPYC": Zen 3 without AVX-512, Zen 4 with it) pick different
    matrix kernels, so their goldens and cached peaks must not share a key (a golden keyed "AMD EPYC" alone, made on another EPYC, failed bitwise on a Zen 4)."""
    from forgetrain.metrics import cpu_ident

    assert cpu_ident(ZEN3) == "AMD EPYC (family 25 model 1, avx2)"
    assert cpu_ident(ZEN4) == "AMD EPYC (family 25 model 17, avx512)"
    assert cpu_ident(SPR) == "Intel(R) Xeon(R) Processor (family 6 model 143, amx)"
    assert cpu_ident("model name\t: Some CPU\n") == "Some CPU"
    assert cpu_ident("processor\t: 0\n") is None
