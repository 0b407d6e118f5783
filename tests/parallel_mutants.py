"""Deliberately wrong data-parallel variants of the forged ``llama_tiny_cpu`` engine (for tests/test_parallel.py).

Each one has a single DP defect that a parallel gate must reject. They are imported by name inside the torchrun
workers (``tests.parallel_mutants:NoDPScale``), so they live in an importable module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from scenarios.llama_tiny_cpu.engine import Engine as Good


class NoDPScale(Good):
    """All-reduces the gradient buffer without dividing by DP first (grads DP times too large)."""

    def _sync_grads(self):
        d = self.ddp
        for b0, b1 in d.buckets:
            dist.all_reduce(d.grad_data[b0:b1], op=dist.ReduceOp.SUM)


class DroppedRankGrads(Good):
    """Rank 1's micro-batches never reach the reduction (its buffer is zeroed first): a dropped rank."""

    def _sync_grads(self):
        if dist.get_rank() == 1:
            self.ddp.grad_data.zero_()
        super()._sync_grads()


class DuplicatedShard(Good):
    """Every rank trains on rank 0's micro-batches (what sharding data by LOCAL_RANK does with one process per
    node): the other ranks' samples are never seen."""

    def train_step(self, micro_batches):
        mbs = [mb.clone() for mb in micro_batches]
        for mb in mbs:
            dist.broadcast(mb, src=0)
        return super().train_step(mbs)


class WrongGatherOrder(Good):
    """ZeRO-1: the all-gather puts the ranks' updated shards back in reverse rank order."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        d = self.ddp

        def gather_params():
            for b, (b0, b1) in enumerate(d.buckets):
                a, z = d.shard_range(b)
                chunks = [torch.empty(z - a) for _ in range(d.world)]
                dist.all_gather(chunks, d.param_data[a:z].clone())
                d.param_data[b0:b1].copy_(torch.cat(chunks[::-1]))

        d.gather_params = gather_params


class ForwardNormOrder(Good):
    """ZeRO-1: grad-norm terms in registration (forward) order instead of the distributed optimizer's buffer
    order. Mathematically the same norm; the fp32 sum rounds differently."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        d = self.ddp
        rank = {n: i for i, n in enumerate(d.order)}
        d.pieces.sort(key=lambda pc: (pc.group, rank[pc.name]))


class ForgetsAdamState(Good):
    """Resume bug: loads the weights but restarts AdamW's moments from zero (the step count is kept)."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for st in self.adam_state.values():
            st["exp_avg"].zero_()
            st["exp_avg_sq"].zero_()
