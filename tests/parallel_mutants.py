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


class ForgetsAdamState(Good):
    """Resume bug: loads the weights but restarts AdamW's moments from zero (the step count is kept)."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for st in self.adam_state.values():
            st["exp_avg"].zero_()
            st["exp_avg_sq"].zero_()


class ContiguousFc1Split(Good):
    """TP: fc1 split into contiguous row chunks (rank 0 gets only gate rows) instead of [gate_r; up_r]."""

    def _load_full(self, full):
        super()._load_full(full)
        if self.tp.size > 1:
            named = self._named()
            with torch.no_grad():
                for k, v in full.items():
                    if k.endswith("mlp.fc1"):
                        named[k].copy_(v.chunk(self.tp.size, dim=0)[self.tp.rank])


class NormWeightsCountedPerTPRank(Good):
    """TP: the replicated norm weights enter the grad norm once per TP rank (Megatron counts them once)."""

    def _grad_norm(self, grads):
        norms = torch.norm(torch.tensor([torch.norm(g) for g in grads.values()]))
        total_sq = torch.tensor([float(norms)], dtype=torch.float32) ** 2.0
        self.tp.all_reduce(total_sq)
        return total_sq.item() ** 0.5


class FSDPDoubleAverage(Good):
    """FSDP2: divides the (already averaged) reduce-scattered grads by DP a second time."""

    def _fsdp_step(self, named, lr):
        with torch.no_grad():
            for p in named.values():
                p.grad.to_local().div_(self.dp_size)
        return super()._fsdp_step(named, lr)
