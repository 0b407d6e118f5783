"""FP8 GEMMs of the fast Hopper engine (``engine.fp8=tensorwise``, scenarios/llama1b_h200/fp8.py) on CPU.

torch runs ``_scaled_mm`` on CPU with the same FP8 operands, scales and fp32 accumulation as cuBLASLt on Hopper, so
the quantisation, the operand layouts and the routing of the weight gradient are checked here; the speed and the
loss-curve tier it declares need the GPU (experiments/fp8/).

Bounds: round-to-nearest with p explicit mantissa bits has relative error at most 2^-(p+1). Its absolute error is
uniform over half a unit in the last place, 2^(e-p-1) for a value m 2^e (m in [1, 2)); over mantissas spread as a
Gaussian's are (log-uniformly, Benford), E[1/m^2] = (1/2 - 1/8) / ln 2 = 0.541, so the relative RMS is
2^-(p+1) sqrt(0.541 / 3) = 0.0265 for e4m3 (p = 3) and 0.0531 for e5m2 (p = 2). A GEMM of two independently rounded
operands has a relative RMS error of about sqrt(e_a^2 + e_b^2): 0.0375 for the forward (e4m3 x e4m3) and 0.0593 for
both backward GEMMs (e5m2 x e4m3). The checks allow 1.5x that; a wrong scale, rounding or layout is off by more.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scenarios.llama1b_h200 import fp8
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
BENFORD = (0.5 - 0.125) / math.log(2)  # E[1/m^2], m the mantissa in [1, 2) of log-uniformly spread values
RMS = {fp8.E4M3: 2.0 ** -4 * math.sqrt(BENFORD / 3), fp8.E5M2: 2.0 ** -3 * math.sqrt(BENFORD / 3)}
FWD_BOUND = 1.5 * math.hypot(RMS[fp8.E4M3], RMS[fp8.E4M3])
BWD_BOUND = 1.5 * math.hypot(RMS[fp8.E5M2], RMS[fp8.E4M3])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _operands(seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 64, 96, generator=g).to(dtype)
    w = (torch.randn(48, 96, generator=g) * 0.02).to(dtype)
    dy = (torch.randn(2, 64, 48, generator=g) * 1e-3).to(dtype)
    return x, w, dy


def _errors(linear=fp8.linear, dtype=torch.bfloat16) -> tuple[float, float, float]:
    """Relative errors of (y, dx, dw) of ``linear`` against fp64 ``F.linear`` on the same operands."""
    x, w, dy = _operands(dtype=dtype)
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = linear(xq, wq)
    y.backward(dy)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = F.linear(x64, w64)
    y64.backward(dy.double())
    return _rel(y, y64), _rel(xq.grad, x64.grad), _rel(wq.grad, w64.grad)


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_maps_amax_onto_the_format_with_a_power_of_two_scale(dtype):
    fmax = torch.finfo(dtype).max
    t = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 37.0
    t8, inv = fp8.quantize(t, dtype)
    scale = 1.0 / float(inv)
    assert t8.dtype == dtype and inv.dtype == torch.float32 and inv.dim() == 0
    assert float(torch.log2(torch.tensor(scale))).is_integer(), scale  # exact scaling
    amax = float(t.abs().max())
    assert fmax / 2 < amax * scale <= fmax  # the largest value lands in the top binade, unsaturated
    back = t8.float() * inv
    mantissa = {fp8.E4M3: 3, fp8.E5M2: 2}[dtype]
    normal = (t.abs() * scale) >= torch.finfo(dtype).smallest_normal
    err = ((back - t).abs() / t.abs())[normal]
    assert float(err.max()) <= 2.0 ** -(mantissa + 1) + 1e-7
    assert abs(float(err.pow(2).mean().sqrt()) - RMS[dtype]) < 0.25 * RMS[dtype]  # round to nearest, not truncation


def test_quantize_of_zeros_is_zero_with_a_finite_scale():
    t8, inv = fp8.quantize(torch.zeros(32, 16), fp8.E4M3)
    assert torch.isfinite(inv) and not t8.float().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_is_within_the_fp8_rounding_bound(dtype):
    ey, edx, edw = _errors(dtype=dtype)
    assert ey < FWD_BOUND and edx < BWD_BOUND and edw < BWD_BOUND, (ey, edx, edw)
    assert ey > 1e-3  # and it is FP8: a bf16 GEMM is ~100x closer


_QUANTIZE = fp8.quantize


def _wrong_scale(t, dtype):
    t8, inv = _QUANTIZE(t, dtype)
    return t8, inv.reciprocal()  # the scale where its inverse belongs


def _truncating(t, dtype):
    """Quantisation that rounds toward zero (a cast through a truncated fp32 mantissa)."""
    fmax = torch.finfo(dtype).max
    scale = fmax / t.abs().amax().float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    y = (t.float() * scale).clamp(-fmax, fmax)
    bits = {fp8.E4M3: 3, fp8.E5M2: 2}[dtype]
    m, e = torch.frexp(y)
    y = torch.ldexp(torch.trunc(m * 2 ** (bits + 1)) / 2 ** (bits + 1), e)
    return y.to(dtype), scale.reciprocal()


@pytest.mark.parametrize("bug", [_wrong_scale, _truncating])
def test_the_bound_rejects_a_wrong_quantisation(bug, monkeypatch):
    monkeypatch.setattr(fp8, "quantize", bug)
    ey, edx, edw = _errors()
    assert not (ey < FWD_BOUND and edx < BWD_BOUND and edw < BWD_BOUND), (ey, edx, edw)


def test_the_bound_rejects_a_transposed_weight_in_the_input_gradient(monkeypatch):
    """``dx`` formed with ``w`` read as the wrong layout (a square weight makes the shapes agree)."""
    g = torch.Generator().manual_seed(3)
    x, w, dy = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g) * 0.1, torch.randn(64, 64, generator=g)
    monkeypatch.setattr(fp8, "_col_major", lambda t: t.contiguous().t())  # [in, out] where [out, in] belongs
    xq = x.clone().requires_grad_()
    fp8.linear(xq, w).backward(dy)
    assert _rel(xq.grad, dy @ w) > BWD_BOUND


def test_weight_gradient_goes_to_main_grad_overwriting_then_adding():
    """With a main_grad, the first micro-batch overwrites it (stale NaN cannot leak) and the next adds; ``w`` gets
    no gradient; the values equal the gradient returned without main_grad."""
    x, w, dy = _operands()
    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8.linear(xq, wq).backward(dy)
    want = wq.grad.float()  # bf16 of the fp32 GEMM result
    flat = torch.full((16 + w.numel(),), float("nan"))
    mg = flat[16:].view_as(w.float())
    wf = w.clone().requires_grad_()
    fp8.linear(x, wf, mg, True).backward(dy)
    assert wf.grad is None and torch.isfinite(mg).all() and int(flat[:16].isnan().sum()) == 16
    assert torch.equal(mg.to(torch.bfloat16), want.to(torch.bfloat16))
    first = mg.clone()
    fp8.linear(x, wf, mg, False).backward(dy)
    assert torch.equal(mg, first + first)


def test_check_shape_refuses_dimensions_cublaslt_cannot_run():
    fp8.check_shape(64, 48)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.check_shape(64, 40)


# ------------------------------------------------------------------ the engine
FAST = ["scenario=llama1b_h200", "hardware=cpu", "model=llama_micro", "kernels.adamw=torch", "kernels.swiglu=torch",
        "kernels.ce_chunk=torch", "engine.onepass_optimizer=false", "engine.compile=false",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.threads=1", "train.steps=4",
        "train.lr_warmup_steps=1"]


def _train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgetrain", *FAST, *extra, f"train.out_dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=hang_s())


def _losses(out: Path) -> list[float]:
    import json

    rows = [json.loads(x) for x in (out / "trace" / "trace.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r and "step" in r]


def test_engine_trains_with_fp8_close_to_bf16_and_not_equal(tmp_path):
    """The Hopper engine with engine.fp8=tensorwise (grad accumulation fusion on, as in the scenario default) trains
    4 steps from the same init; its losses stay within 1% of the bf16 engine's and are not identical to them (the
    switch is honoured)."""
    a, b = _train(tmp_path / "bf16"), _train(tmp_path / "fp8", "engine.fp8=tensorwise")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    la, lb = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp8")
    assert len(la) == len(lb) == 4
    assert la != lb
    assert max(abs(x - y) / x for x, y in zip(la, lb)) < 0.01, (la, lb)


@pytest.mark.parametrize("extra,msg", [
    (["engine.fp8=e4m3"], "engine.fp8 must be none|tensorwise, got 'e4m3'"),
    (["mode=exact", "engine.fp8=tensorwise"], "engine.fp8=tensorwise needs engine.mode=fast"),
    (["engine.fp8=tensorwise", "model.ffn_hidden_size=88"], "engine.fp8 needs linear dimensions that are "
                                                            "multiples of 16"),
])
def test_bad_fp8_config_is_one_error_line_and_writes_nothing(extra, msg, tmp_path):
    p = _train(tmp_path / "run", *extra)
    lines = [x for x in p.stderr.strip().splitlines() if x]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert lines[-1].startswith("error: ") and msg in lines[-1], lines[-1]
    assert not (tmp_path / "run").exists()


def test_bench_labels_an_fp8_side_and_records_it(tmp_path):
    """bench runs the FP8 engine, says in one note that its MFU is still against the bf16 peak, and bench.json
    records the GEMM precision in the forged side's engine info and the note among its warnings."""
    import json

    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *FAST[:-2], "engine.fp8=tensorwise",
                        "bench.against=[]", "bench.steps=1", "bench.warmup=1", "bench.single_micro_batch=false",
                        f"bench.out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=hang_s())
    assert p.returncode == 0, p.stderr[-2000:]
    note = "note: side 'forged' runs its decoder layers' GEMMs in FP8 (engine.fp8=tensorwise)"
    assert note in p.stdout, p.stdout[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["engine_info"]["forged"]["fp8"] == "tensorwise"
    assert any(w.startswith(note) for w in res["warnings"])


def test_recompute_with_fp8_is_bitwise(tmp_path):
    """engine.recompute=full (bitwise tier) stays bitwise under engine.fp8: the recomputed forward quantises the same
    tensors with the same scales, so every loss and grad norm of 4 steps is the same bits."""
    a = _train(tmp_path / "stored", "engine.fp8=tensorwise")
    b = _train(tmp_path / "recompute", "engine.fp8=tensorwise", "engine.recompute=full")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    import json

    def rows(out):
        return [(r["loss"], r.get("grad_norm")) for r in map(json.loads, (out / "trace" / "trace.jsonl").read_text()
                                                             .splitlines()) if "loss" in r and "step" in r]

    assert rows(tmp_path / "stored") == rows(tmp_path / "recompute") != []


def test_any_token_count_runs_and_padding_is_exact():
    """37 tokens (a generation step, a short sequence) are padded to 48 with zero rows for the GEMMs' multiple of 16:
    the outputs and gradients equal those of the same 37 rows run with 11 explicit zero rows appended (zero rows
    change no amax), and stay within the FP8 bound of fp64."""
    x, w, dy = _operands()
    x, dy = x.reshape(-1, 96)[:37], dy.reshape(-1, 48)[:37]
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya = fp8.linear(xa, wa)
    ya.backward(dy)
    xb, wb = torch.cat([x, torch.zeros(11, 96, dtype=x.dtype)]).requires_grad_(), w.clone().requires_grad_()
    yb = fp8.linear(xb, wb)
    yb.backward(torch.cat([dy, torch.zeros(11, 48, dtype=dy.dtype)]))
    assert ya.shape == (37, 48) and torch.equal(ya, yb[:37]) and not yb[37:].any()
    assert torch.equal(xa.grad, xb.grad[:37]) and torch.equal(wa.grad, wb.grad)
    assert _rel(ya, F.linear(x.double(), w.double())) < FWD_BOUND


def test_resume_names_a_changed_engine_setting(tmp_path):
    """engine.* settings stay out of the config hash (goldens are the reference's), but a resume with another one
    (here FP8 switched off) is named in a warning: the steps after it are computed another way."""
    out = tmp_path / "run"
    a = _train(out, "engine.fp8=tensorwise", "train.save_interval=2")
    assert a.returncode == 0, a.stderr[-2000:]
    b = _train(out, "train.resume=true", "train.steps=6")
    assert b.returncode == 0, b.stderr[-2000:]
    assert "with engine settings different from the checkpoint's: engine.fp8 tensorwise -> none" in b.stderr, \
        b.stderr[-2000:]
    c = _train(out, "train.resume=true", "train.steps=8")  # b's checkpoint, b's engine: no such warning
    assert c.returncode == 0 and "engine settings different" not in c.stderr, c.stderr[-2000:]


def test_the_run_banner_names_fp8(tmp_path):
    p = _train(tmp_path / "run", "engine.fp8=tensorwise", "train.steps=2")
    assert p.returncode == 0 and "bf16 (FP8 GEMMs in the decoder layers: engine.fp8=tensorwise) on cpu" in p.stderr, \
        p.stderr[-2000:]


# ------------------------------------------------------------------ the LM head (engine.fp8_lm_head)
def _head_operands(seed: int = 0):
    """h [40, 64] bf16 (40 tokens: padded to 48 inside), w [160, 64] bf16, labels [40]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(160, 64, generator=g) * 0.2).to(torch.bfloat16)
    return h, w, torch.randint(0, 160, (40,), generator=g)


def _head_errors(chunk: int = 16) -> tuple[float, float, float]:
    """Relative errors of (per-token loss, dh, dw) of the chunked cross-entropy with FP8 head GEMMs against fp64."""
    from scenarios.llama1b_h200.fast import ChunkedLinearCE

    h, w, labels = _head_operands()
    hq, wq = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, tok = ChunkedLinearCE.apply(hq, wq, labels, chunk, None, None, None, "torch", True)
    loss.backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    tok64 = F.cross_entropy(h64 @ w64.t(), labels, reduction="none")
    tok64.mean().backward()
    return _rel(tok, tok64), _rel(hq.grad, h64.grad), _rel(wq.grad, w64.grad)


@pytest.mark.parametrize("chunk", [16, 64])
def test_fp8_lm_head_is_within_the_fp8_rounding_bound(chunk):
    """The loss is bounded by the logits' forward error (e4m3 x e4m3); d(h) and d(W) by a backward GEMM's (e5m2 x
    e4m3), the bounds of :class:`fp8.Fp8Linear` (module doc): the logits' error reaches g = softmax - onehot only
    damped by the softmax, so each backward GEMM's own rounding dominates (measured here: 0.066 against the 0.059
    that the bound's 1.5x covers). Several chunks (16 tokens) or one (64)."""
    el, edh, edw = _head_errors(chunk)
    assert 0 < el < FWD_BOUND and 0 < edh < BWD_BOUND and 0 < edw < BWD_BOUND, (el, edh, edw)


@pytest.mark.parametrize("bug", [_wrong_scale, _truncating])
def test_the_head_bound_rejects_a_wrong_quantisation(bug, monkeypatch):
    monkeypatch.setattr(fp8, "quantize", bug)
    el, edh, edw = _head_errors()
    assert not (el < FWD_BOUND and edh < BWD_BOUND and edw < BWD_BOUND), (el, edh, edw)


def test_fp8_lm_head_weight_gradient_goes_to_main_grad_scaled_overwriting_then_adding():
    """Under gradient accumulation fusion the head's dW goes to main_grad times the loss scale (1/n): the first
    micro-batch overwrites it (stale NaN cannot leak), the next adds; equal to the unfused FP8 head's gradient."""
    from scenarios.llama1b_h200.fast import ChunkedLinearCE
    from scenarios.llama1b_h200.wgrad import WGradAccum

    h, w, labels = _head_operands()
    wq = w.clone().requires_grad_()
    loss, _ = ChunkedLinearCE.apply(h, wq, labels, 16, None, None, None, "torch", True)
    (loss * 0.5).backward()
    mg = torch.full(w.shape, float("nan"))
    wf = w.clone().requires_grad_()
    loss, _ = ChunkedLinearCE.apply(h, wf, labels, 16, mg, WGradAccum(True, 0.5, "fp32_upcast"), None, "torch", True)
    (loss * 0.5).backward()
    assert wf.grad is None and torch.isfinite(mg).all()
    assert _rel(mg, wq.grad.float()) < 1e-2  # the unfused gradient is rounded to bf16 once
    first = mg.clone()
    ChunkedLinearCE.apply(h, wf, labels, 16, mg, WGradAccum(False, 0.5, "fp32_upcast"), None, "torch", True)
    torch.testing.assert_close(mg, first + first, rtol=1e-6, atol=0)  # chunk by chunk onto it: fp32 rounding only


def test_engine_trains_with_the_fp8_lm_head_close_and_not_equal(tmp_path):
    """engine.fp8_lm_head=true changes the run (the switch is honoured) and stays within 1% of FP8 without it."""
    a = _train(tmp_path / "fp8", "engine.fp8=tensorwise")
    b = _train(tmp_path / "head", "engine.fp8=tensorwise", "engine.fp8_lm_head=true")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    assert "FP8 GEMMs in the decoder layers and the LM head" in b.stderr
    la, lb = _losses(tmp_path / "fp8"), _losses(tmp_path / "head")
    assert len(la) == len(lb) == 4 and la != lb
    assert max(abs(x - y) / x for x, y in zip(la, lb)) < 0.01, (la, lb)


@pytest.mark.parametrize("extra,msg", [
    (["engine.fp8_lm_head=true"], "engine.fp8_lm_head=true needs engine.fp8=tensorwise and "
                                  "kernels.cross_entropy=chunked"),
    (["engine.fp8=tensorwise", "engine.fp8_lm_head=true", "kernels.cross_entropy=torch"],
     "got engine.fp8=tensorwise, kernels.cross_entropy=torch"),
    (["engine.fp8=tensorwise", "engine.fp8_lm_head=true", "model.vocab_size=4104"],
     "engine.fp8 needs linear dimensions that are multiples of 16"),
])
def test_bad_fp8_lm_head_config_is_one_error_line_and_writes_nothing(extra, msg, tmp_path):
    test_bad_fp8_config_is_one_error_line_and_writes_nothing(extra, msg, tmp_path)
