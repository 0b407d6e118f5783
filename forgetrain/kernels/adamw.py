"""Multi-tensor AdamW step (Triton) with fp32 main weights and low-precision model weights copied back.

Replaces ``torch.optim.AdamW(foreach=False).step()`` on fp32 main params (the functional
``torch.optim.adamw.adamw(..., foreach=False)``) followed by ``param.copy_(main_param)``.

Arithmetic, mirroring ``torch.optim.adam._single_tensor_adam`` with ``decoupled_weight_decay=True`` (Loshchilov &
Hutter 2019, "Decoupled Weight Decay Regularization"; Kingma & Ba 2015) operation by operation, in fp32 with
the Python-double scalars rounded to fp32 as torch does when it applies a Python scalar to an fp32 tensor:

    p   = p * (1 - lr * wd)                                     param.mul_(1 - lr * weight_decay)
    m   = m + (1 - b1) * (g - m)         if 1 - b1 < 0.5        exp_avg.lerp_(grad, 1 - beta1)
        = g - (g - m) * (1 - (1 - b1))   otherwise              (torch's lerp formula for large weights)
    v   = v * b2 + ((1 - b2) * g) * g                           exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    bc1 = 1 - b1 ** step,  bc2 = 1 - b2 ** step                 (Python doubles)
    denom = sqrt(v) / sqrt(bc2) + eps                           (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p   = p + (-lr / bc1) * (m / denom)                         param.addcdiv_(exp_avg, denom, value=-step_size)

``sqrt`` and ``/`` use the IEEE round-to-nearest forms (``tl.sqrt_rn``, ``tl.div_rn``), as torch's kernels do.
The result is not guaranteed bitwise equal to torch: both sides may contract a multiply-add into an FMA
differently (nvcc and Triton/LLVM both contract by default), so the spec is validated statistically.

One launch per group of tensors sharing dtypes: a table of per-tensor addresses and sizes plus a table of
(tensor, block start) pairs lets every program find its block, so hundreds of parameters cost one launch.
"""

from __future__ import annotations

import collections

import torch

from forgetrain.kernels import torch_ops
from forgetrain.kernels._triton import check_device, interpreting, tl, triton
from forgetrain.kernels.spec import KernelSpec

__all__ = ["adamw_step", "SPEC"]

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _ld(ptr, mask, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(ptr, mask=mask, other=0.0)
    else:
        x = tl.load(ptr)
    return x.to(tl.float32)


@triton.jit
def _st(ptr, val, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr, val.to(ptr.dtype.element_ty))


@triton.jit
def _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, decay, w1, b2, omb2, step_size_neg, bc2_sqrt,
                  eps, gs, HAS_MAIN: tl.constexpr, HAS_GS: tl.constexpr, LERP_SMALL: tl.constexpr,
                  MASKED: tl.constexpr):
    if HAS_MAIN:
        w = _ld(w_ptr + offs, mask, MASKED)
    else:
        w = _ld(p_ptr + offs, mask, MASKED)
    g = _ld(g_ptr + offs, mask, MASKED)
    if HAS_GS:  # clipping folded in: g * coeff in fp32, the product Megatron's clip writes back into main_grad
        g = g * gs
    m = _ld(m_ptr + offs, mask, MASKED)
    v = _ld(v_ptr + offs, mask, MASKED)
    w = w * decay
    if LERP_SMALL:
        m = tl.fma(w1, g - m, m)
    else:
        m = tl.fma(-(g - m), 1.0 - w1, g)
    v = v * b2
    v = tl.fma(omb2 * g, g, v)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = tl.fma(step_size_neg, tl.div_rn(m, denom), w)
    _st(m_ptr + offs, m, mask, MASKED)
    _st(v_ptr + offs, v, mask, MASKED)
    if HAS_MAIN:
        _st(w_ptr + offs, w, mask, MASKED)
    _st(p_ptr + offs, w, mask, MASKED)


@triton.jit
def _adamw_kernel(TABLE, BLOCKS, decay, w1, b2, omb2, step_size_neg, bc2_sqrt, eps, GS,
                  P_DT: tl.constexpr, G_DT: tl.constexpr, HAS_MAIN: tl.constexpr, HAS_GS: tl.constexpr,
                  LERP_SMALL: tl.constexpr, ALIGN_HINT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if HAS_GS:
        gs = tl.load(GS)
    else:
        gs = 1.0
    ti = tl.load(BLOCKS + 2 * pid)
    start = tl.load(BLOCKS + 2 * pid + 1)
    row = TABLE + 6 * ti
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DT))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    w_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    n = tl.load(row + 5)
    if ALIGN_HINT:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    if start + BLOCK <= n:
        _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, decay, w1, b2, omb2, step_size_neg, bc2_sqrt,
                      eps, gs, HAS_MAIN, HAS_GS, LERP_SMALL, False)
    else:
        _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, decay, w1, b2, omb2, step_size_neg, bc2_sqrt,
                      eps, gs, HAS_MAIN, HAS_GS, LERP_SMALL, True)


_TABLES: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_ALIGN_HINT_OK = {"ok": True}


def _block_size(device: torch.device) -> int:
    """Elements per program. The same on both device types, so that the CPU interpreter runs the GPU's blocking
    (full blocks and masked tails); at 256 the interpreter ran 14x slower for no extra coverage."""
    del device
    return 2048


def _tables(group: list, block: int, device: torch.device):
    """(table int64 [T, 6], blocks int64 [NB, 2]) for one dtype group; cached on the tensors' addresses."""
    rows = [(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), w.data_ptr() if w is not None else 0,
             p.numel()) for p, g, m, v, w in group]
    key = (str(device), block, tuple(rows))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    blocks = [(ti, s) for ti, r in enumerate(rows) for s in range(0, r[5], block)]
    table = torch.tensor(rows, dtype=torch.int64)
    blk = torch.tensor(blocks, dtype=torch.int64).reshape(-1, 2)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
        blk = blk.pin_memory().to(device, non_blocking=True)
    _TABLES[key] = (table, blk)
    while len(_TABLES) > 32:
        _TABLES.popitem(last=False)
    return table, blk


def adamw_step(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, main_params: list | None = None,
               *, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
               wd: float = 0.0, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step over lists of tensors, in place (one kernel launch per dtype group).

    Args:
        params: model weights. With ``main_params``: any float dtype (bf16 typically), overwritten with the
            rounded new main weights. Without: updated in place (computed in fp32 from their own values).
        grads: gradients, one per param, same shape, any float dtype (upcast to fp32; fp32 main grads typically).
        exp_avgs, exp_avg_sqs: fp32 first / second moments, same shapes, updated in place.
        main_params: optional fp32 master weights, same shapes, updated in place.
        step: the 1-based step number of this update (torch's ``state["step"]`` after its increment).
        lr, beta1, beta2, eps, wd: as ``torch.optim.AdamW(lr, (beta1, beta2), eps, weight_decay=wd)``.
        grad_scale: optional fp32 tensor of one element on the tensors' device: every gradient is multiplied by
            it (in fp32, in registers; ``grads`` are not written) before the update. This folds gradient clipping
            into the step without a host sync: pass ``min(1, clip / (norm + 1e-6))`` computed on the device
            (Megatron's ``clip_grad_by_total_norm_fp32`` coefficient; multiplying by exactly 1.0 changes nothing).
    All tensors must be contiguous and on one device.
    Raises:
        ValueError: mismatched list lengths, shapes or dtypes, non-contiguous tensors, step < 1, a grad_scale
            that is not one fp32 element.
    """
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n) or (main_params is not None
                                                                      and len(main_params) != n):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs (and main_params) must have equal lengths")
    if int(step) < 1:
        raise ValueError(f"step must be >= 1 (1-based), got {step}")
    if n == 0:
        return
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32):
        raise ValueError(f"grad_scale must be one float32 element, got {grad_scale.dtype} x {grad_scale.numel()}")
    groups: dict = {}
    for i in range(n):
        p, g, m, v = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        w = main_params[i] if main_params is not None else None
        ts = [t for t in (p, g, m, v, w) if t is not None]
        for t in ts:
            if t.shape != p.shape:
                raise ValueError(f"tensor {i}: shape {tuple(t.shape)} != param shape {tuple(p.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"tensor {i}: all tensors must be contiguous")
            if t.dtype not in _TL_DTYPE:
                raise ValueError(f"tensor {i}: unsupported dtype {t.dtype}")
        if m.dtype != torch.float32 or v.dtype != torch.float32 or (w is not None and w.dtype != torch.float32):
            raise ValueError(f"tensor {i}: exp_avg, exp_avg_sq and main_params must be float32")
        if p.numel() == 0:
            continue
        aligned = all(t.data_ptr() % 16 == 0 for t in ts)
        groups.setdefault((p.dtype, g.dtype, w is not None, aligned), []).append((p, g, m, v, w))
    check_device(*[t for grp in groups.values() for tup in grp for t in tup if t is not None] or [params[0]],
                 *([grad_scale] if grad_scale is not None else []))

    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    scal = dict(decay=1.0 - lr * wd, w1=1.0 - beta1, b2=beta2, omb2=1.0 - beta2, step_size_neg=-(lr / bc1),
                bc2_sqrt=bc2 ** 0.5, eps=eps)
    lerp_small = abs(1.0 - beta1) < 0.5
    for (pdt, gdt, has_main, aligned), grp in groups.items():
        device = grp[0][0].device
        block = _block_size(device)
        table, blk = _tables(grp, block, device)
        nb = blk.shape[0]
        args = (table, blk, scal["decay"], scal["w1"], scal["b2"], scal["omb2"], scal["step_size_neg"],
                scal["bc2_sqrt"], scal["eps"], grad_scale if grad_scale is not None else table)
        kw = dict(P_DT=_TL_DTYPE[pdt], G_DT=_TL_DTYPE[gdt], HAS_MAIN=has_main, HAS_GS=grad_scale is not None,
                  LERP_SMALL=lerp_small, BLOCK=block,
                  num_warps=8 if block >= 2048 else 4)
        hint = aligned and _ALIGN_HINT_OK["ok"] and not interpreting()
        if hint:
            try:
                _adamw_kernel[(nb,)](*args, ALIGN_HINT=True, **kw)
                continue
            except Exception as e:  # noqa: BLE001 - a compiler that rejects the pointer hint: run without it
                _ALIGN_HINT_OK["ok"] = False
                print(f"forgetrain.kernels.adamw: alignment hint rejected ({type(e).__name__}); running without it")
        _adamw_kernel[(nb,)](*args, ALIGN_HINT=False, **kw)


# ------------------------------------------------------------------------------------------------ spec

_HYPER = ("step", "lr", "beta1", "beta2", "eps", "wd")


def candidate_from(fn):
    def _candidate(inp):
        gs = inp.get("grad_scale")
        kw = {} if gs is None else {"grad_scale": torch.tensor([gs], dtype=torch.float32,
                                                                device=inp["grads"][0].device)}
        fn(inp["params"], inp["grads"], inp["exp_avgs"], inp["exp_avg_sqs"], inp["main_params"],
           **{k: inp[k] for k in _HYPER}, **kw)
        return {k: inp[k] for k in ("main_params", "exp_avgs", "exp_avg_sqs", "params")}
    return _candidate


def _scaled(inp):
    """The grads as the replaced ops see them: ``g * coeff`` in fp32 (the clip pass) when a grad_scale is given."""
    gs = inp.get("grad_scale")
    if gs is None:
        return inp["grads"]
    return [g.to(torch.float64 if g.dtype == torch.float64 else torch.float32) * gs for g in inp["grads"]]


def _reference(inp):
    torch_ops.adamw_step(inp["params"], _scaled(inp), inp["exp_avgs"], inp["exp_avg_sqs"], inp["main_params"],
                         **{k: inp[k] for k in _HYPER})
    return {k: inp[k] for k in ("main_params", "exp_avgs", "exp_avg_sqs", "params")}


def _oracle(inp):
    b1, b2, lr, wd, eps, step = (inp[k] for k in ("beta1", "beta2", "lr", "wd", "eps", "step"))
    bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
    mains, ms, vs = [], [], []
    for w, g, m, v in zip(inp["main_params"], _scaled(inp), inp["exp_avgs"], inp["exp_avg_sqs"]):
        w = w * (1.0 - lr * wd)
        m = m + (1.0 - b1) * (g - m)
        v = b2 * v + (1.0 - b2) * g * g
        w = w - (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
        mains.append(w)
        ms.append(m)
        vs.append(v)
    return {"main_params": mains, "exp_avgs": ms, "exp_avg_sqs": vs, "params": [w.clone() for w in mains]}


def _derived(inputs, outs):
    """The update actually applied, p_new - p_old, in fp64: far more sensitive than p_new itself (|update| is
    ~lr while |p| ~ 0.02-1), and it exposes elements a kernel skipped (update 0 instead of ~lr)."""
    return {"update": [n.double() - o.double() for n, o in zip(outs["main_params"], inputs["main_params"])]}


def _make_inputs(shape, dtype, device, gen):
    gdt = getattr(torch, shape.get("grad_dtype", "float32"))
    main, params, grads, ms, vs = [], [], [], [], []
    for i, s in enumerate(shape["shapes"]):
        scale = 1.0 if len(s) == 1 else 0.02  # norm gains ~1, matrices ~0.02
        w = (torch.randn(*s, generator=gen, device=device) * scale + (1.0 if len(s) == 1 else 0.0))
        g = torch.randn(*s, generator=gen, device=device) * 1e-2
        m = torch.randn(*s, generator=gen, device=device) * 3e-3
        v = (torch.randn(*s, generator=gen, device=device) * 1e-2).square() + 1e-6
        main.append(w.float())
        params.append(w.to(dtype))
        grads.append(g.to(gdt))
        ms.append(m.float())
        vs.append(v.float())
    return {"params": params, "grads": grads, "exp_avgs": ms, "exp_avg_sqs": vs, "main_params": main,
            "step": int(shape.get("step", 10)), "lr": float(shape.get("lr", 3e-4)),
            "beta1": float(shape.get("beta1", 0.9)), "beta2": float(shape.get("beta2", 0.95)),
            "eps": float(shape.get("eps", 1e-8)), "wd": float(shape.get("wd", 0.1)),
            **({"grad_scale": float(shape["grad_scale"])} if "grad_scale" in shape else {})}


def _cost(shape, dtype):
    n = 0
    for s in shape["shapes"]:
        k = 1
        for d in s:
            k *= d
        n += k
    gb = torch.tensor([], dtype=getattr(torch, shape.get("grad_dtype", "float32"))).element_size()
    pb = torch.tensor([], dtype=dtype).element_size()
    return {"fwd": {"bytes": n * (8 + 8 + 8 + gb + pb), "flops": 16 * n}, "bwd": {"bytes": 0, "flops": 0}}


def _layer(h, ffn, heads, kv_heads):
    """The parameter shapes of one Llama decoder layer (q, k, v, o, gate, up, down, two norms)."""
    head_dim = h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return [[q, h], [kv, h], [kv, h], [h, q], [ffn, h], [ffn, h], [h, ffn], [h], [h]]


SPEC = KernelSpec(
    name="adamw",
    module=__name__,
    api="adamw_step(params, grads, exp_avgs, exp_avg_sqs, main_params=None, *, step, lr, beta1, beta2, eps, wd, "
        "grad_scale=None)",
    replaces="torch.optim.AdamW(foreach=False).step() on fp32 main params (torch.optim.adamw.adamw(..., "
             "foreach=False)); then params[i].copy_(main_params[i]); with grad_scale, preceded by the clip pass "
             "g.mul_(coeff)",
    candidate=candidate_from(adamw_step),
    reference=_reference,
    oracle=_oracle,
    make_inputs=_make_inputs,
    inputs={"params": "list of [*] dtype (model weights)", "grads": "list of [*] fp32 or bf16",
            "exp_avgs": "list of [*] fp32", "exp_avg_sqs": "list of [*] fp32", "main_params": "list of [*] fp32",
            "step/lr/beta1/beta2/eps/wd": "python scalars",
            "grad_scale": "optional python float (a one-element fp32 tensor to the kernel)"},
    outputs={"main_params": "updated in place", "exp_avgs": "updated in place", "exp_avg_sqs": "updated in place",
             "params": "overwritten with main_params rounded to dtype",
             "update (derived)": "main_params_new - main_params_old, fp64"},
    saved={},
    dtypes=(torch.bfloat16,),
    shapes={
        "small": ({"shapes": [[64, 48], [100], [33, 7]], "step": 1},
                  {"shapes": [[130, 17], [5], [300]], "step": 1000, "grad_dtype": "bfloat16", "wd": 0.0},
                  {"shapes": [[40, 40]], "step": 7, "beta1": 0.3},
                  {"shapes": [[64, 48], [100]], "step": 5, "grad_scale": 0.37}),  # clipping folded in
        "full": ({"shapes": _layer(2048, 8192, 32, 8), "step": 100, "grad_scale": 0.5},
                 {"shapes": _layer(4096, 14336, 32, 8), "step": 100}),
    },
    cost=_cost,
    inplace=True,
    derived=_derived,
)
