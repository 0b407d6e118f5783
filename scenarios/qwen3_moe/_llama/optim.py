"""The optimizer step of the forged Llama engines: Megatron's grad norm and clipping, torch AdamW's arithmetic
and the AdamW state (whole tensors, or ZeRO-1 shards of the flat buffer).

Sources: megatron-core 0.16.1 ``optimizer/clip_grads.py`` (``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``)
for the norm and the clip; torch 2.x ``optim/adamw.py`` (``_single_tensor_adamw``, ``_multi_tensor_adamw``,
``_fused_adamw``) for AdamW. Weight decay applies to 2-D weights only (Megatron sets wd_mult=0 for 1-D params).

An AdamW state is a dict ``{"step": float, "exp_avg": tensor, "exp_avg_sq": tensor}`` elementwise-aligned with
its parameter (a whole tensor, or a ZeRO-1 piece: a flat 1-D view).
"""

from __future__ import annotations

import torch

from .model import TP1, TPGroup

CLIP_EPS = 1.0e-6  # Megatron's clip_grad_by_total_norm_fp32: coeff = max_norm / (total_norm + 1e-6)


def fresh_state(params: dict[str, torch.Tensor], host: tuple | list = (), pin: bool = False) -> dict[str, dict]:
    """Zero AdamW state for every tensor of ``params`` (``step`` 0.0, moments shaped like the tensor, on its
    device). The names in ``host`` get their moments in host memory instead (page-locked with ``pin``: the
    optimizer offload, :class:`HostMoments`), never allocated on the device."""
    def zeros(k, v):
        if k in host:
            return torch.zeros(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin)
        return torch.zeros_like(v)

    return {k: {"step": 0.0, "exp_avg": zeros(k, v), "exp_avg_sq": zeros(k, v)} for k, v in params.items()}


def shard_state(ddp, device: torch.device, step: float):
    """ZeRO-1: the AdamW moments of this rank's shard of ``ddp`` (a ``GradBuffer`` with ``zero1``) as two flat
    fp32 buffers ``[shard_numel]``; returns ``(m_shard, v_shard, state)`` where ``state`` maps each owned piece's
    parameter name to views of them."""
    n = ddp.shard_numel()
    m_shard = torch.zeros(n, dtype=torch.float32, device=device)
    v_shard = torch.zeros(n, dtype=torch.float32, device=device)
    state = {}
    for pc in ddp.pieces:
        o = ddp.shard_offset(pc.buf_start)
        k = pc.buf_end - pc.buf_start
        state[pc.name] = {"step": float(step), "exp_avg": m_shard[o:o + k], "exp_avg_sq": v_shard[o:o + k]}
    return m_shard, v_shard, state


def grad_norm(grads: list[torch.Tensor], tp: TPGroup = TP1, device: torch.device | str = "cpu") -> float:
    """Megatron's global L2 norm: per-tensor norms (host) -> ``norm(tensor(norms))`` -> fp32 ``[x] ** 2`` on
    ``device`` -> ``.item() ** 0.5``. ``grads`` in the grad-norm order (:func:`.layout.norm_order`). Under TP
    the replicated 1-D norm weights count on TP rank 0 only and the squares are all-reduced over TP
    (``get_grad_norm_fp32``'s model-parallel group)."""
    terms = [g for g in grads if tp.rank == 0 or g.dim() > 1]
    l2 = torch.norm(torch.tensor([float(torch.norm(g)) for g in terms], dtype=torch.float32))
    total_sq = torch.tensor([float(l2)], dtype=torch.float32, device=device) ** 2.0
    if tp.size > 1:
        tp.all_reduce(total_sq)
    return total_sq.item() ** 0.5


def clip_coeff(clip_grad: float, norm: float) -> float | None:
    """Megatron's clip coefficient ``clip_grad / (norm + 1e-6)``, or None when no clipping applies
    (``clip_grad`` 0, or a coefficient >= 1)."""
    if clip_grad > 0:
        coeff = clip_grad / (norm + CLIP_EPS)
        if coeff < 1.0:
            return coeff
    return None


def clip_(grads, norm: float, clip_grad: float) -> None:
    """Clip by the total norm in place, Megatron's arithmetic: ``g.copy_(g * coeff)`` when a coefficient applies."""
    coeff = clip_coeff(clip_grad, norm)
    if coeff is not None:
        for g in grads:
            g.copy_(g * coeff)


@torch.no_grad()
def onepass_update(main: dict, main_grad: dict, model: dict, adam_state: dict, order: list[str], lr: float, t,
                   bf16: bool, default_step: float) -> float:
    """The optimizer step in one pass (``engine.onepass_optimizer``, fast mode, no ZeRO): the fast path's grad norm
    (per-tensor norms, then their norm) kept on the device; Megatron's clip coefficient ``clip / (norm + 1e-6)``
    formed there in fp64 from the fp32 norm (as the host forms it from ``float(norm)``), capped at 1 and rounded
    to fp32; then one Triton AdamW launch per parameter group (2-D weights with weight decay, 1-D norms without)
    that scales each gradient by it in registers, updates the fp32 ``main`` weights and the moments, and writes
    the ``model`` weights (bf16) itself. The same arithmetic as the clip pass + ``kernels.adamw=triton`` + the
    bf16 copy, with the host sync after the update instead of before it. ``main``/``main_grad``/``model``/
    ``adam_state``: dicts by parameter name, same shapes; ``t``: the train config. Returns the grad norm."""
    from forgetrain.kernels import adamw_step

    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([main_grad[k] for k in order])))
    scale = None
    if t.clip_grad > 0:
        scale = (t.clip_grad / (norm.double() + CLIP_EPS)).clamp(max=1.0).float().reshape(1)
    for k in main:
        adam_state[k]["step"] += 1.0
    step = adam_state[order[0]]["step"] if order else default_step
    for decay in (True, False):
        ks = [k for k in main if (main[k].dim() > 1) == decay]
        if not ks:
            continue
        # a model weight that is its own main weight (fp32, or engine.bf16_weights=per_layer) updates in place
        for own in (False, True):
            sel = [k for k in ks if (not bf16 or model[k].data.data_ptr() == main[k].data_ptr()) == own]
            if not sel:
                continue
            sts = [adam_state[k] for k in sel]
            adamw_step([model[k].data for k in sel], [main_grad[k] for k in sel], [s["exp_avg"] for s in sts],
                       [s["exp_avg_sq"] for s in sts], None if own else [main[k] for k in sel], step=step, lr=lr,
                       beta1=t.adam_beta1, beta2=t.adam_beta2, eps=t.adam_eps,
                       wd=t.weight_decay if decay else 0.0, grad_scale=scale)
    return float(norm)


@torch.no_grad()
def adamw_single(items, lr: float, t) -> None:
    """torch AdamW's single-tensor arithmetic over ``(state, param, grad, decayed)`` items (``t``: the
    TrainConfig's betas, eps, weight decay). Elementwise, so a ZeRO-1 piece or an FSDP shard updates to the
    same bits as the whole tensor would. Each state's ``step`` is incremented first."""
    b1, b2, eps = t.adam_beta1, t.adam_beta2, t.adam_eps
    for st, p, g, decayed in items:
        st["step"] += 1.0
        wd = t.weight_decay if decayed else 0.0
        if wd != 0:
            p.mul_(1 - lr * wd)
        st["exp_avg"].lerp_(g, 1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
        step = st["step"]
        bc1 = 1 - b1 ** step
        bc2 = 1 - b2 ** step
        denom = (st["exp_avg_sq"].sqrt() / bc2 ** 0.5).add_(eps)
        p.addcdiv_(st["exp_avg"], denom, value=-(lr / bc1))


@torch.no_grad()
def adamw_groups(groups, lr: float, t, kernel: str, device: torch.device, default_step: float,
                 offload: "HostMoments | None" = None) -> None:
    """torch AdamW over ``groups`` = [(decayed, params, grads, states)] (one shared step count).

    Arithmetic by ``kernel`` (``kernels.adamw``) and device: ``fused`` on CUDA -> ``torch._fused_adamw_``;
    ``triton`` -> :func:`forgetrain.kernels.adamw_step`; otherwise torch's foreach path on CUDA and its
    single-tensor path elsewhere (each framework's default there). ``default_step`` is the step when no group
    holds a state (a ZeRO-1 rank that owns no piece). States whose moments live in host memory
    (``offload``, :class:`HostMoments`) are streamed through the device chunk by chunk with the same arithmetic."""
    states = [st for _, _, _, sts in groups for st in sts]
    for st in states:
        st["step"] += 1.0
    step = states[0]["step"] if states else float(default_step)
    for decay, p, g, sts in groups:
        if offload is not None:
            on_host = [offload.holds(st) for st in sts]
            if any(on_host):
                offload.update(*([x for x, h in zip(xs, on_host) if h] for xs in (p, g, sts)), decay, step, lr,
                               t, kernel, device)
                p, g, sts = ([x for x, h in zip(xs, on_host) if not h] for xs in (p, g, sts))
        if not p:
            continue
        adamw_apply(p, g, [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts], decay, step, lr, t,
                    kernel, device)


@torch.no_grad()
def adamw_apply(p, g, m, v, decay: bool, step: float, lr: float, t, kernel: str, device: torch.device) -> None:
    """One AdamW update of the tensors ``p`` (in place) from ``g`` with moments ``m``, ``v`` (in place) at
    ``step`` (already incremented), by ``kernel`` and device as :func:`adamw_groups` describes. Elementwise in
    every form, so a slice of a tensor updates to the same bits as the whole tensor would."""
    b1, b2, eps = t.adam_beta1, t.adam_beta2, t.adam_eps
    wd = t.weight_decay if decay else 0.0
    if kernel == "fused" and device.type == "cuda":
        steps = [torch.tensor(step, device=device) for _ in p]
        torch._fused_adamw_(p, g, m, v, [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                            amsgrad=False, maximize=False)
        return
    if kernel == "triton":
        from forgetrain.kernels import adamw_step

        adamw_step(p, g, m, v, step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, wd=wd)
        return
    if device.type != "cuda":  # torch's single-tensor path (its CPU default)
        for pi, gi, mi, vi in zip(p, g, m, v):
            if wd != 0:
                pi.mul_(1 - lr * wd)
            mi.lerp_(gi, 1 - b1)
            vi.mul_(b2).addcmul_(gi, gi, value=1 - b2)
            denom = (vi.sqrt() / (1 - b2 ** step) ** 0.5).add_(eps)
            pi.addcdiv_(mi, denom, value=-(lr / (1 - b1 ** step)))
        return
    # torch's foreach path (its CUDA default), same op sequence
    if wd != 0:
        torch._foreach_mul_(p, 1 - lr * wd)
    torch._foreach_lerp_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g, g, 1 - b2)
    bc1 = [1 - b1 ** step for _ in p]
    bc2 = [1 - b2 ** step for _ in p]
    step_size = [(lr / bc) * -1 for bc in bc1]
    bc2_sqrt = [bc ** 0.5 for bc in bc2]
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p, m, denom, step_size)


class HostMoments:
    """``engine.optimizer_offload_fraction``: the AdamW moments of some parameters live in host memory (pinned on
    CUDA) and are streamed through the device for the update.

    For each chunk of ``forgetrain.memory.OFFLOAD_CHUNK_ELEMS`` elements (the estimate counts its staging): its
    ``exp_avg`` and ``exp_avg_sq`` are copied into one of two device staging slots, the same AdamW arithmetic as the resident states (:func:`adamw_apply`, the same
    ``kernels.adamw`` form) updates the fp32 main weight slice in place on the device, and the moments go back to
    the host. On CUDA the copies in and out run on two side streams (PCIe is full duplex), so chunk i+1 comes in
    while chunk i is updated and chunk i-1 goes out; events order the slots' reuse. Every form of the update is
    elementwise, so a chunk updates to the same bits as the whole tensor: declared bitwise
    (``optimisations.yaml``).

    Which parameters: ``forgetrain.memory.offload_names`` (the largest first, until the fraction of elements is
    reached).
    ``state``: the engine's AdamW states by name, the chosen ones' moments already in host memory
    (:func:`fresh_state` with ``host=names``, pinned on CUDA). Raises ValueError for a chosen moment that is not.
    """

    def __init__(self, state: dict[str, dict], names: list[str], device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        for k in names:
            for key in ("exp_avg", "exp_avg_sq"):
                t = state[k][key]
                if t.device.type != "cpu" or (cuda and not t.is_pinned()):
                    raise ValueError(f"offloaded moment {k}.{key} is on {t.device} (pinned: {t.is_pinned()}); "
                                     f"make the state with fresh_state(host=names, pin=<on CUDA>)")
        self._ids = {id(state[k]) for k in names}
        self.names = list(names)
        from forgetrain.memory import OFFLOAD_CHUNK_ELEMS

        n = max((state[k]["exp_avg"].numel() for k in names), default=0)
        self.chunk = min(OFFLOAD_CHUNK_ELEMS, n)
        self._stage = [(torch.empty(self.chunk, dtype=torch.float32, device=device),
                        torch.empty(self.chunk, dtype=torch.float32, device=device)) for _ in range(2)] if n else []
        if cuda:
            self._h2d, self._d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)

    @property
    def staging_bytes(self) -> int:
        """Device bytes of the two staging slots."""
        return sum(t.numel() * t.element_size() for slot in self._stage for t in slot)

    def holds(self, st: dict) -> bool:
        """Whether the AdamW state ``st`` has its moments in host memory."""
        return id(st) in self._ids

    def synchronize(self) -> None:
        """Wait for every copy back to the host (before the host reads or writes the moments: a checkpoint saved or
        loaded)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self._d2h)
            self._d2h.synchronize()

    @torch.no_grad()
    def update(self, p, g, states, decay: bool, step: float, lr: float, t, kernel: str, device) -> None:
        """AdamW on ``p`` (device fp32 main weights) from ``g`` with host moments ``states``, chunk by chunk
        (class doc). Leaves the compute stream ordered after the last copy back."""
        chunks = []
        for pi, gi, st in zip(p, g, states):
            pf, gf = pi.view(-1), gi.view(-1)
            mf, vf = st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)
            for a in range(0, pf.numel(), self.chunk):
                b = min(a + self.chunk, pf.numel())
                chunks.append((pf[a:b], gf[a:b], mf[a:b], vf[a:b]))
        if self.device.type != "cuda":
            for i, (pc, gc, mh, vh) in enumerate(chunks):
                sm, sv = (x[:pc.numel()] for x in self._stage[i % 2])
                sm.copy_(mh), sv.copy_(vh)
                adamw_apply([pc], [gc], [sm], [sv], decay, step, lr, t, kernel, device)
                mh.copy_(sm), vh.copy_(sv)
            return
        compute = torch.cuda.current_stream(self.device)
        # the previous call's copies back read the same slots and write the same host moments
        self._h2d.wait_stream(self._d2h)
        loaded = [torch.cuda.Event(), torch.cuda.Event()]
        done = [torch.cuda.Event(), torch.cuda.Event()]
        freed: list = [None, None]
        for i, (pc, gc, mh, vh) in enumerate(chunks):
            s = i % 2
            sm, sv = (x[:pc.numel()] for x in self._stage[s])
            with torch.cuda.stream(self._h2d):
                if freed[s] is not None:
                    self._h2d.wait_event(freed[s])  # the slot's previous chunk is back on the host
                sm.copy_(mh, non_blocking=True), sv.copy_(vh, non_blocking=True)
                loaded[s].record(self._h2d)
            compute.wait_event(loaded[s])
            adamw_apply([pc], [gc], [sm], [sv], decay, step, lr, t, kernel, device)
            done[s].record(compute)
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(done[s])
                mh.copy_(sm, non_blocking=True), vh.copy_(sv, non_blocking=True)
                freed[s] = torch.cuda.Event()
                freed[s].record(self._d2h)
        compute.wait_stream(self._d2h)


def state_to_dict(adam_state: dict[str, dict]) -> dict[str, dict]:
    """Checkpoint form of whole-tensor AdamW states: ``step`` as a float64 0-dim tensor, the moments as they are."""
    return {k: {"step": torch.tensor(st["step"], dtype=torch.float64), "exp_avg": st["exp_avg"],
                "exp_avg_sq": st["exp_avg_sq"]} for k, st in adam_state.items()}


def gather_zero1_state(ddp, m_shard: torch.Tensor, v_shard: torch.Tensor, names, completed_steps: int) -> dict:
    """Checkpoint form of ZeRO-1 AdamW states: the moment shards all-gathered (a collective: every DP rank must
    call it) and cut back into full per-parameter tensors; ``step`` = ``completed_steps`` for every name."""
    m_full, v_full = ddp.gather_flat(m_shard), ddp.gather_flat(v_shard)
    step = torch.tensor(float(completed_steps), dtype=torch.float64)
    return {k: {"step": step.clone(), "exp_avg": ddp.view(m_full, k).clone(), "exp_avg_sq": ddp.view(v_full, k).clone()}
            for k in names}


@torch.no_grad()
def load_zero1_state(ddp, adam_state: dict[str, dict], saved: dict[str, dict]) -> None:
    """Copy full per-parameter moments ``saved`` (any layout's checkpoint) into this rank's ZeRO-1 pieces."""
    for pc in ddp.pieces:
        st, src = adam_state[pc.name], saved[pc.name]
        st["step"] = float(src["step"])
        st["exp_avg"].copy_(src["exp_avg"].reshape(-1)[pc.start:pc.end])
        st["exp_avg_sq"].copy_(src["exp_avg_sq"].reshape(-1)[pc.start:pc.end])
