"""forgetrain.memory: the step memory estimate (hand-counted) and the loud check that refuses a config that cannot
fit the GPU before the first step (faked device capacity: ``FORGETRAIN_FAKE_DEVICE_GIB``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgetrain import memory
from forgetrain.config import EngineOptions, KernelsConfig, ModelConfig, RunConfig, TrainConfig, validate
from forgetrain.errors import ConfigError
from forgetrain.memory import GIB, estimate
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["model=llama_micro", "train.steps=2", "train.lr_warmup_steps=1", "train.micro_batch_size=4",
         "train.global_batch_size=8", "train.eval_interval=0", "train.sample_tokens=0", "train.save=false"]


def _tiny(**engine) -> RunConfig:
    """h 8, 1 layer, 2 query heads / 1 KV group (d 4), FFN 16, V 32, seq 4, micro-batch 2: T = 8 tokens."""
    return RunConfig(
        model=ModelConfig(vocab_size=32, hidden_size=8, num_layers=1, num_attention_heads=2, num_query_groups=1,
                          ffn_hidden_size=16, seq_length=4),
        train=TrainConfig(micro_batch_size=2, global_batch_size=2, precision="bf16"),
        engine=EngineOptions(**{"mode": "fast", "ce_chunk_tokens": 4, **engine}),
        kernels=KernelsConfig(cross_entropy="chunked"))


# Parameters by hand: qkv (2+2)*4 x 8 = 128, proj 8x8 = 64, fc1 32x8 = 256, fc2 8x16 = 128, two norms 16 -> 592
# per layer; embedding 256, LM head 256, final norm 8: N = 1112.
N = 592 + 256 + 256 + 8


def test_hand_count_fast_bf16_chunked():
    e = estimate(_tiny())
    assert e.model_weights == 2 * N
    assert e.main_weights == 4 * N
    assert e.main_grads == 4 * N
    assert e.adam_moments == 8 * N
    assert e.autograd_grads == 2 * N  # unfused: every weight's bf16 .grad
    # per token per layer, bf16 elements: x 8, normed 8, q 8, k 4, v 16 (a view of the whole QKV output: (2 + 2 x 1)
    # x 4), o 8, x1 8, normed 8, fc1 out 32, act 16 = 116 -> 232 B, + fp32 logsumexp 2 heads x 4 B = 240 B; x 8
    # tokens; + final-norm input and dh: 2 x 2 B x 8 x 8
    assert e.activations == 240 * 8 + 2 * 2 * 8 * 8
    # engine.free_qkv: v its own 4 elements
    assert estimate(_tiny(free_qkv=True)).activations == 216 * 8 + 2 * 2 * 8 * 8
    # 2 chunks of 4 tokens: logits + grad 4 x 32 x (2 + 2) B, and the fp32 dW accumulator 32 x 8 x 4 B
    assert e.lm_head_ce == 4 * 32 * 4 + 32 * 8 * 4
    assert e.workspace == GIB
    assert e.total_bytes == sum(e.parts().values())
    assert e.total_gib == pytest.approx(e.total_bytes / 2**30)


def test_hand_count_switches():
    fused = estimate(_tiny(grad_accum_fusion=True))
    assert fused.autograd_grads == 2 * (2 * 1 + 1) * 8  # only the 3 norm weights keep a bf16 .grad
    assert fused.lm_head_ce == 4 * 32 * 4  # dW goes to main_grad: no fp32 accumulator
    one_chunk = estimate(_tiny(ce_chunk_tokens=4096))
    assert one_chunk.lm_head_ce == 8 * 32 * 4  # one chunk of all 8 tokens; its bf16 dW is the head's .grad
    c = _tiny()
    zero1 = dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, data_parallel_size=2, zero_stage=1))
    assert estimate(zero1).adam_moments == 8 * N // 2
    assert estimate(zero1).main_grads == 4 * N  # the DP grad buffer is full on every rank
    torch_ce = dataclasses.replace(c, kernels=KernelsConfig(cross_entropy="torch"))
    assert estimate(torch_ce).lm_head_ce == 8 * 32 * 12
    exact = _tiny(mode="exact")
    e = estimate(exact)
    # exact: q, repeated k and v, ctx = 4 x 8; + fp32 softmax and bf16 probs 2 x 2 heads x 4^2 x (4 + 2) B
    assert e.activations == 2 * (4 * 8 + 4 * 8 + 3 * 16) * 8 + 2 * 2 * 8 * 8 + 2 * 2 * 16 * 6
    fp32 = dataclasses.replace(c, train=dataclasses.replace(c.train, precision="fp32"))
    e = estimate(fp32)
    assert (e.model_weights, e.main_weights, e.autograd_grads) == (4 * N, 0, 4 * N)


def _compose(overrides: list[str]) -> RunConfig:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from forgetrain.cli import CONF_DIR
    from forgetrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return to_run_config(OmegaConf.to_container(cfg, resolve=True))


# gradient accumulation fusion off (the scenario default turns it on), so the refusal's hint can name it
LLAMA3_8B = ["scenario=llama8b_h100", "model=llama8b", "train.micro_batch_size=1", "train.global_batch_size=1",
             "engine.grad_accum_fusion=false"]


def test_llama3_8b_full_depth_refused_on_h200(monkeypatch):
    cfg = _compose(LLAMA3_8B)
    assert (cfg.model.num_layers, cfg.model.seq_length, cfg.engine.grad_accum_fusion) == (32, 8192, False)
    e = estimate(cfg)
    # the table: 8.03 B parameters -> fp32 main 32.1 GB, Adam m and v 64.2 GB, fp32 grads 32.1 GB
    assert round(e.main_weights / 1e9, 1) == 32.1
    assert round(e.adam_moments / 1e9, 1) == 64.2
    assert round(e.main_grads / 1e9, 1) == 32.1
    fp32_state = e.main_weights + e.adam_moments + e.main_grads
    assert round(fp32_state / 1e9) == 128  # the "128 GB (119.6 GiB)": 119.6 is 128.0 GB in GiB
    assert fp32_state / GIB == pytest.approx(119.66, abs=0.01)
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "139")
    with pytest.raises(ConfigError) as exc:
        memory.check(cfg)
    msg = str(exc.value)
    assert "\n" not in msg
    assert f"estimated {e.total_gib:.1f} GiB" in msg
    assert "Adam m and v 59.8 GiB (64.2 GB)" in msg and "fp32 main weights 29.9 GiB (32.1 GB)" in msg
    assert "activations" in msg  # the three biggest: Adam, activations, fp32 main weights
    assert "139.0 GiB" in msg and "engine.grad_accum_fusion" in msg  # only what is not in effect yet
    assert ("train.micro_batch_size" in msg) == (cfg.train.micro_batch_size > 1)
    assert "model.seq_length" in msg and "model.num_layers" in msg
    # the override skips it; a device large enough passes it
    memory.check(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, skip_memory_check=True)))
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "400")
    memory.check(cfg)


def test_cpu_is_checked_against_host_memory(monkeypatch):
    """On CPU the capacity is the host's memory: full-depth 8B on a 24 GiB machine is refused in one line (before,
    it was started and killed by the kernel's out-of-memory killer after minutes, with no message)."""
    monkeypatch.delenv(memory.FAKE_DEVICE_ENV, raising=False)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 24 * GIB)
    cfg = _compose([*LLAMA3_8B, "hardware=cpu", "engine.compile=false"])  # its Triton kernels run on CPU, eagerly
    assert memory.device_capacity_bytes(cfg) == 24 * GIB
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    msg = str(exc.value)
    assert "\n" not in msg and "on this machine" in msg and "the host memory has 24.0 GiB" in msg
    validate(_compose(["hardware=cpu"]))  # the default tiny scenario passes
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: None)  # a platform that does not say: no check
    validate(cfg)


@pytest.mark.parametrize("bad", ["0", "-3", "lots", "nan"])
def test_bad_fake_capacity_is_refused(monkeypatch, bad):
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, bad)
    with pytest.raises(ConfigError, match="FORGETRAIN_FAKE_DEVICE_GIB must be a positive number"):
        memory.check(_tiny())


def test_bench_footprint_is_the_estimate():
    from forgetrain import bench

    cfg = _compose(LLAMA3_8B)
    assert bench.bytes_per_engine(cfg) == estimate(cfg).total_bytes


def _cli(module: str, args: list[str], cwd: Path, fake_gib: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{memory.FAKE_DEVICE_ENV: fake_gib})
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, text=True, capture_output=True,
                          timeout=hang_s())


@pytest.mark.parametrize("module,extra", [
    ("forgetrain", []),
    ("forgetrain.bench", ["bench.against=[]", "bench.out_dir={out}"]),
    ("forgetrain.verify", ["tier=bitwise", "verify.out_dir={out}"]),
])
def test_cli_refuses_before_anything_is_written(tmp_path, module, extra):
    out = tmp_path / "run"
    # 2 GiB is less than the 3 GiB reserve: nothing fits
    p = _cli(module, [*SHORT, *(x.format(out=out) for x in extra), f"train.out_dir={out}"], tmp_path, "2")
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this config needs an estimated "), p.stderr
    assert "2.0 GiB less a 3 GiB reserve" in lines[0]
    assert "Traceback" not in p.stderr
    assert not out.exists()
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_cli_trains_when_it_fits_or_when_skipped(tmp_path):
    out = tmp_path / "run"
    p = _cli("forgetrain", [*SHORT, f"train.out_dir={out}"], tmp_path, "1000")
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / "trace" / "trace.jsonl").exists()
    out2 = tmp_path / "run2"
    p = _cli("forgetrain", [*SHORT, f"train.out_dir={out2}", "train.skip_memory_check=true"], tmp_path, "2")
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out2 / "trace" / "trace.jsonl").exists()


# the scenario's device-only layout (no host memory): the AdamW moments on the GPU, so every layer is recomputed
# and the layers keep no bf16 copy between steps
DEVICE_ONLY = ["engine.optimizer_offload_fraction=0", "engine.recompute=full", "engine.bf16_weights=per_layer"]


def test_llama8b_h200_default_offloads_and_fits_with_headroom(monkeypatch):
    """The scenario default (the AdamW moments of 65% of the parameters in host memory, V copied out of the QKV
    output, every activation stored, resident bf16 weights, global batch 32) fits a 139 GiB H200 by the estimate
    with at least 5 GiB left (issue 18's goal; 133.5 GiB measured on the H200 against 133.3 estimated)
    and pins 43.5 GiB of host memory; without engine.free_qkv it no longer leaves 5 GiB, and without the offload it
    is refused before any step."""
    cfg = _compose(["scenario=llama8b_h200"])
    e = cfg.engine
    assert (cfg.model.num_layers, cfg.model.seq_length, e.recompute, e.bf16_weights, e.optimizer_offload_fraction,
            e.free_qkv, cfg.train.global_batch_size) == (32, 8192, "none", "resident", 0.65, True, 32)
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "139")
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 128 * GIB)
    memory.check(cfg)
    assert 139 * GIB - estimate(cfg).total_bytes >= 5 * GIB
    assert round(memory.host_offload_bytes(cfg) / GIB, 1) == 43.5
    kept_qkv = dataclasses.replace(cfg, engine=dataclasses.replace(e, free_qkv=False))
    assert 139 * GIB - estimate(kept_qkv).total_bytes < 5 * GIB
    bad = dataclasses.replace(cfg, engine=dataclasses.replace(e, optimizer_offload_fraction=0.0))
    with pytest.raises(ConfigError, match="this config needs an estimated"):
        memory.check(bad)


def test_llama8b_h200_fits_with_headroom_and_needs_its_memory_layout(monkeypatch):
    """The full-depth scenario's device-only layout (32 layers, seq 8192) fits a 139 GiB H200 by the estimate with
    at least 5 GiB left; without per-layer bf16 weights, or without recompute, it is refused before any step."""
    from forgetrain.metrics import param_counts

    cfg = _compose(["scenario=llama8b_h200", *DEVICE_ONLY])
    m = cfg.model
    assert (m.num_layers, m.seq_length, cfg.engine.recompute, cfg.engine.bf16_weights) == (32, 8192, "full",
                                                                                           "per_layer")
    e = estimate(cfg)
    n = param_counts(m)["total"]
    n_layer = (n - 2 * m.vocab_size * m.hidden_size - m.hidden_size) // m.num_layers
    assert e.model_weights == 2 * (n - m.num_layers * n_layer) + 2 * n_layer  # embedding, head, one layer
    assert e.activations < 4 * GIB  # saved layer inputs (2 GiB) + one layer recomputed + the final norm's
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "139")
    memory.check(cfg)
    assert 139 * GIB - e.total_bytes >= 5 * GIB
    for off in ({"bf16_weights": "resident"}, {"recompute": "none", "bf16_weights": "resident"}):
        bad = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **off))
        with pytest.raises(ConfigError, match="engine.bf16_weights=per_layer"):
            memory.check(bad)


def test_block_recompute_estimate_by_hand(monkeypatch):
    """``engine.recompute_num_layers=R`` of L: the stored layers' activations (and, per-layer, their bf16 copies)
    plus the one being recomputed, plus R saved inputs; R = L is full recompute, R = 0 stores every layer."""
    from forgetrain.metrics import param_counts

    cfg = _compose(["scenario=llama8b_h200", *DEVICE_ONLY])
    m, L = cfg.model, cfg.model.num_layers
    n = param_counts(m)["total"]
    n_layer = (n - 2 * m.vocab_size * m.hidden_size - m.hidden_size) // L
    full = estimate(cfg)

    def at(r):
        return estimate(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute_num_layers=r)))

    assert at(L) == full
    one_layer = at(L - 1).activations - full.activations + m.seq_length * m.hidden_size * 2  # less one saved input
    for r in (0, 1, L - 4):
        e = at(r)
        stored = L - r
        live = stored + (1 if r else 0)
        assert e.activations == full.activations + (live - 1) * one_layer - stored * m.seq_length * m.hidden_size * 2
        assert e.model_weights == 2 * (n - L * n_layer) + 2 * live * n_layer
    # the 8B scenario: storing 4 of 32 layers still fits a 139 GiB H200; storing all of them does not
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "139")
    memory.check(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute_num_layers=L - 4)))
    with pytest.raises(ConfigError, match="this config needs an estimated"):
        memory.check(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute_num_layers=0)))


def test_refusal_names_only_the_remedies_not_yet_in_effect(monkeypatch):
    """The 8B scenario's device-only layout on a CPU host already has recompute, per-layer weights, fusion and the V
    copy on, and offload moves nothing on the host: the refusal must not suggest them. On a too-small GPU it
    suggests the offload; without fusion and the V copy (fast mode) it names both, and the V copy is never part of
    exact mode's leanest layout."""
    cfg = _compose(["scenario=llama8b_h200", *DEVICE_ONLY])
    cpu = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, device="cpu"))
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 24 * GIB)
    with pytest.raises(ConfigError) as e:
        memory.check(cpu)
    msg = str(e.value)
    assert "host memory has 24.0 GiB" in msg
    for done in ("recompute=full", "per_layer", "grad_accum_fusion", "free_qkv", "optimizer_offload",
                 "micro_batch_size"):
        assert done not in msg, (done, msg)
    assert "shorten model.seq_length or use fewer model.num_layers" in msg
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "100")
    with pytest.raises(ConfigError, match="raise engine.optimizer_offload_fraction"):
        memory.check(cfg)
    plain = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute="none",
                                                                bf16_weights="resident", grad_accum_fusion=False,
                                                                free_qkv=False))
    with pytest.raises(ConfigError, match="set engine.grad_accum_fusion=true; set engine.free_qkv=true; "
                                          "set engine.recompute=full"):
        memory.check(plain)
    assert memory.leanest(plain).engine.free_qkv and not memory.leanest(
        dataclasses.replace(plain, engine=dataclasses.replace(plain.engine, mode="exact"))).engine.free_qkv


def test_param_tensor_sizes_are_the_engines_tensors():
    """The host estimate chooses from ``metrics.param_tensor_sizes``: it must be the Hopper engine's own tensors
    (same element counts, as a multiset), or it would count tensors the engine does not offload."""
    from forgetrain.metrics import param_tensor_sizes
    from scenarios.llama1b_h200.engine import Engine as Hopper
    from tests.helpers import hopper_cfg as _cfg_for

    cfg = _cfg_for("fast")
    eng = Hopper(cfg, "cpu")
    assert sorted(v.numel() for v in eng.main.values()) == sorted(param_tensor_sizes(cfg.model))


@pytest.mark.parametrize("nbytes,pinned", [(1, 1), (3, 4), (4, 4), (5, 8), (2**26, 2**26), (2**26 + 1, 2**27)])
def test_pinned_allocations_round_up_to_a_power_of_two(nbytes, pinned):
    assert memory.pinned_alloc_bytes(nbytes) == pinned


def test_llama3_8b_offload_pins_68_gib_by_hand():
    """Llama-3-8B at F = 1, per fp32 moment: embedding and LM head 2.10 GB (1.96 GiB) -> 2 GiB each; per layer
    QKV 100.7 MB -> 128 MiB, projection 64 MiB (already a power of two), fc1 469.8 MB -> 512 MiB, fc2 234.9 MB ->
    256 MiB, two norms 16 KiB each; final norm 16 KiB. Two moments: 2 * (4 GiB + 32 * 960 MiB + 65 * 16 KiB)."""
    cfg = _compose(["scenario=llama8b_h200", "engine.optimizer_offload_fraction=1.0"])
    want = 2 * (4 * GIB + 32 * 960 * 2**20 + 65 * 16 * 2**10)
    assert memory.host_offload_bytes(cfg) == want
    assert 67 * GIB < want < 69 * GIB
    off = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, optimizer_offload_fraction=0.0))
    assert memory.host_offload_bytes(off) == 0


def test_offload_that_cannot_be_pinned_is_refused_in_one_line(monkeypatch):
    """On a GPU the device may fit while the host cannot hold the pinned moments: refused before any step."""
    cfg = _compose(["scenario=llama8b_h200", "engine.optimizer_offload_fraction=1.0"])
    monkeypatch.setenv(memory.FAKE_DEVICE_ENV, "139")
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 128 * GIB)
    memory.check(cfg)  # 68 GiB pinned + 16 GiB reserve fit a 128 GiB host
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 * GIB)
    with pytest.raises(ConfigError, match=r"pins an estimated 68\.0 GiB of host memory") as e:
        memory.check(cfg)
    assert "\n" not in str(e.value) and "lower engine.optimizer_offload_fraction" in str(e.value)
    # the scenario default stores every layer: at offload 0 it needs the device-only layout, and the line says so
    assert ("at 0 this model fits the device only with engine.optimizer_offload_fraction=0 engine.recompute=full "
            "engine.bf16_weights=per_layer") in str(e.value)
    lean = _compose(["scenario=llama8b_h200", "engine.optimizer_offload_fraction=1.0", "engine.recompute=full",
                     "engine.bf16_weights=per_layer"])
    with pytest.raises(ConfigError) as e:
        memory.check(lean)  # already lean: lowering the fraction alone is the remedy
    assert "fits the device only with" not in str(e.value)
    skipped = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, skip_memory_check=True))
    memory.check(skipped)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: None)  # the platform does not say: nothing to check
    memory.check(cfg)


def test_cpu_check_counts_the_offloaded_moments_back(monkeypatch):
    """On CPU the optimizer offload moves the AdamW moments from "device" to host memory, which is the same memory:
    the host check counts them back (8 bytes per offloaded element). A config that fits only if they were
    forgotten is refused."""
    monkeypatch.delenv(memory.FAKE_DEVICE_ENV, raising=False)
    plain, off = _tiny(), _tiny(optimizer_offload_fraction=1.0)
    assert memory.host_estimate(plain) == estimate(plain)
    assert memory.host_estimate(off).adam_moments == estimate(off).adam_moments + 8 * N
    assert memory.host_estimate(off).adam_moments >= estimate(plain).adam_moments
    cfg = _compose([*LLAMA3_8B, "hardware=cpu", "engine.optimizer_offload_fraction=1.0"])
    host_total = memory.host_estimate(cfg).total_bytes
    assert host_total > estimate(cfg).total_bytes + 59 * GIB  # Llama-3-8B: 59.8 GiB of moments
    # a host between the two totals: the check without them would pass it
    monkeypatch.setattr(memory, "host_memory_bytes",
                        lambda: (estimate(cfg).total_bytes + host_total) // 2 + memory.RESERVE_BYTES)
    with pytest.raises(ConfigError, match="host memory"):
        memory.check(cfg)


def test_a_model_no_layout_fits_is_refused_first_and_once(monkeypatch):
    """Full-size llama8b_h200 on a 24 GiB CPU host: one refusal that says no layout switch is enough (before, the
    kernel-switch error came first, then a refusal listing switches that could not make it fit)."""
    monkeypatch.delenv(memory.FAKE_DEVICE_ENV, raising=False)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 24 * GIB)
    cfg = _compose(["scenario=llama8b_h200", "hardware=cpu"])  # kernels.adamw=fused is not honoured on CPU
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    msg = str(exc.value)
    assert "even the leanest layout (engine.recompute=full engine.bf16_weights=per_layer) needs an estimated" in msg
    assert "shorten model.seq_length or use fewer model.num_layers" in msg and "set engine.recompute" not in msg
    lean = memory.leanest(cfg, "host memory")
    assert memory.host_estimate(lean).total_bytes < memory.host_estimate(cfg).total_bytes


@pytest.mark.parametrize("free_qkv", [False, True], ids=["qkv_view", "free_qkv"])
def test_a_compiled_block_saves_what_the_estimate_counts(free_qkv):
    """The activation term against what autograd really keeps: one compiled FastBlock (bf16, GQA 8 heads / 2 groups)
    on CPU, every saved storage counted whole once (``memory.saved_storages``). The estimate may fall short only by
    what it leaves out on purpose: the shared RoPE cos/sin tables and the two norms' fp32 rstd. Without
    ``engine.free_qkv`` V is a view that keeps the whole QKV output alive, and an estimate that counts V alone (2.5 GiB
    short for llama8b_h200 on the H200) is rejected."""
    import torch
    from types import SimpleNamespace

    from scenarios.llama1b_h200.fast import FastBlock, rope_cos_sin

    m = SimpleNamespace(num_attention_heads=8, num_query_groups=2, head_dim=32, hidden_size=256, ffn_hidden_size=512,
                        norm_epsilon=1e-5)
    b, s = 1, 128
    T = b * s
    torch.manual_seed(0)
    blk = FastBlock(m, SimpleNamespace(rmsnorm="torch", swiglu="torch", rope="torch"), free_qkv).to(torch.bfloat16)
    for p in blk.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(b, s, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(s, m.head_dim, 10000.0, "cpu", torch.bfloat16)
    run = torch.compile(blk)
    run(x, cos, sin).sum().backward()  # trace once
    y, rows = memory.saved_storages(run, x, cos, sin, exclude=[*blk.parameters(), x, cos, sin])
    y.float().sum().backward()
    measured = sum(r["bytes"] for r in rows) + T * m.hidden_size * 2  # + x, which the estimate counts as saved
    est = T * memory.layer_bytes_per_token(m, 2, fast=True, free_qkv=free_qkv)
    rstd = 2 * T * 4
    assert est <= measured <= est + rstd, (measured, est, rows)
    if not free_qkv:
        assert measured > T * memory.layer_bytes_per_token(m, 2, fast=True, free_qkv=True) + rstd
