"""``forgetrain.bench`` on CPU at the llama_micro shape: one process, and two ranks under torchrun (gloo).

Only the pipeline and its reporting are checked (rows, units, devices, one writer); speeds are benchmarks
(docs/benchmarks.md), never asserted here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=llama_micro", "train.micro_batch_size=2", "train.lr_warmup_steps=1", "bench.steps=2",
        "bench.warmup=1", "bench.against=[megatron]", "train.threads=1"]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _check(out: Path, devices: int) -> list[dict]:
    res = json.loads((out / "bench.json").read_text())
    rows = {r["side"]: r for r in res["rows"]}
    assert set(rows) == {"forged", "megatron"}
    for r in rows.values():
        assert r["n"] == 2 and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu_pct"] > 0
        assert r["devices"] == devices
    assert rows["forged"]["forged_speedup"] == 1.0
    return res["rows"]


def test_bench_one_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY, "train.global_batch_size=4",
                        f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True, capture_output=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    _check(tmp_path, 1)
    assert "tokens_per_s" in p.stdout and "1 devices" in p.stdout


def test_bench_under_torchrun_dp2(tmp_path):
    """Two ranks: each feeds its DP share; rank 0 alone prints the table and writes bench.json."""
    from tests.test_parallel import _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "-m", "forgetrain.bench", *TINY, "parallel=dp2", "train.global_batch_size=8",
           f"bench.out_dir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    _check(tmp_path, 2)
    assert p.stdout.count("tokens_per_s") == 1 and "2 devices" in p.stdout


def test_bench_rejects_unknown_reference(tmp_path):
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY[:-2], "bench.against=[nope]",
                        f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True, capture_output=True,
                       timeout=300)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr and "nope" in p.stderr.strip().splitlines()[-1], p.stderr[-1500:]


def _reduce_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from forgetrain.bench import reduce_over_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {"forged": [1.0 + rank, 5.0 - rank], "_mem_gib": {"forged": 2.0 * rank}, "_forged_blocks": [rank, 1.0]}
    red = reduce_over_ranks(times)
    if rank == 0:
        Path(out).write_text(json.dumps(red))
    dist.destroy_process_group()


def test_step_time_is_the_slowest_ranks(tmp_path):
    """Each step's time is the MAX over ranks (the step ends with the last rank), memory the largest rank's."""
    import torch.multiprocessing as mp

    from tests.test_parallel import _free_port

    out = tmp_path / "red.json"
    mp.spawn(_reduce_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    red = json.loads(out.read_text())
    assert red["forged"] == [2.0, 5.0] and red["_mem_gib"] == {"forged": 2.0} and red["_forged_blocks"] == [1.0, 1.0]
