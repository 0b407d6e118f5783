"""``references/deepspeed`` as a bench side and with the run config's memory layout: ZeRO-Offload (stage 2,
``offload_optimizer: cpu`` with pinned memory, DeepSpeed's CPU Adam) under ``engine.optimizer_offload_fraction > 0``,
HF activation checkpointing under ``engine.recompute=full``, SDPA attention and no measurement snapshots when the
bench builds it, and the host-memory refusal of an offload that cannot fit the machine. The equivalence form
(eager attention, torch AdamW, no offload) is tests/test_deepspeed_ref.py's.

On CPU at llama_micro (2 layers, width 64), micro-batch 2 x grad-accum 2, clipping active (tests/test_ladder.py's
``_cfg``). ``DeepSpeedCPUAdam`` JIT-compiles DeepSpeed's ``cpu_adam`` C++ op on first use: about 3.5 min on this
2-core machine (g++ and ninja), then cached under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``)
and loaded in seconds; those tests are skipped where no C++ compiler or ninja is found.

Measured here (torch 2.13+cpu, deepspeed 0.19.8, transformers 5.24.0), offload against the same config without it
over 4 steps: fp32 losses bit-equal, grad norms within 1e-7 relative, final weights 5.7e-8 relative L2 apart (CPU
Adam's vectorised AdamW against torch's, both fp32); bf16 losses within 1e-6 relative, final weights 7e-5 apart
(the model's bf16 copy rounds differently once the fp32 masters differ in their last bits).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # these are CPU tests; DeepSpeed picks its accelerator once
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from tests.helpers import ladder_cfg as _ladder_cfg  # noqa: E402

GIB = 2**30
STEPS = 4


def _cfg(precision: str = "fp32", offload: float = 0.0, recompute: str = "none", **train):
    c = _ladder_cfg(**train)
    return dataclasses.replace(c, train=dataclasses.replace(c.train, precision=precision),
                               engine=dataclasses.replace(c.engine, optimizer_offload_fraction=offload,
                                                          recompute=recompute))


def _engine(cfg, **kw):
    from references.deepspeed.engine import Engine

    return Engine(cfg, torch.device("cpu"), **kw)


def _batches(cfg, n_steps: int = STEPS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    t, m = cfg.train, cfg.model
    return [[torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=g)
             for _ in range(t.global_batch_size // t.micro_batch_size)] for _ in range(n_steps)]


def _rel_l2(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return math.sqrt(num / sum(float(a[k].double().pow(2).sum()) for k in a))


def _toolchain() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available() and shutil.which(os.environ.get("CXX", "c++")) is not None


def needs_cpu_adam(test):
    """DeepSpeedCPUAdam JIT-compiles a C++ op: it needs a C++ compiler and ninja, and the first build takes about
    3.5 min on this 2-core machine (then ~/.cache/torch_extensions holds it). That would push the default CI run
    past its 30 minutes on a clean clone, so these tests are marked slow: `bash .ci/run -m slow` runs them."""
    test = pytest.mark.skipif(not _toolchain(), reason="DeepSpeedCPUAdam JIT-compiles a C++ op: needs a C++ "
                                                       "compiler and ninja")(test)
    return pytest.mark.slow(test)


def _llama8b_cfg(**model):
    """The llama8b_h200 scenario's composed config (Llama-3-8B, bf16, offload 1.0, global batch 32)."""
    from hydra import compose, initialize_config_dir

    from forgetrain.config import register_configs, to_run_config
    from tests.helpers import ROOT

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = to_run_config(compose(config_name="config", overrides=["scenario=llama8b_h200"]))
    return dataclasses.replace(c, model=dataclasses.replace(c.model, **model))


# ------------------------------------------------------------------------------------------------ ZeRO-Offload
@needs_cpu_adam
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-6), ("bf16", 1e-3)])
def test_offload_trains_like_the_device_optimizer(precision, tol):
    """ZeRO-Offload (stage 2, CPU Adam in AdamW mode, the same groups and hyperparameters) trains the tiny model as
    ZeRO-2 without offload does (torch AdamW on the device), within ``tol`` (loss and grad norm relative, final
    weights relative L2; measured: module doc)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    c = _cfg(precision)
    plain = _engine(dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, zero_stage=2)))
    off = _engine(_cfg(precision, offload=1.0))  # parallel.zero_stage=0, as the forged offload needs: stage 2 here
    assert plain.zero_stage == 2 and not plain.offload and off.zero_stage == 2 and off.offload
    zc = off.ds_config()["zero_optimization"]
    assert zc == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert "torch_adam" not in off.ds_config()["optimizer"]["params"]
    opt = off.ds.basic_optimizer
    assert isinstance(opt, DeepSpeedCPUAdam) and opt.adam_w_mode
    t = off.cfg.train
    assert [g["weight_decay"] for g in opt.param_groups] == [t.weight_decay, 0.0]
    assert all(tuple(g["betas"]) == (t.adam_beta1, t.adam_beta2) and g["eps"] == t.adam_eps for g in opt.param_groups)
    assert off.bench_info["optimizer"].startswith("DeepSpeedCPUAdam") and off.bench_info["zero_stage"] == 2

    init = plain.export_hf_weights()
    off.load_hf_weights(init)
    for mbs in _batches(plain.cfg):
        a, b = plain.train_step(mbs), off.train_step(mbs)
        assert a.lr == b.lr
        assert abs(a.loss - b.loss) <= tol * abs(a.loss), (a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) <= tol * a.grad_norm, (a.grad_norm, b.grad_norm)
        assert b.per_token_loss.shape == (2, 2, 32)
    assert b.grad_norm > t.clip_grad  # clipping is active
    wa, wb = plain.export_hf_weights(), off.export_hf_weights()
    assert _rel_l2(wa, wb) <= tol
    assert all(not torch.equal(wb[k], init[k]) for k in wb)  # every weight moved
    assert _rel_l2(plain.export_hf_grads(), off.export_hf_grads()) <= 1e-2  # the snapshot works under offload too


@needs_cpu_adam
def test_offload_resume_is_bitwise():
    """state_dict / load_state_dict under ZeRO-Offload (DeepSpeedCPUAdam counts its step in an int): a resumed run
    equals the uninterrupted one bit for bit; init_weights puts everything back to step 0."""
    cfg = _cfg(offload=1.0)
    batches = _batches(cfg)
    a = _engine(cfg)
    for mbs in batches[:2]:
        a.train_step(mbs)
    saved = a.state_dict()
    assert float(saved["adam_step"]) == 2.0
    for mbs in batches[2:]:
        ra = a.train_step(mbs)
    b = _engine(cfg)
    b.load_state_dict(saved)
    for mbs in batches[2:]:
        rb = b.train_step(mbs)
    assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm)
    wa, wb = a.export_hf_weights(), b.export_hf_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    b.init_weights()
    assert float(b.state_dict()["adam_step"]) == 0.0
    assert all(int(st["step"]) == 0 for st in b.ds.basic_optimizer.state.values())


def test_offload_host_memory_estimate():
    """The host bytes of ZeRO-Offload (DeepSpeed 0.19.8's stage_1_and_2.py and cpu_adam.py; the function's doc):
    18 B/param under bf16 plus one staging buffer the size of the largest parameter; pinned buffers rounded to
    powers of two on a GPU. Llama-3-8B: 140.8 GiB on the GPU machine; the 8B proxy (4 layers): 35.3 GiB."""
    from forgetrain.metrics import param_counts
    from references.deepspeed.engine import zero_offload_host_parts

    c8 = _llama8b_cfg()
    n = param_counts(c8.model)["total"]
    raw = zero_offload_host_parts(c8, pinned=False)
    staging = 2 * c8.model.vocab_size * c8.model.hidden_size  # bf16 embedding-sized buffer
    assert sum(raw.values()) == 18 * n + staging and raw["fp32_grad_accum"] == 0
    assert round(sum(zero_offload_host_parts(c8, pinned=True).values()) / GIB, 1) == 140.8
    proxy = _llama8b_cfg(num_layers=4)
    assert round(sum(zero_offload_host_parts(proxy, pinned=True).values()) / GIB, 1) == 35.3
    assert round(sum(zero_offload_host_parts(proxy, pinned=False).values()) / GIB, 1) == 33.2
    # fp32 with gradient accumulation: the fp32 model copy (4 B) and DeepSpeed's per-parameter host accumulators
    micro = _cfg()
    m = zero_offload_host_parts(micro, pinned=False)
    assert m["weight_copy"] == 4 * param_counts(micro.model)["total"] and m["fp32_grad_accum"] > 0


def test_offload_is_refused_before_anything_is_built_on_a_small_host(monkeypatch):
    """llama8b_h200 (offload) on a machine of 128 GiB: one CannotRunHere line with the need and the machine's memory,
    raised before the process group, deepspeed or the model exist (their builders are booby-trapped)."""
    from forgetrain import memory
    from forgetrain.errors import CannotRunHere
    from references.deepspeed import engine as ds_engine

    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 128 * GIB)

    def trap(*a, **k):
        raise AssertionError("built something before the host-memory check")

    monkeypatch.setattr(ds_engine, "_init_process_group", trap)
    monkeypatch.setattr(ds_engine.Engine, "_build_hf", trap)
    with pytest.raises(CannotRunHere) as err:
        ds_engine.Engine(_llama8b_cfg(), torch.device("cuda"))  # refused before CUDA is touched
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("needs ~140.8 GiB of host memory for ZeRO-Offload (fp32 master weights + fp32 grads + "
                           "Adam m and v + a bf16 weight copy, 18 B/param"), line
    assert "the machine has 128.0 GiB less a 16 GiB reserve" in line
    # the same config without offload is not this check's business; skip_memory_check runs anyway
    assert ds_engine.zero_offload_refusal(
        dataclasses.replace(_llama8b_cfg(), train=dataclasses.replace(_llama8b_cfg().train, skip_memory_check=True)),
        torch.device("cuda")) is None


@pytest.mark.parametrize("interleave", ["always", "never"])
def test_bench_prints_the_refusal_as_one_line_and_times_nothing_of_it(monkeypatch, capsys, tmp_path, interleave):
    """``forgetrain.bench`` beside deepspeed with an offload config on a host too small for it: the side is one line,
    ``deepspeed: cannot run here: needs ~X GiB ...`` (not timed), stored under "unavailable" in bench.json; no
    deepspeed row, no deepspeed time; the forged engine is timed as usual."""
    from forgetrain import bench, memory

    monkeypatch.setattr(memory, "host_memory_bytes", lambda: memory.HOST_RESERVE_BYTES)  # nothing left to use
    cfg = _cfg(offload=1.0)
    b = bench.BenchConfig(against=["deepspeed"], steps=1, warmup=0, interleave=interleave, single_micro_batch=False,
                          out_dir=str(tmp_path))
    _, times = bench.timed_sides(cfg, ["deepspeed"], steps=1, warmup=0, interleave=interleave)
    assert "deepspeed" not in times and len(times["forged"]) >= 1
    bench.run_bench(cfg, b, rank=0)
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("deepspeed")]
    assert len(lines) == 1 and lines[0].startswith("deepspeed: cannot run here: needs ~"), out
    assert lines[0].endswith("(not timed)") and "GiB of host memory for ZeRO-Offload" in lines[0]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert [r["side"] for r in res["rows"]] == ["forged"]
    assert res["unavailable"]["deepspeed"].startswith("deepspeed: cannot run here: needs ~")


# ------------------------------------------------------------------------------------------------ recompute
def test_recompute_is_bitwise_and_runs():
    """engine.recompute=full: HF activation checkpointing of every layer. Bitwise the run without it (the same ops
    on the same inputs; eager, CPU, fp32), and the recompute really runs: layer 0's MLP starts its forward twice per
    micro-batch (the forward, then the recompute in the backward), once without."""
    from forgetrain.bench import recompute_warnings

    def run(recompute):
        e = _engine(_cfg(recompute=recompute))
        calls = [0]
        e.module_probes()["layers.0.mlp"].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        res = []
        for mbs in _batches(e.cfg, 3):
            calls[0] = 0
            r = e.train_step(mbs)
            res.append((r.loss, r.grad_norm, calls[0]))
        return res, e.export_hf_weights(), e

    off, w_off, e_off = run("none")
    on, w_on, e_on = run("full")
    assert [c for *_, c in off] == [2] * 3 and [c for *_, c in on] == [4] * 3, (off, on)
    assert [r[:2] for r in on] == [r[:2] for r in off]
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_off)
    assert e_on.bench_info["recompute"] == "full" and e_off.bench_info["recompute"] == "none"
    rc = _cfg(recompute="full")
    assert recompute_warnings(rc, ["deepspeed"]) == []  # supports_recompute: no "activations stored" warning
    rc = dataclasses.replace(rc, engine=dataclasses.replace(rc.engine, recompute_num_layers=1))
    assert "recomputes every layer" in recompute_warnings(rc, ["deepspeed"])[0]


# ------------------------------------------------------------------------------------------------ bench side
def test_bench_side_runs_sdpa_without_snapshots():
    """``bench.make_side`` builds DeepSpeed with bench_side=True: HF's SDPA attention, no gradient snapshot and no
    per-token losses; from the same weights its step-1 loss is the eager engine's up to rounding. Without the flag
    (what verify builds) the engine is the eager, snapshotting equivalence form."""
    from forgetrain import bench

    cfg = _cfg()
    eager = _engine(cfg)
    fast = bench.make_side("deepspeed", cfg, torch.device("cpu"))
    assert fast.bench_side and not eager.bench_side
    assert fast.model.config._attn_implementation == "sdpa" and eager.model.config._attn_implementation == "eager"
    assert fast.bench_info["attention"] == "sdpa"
    fast.load_hf_weights(eager.export_hf_weights())
    mbs = _batches(cfg, 1)[0]
    a, b = eager.train_step(mbs), fast.train_step(mbs)
    assert a.per_token_loss is not None and b.per_token_loss is None
    assert abs(a.loss - b.loss) <= 1e-5 * a.loss and abs(a.grad_norm - b.grad_norm) <= 1e-4 * a.grad_norm
    with pytest.raises(RuntimeError, match="no gradient snapshot"):
        fast.export_hf_grads()
    eager.export_hf_grads()


def test_model_is_built_on_the_engine_device():
    """The HF model is constructed on the engine's device (on a GPU: no fp32 copy of the model in host memory). Seen
    through the meta device, where construction allocates nothing."""
    from references.deepspeed.engine import Engine

    e = Engine.__new__(Engine)
    e.cfg, e.device, e.attention = _cfg(), torch.device("meta"), "sdpa"
    model = e._build_hf()
    assert {q.device.type for q in model.parameters()} == {"meta"}
    assert {q.dtype for q in model.parameters()} == {torch.float32}
