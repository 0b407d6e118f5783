"""Cross-entropy of one chunk of logits, loss and gradient in one kernel (Triton), replacing the torch ops of
``torch_ops.ce_chunk`` (the fast Hopper engine's ``_ce_chunk``, compiled by inductor on CUDA).

Used by the chunked LM head (``kernels.cross_entropy=chunked``, ``scenarios/llama1b_h200/fast.py``): per token
chunk, its logits ``[n, V]`` come from one matmul and this kernel turns them into the per-token loss and the
gradient of the mean loss with respect to them, inside the forward of the chunked autograd function (so it needs
no backward of its own).

Math (softmax cross-entropy with the max-shifted log-sum-exp, Blanchard, Higham & Higham 2021, "Accurately
computing the log-sum-exp and softmax functions", IMA J. Numer. Anal. 41(4); the online, tile-by-tile max
and sum-exp merge of Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"), all in fp32 on
``z = logits`` upcast, for row ``r`` with label ``y_r``:

    m_r        = max_v z_rv
    s_r        = sum_v exp(z_rv - m_r)
    loss_r     = log(s_r) + m_r - z_{r, y_r}                                       (fp32)
    dlogits_rv = (exp(z_rv - m_r) / s_r - [v == y_r]) * inv_n                      (rounded to logits.dtype)

One program per row, two passes over it in ``BLOCK``-wide tiles. Pass 1 keeps a running scalar max ``m`` and a
``BLOCK``-wide vector of partial sums: per tile ``m' = max(m, max(tile))``, the partial sums are rescaled by
``exp(m - m')`` (exactly 1 when the max did not move) and ``exp(z - m')`` is added lane by lane; ``s`` is the sum
of the lanes at the end. Each lane thus sums about ``V / BLOCK`` terms and the lanes are combined by a tree, as
accurate as the replaced op's one-shot sum. Pass 1 also picks ``z[y_r]``. Pass 2 re-reads the row and writes
``dlogits``. Count that read as HBM traffic: one bf16 row of 128256 logits is 250 KiB, and with up to four
16-warp programs per SM about 500 rows are in flight, more than the 50 MB L2 holds. HBM traffic: the logits read
twice and written once, ``3 * n * V * itemsize`` bytes (3.15 GB for a [4096, 128256] bf16 chunk), the traffic of
the compiled op too; the kernel's gain can only be bandwidth (the compiled op reaches about 2 TB/s on the H200).

Tiling on Hopper: ``BLOCK = min(8192, next_pow2(V))`` (16 tiles for V = 128256, the last one 5376 wide) and
``num_warps = 16`` (16 bf16 logits, two 16-byte loads, per thread and tile); pass ``block`` to override (the CPU
tests use small tiles so several tiles and a ragged last tile are exercised at small V).

Labels are not checked against ``[0, V)`` on the device and there is no ignore_index: every label is a real
class, as in the replaced op.

Validation (:data:`SPEC`): bf16 logits, the engine's dtype on the GPU; fp32 logits (the CPU engine tests in fp32)
run the same code and are judged end to end only (tests/test_fast_tiers.py), see the ``ce_chunk`` entry of
``tolerances.yaml`` for why, and for the floor of a few fp32 ulps its per-row loss gets on the small grid.

Errors: ``ce_chunk`` raises ValueError for logits that are not a 2-D floating point tensor, labels that are not an
integer ``[n]`` tensor, ``V == 0``, a ``block`` that is not a power of two, and tensors on different or unsupported
devices (``_triton.check_device``: CPU tensors need the interpreter).
"""

from __future__ import annotations

import torch

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, empty, next_pow2, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["ce_chunk", "make_ce_chunk", "SPEC"]

MAX_BLOCK = 8192  # tile width on the GPU; see the module docstring


@triton.jit
def _ce_chunk_kernel(Z, LABELS, LOSS, DZ, stride_z, stride_dz, V, inv_n, BLOCK: tl.constexpr):
    """Row ``program_id(0)``: pass 1 online max / sum-exp and z[label], then loss; pass 2 the gradient."""
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    cols = tl.arange(0, BLOCK)
    # pass 1: running max m (scalar) and per-lane partial sums of exp(z - m); masked lanes hold exp(-inf) = 0
    z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    acc = tl.exp(z - m)
    for v0 in range(BLOCK, V, BLOCK):
        z = tl.load(base + v0 + cols, mask=(v0 + cols) < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        acc = acc * tl.exp(m - m_new) + tl.exp(z - m_new)  # the factor is exactly 1 when m is unchanged
        m = m_new
    s = tl.sum(acc, axis=0)
    label = tl.load(LABELS + row).to(tl.int64)
    z_label = tl.load(base + label).to(tl.float32)
    tl.store(LOSS + row, tl.log(s) + m - z_label)
    # pass 2: dlogits = (exp(z - m) / s - onehot) * inv_n
    out = DZ + row * stride_dz
    for v0 in range(0, V, BLOCK):
        c = v0 + cols
        mask = c < V
        z = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - m) / s
        p = tl.where(c == label, p - 1.0, p)
        tl.store(out + c, (p * inv_n).to(DZ.dtype.element_ty), mask=mask)


def _block(V: int, block: int | None) -> int:
    if block is None:
        return min(MAX_BLOCK, next_pow2(V))
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return int(block)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def make_ce_chunk(kernel=_ce_chunk_kernel):
    """Build the functional API around ``kernel`` (same signature as ``_ce_chunk_kernel``; tests inject broken
    variants)."""

    def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, inv_n: float,
                 block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cross-entropy of a chunk of logits and its gradient, scaled by ``inv_n``.

        Args:
            logits: ``[n, V]`` bf16 / fp16 / fp32; the last dim must be contiguous (rows may be strided).
            labels: ``[n]`` int64 (or int32) targets in ``[0, V)`` (not range-checked on the device; no
                ignore_index).
            inv_n: python float multiplying the gradient (the engine's 1 / tokens of the mean loss).
            block: tile width, a power of two (default ``min(8192, next_pow2(V))``).
        Returns:
            ``loss`` ``[n]`` fp32 (``log sum exp z - z[label]``) and ``dlogits`` ``[n, V]`` contiguous in
            ``logits.dtype`` (``(softmax(z) - onehot(label)) * inv_n``, computed in fp32, rounded once).
            No autograd: the outputs do not require grad.
        Raises:
            ValueError: logits not 2-D floating point, labels not an integer ``[n]`` tensor, V == 0, a block
                that is not a power of two, or tensors on different / unsupported devices.
        """
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a floating point [n, V] tensor, got {logits.dtype} "
                             f"{tuple(logits.shape)}")
        n, V = logits.shape
        if labels.shape != (n,) or labels.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"labels must be int64 [{n}], got {labels.dtype} {tuple(labels.shape)}")
        if V == 0:
            raise ValueError("logits have no classes (V == 0)")
        check_device(logits, labels)
        BLOCK = _block(V, block)
        z = logits.detach()
        if z.stride(-1) != 1:
            z = z.contiguous()
        loss = empty((n,), torch.float32, z.device)
        dz = empty((n, V), z.dtype, z.device)
        if n > 0:
            kernel[(n,)](z, labels.contiguous(), loss, dz, z.stride(0), dz.stride(0), V, float(inv_n),
                         BLOCK=BLOCK, num_warps=_num_warps(BLOCK))
        return loss, dz

    return ce_chunk


ce_chunk = make_ce_chunk()


# ------------------------------------------------------------------------------------------------ spec

def candidate_from(fn):
    def _candidate(inp):
        loss, dlogits = fn(inp["logits"], inp["labels"], inp["inv_n"], inp["block"])
        return {"loss": loss, "dlogits": dlogits}
    return _candidate


def _reference(inp):
    loss, dlogits = torch_ops.ce_chunk(inp["logits"], inp["labels"], inp["inv_n"])
    return {"loss": loss, "dlogits": dlogits}


def _oracle(inp):
    """The same math in float64, written with torch's own logsumexp and softmax (independent of the reference's
    explicit max shift)."""
    z = inp["logits"]
    lab = inp["labels"]
    loss = torch.logsumexp(z, dim=-1) - z.gather(1, lab[:, None]).squeeze(1)
    onehot = torch.nn.functional.one_hot(lab, z.shape[1]).to(z.dtype)
    return {"loss": loss, "dlogits": (torch.softmax(z, dim=-1) - onehot) * inp["inv_n"]}


def _make_inputs(shape, dtype, device, gen):
    """Logits ~ N(0, logit_std^2) (default 2: softmax mass spread over many classes, as early in training);
    logit_std 60 puts row maxima near 150-200, past where fp32 exp overflows (~88.7), so a kernel without the max
    shift returns inf/NaN. ``inv_n`` = 1 / (4 n), as for a chunk of a 4-chunk batch."""
    n, V = shape["rows"], shape["vocab"]
    std = float(shape.get("logit_std", 2.0))
    logits = torch.randn(n, V, generator=gen, device=device) * std
    labels = torch.randint(0, V, (n,), generator=gen, device=device)
    return {"logits": logits.to(dtype), "labels": labels, "inv_n": 1.0 / (4 * n), "block": shape.get("block")}


def _cost(shape, dtype):
    n, V = shape["rows"], shape["vocab"]
    b = torch.tensor([], dtype=dtype).element_size()
    # minimum HBM traffic: logits read twice (max/sum-exp pass, gradient pass), dlogits written once; labels
    # (int64) read, loss (fp32) written. ~8 flops per logit (max, sub, exp, add; sub, exp, div, mul).
    return {"fwd": {"bytes": 3 * n * V * b + 8 * n + 4 * n, "flops": 8 * n * V}, "bwd": {"bytes": 0, "flops": 0}}


SPEC = KernelSpec(
    name="ce_chunk",
    module=__name__,
    api="ce_chunk(logits [n, V], labels [n] int64, inv_n: float, block=None) -> (loss [n] fp32, dlogits [n, V])",
    replaces="torch_ops.ce_chunk: z = logits.float(); loss = log(sum exp(z - max z)) + max z - z[label]; "
             "dlogits = ((exp(z - max z) / sum) - onehot) * inv_n, in logits.dtype",
    candidate=candidate_from(ce_chunk),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"logits": "[rows, vocab] dtype", "labels": "[rows] int64 in [0, vocab)",
            "inv_n": "python float (1 / (4 rows))", "block": "tile width or None (default min(8192, 2^k >= V))"},
    outputs={"loss": "[rows] fp32", "dlogits": "[rows, vocab] dtype"},
    saved={},
    dtypes=(torch.bfloat16,),
    shapes={
        "small": ({"rows": 64, "vocab": 300, "block": 64},
                  {"rows": 32, "vocab": 1000, "block": 128, "logit_std": 60.0},
                  {"rows": 48, "vocab": 257}),
        "full": ({"rows": 4096, "vocab": 128256}, {"rows": 8192, "vocab": 128256},
                 {"rows": 4096, "vocab": 128256, "logit_std": 60.0}),
        "bench": ({"rows": 4096, "vocab": 128256},),
    },
    cost=_cost,
)
