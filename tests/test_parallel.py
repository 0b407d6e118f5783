"""Data-parallel gates on CPU (gloo, torchrun): the forged engine against the Megatron reference at DP=2.

Gates, each with a mutant it rejects (tests/parallel_mutants.py):

* forged DP=2 vs reference DP=2: **bitwise** over 8 steps (per-token losses, every grad, grad norm, params);
  mutants: a grad not divided by DP, a dropped rank's grads.
* forged DP=2 with overlapped, bucketed reduction: still bitwise.
* forged ZeRO-1 vs the reference's distributed optimizer at DP=2: **bitwise**; mutant: shards gathered in the
  wrong order. The distributed optimizer's grad-norm order is needed for bitwise (forward order is only within
  tolerance).
* DP=2 vs DP=1 at the same global batch: **tolerance** (different micro-batch grouping = different fp32 sums);
  mutants as above.
* resume: DP=2 -> DP=2 bitwise (ZeRO-0 and ZeRO-1); DP=2 (ZeRO-0 and ZeRO-1 checkpoints) -> DP=1 within
  tolerance; mutant: a resume that forgets the AdamW moments.
* two torchrun launchers joined by c10d rendezvous (``--nnodes 2``) write the same trace as one launcher; the
  comparison rejects a run where one rank re-used another's data.
* forged TP=2 vs reference TP=2: **bitwise** (mutants: fc1 split without the gate/up interleave, replicated
  norm weights counted per TP rank); TP=2 vs TP=1 and its checkpoint resumed at TP=1: tolerance.
* FSDP2 (``parallel=fsdp2``, zero_stage=3) vs DP=2: tolerance (mutant: grads averaged twice); its DTensor-sharded checkpoint
  resumes at DP=1.
* DP=2 x TP=2 through ``torchrun -m forgetrain.verify``: bitwise with a resume (slow).
* a killed (or, slow, a hung) rank ends the other launcher non-zero, with a one-line message, within 60 s.
* ``torchrun -m forgetrain parallel=dp2``: only rank 0 reports, every rank writes its DCP shard, DP=1 resumes it.

Most runs share one two-rank torchrun launch (``dp2`` fixture, about a minute) to pay the imports once.
Shapes: llama_micro (2 layers, width 64, GQA 4/2), micro-batch 2 x grad-accum 2 x DP 2 = global batch 8
(TP: x DP 1 = 4), warmup 2, clipping active, 8 steps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgetrain import equivalence as eq
from tests.limits import hang_s
from tests.helpers import free_port as _free_port, session_cache as _cache
from tests.helpers import Runs, launch_errors as _errors, run_jobs, torchrun, torchrun_env as _env

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8
BASE = ["model=llama_micro", f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.lr_warmup_steps=2"]
DP2 = ["parallel=dp2", *BASE]
Z1 = ["parallel=dp2_zero1", *BASE]
TP_BASE = [*BASE[:2], "train.micro_batch_size=2", "train.global_batch_size=4", "train.lr_warmup_steps=2"]
TP2 = ["parallel=tp2", *TP_BASE]
FSDP = ["parallel=fsdp2", *BASE]
MEAN = ["parallel.report_loss=dp_mean"]
M = "tests.parallel_mutants:"


def bitwise(ref: Path, cand: Path):
    return eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise"))


def tolerance(ref: Path, cand: Path, tier: dict | None = None):
    return eq.tolerance(ref / "trace", cand / "trace", tier or eq.load_tier("tolerance"))


def layout_tolerance() -> dict:
    """conf/tier/tolerance.yaml with the layout entry merged in (rationale: scenarios/llama_tiny_cpu/
    tolerance_layouts.yaml; the fp32 grad norm of a TP- or FSDP-split tensor rounds differently)."""
    from omegaconf import OmegaConf

    entry = OmegaConf.to_container(OmegaConf.load(ROOT / "scenarios" / "llama_tiny_cpu" / "tolerance_layouts.yaml"))
    from forgetrain.equivalence.verdict import merge_settings

    return merge_settings(eq.load_tier("tolerance"), entry["tolerance"])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """The test run's data cache (as tests/conftest.py sets it), handed to the torchrun children."""
    return _cache(tmp_path_factory)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, cache):
    """One two-rank launch: the reference (DP=2 ZeRO-0, DP=2 ZeRO-1, TP=2), the forged engine, its mutants and
    the checkpointed halves of the resume gates. Returns ``{name: out_dir}`` (a :class:`Runs`)."""
    tmp = tmp_path_factory.mktemp("dp2")
    names = ("ref", "ref_z1", "cand", "no_scale", "dropped_rank", "dup_shard", "overlap", "cand_mean",
             "no_scale_mean", "dropped_rank_mean", "cand_part", "cand_z1", "z1_part", "z1_gather", "mean_part",
             "z1_mean_part", "ref_tp2", "cand_tp2", "tp_fc1", "tp_norm", "tp_part", "fsdp", "fsdp_double_avg",
             "fsdp_part", "ref_z1_part", "ref_tp2_part")
    d = {n: tmp / n for n in names}

    def cand(name, over, engine=None, init="ref", **kw):
        return {"side": "candidate", "out": str(d[name]), "init": str(d[init] / "init.safetensors"),
                "overrides": over, **({"engine": M + engine} if engine else {}), **kw}

    jobs = [
        {"side": "reference", "out": str(d["ref"]), "overrides": DP2},
        cand("cand", DP2),
        cand("no_scale", DP2, "NoDPScale"),
        cand("dropped_rank", DP2, "DroppedRankGrads"),
        cand("dup_shard", DP2, "DuplicatedShard"),
        cand("overlap", [*DP2, "parallel.overlap_grad_reduce=true", "parallel.bucket_size=60000"]),
        cand("cand_mean", [*DP2, *MEAN], digests=False),
        cand("no_scale_mean", [*DP2, *MEAN], "NoDPScale", digests=False),
        cand("dropped_rank_mean", [*DP2, *MEAN], "DroppedRankGrads", digests=False),
        cand("cand_part", DP2, stop_after=4), cand("cand_part", DP2, resume=True),
        cand("mean_part", [*DP2, *MEAN], digests=False, stop_after=4),
        {"side": "reference", "out": str(d["ref_z1"]), "overrides": Z1},
        {"side": "reference", "out": str(d["ref_z1_part"]), "overrides": Z1, "stop_after": 4},
        {"side": "reference", "out": str(d["ref_z1_part"]), "overrides": Z1, "resume": True},
        cand("cand_z1", Z1),
        cand("z1_part", Z1, stop_after=4), cand("z1_part", Z1, resume=True),
        cand("z1_gather", Z1, "WrongGatherOrder"),
        cand("z1_mean_part", [*Z1, *MEAN], digests=False, stop_after=4),
        {"side": "reference", "out": str(d["ref_tp2"]), "overrides": TP2},
        {"side": "reference", "out": str(d["ref_tp2_part"]), "overrides": TP2, "stop_after": 4},
        {"side": "reference", "out": str(d["ref_tp2_part"]), "overrides": TP2, "resume": True},
        cand("cand_tp2", TP2, init="ref_tp2"),
        cand("tp_fc1", TP2, "ContiguousFc1Split", init="ref_tp2"),
        cand("tp_norm", TP2, "NormWeightsCountedPerTPRank", init="ref_tp2"),
        cand("tp_part", TP2, init="ref_tp2", digests=False, stop_after=4),
        cand("fsdp", [*FSDP, *MEAN, "train.eval_interval=3"], digests=False),  # eval between steps too
        cand("fsdp_double_avg", [*FSDP, *MEAN], "FSDPDoubleAverage", digests=False),
        cand("fsdp_part", [*FSDP, *MEAN], digests=False, stop_after=4),
    ]
    t0 = time.perf_counter()
    p = run_jobs(jobs, tmp, cache)
    runs = Runs(d, p, time.perf_counter() - t0)
    print(f"two-rank launch ({len(jobs)} runs): {runs.launch_s:.1f} s")
    return runs


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("override,msg", [
    ("parallel.zero_stage=2", "parallel.zero_stage must be 0"),
    ("parallel.report_loss=sum", "parallel.report_loss must be local or dp_mean"),
    ("parallel.bucket_size=0", "parallel.bucket_size must be positive"),
    ("parallel.timeout_s=0", "parallel.timeout_s must be positive"),
    ("parallel=fsdp2 parallel.tensor_parallel_size=2", "parallel.zero_stage=3 (FSDP2) is implemented with TP=1"),
    ("parallel=tp2 model.vocab_size=4095", "TP=2 must divide"),
])
def test_parallel_config_errors_are_one_line(override, msg):
    from forgetrain.config import validate
    from forgetrain.errors import ConfigError
    from tests.parallel_worker import compose

    cfg = compose(override.split())
    world = cfg.parallel.data_parallel_size * cfg.parallel.tensor_parallel_size
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_parallel_layout_must_match_the_world_size():
    from forgetrain.config import validate
    from forgetrain.errors import ConfigError
    from tests.parallel_worker import compose

    with pytest.raises(ConfigError, match="launch with torchrun --nproc-per-node 2"):
        validate(compose(["parallel=dp2"]), world_size=1)


# ------------------------------------------------------------------ DP=2 bitwise vs the reference
def test_forged_dp2_matches_reference_dp2_bitwise(dp2):
    v = bitwise(dp2["ref"], dp2["cand"])
    assert v.passed, v.summary
    ev = v.evidence
    assert ev["digests"]["compared"] and ev["final_params"]["compared"]
    meta = json.loads((dp2["cand"] / "trace" / "meta.json").read_text())
    assert meta["world_size"] == 2
    assert len(eq_records(dp2["cand"])) == STEPS


def eq_records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "trace" / "trace.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mutant", ["no_scale", "dropped_rank"])
def test_dp2_bitwise_rejects_mutant(dp2, mutant):
    v = bitwise(dp2["ref"], dp2[mutant])
    assert not v.passed
    fd = v.first_divergence
    assert fd["step"] == 1 and fd["kind"] in ("grad", "grad_norm"), fd


def test_overlapped_bucketed_reduction_is_still_bitwise(dp2):
    v = bitwise(dp2["ref"], dp2["overlap"])
    assert v.passed, v.summary


def test_reference_dp2_is_not_dp1_trivially(dp2):
    """The gate has teeth: the two ranks' data differ, so rank 0's loss is not the global one."""
    loc = [r["loss"] for r in eq_records(dp2["cand"])]
    mean = [r["loss"] for r in eq_records(dp2["cand_mean"])]
    assert all(a != b for a, b in zip(loc, mean))
    assert [r["grad_norm"] for r in eq_records(dp2["cand"])] == [r["grad_norm"] for r in eq_records(dp2["cand_mean"])]


# ------------------------------------------------------------------ ZeRO-1
def test_forged_zero1_matches_reference_distributed_optimizer_bitwise(dp2):
    v = bitwise(dp2["ref_z1"], dp2["cand_z1"])
    assert v.passed, v.summary
    assert not bitwise(dp2["ref"], dp2["ref_z1"]).passed  # ZeRO-1 is a different computation: the gate is real


def test_zero1_rejects_shards_gathered_in_wrong_order(dp2):
    v = bitwise(dp2["ref_z1"], dp2["z1_gather"])
    assert not v.passed and v.first_divergence["kind"] == "param", v.first_divergence
    assert not tolerance(dp2["ref_z1"], dp2["z1_gather"]).passed


def _megatron_name(n: str) -> str:
    n = n.replace("embedding.weight", "embedding.word_embeddings.weight").replace("layers.", "decoder.layers.")
    n = n.replace("final_norm.weight", "decoder.final_layernorm.weight")
    for a, b in (("input_norm.weight", "input_layernorm.weight"), ("pre_mlp_norm.weight", "pre_mlp_layernorm.weight"),
                 ("attn.proj", "self_attention.linear_proj.weight"), ("attn.qkv", "self_attention.linear_qkv.weight"),
                 ("mlp.fc1", "mlp.linear_fc1.weight"), ("mlp.fc2", "mlp.linear_fc2.weight")):
        n = n.replace(a, b)
    return n


def test_zero1_layout_and_norm_order_are_megatrons():
    """The forged ZeRO-1 buffer layout (64-element param alignment, 128-element bucket padding, reverse
    registration order) and its grad-norm order equal the distributed optimizer's own, read from Megatron."""
    import torch

    from references.megatron.engine import Engine as Ref
    from scenarios.llama_tiny_cpu.engine import Engine
    from tests.parallel_worker import compose

    cfg = compose(["model=llama_micro", "parallel.zero_stage=1"])
    ref, cand = Ref(cfg, torch.device("cpu")), Engine(cfg, torch.device("cpu"))
    buf = ref.model.buffers[0]
    ref_layout = {ref._names[id(p)]: rng for p, rng in buf.param_index_map.items()}
    cand_layout = {_megatron_name(n): rng for n, rng in cand.ddp.layout.items()}
    assert cand_layout == ref_layout and cand.ddp.numel == buf.numel
    assert [_megatron_name(pc.name) for pc in cand.ddp.pieces] == ref.grad_norm_param_order()


# ------------------------------------------------------------------ DP=2 vs DP=1, same global batch
def _single_process(tmp_path_factory, name: str, init: Path, base: list[str]) -> Path:
    """The forged engine in this process (``parallel=single``) from ``init``: the 1-process side of a gate."""
    from tests.parallel_worker import run_job

    out = tmp_path_factory.mktemp(name) / "cand"
    run_job({"side": "candidate", "out": str(out), "init": str(init), "overrides": ["parallel=single", *base],
             "digests": False})
    return out


@pytest.fixture(scope="module")
def dp1(dp2, tmp_path_factory):
    return _single_process(tmp_path_factory, "dp1", dp2["ref"] / "init.safetensors", BASE)


def test_dp2_matches_dp1_within_tolerance(dp2, dp1):
    assert not bitwise(dp1, dp2["cand_mean"]).passed  # different fp32 sums: tolerance is the right tier
    v = tolerance(dp1, dp2["cand_mean"])
    assert v.passed, v.summary


@pytest.mark.parametrize("mutant", ["no_scale_mean", "dropped_rank_mean"])
def test_dp2_vs_dp1_tolerance_rejects_mutant(dp2, dp1, mutant):
    v = tolerance(dp1, dp2[mutant])
    assert not v.passed, v.summary


def test_dp2_vs_dp1_rejects_a_duplicated_shard(dp2):
    """A rank training on another rank's samples: bitwise against the reference catches it at step 1."""
    v = bitwise(dp2["ref"], dp2["dup_shard"])
    assert not v.passed and v.first_divergence["step"] == 1


# ------------------------------------------------------------------ resume
def test_resume_dp2_to_dp2_is_bitwise(dp2):
    """The forged engine (ZeRO-0, ZeRO-1) and the reference's own distributed-optimizer and TP=2 checkpoints
    (gathered into the same DP/TP-independent layout) resume to the bit."""
    for part, full in (("cand_part", "cand"), ("z1_part", "cand_z1"), ("ref_z1_part", "ref_z1"),
                       ("ref_tp2_part", "ref_tp2")):
        v = bitwise(dp2[full], dp2[part])
        assert v.passed, (part, v.summary)


def _resume_at_dp1(dp2, part: str, tmp: Path, engine=None) -> Path:
    from tests.parallel_worker import run_job

    out = tmp / part
    shutil.copytree(dp2[part], out)
    run_job({"side": "candidate", "out": str(out), "overrides": ["parallel=single", *BASE], "digests": False,
             "resume": True, **({"engine": M + engine} if engine else {})})
    return out


@pytest.mark.parametrize("part", ["mean_part", "z1_mean_part"])
def test_resume_dp2_checkpoint_at_dp1_within_tolerance(dp2, part, tmp_path):
    ck = dp2[part] / "checkpoints" / "step_000004"
    assert sorted(p.name for p in ck.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one shard per rank
    out = _resume_at_dp1(dp2, part, tmp_path)
    recs = eq_records(out)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    v = tolerance(dp2["cand_mean"], out)
    assert v.passed, v.summary


def test_resume_at_dp1_rejects_forgotten_adam_state(dp2, tmp_path):
    out = _resume_at_dp1(dp2, "z1_mean_part", tmp_path, engine="ForgetsAdamState")
    v = tolerance(dp2["cand_mean"], out)
    assert not v.passed, v.summary


# ------------------------------------------------------------------ TP=2
def test_forged_tp2_matches_reference_tp2_bitwise(dp2):
    v = bitwise(dp2["ref_tp2"], dp2["cand_tp2"])
    assert v.passed, v.summary
    assert v.evidence["digests"]["compared"] and v.evidence["modules"]["compared"]


@pytest.mark.parametrize("mutant,kind", [("tp_fc1", "module_fwd"), ("tp_norm", "grad_norm")])
def test_tp2_bitwise_rejects_mutant(dp2, mutant, kind):
    v = bitwise(dp2["ref_tp2"], dp2[mutant])
    assert not v.passed and v.first_divergence["step"] == 1 and v.first_divergence["kind"] == kind, v.first_divergence


@pytest.fixture(scope="module")
def tp1(dp2, tmp_path_factory):
    return _single_process(tmp_path_factory, "tp1", dp2["ref_tp2"] / "init.safetensors", TP_BASE)


def test_tp2_matches_tp1_within_tolerance_and_resumes_at_tp1(dp2, tp1, tmp_path):
    """TP splits the vocabulary sums of the cross-entropy and the row-parallel matmuls into two partial sums, so
    TP=2 vs TP=1 is a tolerance comparison; a TP=2 checkpoint (full per-parameter tensors) resumes at TP=1."""
    from tests.parallel_worker import run_job

    assert not bitwise(tp1, dp2["cand_tp2"]).passed
    strict = tolerance(tp1, dp2["cand_tp2"])
    assert {d["kind"] for d in strict.evidence["divergences"]} <= {"grad_norm"}, strict.summary
    v = tolerance(tp1, dp2["cand_tp2"], layout_tolerance())
    assert v.passed, v.summary
    assert not tolerance(tp1, dp2["tp_fc1"], layout_tolerance()).passed
    out = tmp_path / "tp_part"
    shutil.copytree(dp2["tp_part"], out)
    run_job({"side": "candidate", "out": str(out), "overrides": ["parallel=single", *TP_BASE], "digests": False,
             "resume": True})
    v = tolerance(dp2["cand_tp2"], out, layout_tolerance())
    assert v.passed, v.summary


# ------------------------------------------------------------------ FSDP2
def test_fsdp2_matches_dp2_within_tolerance(dp2):
    """FSDP2 reduce-scatters and norms per shard: tolerance (layout entry), not bitwise, against DP=2."""
    strict = tolerance(dp2["cand_mean"], dp2["fsdp"])
    assert {d["kind"] for d in strict.evidence["divergences"]} <= {"grad_norm"}, strict.summary
    v = tolerance(dp2["cand_mean"], dp2["fsdp"], layout_tolerance())
    assert v.passed, v.summary
    assert not tolerance(dp2["cand_mean"], dp2["fsdp_double_avg"], layout_tolerance()).passed


def test_fsdp2_sharded_checkpoint_resumes_at_dp1(dp2, tmp_path):
    """The FSDP2 checkpoint holds DTensor shards (one DCP file per rank); DCP reshards them into DP=1's plain
    tensors."""
    from torch.distributed.checkpoint import FileSystemReader

    ck = dp2["fsdp_part"] / "checkpoints" / "step_000004"
    md = FileSystemReader(str(ck)).read_metadata()
    chunks = md.state_dict_metadata["model.embedding.weight"].chunks
    assert len(chunks) == 2 and {c.offsets[0] for c in chunks} == {0, 2048}  # sharded on the vocabulary dim
    out = _resume_at_dp1(dp2, "fsdp_part", tmp_path)
    v = tolerance(dp2["cand_mean"], out, layout_tolerance())
    assert v.passed, v.summary


# ------------------------------------------------------------------ DP=2 x TP=2 (4 ranks), through forgetrain.verify
@pytest.mark.slow
def test_verify_cli_dp2_tp2_bitwise_with_resume(cache, tmp_path):
    """``torchrun --nproc-per-node 4 -m forgetrain.verify tier=bitwise`` at DP=2 x TP=2: the forged engine
    (stopped at step 3 and resumed) equals the reference to the bit."""
    p = torchrun(["-m", "forgetrain.verify", "tier=bitwise", "parallel=dp2", "parallel.tensor_parallel_size=2",
                  *BASE[:1], "train.steps=6", "verify.steps=6", "verify.resume_at=3", *BASE[2:],
                  f"verify.out_dir={tmp_path}"], _env(cache), nproc=4)
    assert p.returncode == 0, _errors(p)
    assert (p.stdout + p.stderr).count("strictest equivalence tier passed: bitwise") == 1  # rank 0 reports


# ------------------------------------------------------------------ two launchers, c10d rendezvous
def _launcher(node_rank: int, port: int, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"ft{port}", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_two_launcher_rendezvous_writes_the_single_launcher_trace(dp2, cache, tmp_path):
    out = tmp_path / "multinode"
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps([{"side": "candidate", "out": str(out), "init": str(dp2["ref"] / "init.safetensors"),
                                 "overrides": DP2}]))
    port, env = _free_port(), _env(cache)
    procs = [_launcher(i, port, ["-m", "tests.parallel_worker", str(spec)], env, tmp_path / f"node{i}.log")
             for i in range(2)]
    rcs = [p.wait(timeout=hang_s()) for p in procs]
    assert rcs == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]
    v = bitwise(dp2["cand"], out)
    assert v.passed, v.summary
    assert not bitwise(dp2["dup_shard"], out).passed  # the comparison would see a rank re-using another's data


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _worker_pid(launcher: subprocess.Popen, deadline: float) -> int:
    while time.time() < deadline and launcher.poll() is None:
        kids = _children(launcher.pid)
        if kids:
            return kids[0]
        time.sleep(0.2)
    raise AssertionError("torchrun never started its worker")


def _wait_for_training(logs: list[Path], deadline: float) -> None:
    """Until rank 0 (on either launcher) has printed its run header."""
    while time.time() < deadline:
        if any("forgetrain: scenario llama_tiny_cpu, engine " in log.read_text() for log in logs):
            return
        time.sleep(0.3)
    raise AssertionError("training never started:\n" + "\n".join(log.read_text()[-2000:] for log in logs))


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.parametrize("how", ["kill", pytest.param("hang", marks=pytest.mark.slow)])
def test_lost_rank_ends_the_job_with_a_clear_message(cache, tmp_path, how):
    """Two launchers; one worker is SIGKILLed (or SIGSTOPped: a hang) mid-training. The other launcher must exit
    non-zero within 60 s, its rank printing one ``error: rank r/2: a collective failed ...`` line."""
    timeout_s = 10
    from forgetrain.config import DataConfig
    from forgetrain.data import prepare

    prepare(DataConfig(), progress=False)  # cached first: rank 0 preparing it for > timeout_s would time rank 1 out
    argv = ["-m", "forgetrain", *DP2, "train.steps=100000", "train.eval_interval=0", "train.sample_tokens=0",
            "train.save_interval=0", f"parallel.timeout_s={timeout_s}", f"train.out_dir={tmp_path / 'run'}"]
    port, env = _free_port(), _env(cache)
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = [_launcher(i, port, argv, env, logs[i]) for i in range(2)]
    workers: list[int] = []
    try:
        deadline = time.time() + hang_s()
        victim = _worker_pid(procs[1], deadline)
        workers = [victim, _worker_pid(procs[0], deadline)]
        _wait_for_training(logs, deadline)
        time.sleep(2.0)  # a few steps into training
        t0 = time.time()
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        rc = procs[0].wait(timeout=hang_s())
        elapsed = time.time() - t0
        text = logs[0].read_text()
        assert rc != 0
        assert elapsed < 60
        assert "a collective failed" in text, text[-3000:]
        if how == "hang":
            assert elapsed >= timeout_s * 0.5
    finally:
        for p in procs:
            _kill_group(p)
        for pid in workers:  # torchrun starts each worker in a session of its own; a stopped one outlives it
            try:
                if "forgetrain" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


# ------------------------------------------------------------------ the CLI under torchrun
def test_cli_torchrun_dp2_then_resume_at_dp1(cache, tmp_path):
    out = tmp_path / "run"
    args = ["model=llama_micro", "train.steps=6", "train.lr_warmup_steps=1", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.eval_interval=3", "train.eval_iters=2", "train.sample_tokens=8",
            "train.save_interval=3", "parallel.report_loss=dp_mean", f"train.out_dir={out}"]
    t0 = time.perf_counter()
    p = torchrun(["-m", "forgetrain", "parallel=dp2", "train.stop_after=3", *args], _env(cache))
    dp2_s = time.perf_counter() - t0
    assert p.returncode == 0, _errors(p)
    assert p.stderr.count("forgetrain: scenario llama_tiny_cpu, engine ") == 1  # only rank 0 reports
    assert "DP2 TP1" in p.stderr
    assert sorted(x.name for x in (out / "checkpoints" / "step_000003").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    env = dict(_env(cache), OMP_NUM_THREADS="2")
    q = subprocess.run([sys.executable, "-m", "forgetrain", "parallel=single", "train.resume=true", *args],
                       cwd=ROOT, env=env, text=True, capture_output=True, timeout=hang_s())
    assert q.returncode == 0, q.stderr[-3000:]
    assert "resumed from" in q.stderr and "=== summary ===" in q.stderr
    assert [r["step"] for r in eq_records(out)] == list(range(1, 7))
    print(f"torchrun DP=2 (3 steps + checkpoint): {dp2_s:.1f} s")


def test_dp2_final_export_failure_is_rank_0s_line_on_every_rank(cache, tmp_path):
    """The export fails on rank 0 (a full disk, injected through sitecustomize in the children): every rank ends
    with rank 0's line, none reports a dead peer, and the launch fails."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import safetensors, safetensors.torch\n"
        "def full(*a, **k):\n"
        "    raise safetensors.SafetensorError('Error while serializing: I/O error: No space left on device "
        "(os error 28)')\n"
        "safetensors.torch.save_file = full\n")
    env = _env(cache)
    env["PYTHONPATH"] = f"{inject}{os.pathsep}{env['PYTHONPATH']}"
    out = tmp_path / "run"
    p = torchrun(["-m", "forgetrain", "parallel=dp2", "model=llama_micro", "train.steps=2", "train.lr_warmup_steps=1",
                  "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=0",
                  "train.sample_tokens=0", "train.save=false", f"train.out_dir={out}"], env)
    errs = {x for x in p.stderr.splitlines() if x.startswith("error:")}
    assert p.returncode != 0, _errors(p)
    assert len(errs) == 1, _errors(p)
    line = errs.pop()
    assert "cannot write the final weights" in line and "No space left on device" in line, line
    assert "collective" not in p.stderr, _errors(p)
    assert sorted(os.listdir(out / "trace")) == ["meta.json", "trace.jsonl"]
