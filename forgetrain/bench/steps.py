"""What every timed step of ``forgetrain.bench`` stands on: the step timer (CUDA events on a GPU, the host clock
on CPU), this process's rank and device, and the real-token micro-batches every side is fed."""

from __future__ import annotations

import os
import time

import torch

from forgetrain.config import RunConfig, grad_accum_steps


class StepTimer:
    """``with StepTimer(device) as tm:`` times the block into ``tm.s`` (seconds; on a GPU it synchronizes)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def bench_device(cfg: RunConfig) -> torch.device:
    """``cpu``, or this process's GPU (``cuda:LOCAL_RANK`` under torchrun)."""
    if cfg.hardware.device == "cpu":
        return torch.device("cpu")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")


def say(*args, **kw) -> None:
    if rank_world()[0] == 0:
        print(*args, **kw)


def step_batches(cfg: RunConfig, n_steps: int) -> list[list[torch.Tensor]]:
    """This rank's micro-batches for ``n_steps`` steps: ``[n_steps][grad_accum]`` of ``[mb, seq + 1]`` int64."""
    from forgetrain.data import TokenWindows, micro_batch, prepare

    data = prepare(cfg.data, progress=False)
    w = TokenWindows(data.train_prefix, cfg.model.seq_length, cfg.train.seed)
    t, p = cfg.train, cfg.parallel
    ga = grad_accum_steps(cfg)
    dp_rank = rank_world()[0] // p.tensor_parallel_size
    return [[micro_batch(w, s, m, dp_rank, t.micro_batch_size, p.data_parallel_size, t.global_batch_size)
             for m in range(ga)] for s in range(n_steps)]
