"""The forged per-chunk cross-entropy kernel (forgetrain/kernels/ce_chunk.py) on CPU, under Triton's interpreter.

* it passes validation against the fp64 oracle beside the replaced op (``torch_ops.ce_chunk``) on its small grid;
* two planted bugs are rejected: a gradient without the one-hot subtraction, and an online sum-exp that merges
  tiles without rescaling the running sum when the running max moves;
* the Hopper engine's chunked LM head with ``kernels.ce_chunk=triton`` trains like ``kernels.ce_chunk=torch``;
* ``kernels.ce_chunk=triton`` without ``kernels.cross_entropy=chunked`` is refused in one line.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernel modules import it lazily)

import dataclasses  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from forgetrain import kernels  # noqa: E402
from forgetrain.config import validate as validate_config  # noqa: E402
from forgetrain.errors import ConfigError  # noqa: E402
from forgetrain.kernels.validate import validate  # noqa: E402
from tests.limits import hang_s  # noqa: E402
from tests.switch_helpers import ce_chunk_cfg as _engine_cfg  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ce_m = kernels.module_of("ce_chunk")


def test_validates_on_the_small_grid():
    """The kernel passes validate() on every small-grid point: several tiles with a ragged last one, logits
    large enough to overflow exp without the max shift, and the default (single-tile) block."""
    spec = ce_m.SPEC
    assert any(s.get("block") and s["vocab"] % s["block"] for s in spec.shapes["small"])  # a ragged last tile
    assert any(s.get("logit_std", 0) > 30 for s in spec.shapes["small"])  # exp(max logit) overflows fp32
    rep = validate(spec, "cpu", shapes="small")
    assert rep.passed, rep.failures
    assert {t.name for c in rep.cases for t in c.tensors} == {"loss", "dlogits"}


@triton.jit
def _ce_chunk_no_onehot(Z, LABELS, LOSS, DZ, stride_z, stride_dz, V, inv_n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    cols = tl.arange(0, BLOCK)
    z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    acc = tl.exp(z - m)
    for v0 in range(BLOCK, V, BLOCK):
        z = tl.load(base + v0 + cols, mask=(v0 + cols) < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        acc = acc * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    s = tl.sum(acc, axis=0)
    label = tl.load(LABELS + row).to(tl.int64)
    tl.store(LOSS + row, tl.log(s) + m - tl.load(base + label).to(tl.float32))
    for v0 in range(0, V, BLOCK):
        c = v0 + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        p = tl.exp(z - m) / s  # BUG: the label's column keeps softmax, without the one-hot subtraction
        tl.store(DZ + row * stride_dz + c, (p * inv_n).to(DZ.dtype.element_ty), mask=c < V)


@triton.jit
def _ce_chunk_no_rescale(Z, LABELS, LOSS, DZ, stride_z, stride_dz, V, inv_n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    cols = tl.arange(0, BLOCK)
    z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    acc = tl.exp(z - m)
    for v0 in range(BLOCK, V, BLOCK):
        z = tl.load(base + v0 + cols, mask=(v0 + cols) < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        acc = acc + tl.exp(z - m_new)  # BUG: the sum so far is relative to the old max, not rescaled to m_new
        m = m_new
    s = tl.sum(acc, axis=0)
    label = tl.load(LABELS + row).to(tl.int64)
    tl.store(LOSS + row, tl.log(s) + m - tl.load(base + label).to(tl.float32))
    for v0 in range(0, V, BLOCK):
        c = v0 + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        p = tl.exp(z - m) / s
        p = tl.where(c == label, p - 1.0, p)
        tl.store(DZ + row * stride_dz + c, (p * inv_n).to(DZ.dtype.element_ty), mask=c < V)


def test_rejects_missing_onehot():
    """A gradient without ``- onehot(label)`` is wrong only in the label's column (by inv_n, an O(1) relative
    error there): validation must fail dlogits on its max, and must not blame the loss, which is right."""
    fn = ce_m.make_ce_chunk(kernel=_ce_chunk_no_onehot)
    rep = validate(dataclasses.replace(ce_m.SPEC, candidate=ce_m.candidate_from(fn)), "cpu", shapes="small")
    assert not rep.passed
    failed = {t.name: set(t.failed) for c in rep.cases for t in c.tensors if t.failed}
    assert set(failed) == {"dlogits"} and all("max" in s for s in failed.values()), rep.failures


def test_rejects_unrescaled_tile_merge():
    """Merging a tile into the running sum without the factor exp(m_old - m_new) overweights earlier tiles
    whenever a later tile raises the max: wrong loss and gradient on the multi-tile grid points; where the block
    covers the whole row (one tile) the bug cannot show and that case passes."""
    fn = ce_m.make_ce_chunk(kernel=_ce_chunk_no_rescale)
    rep = validate(dataclasses.replace(ce_m.SPEC, candidate=ce_m.candidate_from(fn)), "cpu", shapes="small")
    assert not rep.passed
    multi = [c for c in rep.cases if c.shape.get("block")]
    single = [c for c in rep.cases if not c.shape.get("block")]
    assert multi and all(not c.ok for c in multi), rep.failures
    assert all({"loss", "dlogits"} <= {t.name for t in c.tensors if t.failed} for c in multi), rep.failures
    assert single and all(c.ok for c in single), rep.failures


def test_public_function_refuses_bad_inputs():
    """Wrong shapes, dtypes and blocks raise ValueError naming the problem."""
    z = torch.randn(4, 10, dtype=torch.bfloat16)
    lab = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="logits must be a floating point"):
        ce_m.ce_chunk(z.view(-1), lab, 0.25)
    with pytest.raises(ValueError, match="labels must be int64"):
        ce_m.ce_chunk(z, lab.float(), 0.25)
    with pytest.raises(ValueError, match="power of two"):
        ce_m.ce_chunk(z, lab, 0.25, block=12)


def test_engine_switch_matches_torch():
    """``check_engine_matches_torch`` in its own process (Triton 3.6's interpreter keeps state between kernels in
    one process; see tests/test_hopper_cpu.py)."""
    p = subprocess.run([sys.executable, "-c", "import tests.switch_helpers as t; t.check_engine_matches_torch()"],
                       cwd=ROOT, capture_output=True, text=True, timeout=hang_s(),
                       env=dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-3000:]


def test_needs_chunked_cross_entropy():
    """``kernels.ce_chunk=triton`` replaces a part of the chunked LM head; with any other cross_entropy value it is
    refused by config validation, in one line naming both switches."""
    for ce in ("torch", "triton"):
        one_line = r"^kernels\.ce_chunk=triton needs kernels\.cross_entropy=chunked[^\n]*$"
        with pytest.raises(ConfigError, match=one_line):
            validate_config(_engine_cfg("triton", ce))
