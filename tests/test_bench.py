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
