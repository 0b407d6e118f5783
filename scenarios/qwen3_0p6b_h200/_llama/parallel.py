"""Data and tensor parallelism of the forged Llama engines: Megatron-DDP's grad buffer and ZeRO-1, the TP splits,
the process groups and :class:`ParallelState` (where this rank sits), from scratch.

What is mirrored (megatron-core 0.16.1, ``distributed/param_and_grad_buffer.py`` and
``optimizer/distrib_optimizer.py``; the reference's README, "Gradient accumulation" and "ZeRO-1"):

* **One contiguous fp32 grad buffer.** Parameters enter it in *reverse* registration order (Megatron's
  ``params[::-1]``, "roughly backprop order"): ``output_layer``, ``final_norm``, then layer L-1 ``fc2, fc1,
  pre_mlp_norm, qkv, proj, input_norm`` down to layer 0, then ``embedding``. Each ``param.grad`` is a view into
  it, so autograd accumulates the micro-batches in place (``0 + g1 + g2 ...``, the same adds as Megatron's
  ``main_grad.add_(grad)``).
* **Buckets.** A new bucket starts once the current one holds >= ``bucket_size`` elements. Megatron sets
  ``bucket_size = None`` (one bucket for the whole buffer) when ``overlap_grad_reduce`` is off, which is the
  reference's setting, and ``max(4e7, 1e6 * DP)`` when it is on; both give a single bucket for the tiny models.
* **Reduction.** Per bucket: ``grad_data *= 1/DP`` (a Python float, so an fp32 multiply by ``float32(1/DP)``),
  then ``all_reduce(SUM)`` on the flat bucket (ZeRO-0) or ``reduce_scatter_tensor(SUM)`` into this rank's
  contiguous 1/DP of the bucket (ZeRO-1). With 2 ranks each element is ``r0 + r1``: commutative, so the sum is the
  same bits whatever the transport's order; with more ranks the flat layout keeps gloo's chunking identical to
  Megatron's.
* **ZeRO-1 layout.** With the distributed optimizer Megatron pads each param's start to a multiple of 64
  elements and each bucket's end to a multiple of ``lcm(DP, 128)``; rank r owns elements
  ``[r*S, (r+1)*S)`` of each bucket (``S = bucket_numel / DP``), cutting across parameter boundaries. The
  parameters themselves become views into a flat param buffer with the same layout; after the sharded AdamW
  update ``all_gather_into_tensor`` refills every rank's copy.
* **ZeRO-1 grad norm.** The norm terms are this rank's pieces (flat 1-D views), ordered by optimizer group
  (decayed 2-D weights first, then the 1-D norm weights) and, inside a group, in *buffer* order (reverse
  registration). ``norm(tensor([[norm(piece) ...]]))`` -> fp32 ``[x] ** 2`` -> ``all_reduce(SUM)`` over DP ->
  ``.item() ** 0.5`` (``clip_grads.get_grad_norm_fp32`` with ``local_multi_tensor_l2_norm``).

Overlap: with ``overlap=True`` a post-accumulate-grad hook launches a bucket's (async) collective as soon as every
parameter of the bucket has received its last micro-batch's gradient, so communication overlaps the rest of the
backward. The arithmetic is unchanged (the same scale, the same flat collective on the same finished values),
so it stays bitwise; with one bucket it only starts the collective a little earlier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .model import TP1, TPGroup


def megatron_registration_order(m) -> list[str]:
    """Forged parameter names in Megatron ``GPTModel.named_parameters()`` order (``linear_proj`` before
    ``linear_qkv``, then ``q_layernorm`` and ``k_layernorm``; no output layer when it is tied). ``m``: the
    ModelConfig."""
    names = ["embedding.weight"]
    for i in range(m.num_layers):
        p = f"layers.{i}."
        names += [p + "input_norm.weight", p + "attn.proj", p + "attn.qkv"]
        if m.qk_layernorm:
            names += [p + "attn.q_norm.weight", p + "attn.k_norm.weight"]
        names += [p + "pre_mlp_norm.weight", p + "mlp.fc1", p + "mlp.fc2"]
    names += ["final_norm.weight"] + ([] if m.share_embeddings_and_output_weights else ["output_layer.weight"])
    return names


@dataclass
class Piece:
    """The part of parameter ``name`` that this rank owns: elements ``[start, end)`` of the flattened param, at
    ``[buf_start, buf_end)`` of the flat buffers. ``group``: 0 = decayed 2-D weights, 1 = 1-D norm weights."""

    name: str
    start: int
    end: int
    buf_start: int
    buf_end: int
    group: int


class GradBuffer:
    """Megatron-DDP-style flat grad buffer (and, for ZeRO-1, flat param buffer and shard bookkeeping).

    ``params``: ``{name: Parameter}`` of one model replica; ``order``: names in Megatron registration order.
    ``group``: the DP process group (None = the default group; a world of 1 skips every collective).
    ``zero1``: lay out and reduce like Megatron's distributed optimizer. ``bucket_size``: elements per bucket,
    None = one bucket. ``overlap``: launch each bucket's collective from the backward hooks.

    Shapes: ``grad_data`` and ``param_data`` (ZeRO-1) are fp32 ``[numel]`` (``numel`` includes the ZeRO-1
    padding). Raises ValueError when a parameter is not fp32 or ``order`` does not name every parameter.
    """

    def __init__(self, params: dict[str, torch.nn.Parameter], order: list[str], *, group=None, zero1: bool = False,
                 bucket_size: int | None = None, overlap: bool = False):
        if sorted(order) != sorted(params):
            raise ValueError(f"registration order names {sorted(set(order) ^ set(params))} inconsistently")
        for n, p in params.items():
            if p.dtype != torch.float32:
                raise ValueError(f"{n}: the DP grad buffer holds fp32 params only, got {p.dtype}")
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.zero1, self.overlap = zero1, overlap
        self.params = params
        self.order = list(order)
        self.layout: dict[str, tuple[int, int, int]] = {}  # name -> (start, end, bucket)
        self.buckets: list[tuple[int, int]] = []  # [start, end) of each bucket, padded
        self._build_layout(bucket_size)
        self.numel = self.buckets[-1][1]
        dev = next(iter(params.values())).device
        self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=dev)
        self.param_data = None
        if zero1:
            self.param_data = torch.zeros(self.numel, dtype=torch.float32, device=dev)
            self.rebind_params()
        self.bucket_params = [[n for n, (_, _, b) in self.layout.items() if b == i] for i in range(len(self.buckets))]
        self.pieces = self._own_pieces() if zero1 else []
        self._handles: list = []
        self._ready: list[int] = [0] * len(self.buckets)
        self._launched: list[bool] = [False] * len(self.buckets)
        self._armed = False
        self._hooks = []
        if overlap:
            for n, p in params.items():
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready(n)))

    # ------------------------------------------------------------------ layout
    def _build_layout(self, bucket_size: int | None) -> None:
        def pad(x: int, d: int) -> int:
            return int(math.ceil(x / d) * d)

        bucket_div = math.lcm(self.world, 128)
        start, bucket_start, bucket_id, end, open_params = 0, 0, 0, 0, 0
        for name in reversed(self.order):  # Megatron: params[::-1]
            if self.zero1:
                start = pad(start, 64)
            end = start + self.params[name].numel()
            self.layout[name] = (start, end, bucket_id)
            open_params += 1
            if bucket_size is not None and end - bucket_start >= bucket_size:
                b_end = pad(end, bucket_div) if self.zero1 else end
                self.buckets.append((bucket_start, b_end))
                bucket_start, bucket_id, start, open_params = b_end, bucket_id + 1, b_end, 0
            else:
                start = end
        if open_params:
            self.buckets.append((bucket_start, pad(end, bucket_div) if self.zero1 else end))

    def shard_range(self, bucket: int, rank: int | None = None) -> tuple[int, int]:
        """Buffer range ``[a, b)`` that ``rank`` (default: this rank) owns in ``bucket`` (ZeRO-1)."""
        r = self.rank if rank is None else rank
        b0, b1 = self.buckets[bucket]
        size = (b1 - b0) // self.world
        return b0 + r * size, b0 + (r + 1) * size

    def _own_pieces(self) -> list[Piece]:
        """This rank's pieces, in the distributed optimizer's order: group 0 then group 1, each in buffer order."""
        pieces: list[Piece] = []
        for name in reversed(self.order):
            s, e, b = self.layout[name]
            a, z = self.shard_range(b)
            lo, hi = max(s, a), min(e, z)
            if hi > lo:
                pieces.append(Piece(name, lo - s, hi - s, lo, hi, 0 if self.params[name].dim() > 1 else 1))
        return [p for p in pieces if p.group == 0] + [p for p in pieces if p.group == 1]

    def view(self, data: torch.Tensor, name: str) -> torch.Tensor:
        s, e, _ = self.layout[name]
        return data[s:e].view(self.params[name].shape)

    def rebind_params(self) -> None:
        """ZeRO-1: copy every param into ``param_data`` and make ``param.data`` a view of it (Megatron remaps
        ``param.data`` the same way), so the all-gather writes the model weights directly."""
        with torch.no_grad():
            for n, p in self.params.items():
                v = self.view(self.param_data, n)
                if p.data.data_ptr() != v.data_ptr():
                    v.copy_(p.data)
                    p.data = v

    # ------------------------------------------------------------------ per step
    def zero_grad(self) -> None:
        """Zero the buffer and point every ``param.grad`` at its view (autograd then accumulates in place)."""
        self.grad_data.zero_()
        for n, p in self.params.items():
            p.grad = self.view(self.grad_data, n)
        self.new_step()

    def new_step(self) -> None:
        """Forget the last step's launched buckets (for owners that fill ``grad_data`` themselves)."""
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._armed = False

    def arm(self, last_micro_batch: bool) -> None:
        """Tell the overlap hooks whether the coming backward is the step's last (only then do buckets launch)."""
        self._armed = last_micro_batch and self.overlap

    def _on_grad_ready(self, name: str):
        def hook(_p):
            if not self._armed:
                return
            b = self.layout[name][2]
            self._ready[b] += 1
            if self._ready[b] == len(self.bucket_params[b]):
                self._launch(b, async_op=True)
        return hook

    def _launch(self, b: int, async_op: bool) -> None:
        self._launched[b] = True
        b0, b1 = self.buckets[b]
        data = self.grad_data[b0:b1]
        if self.world == 1:
            return
        data *= 1.0 / self.world  # Megatron: gradient_scaling_factor = 1/DP, before a SUM collective
        if self.zero1:
            a, z = self.shard_range(b)
            h = dist.reduce_scatter_tensor(self.grad_data[a:z], data, op=dist.ReduceOp.SUM, group=self.group,
                                           async_op=async_op)
        else:
            h = dist.all_reduce(data, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        if h is not None:
            self._handles.append(h)

    def finish_grad_sync(self) -> None:
        """Reduce every bucket not yet launched (synchronously) and wait for the launched ones."""
        for b in range(len(self.buckets)):
            if not self._launched[b]:
                self._launch(b, async_op=False)
        for h in self._handles:
            h.wait()
        self._handles = []
        self._armed = False

    def grad_norm_sq_shards(self) -> torch.Tensor:
        """ZeRO-1: this rank's squared norm, Megatron's arithmetic, all-reduced (SUM) over DP: fp32 ``[1]``."""
        grads = [self.grad_data[p.buf_start:p.buf_end] for p in self.pieces]
        dev = self.grad_data.device
        if grads:
            l2 = torch.norm(torch.tensor([[torch.norm(g) for g in grads]]))
            total = torch.tensor([float(l2)], dtype=torch.float32, device=dev) ** 2.0
        else:
            total = torch.zeros(1, dtype=torch.float32, device=dev) ** 2.0
        if self.world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total

    def gather_params(self) -> None:
        """ZeRO-1: all-gather each bucket's updated shards into every rank's ``param_data``."""
        if self.world == 1:
            return
        for b, (b0, b1) in enumerate(self.buckets):
            a, z = self.shard_range(b)
            dist.all_gather_into_tensor(self.param_data[b0:b1], self.param_data[a:z], group=self.group)

    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """ZeRO-1: all-gather per-rank shard-sized tensors (``[sum of shard sizes]``, bucket by bucket) into a
        full ``[numel]`` tensor in buffer layout (used to save optimizer state in a DP-independent layout)."""
        full = torch.zeros(self.numel, dtype=shard.dtype, device=shard.device)
        off = 0
        for b, (b0, b1) in enumerate(self.buckets):
            size = (b1 - b0) // self.world
            if self.world == 1:
                full[b0:b1].copy_(shard[off:off + size])
            else:
                dist.all_gather_into_tensor(full[b0:b1], shard[off:off + size].contiguous(), group=self.group)
            off += size
        return full

    def shard_numel(self) -> int:
        return sum((b1 - b0) // self.world for b0, b1 in self.buckets)

    def shard_offset(self, buf_index: int) -> int:
        """Position of owned buffer element ``buf_index`` inside this rank's concatenated shards."""
        off = 0
        for b in range(len(self.buckets)):
            a, z = self.shard_range(b)
            if a <= buf_index < z:
                return off + buf_index - a
            off += z - a
        raise IndexError(f"buffer element {buf_index} is not owned by rank {self.rank}")

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


# ----------------------------------------------------------------------------------------------------------------
# Tensor parallelism: how each forged parameter is split over TP ranks (Megatron's layout, see model.py) and the
# process groups of a DP x TP layout (TP-major: ranks r*TP .. r*TP+TP-1 form a TP group, as in Megatron's
# default "tp-cp-ep-dp-pp" order and the harness's ``dp_rank = rank // TP``).
# ----------------------------------------------------------------------------------------------------------------


def tp_partition(name: str):
    """0 / 1: contiguous chunks of that dim; ``"glu"``: fc1's gate and up halves chunked separately; None:
    replicated (norm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith("mlp.fc1"):
        return "glu"
    if name.endswith(("attn.proj", "mlp.fc2")):
        return 1
    if name.endswith(("attn.qkv", "embedding.weight", "output_layer.weight")):
        return 0
    raise KeyError(f"no tensor-parallel partitioning known for {name}")


def tp_split(name: str, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Full tensor -> rank ``rank``'s shard (a contiguous copy)."""
    part = tp_partition(name)
    if part is None or size == 1:
        return full.contiguous()
    if part == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()
    return full.chunk(size, dim=part)[rank].contiguous()


def tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Every TP rank's shard (TP-rank order) -> the full tensor (rank 0's copy for a replicated one)."""
    part = tp_partition(name)
    if part is None or len(shards) == 1:
        return shards[0].contiguous()
    if part == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]).contiguous()
    return torch.cat(shards, dim=part).contiguous()


def tp_all_gather(t: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every TP rank's ``t`` (same shape on all), in TP-rank order."""
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def build_groups(dp: int, tp: int):
    """``(tp_group, tp_rank, dp_group)`` for this rank; a group spanning the whole world is None (the default
    group). Every rank creates every group, in the same order (``dist.new_group`` is collective)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != dp * tp:
        raise RuntimeError(f"DP{dp} x TP{tp} = {dp * tp} ranks, but the process group has {world}; launch with "
                           f"torchrun --nproc-per-node {dp * tp}")
    rank = dist.get_rank() if world > 1 else 0
    tp_group = dp_group = None
    if tp > 1 and dp > 1:
        for d in range(dp):
            g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            if rank // tp == d:
                tp_group = g
        for t in range(tp):
            g = dist.new_group(list(range(t, world, tp)))
            if rank % tp == t:
                dp_group = g
    return tp_group, rank % tp, dp_group


@dataclass
class ParallelState:
    """Where this rank sits: ``dp_size`` data-parallel replicas, its tensor-parallel ``tp`` group
    (:class:`~.model.TPGroup`, size 1 without TP), the ZeRO stage (0, 1 or 3 = FSDP2) and the DP process group
    (None = the default group, or no group at all in a world of 1)."""

    dp_size: int = 1
    tp: TPGroup = TP1
    zero_stage: int = 0
    dp_group: object = None

    @classmethod
    def build(cls, pcfg) -> "ParallelState":
        """From ``cfg.parallel``: creates the TP and DP groups (:func:`build_groups`, collective) when DP x TP > 1.
        Raises RuntimeError when the world size is not DP x TP."""
        dp, tp = pcfg.data_parallel_size, pcfg.tensor_parallel_size
        tp_group, dp_group = TP1, None
        if dp * tp > 1:
            group, tp_rank, dp_group = build_groups(dp, tp)
            tp_group = TPGroup(tp, tp_rank, group) if tp > 1 else TP1
        return cls(dp, tp_group, pcfg.zero_stage, dp_group)
