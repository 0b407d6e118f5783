"""``forgetrain.bench`` on CPU at the llama_micro shape: one process, and two ranks under torchrun (gloo).

Only the pipeline and its reporting are checked (rows, units, devices, one writer); speeds are benchmarks
(docs/benchmarks.md), never asserted here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgetrain.levers import EngineSpec
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=llama_micro", "train.micro_batch_size=2", "train.lr_warmup_steps=1", "bench.steps=2",
        "bench.warmup=1", "bench.against=[megatron]", "train.threads=1"]


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _check(out: Path, devices: int, gbs: int, grad_accum: int, key: str = "rows") -> list[dict]:
    """The row set ``key`` of bench.json: both sides, units, devices, and the global batch it was timed at."""
    res = json.loads((out / "bench.json").read_text())
    rows = {r["side"]: r for r in res[key]}
    assert set(rows) == {"forged", "megatron"}
    for r in rows.values():
        assert r["n"] == 2 and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu_pct"] > 0
        assert r["mfu_causal_pct"] > 0 and "mem_gib" in r
        assert r["devices"] == devices and r["global_batch_size"] == gbs and r["grad_accum"] == grad_accum
    assert rows["forged"]["forged_speedup"] == 1.0
    return res[key]


def test_bench_one_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY, "train.global_batch_size=4",
                        f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True, capture_output=True,
                       timeout=hang_s())
    assert p.returncode == 0, p.stderr[-2000:]
    _check(tmp_path, 1, gbs=4, grad_accum=2)  # the headline (the configured global batch)
    _check(tmp_path, 1, gbs=2, grad_accum=1, key="rows_single_micro_batch")  # one micro-batch per step beside it
    assert "tokens_per_s" in p.stdout and "1 devices" in p.stdout
    warnings = [x for x in p.stdout.splitlines() if "not production-like" in x]
    assert len(warnings) == 1 and "train.global_batch_size=16" in warnings[0], p.stdout
    assert (tmp_path / ".hydra" / "config.yaml").is_file() and not list(tmp_path.glob("*.log"))  # no empty cli.log
    res = json.loads((tmp_path / "bench.json").read_text())
    printed = [x for x in p.stdout.splitlines() if x.startswith("warning:")]  # two timed steps on a shared CPU
    noisy = [x for x in printed if x.startswith("warning: noisy timings (")]  # may be noisy, and then say so
    assert printed == [warnings[0], *noisy], printed
    assert res["side_recompute"] is None and res["warnings"] == printed  # the printed warnings, recorded
    assert res["noisy_iqr_pct"] == 10.0
    rows = res["rows"] + res["rows_single_micro_batch"]
    assert len(noisy) == sum(r["noisy"] for r in rows)
    assert all(r["noisy"] == (r["step_s_iqr_pct"] > 10.0) for r in rows)


def test_bench_under_torchrun_dp2(tmp_path):
    """Two ranks: each feeds its DP share; rank 0 alone prints the table and writes bench.json."""
    from tests.helpers import free_port as _free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), "-m", "forgetrain.bench", *TINY, "parallel=dp2", "train.global_batch_size=8",
           f"bench.out_dir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), text=True, capture_output=True, timeout=hang_s())
    assert p.returncode == 0, p.stderr[-3000:]
    _check(tmp_path, 2, gbs=8, grad_accum=2)
    _check(tmp_path, 2, gbs=4, grad_accum=1, key="rows_single_micro_batch")  # micro-batch 2 x DP 2
    assert p.stdout.count("tokens_per_s") == 2 and "2 devices" in p.stdout  # two tables, rank 0 only
    assert p.stdout.count("not production-like") == 1


def test_headline_warning_below_8_micro_batches():
    """The warning fires below 8 micro-batches per step and suggests 8 x micro-batch x DP; silent at 8."""
    from forgetrain.bench import headline_warning, single_micro_batch_config
    from forgetrain.config import ParallelConfig, RunConfig, TrainConfig

    cfg = RunConfig(train=TrainConfig(micro_batch_size=2, global_batch_size=8),
                    parallel=ParallelConfig(data_parallel_size=2))
    assert "train.global_batch_size=32" in headline_warning(cfg)
    assert headline_warning(RunConfig(train=TrainConfig(micro_batch_size=2, global_batch_size=32),
                                      parallel=ParallelConfig(data_parallel_size=2))) is None
    one = single_micro_batch_config(cfg)
    assert one.train.global_batch_size == 4 and cfg.train.global_batch_size == 8  # a copy; the original kept


def test_noisy_side_is_flagged_with_one_warning_line():
    """A side whose step times spread by more than bench.NOISY_IQR_PCT of their median (here 50%-115%, a loaded
    machine's) gets ``noisy`` in its row and one ``warning:`` line naming it and the spread; a steady side none."""
    from forgetrain import bench

    cfg = _micro_cfg()
    steady = [1.00, 1.01, 0.99, 1.00, 1.02, 0.98, 1.00, 1.01, 0.99, 1.00]
    loaded = [0.50, 1.15, 1.00, 0.60, 1.10, 1.00, 0.70, 1.05, 1.00, 0.90]
    rows = {r["side"]: r for r in bench.summarize(cfg, {"forged": steady, "megatron": loaded})}
    assert not rows["forged"]["noisy"] and rows["forged"]["step_s_iqr_pct"] < 3
    m = rows["megatron"]
    assert m["noisy"] and m["step_s_iqr_pct"] > bench.NOISY_IQR_PCT
    assert m["step_s_min_pct"] == pytest.approx(50.0) and m["step_s_max_pct"] == pytest.approx(115.0)
    lines = bench.noise_warnings(list(rows.values()), "headline")
    assert len(lines) == 1 and lines[0].startswith("warning: noisy timings (headline, side megatron): step_s IQR ")
    assert "from 50% to 115% of it" in lines[0] and "forgetrain.bench.report.NOISY_IQR_PCT" in lines[0], lines[0]
    assert bench.noise_warnings([rows["forged"]], "headline") == [] and bench.noise_warnings(None, "x") == []


def test_bench_rejects_unknown_reference(tmp_path):
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY[:-2], "bench.against=[nope]",
                        f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True, capture_output=True,
                       timeout=hang_s())
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

    from tests.helpers import free_port as _free_port

    out = tmp_path / "red.json"
    mp.spawn(_reduce_worker, args=(_free_port(), str(out)), nprocs=2, join=True)
    red = json.loads(out.read_text())
    assert red["forged"] == [2.0, 5.0] and red["_mem_gib"] == {"forged": 2.0} and red["_forged_blocks"] == [1.0, 1.0]


def _check_profile(b: dict) -> None:
    """A profile breakdown: every category, categories sum to the total, and GEMM time was found."""
    from forgetrain.bench import PROFILE_CATEGORIES

    cats = b["categories"]
    assert set(cats) == set(PROFILE_CATEGORIES) and b["total_ms"] > 0  # bench.json sorts keys and b["step_ms"] > 0
    assert abs(sum(v["ms"] for v in cats.values()) - b["total_ms"]) <= 1e-6 * b["total_ms"]
    assert abs(sum(v["pct"] for v in cats.values()) - 100.0) <= 1e-6
    assert cats["GEMM"]["ms"] > 0, f"no GEMM time: {cats}"


def test_bench_profile_and_no_second_row_set(tmp_path):
    """GBS == micro-batch: one row set only. bench.profile: a valid Chrome trace per side and its breakdown."""
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY, "train.global_batch_size=2",
                        "bench.profile=true", f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True,
                       capture_output=True, timeout=hang_s())
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    _check(tmp_path, 1, gbs=2, grad_accum=1)
    assert res["rows_single_micro_batch"] is None and p.stdout.count("tokens_per_s") == 1
    assert set(res["profile"]) == {"forged", "megatron"}
    for side, b in res["profile"].items():
        assert b["basis"] == "self CPU time of ops"
        _check_profile(b)
        trace = json.loads((tmp_path / f"profile_{side}.json").read_text())
        assert trace["traceEvents"]
        assert f"profile {side}: self CPU time of ops" in p.stdout
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # atomic writes leave no temp file


@pytest.mark.parametrize("key", ["profile", "single_micro_batch"])
def test_bench_switches_are_booleans(tmp_path, key):
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY, f"bench.{key}=maybe",
                        f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True, capture_output=True,
                       timeout=hang_s())
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"bench.{key}=maybe" in p.stderr and "not a valid bool" in p.stderr, p.stderr[-1500:]


@pytest.mark.parametrize("name,category", [
    ("aten::mm", "GEMM"), ("aten::baddbmm", "GEMM"), ("aten::linear", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_64x64_64x4_tn_align8>", "GEMM"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("aten::_scaled_dot_product_efficient_attention", "attention"), ("aten::_softmax", "attention"),
    ("aten::_log_softmax", "cross-entropy"), ("aten::nll_loss_forward", "cross-entropy"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "cross-entropy"),
    ("_VocabParallelCrossEntropy", "cross-entropy"), ("_ce_fwd_kernel", "cross-entropy"),
    ("triton_red_fused__to_copy_add_arange_div_eq_exp_gather_log_mul_prepare_softmax_online_sub_unsqueeze_0",
     "cross-entropy"),  # the forged chunked CE under inductor (it once counted as attention: "softmax")
    ("aten::logsumexp", "cross-entropy"),
    ("Optimizer.step#AdamW.step", "optimizer"), ("aten::_foreach_mul_", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>>", "optimizer"),
    ("aten::rms_norm", "norm"), ("_rmsnorm_fwd_kernel", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"), ("gloo:all_reduce", "communication"),
    ("c10d::reduce_scatter_tensor_coalesced_", "communication"),
    ("aten::copy_", "copies and casts"), ("aten::_to_copy", "copies and casts"), ("aten::to", "copies and casts"),
    ("aten::cat", "copies and casts"), ("Memcpy DtoD (Device -> Device)", "copies and casts"),
    ("aten::mul", "other"), ("aten::broadcast_tensors", "other"), ("aten::t", "other"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
])
def test_classify(name, category):
    from forgetrain.bench import classify

    assert classify(name) == category


class _TinyEngine:
    """A train_step with a GEMM, a cross-entropy and an AdamW step, for in-process profiling."""

    def __init__(self):
        import torch

        torch.manual_seed(0)
        self.lin = torch.nn.Linear(16, 32)
        self.opt = torch.optim.AdamW(self.lin.parameters())

    def train_step(self, batch):
        import torch.nn.functional as F

        for mb in batch:
            F.cross_entropy(self.lin(mb[:, :-1].float()), mb[:, -1]).backward()
        self.opt.step()
        self.opt.zero_grad()


def test_profile_check_catches_a_classifier_without_gemm(tmp_path, monkeypatch):
    """The profile check passes with the rule table and fails once GEMM is dropped from it (matmuls -> other)."""
    import torch

    from forgetrain import bench

    batch = [torch.randint(0, 32, (4, 17))]
    b = bench.profile_step(_TinyEngine(), batch, torch.device("cpu"), tmp_path / "profile_tiny.json")
    _check_profile(b)
    assert json.loads((tmp_path / "profile_tiny.json").read_text())["traceEvents"]
    monkeypatch.setattr(bench.profile, "PROFILE_RULES", tuple(r for r in bench.PROFILE_RULES if r[0] != "GEMM"))
    broken = bench.profile_step(_TinyEngine(), batch, torch.device("cpu"))
    assert bench.classify("aten::addmm") == "other" and broken["categories"]["GEMM"]["ms"] == 0
    with pytest.raises(AssertionError, match="no GEMM time"):
        _check_profile(broken)


def _micro_cfg():
    import dataclasses

    from hydra import compose, initialize_config_dir

    from forgetrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = to_run_config(compose(config_name="config", overrides=["model=llama_micro"]))
    return dataclasses.replace(c, train=dataclasses.replace(c.train, micro_batch_size=2, global_batch_size=2,
                                                            threads=1))


def _sides_with_an_unrunnable_one(monkeypatch):
    """The registry, patched: side 'broken' raises the ImportError torchtitan 0.3.0 raised on the H200's torch
    2.11; 'megatron' builds as usual."""
    from forgetrain import registry

    real = registry.load_engine_class

    class _Broken:
        spec = EngineSpec()

        def __init__(self, cfg, device):
            raise ImportError("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'")

    monkeypatch.setattr(registry, "load_engine_class",
                        lambda kind, name: _Broken if name == "broken" else real(kind, name))


@pytest.mark.parametrize("interleave", ["always", "never", "once"])
def test_a_side_that_cannot_run_here_is_one_line_and_the_others_are_timed(monkeypatch, interleave):
    """A general framework that cannot be built on this torch (ImportError) is reported with its reason, the
    other sides are still timed; in both timing modes."""
    from forgetrain import bench

    _sides_with_an_unrunnable_one(monkeypatch)
    cfg = _micro_cfg()
    _, times = bench.timed_sides(cfg, ["broken", "megatron"], steps=1, warmup=0, interleave=interleave)
    assert len(times["forged"]) >= 1 and len(times["megatron"]) == 1 and "broken" not in times
    why = times["_unavailable"]["broken"]
    assert why.startswith("broken cannot run here (torch ") and "DataParallelMeshDims" in why
    assert "\n" not in why
    rows = bench.summarize(cfg, times)
    assert {r["side"] for r in rows} == {"forged", "megatron"}


def test_surpass_timing_against_an_unrunnable_reference_is_a_config_error(monkeypatch):
    """The surpass tier cannot compare speeds with a reference that cannot run: one ConfigError with the reason,
    not an out-of-memory claim."""
    from forgetrain import bench
    from forgetrain.errors import ConfigError

    _sides_with_an_unrunnable_one(monkeypatch)
    with pytest.raises(ConfigError, match="broken cannot run here .*DataParallelMeshDims.*no speed comparison"):
        bench.side_by_side_step_times(_micro_cfg(), ["broken"], steps=1, warmup=0)


def test_build_sides_without_a_store_raises_the_import_error(monkeypatch):
    """Callers that do not ask for the reasons (``unavailable=None``) see the ImportError itself."""
    from forgetrain import bench

    _sides_with_an_unrunnable_one(monkeypatch)
    with pytest.raises(ImportError, match="DataParallelMeshDims"):
        bench.build_sides(_micro_cfg(), ["broken"])


# the message torch's CUDA caching allocator raised for the torch_compile side of llama8b_h200 (the shape of it)
_OOM_MSG = ("CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 139.81 GiB of which "
            "1.02 GiB is free. Including non-PyTorch memory, this process has 138.78 GiB memory in use. Of the "
            "allocated memory 135.20 GiB is allocated by PyTorch, and 2.11 GiB is reserved by PyTorch but "
            "unallocated.")


@pytest.mark.parametrize("fail_at", ["build", "step"])
def test_a_side_out_of_memory_says_where_and_why_and_the_others_are_timed(monkeypatch, fail_at):
    """Sequential A-B-A: a side that runs out of device memory (while building, or in a step) is not timed; its
    one-line reason says where and gives torch's numbers; the forged side is still timed in both blocks."""
    import torch

    from forgetrain import bench, registry

    real = registry.load_engine_class

    class _Huge:
        spec = EngineSpec()

        def __init__(self, cfg, device):
            if fail_at == "build":
                raise torch.OutOfMemoryError(_OOM_MSG)
            self.inner = real("references", "megatron")(cfg, device)

        def __getattr__(self, k):
            return getattr(self.inner, k)

        def train_step(self, mbs):
            raise torch.OutOfMemoryError(_OOM_MSG)

    monkeypatch.setattr(registry, "load_engine_class",
                        lambda kind, name: _Huge if name == "huge" else real(kind, name))
    times = bench.sequential_times(_micro_cfg(), ["huge"], steps=1, warmup=1)
    assert times["_oom"] == ["huge"] and "huge" not in times and len(times["forged"]) == 2
    why = times["_oom_reason"]["huge"]
    where = "building the engine" if fail_at == "build" else "warm-up step 1 of 2 (micro-batch 2 x grad-accum 1)"
    assert why == (f"out of memory while {where}: asked for 3.91 GiB more with 135.20 GiB allocated by PyTorch "
                   "of the device's 139.81 GiB (1.02 GiB free)"), why
    assert "\n" not in why


def test_an_out_of_memory_message_in_other_words_gives_its_first_line():
    import torch

    from forgetrain import bench

    why = bench.oom_reason(torch.OutOfMemoryError("HIP out of memory\nmore"), "timed step 2 of 3")
    assert why == "out of memory while timed step 2 of 3: HIP out of memory"


@pytest.mark.parametrize("interleave", ["always", "never", "once"])
def test_side_recompute_reaches_the_sides_and_not_the_forged_engine(monkeypatch, interleave):
    """``bench.side_recompute=full`` builds every side with ``engine.recompute=full`` (a framework fitted the way
    its users fit the card) while the forged engine keeps its own ``engine.recompute=none``; null leaves the sides
    on the forged engine's setting. In both timing modes."""
    from forgetrain import bench, registry

    real = registry.load_engine_class
    seen = []

    class _Spy:
        spec = EngineSpec()

        def __init__(self, cfg, device):
            seen.append(cfg.engine.recompute)
            self.inner = real("references", "megatron")(cfg, device)

        def __getattr__(self, k):
            return getattr(self.inner, k)

    monkeypatch.setattr(registry, "load_engine_class",
                        lambda kind, name: _Spy if name == "spy" else real(kind, name))
    forged_seen = []
    forged_cls = registry.resolve_engine(_micro_cfg().scenario.engine)

    def forged(cfg, device):
        forged_seen.append(cfg.engine.recompute)
        return forged_cls(cfg, device)

    cfg = _micro_cfg()
    assert cfg.engine.recompute == "none"
    bench.timed_sides(cfg, ["spy"], steps=1, warmup=0, interleave=interleave, engine_cls=forged,
                      side_recompute="full")
    assert seen == ["full"] and set(forged_seen) == {"none"}
    seen.clear()
    bench.timed_sides(cfg, ["spy"], steps=1, warmup=0, interleave=interleave, engine_cls=forged)
    assert seen == ["none"]


def test_side_config_drops_the_recompute_depth_under_none():
    import dataclasses

    from forgetrain import bench

    cfg = _micro_cfg()
    assert bench.side_config(cfg, None) is cfg and bench.side_config(cfg, "none") is cfg
    full = bench.side_config(cfg, "full")
    assert full.engine.recompute == "full" and full.engine.recompute_num_layers is None and full.model == cfg.model
    block = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute="full", recompute_num_layers=1))
    off = bench.side_config(block, "none")
    assert off.engine.recompute == "none" and off.engine.recompute_num_layers is None


def test_bench_rejects_a_bad_side_recompute(tmp_path):
    """One ``error:`` line, a non-zero exit, nothing written."""
    out = tmp_path / "b"
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY, "bench.side_recompute=selective",
                        f"bench.out_dir={out}"], cwd=ROOT, text=True, capture_output=True, timeout=hang_s(), env=_env())
    assert p.returncode != 0
    assert "error: bench.side_recompute must be none|full|null" in p.stderr + p.stdout, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not out.exists()


def test_recompute_warnings_read_the_sides_recompute():
    """Under ``bench.side_recompute=full`` a side with no activation recompute (Megatron-core's local spec) is
    warned about even when the forged engine runs without recompute."""
    from forgetrain.bench import recompute_warnings

    cfg = _micro_cfg()
    assert recompute_warnings(cfg, ["megatron"]) == []
    lines = recompute_warnings(cfg, ["megatron", "torch_compile"], side_recompute="full")
    assert len(lines) == 1 and lines[0].startswith("warning: bench side 'megatron' has no activation recompute")
    assert "(bench.side_recompute=full applies to the sides that implement it)" in lines[0], lines[0]


def test_a_tiny_model_on_cpu_is_timed_interleaved_and_a_repeated_side_is_refused(monkeypatch):
    """``bench.interleave=auto`` on CPU compares with the host's memory: three llama_micro sides (each estimate
    carries a 1 GiB workspace) are interleaved, not timed in A-B-A blocks whose first forged block runs cold. A side
    named twice is one ConfigError."""
    from forgetrain import bench, memory
    from forgetrain.errors import ConfigError

    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 24 * 2**30)
    mode, _ = bench.timed_sides(_micro_cfg(), ["megatron"], steps=1,
                                warmup=0, interleave="auto")
    assert mode == "interleaved"
    assert bench.bytes_per_engine(_micro_cfg()) * 3 > 0.4 * 8e9  # what the fixed 8 GB limit refused
    with pytest.raises(ConfigError, match="bench.against names megatron more than once"):
        bench.check_bench(bench.BenchConfig(against=["megatron", "megatron"]))


def test_sequential_blocks_release_pinned_host_memory(monkeypatch):
    """Between sequential blocks on a GPU the caching host allocator's pinned memory is given back
    (``release_host_cache``); the release function is found on this torch."""
    import torch

    from forgetrain import bench

    calls = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append(1), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.release_host_cache() and calls == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not bench.release_host_cache() and calls == [1]  # no device: nothing to release, nothing raised


def test_headline_is_on_disk_before_the_single_micro_batch_timing(tmp_path, monkeypatch):
    """bench.json is written once the headline is timed (``complete`` false): a run killed while timing one
    micro-batch per step keeps its headline; the finished run rewrites it whole (``complete`` true)."""
    import dataclasses

    from forgetrain import bench
    from tests.helpers import ladder_cfg as _cfg

    rc = _cfg()
    rc = dataclasses.replace(rc, train=dataclasses.replace(rc.train, micro_batch_size=2, global_batch_size=8))
    calls = []

    def fake_timed_sides(cfg, against, steps, warmup, interleave="auto", **kw):
        calls.append(cfg.train.global_batch_size)
        if len(calls) == 2:  # the one-micro-batch timing: the run dies here
            res = json.loads((tmp_path / "bench.json").read_text())
            assert res["complete"] is False and res["rows_single_micro_batch"] is None
            assert {r["side"] for r in res["rows"]} == {"forged", "megatron"}
            raise KeyboardInterrupt
        return "sequential A-B-A", {"forged": [1.0, 1.1], "megatron": [2.0, 2.2]}

    monkeypatch.setattr(bench, "timed_sides", fake_timed_sides)
    b = bench.BenchConfig(against=["megatron"], steps=2, warmup=0, out_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(rc, b, rank=0)
    assert calls == [8, 2]
    calls.clear()
    monkeypatch.setattr(bench, "timed_sides", lambda cfg, *a, **kw: (
        calls.append(cfg.train.global_batch_size) or ("sequential A-B-A", {"forged": [1.0], "megatron": [2.0]})))
    bench.run_bench(rc, b, rank=0)
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["complete"] is True and [r["global_batch_size"] for r in res["rows_single_micro_batch"]] == [2, 2]


def test_bench_once_gives_both_row_sets_from_one_block_per_side(tmp_path):
    """``bench.interleave=once``: every side is built once (one block line each, no closing forged block), both row
    sets come from that pass, every row carries its side's label (Megatron-core's says it has no Transformer
    Engine), and the strong and the autocast torch_compile sides are timed beside it."""
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *TINY[:-2], "train.threads=1",
                        "bench.against=[megatron,torch_compile,torch_compile_autocast]", "bench.interleave=once",
                        "train.global_batch_size=4", f"bench.out_dir={tmp_path}"], cwd=ROOT, env=_env(), text=True,
                       capture_output=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["complete"] is True and res["mode"] == "sequential, one block per side (bench.interleave=once)"
    sides = ["forged", "megatron", "torch_compile", "torch_compile_autocast"]
    for key, gbs in (("rows", 4), ("rows_single_micro_batch", 2)):
        assert [r["side"] for r in res[key]] == sides and {r["global_batch_size"] for r in res[key]} == {gbs}
        labels = {r["side"]: r["label"] for r in res[key]}
        assert "no Transformer Engine" in labels["megatron"] and "fp32 masters" in labels["torch_compile"]
        assert "autocast" in labels["torch_compile_autocast"]
    blocks = [x for x in p.stdout.splitlines() if x.startswith("[block] ")]
    assert [b.split()[1] for b in blocks] == sides, blocks
    assert "[block] megatron (Megatron-core 0.16.1 local spec (no Transformer Engine))" in blocks[1]
    assert "  megatron: Megatron-core 0.16.1 local spec (no Transformer Engine)" in p.stdout
    assert "forged drift" not in p.stdout and res["forged_blocks_s"] is None
    assert res["engine_info"]["torch_compile"]["param_dtype"] == "float32"  # llama_micro's default precision


class _Counted:
    """A megatron side that counts its builds and the micro-batches of its steps (class-level records)."""

    builds: list = []
    spec = EngineSpec()

    def __init__(self, cfg, device):
        from forgetrain import registry

        type(self).builds.append(cfg.train.global_batch_size)
        self.inner = registry.load_engine_class("references", "megatron")(cfg, device)

    def __getattr__(self, k):
        return getattr(self.inner, k)


@pytest.mark.parametrize("fixed", [False, True])
def test_once_builds_each_side_once_unless_its_accumulation_is_fixed(monkeypatch, fixed):
    """One build per side for both batches; a side whose spec has ``fixed_grad_accum`` (DeepSpeed's) is built again
    at the single micro-batch. ``on_block`` sees every side's block as it ends."""
    import dataclasses

    from forgetrain import bench, registry

    real = registry.load_engine_class
    counted = type("Counted", (_Counted,), {"builds": [], "spec": EngineSpec(fixed_grad_accum=fixed)})
    monkeypatch.setattr(registry, "load_engine_class",
                        lambda kind, name: counted if name == "counted" else real(kind, name))
    cfg = _micro_cfg()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=4))
    seen = []
    head, one = bench.once_times(cfg, ["counted"], steps=1, warmup=0, single_cfg=bench.single_micro_batch_config(cfg),
                                 on_block=lambda h, o: seen.append(sorted(k for k in h if not k.startswith("_"))))
    assert counted.builds == ([4, 2] if fixed else [4])
    assert len(head["forged"]) == len(head["counted"]) == len(one["forged"]) == len(one["counted"]) == 1
    assert seen == [["forged"], ["counted", "forged"]]
    assert head["_mem_left_gib"] == {} and "_forged_blocks" not in head  # CPU: no device memory to count


def test_once_a_side_out_of_memory_at_the_single_micro_batch_keeps_its_headline(monkeypatch):
    """A side that runs out of memory in its one-micro-batch steps keeps its headline row; the single row set
    names it out of memory with where and why; a side that cannot run here is left out of both."""
    import dataclasses

    import torch

    from forgetrain import bench, registry

    class _BigAtOne(_Counted):
        builds: list = []

        def train_step(self, mbs):
            if len(mbs) == 1:
                raise torch.OutOfMemoryError(_OOM_MSG)
            return self.inner.train_step(mbs)

    _sides_with_an_unrunnable_one(monkeypatch)
    patched = registry.load_engine_class
    monkeypatch.setattr(registry, "load_engine_class",
                        lambda kind, name: _BigAtOne if name == "big" else patched(kind, name))
    cfg = _micro_cfg()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=4))
    head, one = bench.once_times(cfg, ["broken", "big"], steps=1, warmup=1,
                                 single_cfg=bench.single_micro_batch_config(cfg))
    assert len(head["big"]) == 1 and "big" not in one and one["_oom"] == ["big"] and "_oom" not in head
    assert one["_oom_reason"]["big"].startswith("out of memory while warm-up step 1 of 2 (micro-batch 2 x "
                                                "grad-accum 1): asked for 3.91 GiB more")
    assert "broken" in head["_unavailable"] and "broken" in one["_unavailable"]
    assert "broken" not in head and "broken" not in one
    assert {r["side"] for r in bench.summarize(cfg, head)} == {"forged", "big"}
