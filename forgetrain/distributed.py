"""Process-group setup for torchrun launches (one process to many nodes).

Under ``torchrun`` (``WORLD_SIZE`` > 1) the default group is created with the backend from ``parallel.backend``
(``auto``: nccl on CUDA, gloo on CPU) and a collective timeout of ``parallel.timeout_s`` seconds, so a dead rank
ends the job with an error instead of hanging it. A single process needs no group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def init_distributed(parallel_cfg) -> DistEnv:
    """Create (or reuse) the default process group; returns this process's rank, world size and local rank."""
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    backend = parallel_cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=parallel_cfg.timeout_s))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank)
