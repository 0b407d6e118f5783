"""The plain-PyTorch bench sides on CPU at llama_micro (2 layers, micro-batch 2 x grad-accum 2), eagerly:

* ``torch_compile``, the strong user's script (bf16 parameters, fp32 masters and master gradients, fused QKV and
  gate/up, AdamW on the masters): the same training as the autocast side (``torch_compile_autocast``) from the same
  init in fp32, and in bf16 its parameters are the bf16 copies of its fp32 masters after every step; Megatron's
  init distributions, weight-decay groups, the harness's LR schedule and global-norm clipping;
* the torchao float8 sides (``torchao_float8_tensorwise``, ``torchao_float8_rowwise``): one ``error:`` line where
  they cannot run (no torchao, a CPU run, a GPU below compute capability 8.9), and, with torchao installed, the
  recipe's config and the conversion of exactly the decoder linears, run on CPU through torchao's emulation.

No timings are asserted (speeds are benchmarks, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from references.torch_compile.engine import Engine as Strong
from references.torch_compile_autocast.engine import Engine as Autocast
from tests.helpers import ladder_cfg as _ladder_cfg

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def _cfg(precision: str = "fp32", **train):
    c = _ladder_cfg(**train)  # llama_micro, micro-batch 2, global batch 4: grad-accum 2; lr warm-up 2
    return dataclasses.replace(c, train=dataclasses.replace(c.train, precision=precision))


def _batches(cfg, steps: int = STEPS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    t, m = cfg.train, cfg.model
    return [[torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=g)
             for _ in range(t.global_batch_size // t.micro_batch_size)] for _ in range(steps)]


def test_strong_side_trains_as_the_autocast_side_in_fp32():
    """Fused QKV and gate/up and AdamW on separate masters are the same training as the autocast side's separate
    linears: from the same init, losses and grad norms agree to fp32 rounding over 3 steps, and so do the weights."""
    cfg = _cfg("fp32")
    torch.manual_seed(0)
    s, a = Strong(cfg, torch.device("cpu")), Autocast(cfg, torch.device("cpu"))
    a.load_hf_weights(s.export_hf_weights())
    for mbs in _batches(cfg):
        rs, ra = s.train_step(mbs), a.train_step(mbs)
        assert math.isclose(rs.loss, ra.loss, rel_tol=1e-5) and math.isclose(rs.grad_norm, ra.grad_norm, rel_tol=1e-4)
        assert rs.lr == ra.lr
    ws, wa = s.export_hf_weights(), a.export_hf_weights()
    assert set(ws) == set(wa)
    assert max((ws[k] - wa[k]).abs().max().item() for k in ws) < 1e-4


def test_strong_side_keeps_bf16_params_beside_fp32_masters():
    """train.precision=bf16: every parameter is bf16 and, after each step, exactly its fp32 master rounded to bf16;
    the master gradients are fp32; the exported weights are the masters (fp32) and every one moved."""
    cfg = _cfg("bf16")
    e = Strong(cfg, torch.device("cpu"))
    before = e.export_hf_weights()
    for mbs in _batches(cfg):
        r = e.train_step(mbs)
        assert math.isfinite(r.loss)
        for n, p in e.model.named_parameters():
            assert p.dtype == torch.bfloat16 and e.masters[n].dtype == torch.float32
            assert e.masters[n].grad.dtype == torch.float32
            assert torch.equal(p, e.masters[n].to(torch.bfloat16)), n
    after = e.export_hf_weights()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert all(not torch.equal(after[k], before[k]) for k in before)
    assert e.bench_info == {"recompute": "none", "recompute_num_layers": None, "param_dtype": "bfloat16"}


def test_strong_side_hf_layout_round_trips_through_the_fused_linears():
    """load_hf_weights then export_hf_weights gives the same tensors back; q, k, v are the rows [q; k; v] of
    qkv_proj and gate, up the rows [gate; up] of gate_up_proj."""
    cfg = _cfg("fp32")
    e = Strong(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    state = {k: torch.randn(v.shape, generator=g) for k, v in e.export_hf_weights().items()}
    e.load_hf_weights(state)
    out = e.export_hf_weights()
    assert all(torch.equal(out[k], state[k]) for k in state)
    blk = e.model.layers[1]
    q, k, v = (state[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(blk.qkv_proj.weight.detach(), torch.cat([q, k, v]))
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(blk.gate_up_proj.weight.detach(), torch.cat([gate, up]))


def test_strong_side_follows_megatrons_init_decay_groups_schedule_and_clipping():
    """Megatron's init (N(0, std) matrices, N(0, std / sqrt(2 L)) for o_proj and down_proj, norms at 1), decay on
    every matrix and none on the norms, the harness's LR schedule, and clipping of the global norm to
    train.clip_grad (the reported norm is the one before clipping)."""
    from forgetrain.schedule import lr_for_step

    cfg = _cfg("fp32", clip_grad=0.05)
    e = Strong(cfg, torch.device("cpu"))
    std, scaled = cfg.model.init_method_std, cfg.model.init_method_std / math.sqrt(2 * cfg.model.num_layers)
    for n, p in e.masters.items():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), n
        else:
            want = scaled if n.endswith(("o_proj.weight", "down_proj.weight")) else std
            assert abs(p.detach().std().item() / want - 1) < 0.1, (n, p.std().item(), want)
    decay, no_decay = e.opt.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(p) for p in e.masters.values() if p.dim() == 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in e.masters.values() if p.dim() == 1}
    for i, mbs in enumerate(_batches(cfg)):
        r = e.train_step(mbs)
        assert r.lr == lr_for_step(cfg.train, i) == e.opt.param_groups[0]["lr"]
        assert r.grad_norm > cfg.train.clip_grad  # so the clipping acted
        clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in e.masters.values()])).item()
        assert clipped == pytest.approx(cfg.train.clip_grad, rel=1e-3)


def test_strong_side_refuses_a_parallel_layout():
    from forgetrain.errors import ConfigError

    cfg = _cfg()
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data_parallel_size=2))
    with pytest.raises(ConfigError, match="references/torch_compile is a single-device baseline"):
        Strong(cfg, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------- torchao float8
FLOAT8 = ("torchao_float8_tensorwise", "torchao_float8_rowwise")


def _float8_cls(name: str):
    import importlib

    return importlib.import_module(f"references.{name}.engine").Engine


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_side_without_torchao_names_the_extra(monkeypatch, name):
    """Without torchao the side is one ConfigError naming the optional extra and its pin."""
    import importlib.util

    from forgetrain import extras, registry
    from forgetrain.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda m, *a: None if m == "torchao" else real(m, *a))
    with pytest.raises(ConfigError, match=rf"references/{name} needs the optional 'torchao' extra .*"
                                          r"pip install -e '\.\[torchao\]' \(torchao==0\.17\.0\)"):
        registry.load_engine_class("references", name)


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_side_refuses_a_machine_without_fp8(monkeypatch, name):
    """hardware.device=cpu, no visible CUDA device, and a GPU below compute capability 8.9 are each one line naming
    what is missing; an H200 (9.0) passes. The constructor refuses too."""
    from forgetrain.errors import ConfigError

    cls = _float8_cls(name)
    cpu = _cfg("bf16")
    with pytest.raises(ConfigError, match=rf"bench side '{name}' .* needs a CUDA device with FP8 GEMMs \(compute "
                                          r"capability 8\.9 or later\); this run has hardware.device=cpu"):
        cls.check_run(cpu)
    with pytest.raises(ConfigError, match="hardware.device=cpu"):
        cls(cpu, torch.device("cpu"))
    gpu = dataclasses.replace(cpu, hardware=dataclasses.replace(cpu.hardware, device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        cls.check_run(gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match="NVIDIA A100-SXM4-80GB has compute capability 8.0"):
        cls.check_run(gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert cls.check_run(gpu) is None


def test_bench_with_a_float8_side_on_cpu_is_one_error_line(tmp_path):
    """On this CPU machine the bench refuses the side before building anything: one ``error:`` line (the missing
    extra without torchao, the device with it), exit 2, nothing written."""
    out = tmp_path / "b"
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", "model=llama_micro", "train.threads=1",
                        "bench.against=[torchao_float8_rowwise]", f"bench.out_dir={out}"], cwd=ROOT, text=True,
                       capture_output=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                                OMP_NUM_THREADS="1"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [x for x in (p.stderr + p.stdout).splitlines() if x.startswith("error:")]
    assert len(errors) == 1, p.stderr[-2000:]
    assert ("needs the optional 'torchao' extra" in errors[0]
            or "needs a CUDA device with FP8 GEMMs" in errors[0]), errors[0]
    assert not out.exists()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_config_is_torchaos_recipe(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.config import ScalingGranularity

    from references.torch_compile.float8 import float8_config

    c = float8_config(recipe)
    want = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
    assert c.cast_config_input.scaling_granularity == want and c.cast_config_weight.scaling_granularity == want
    assert c.round_scales_to_power_of_2 == (recipe == "rowwise") and c.emulate is False
    assert float8_config(recipe, emulate=True).emulate is True
    with pytest.raises(ValueError, match="tensorwise or rowwise"):
        float8_config("delayed")


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_side_converts_the_decoder_linears_and_trains_emulated(name):
    """With torchao's emulation (FP8 casts, high-precision matmuls) on CPU: exactly the 4 linears of each decoder
    layer become Float8Linear with the side's recipe, the LM head stays nn.Linear, parameters stay bf16 with fp32
    masters, two steps train, and bench_info and the bench's FP8 note name torchao."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from forgetrain.bench import fp8_notes

    class Emulated(_float8_cls(name)):
        emulate = True

    cfg = _cfg("bf16")
    e = Emulated(cfg, torch.device("cpu"))
    f8 = [n for n, m in e.model.named_modules() if isinstance(m, Float8Linear)]
    assert len(f8) == 4 * cfg.model.num_layers and all(n.startswith("layers.") for n in f8)
    assert type(e.model.lm_head) is torch.nn.Linear
    recipe = Emulated.recipe
    gran = "ten" if recipe == "tensorwise" else "axs"
    assert all(f"i:dyn_{gran}_e4m3" in repr(m) for m in e.model.modules() if isinstance(m, Float8Linear))
    before = e.export_hf_weights()
    for mbs in _batches(cfg, 2):
        assert math.isfinite(e.train_step(mbs).loss)
    assert all(p.dtype == torch.bfloat16 for p in e.model.parameters())
    after = e.export_hf_weights()
    assert all(not torch.equal(after[k], before[k]) for k in before)
    info = e.bench_info
    assert info["fp8"] == recipe and info["float8_linears"] == len(f8) and info["param_dtype"] == "bfloat16"
    assert f"recipe {recipe}" in info["fp8_by"] and info["fp8_by"].startswith("torchao ")
    note, = fp8_notes({name: info})
    assert note.startswith(f"note: side '{name}' runs its decoder layers' GEMMs in FP8 (torchao ")


# ------------------------------------------------------------------------------------------ the device script
SCRIPT = ROOT / "experiments" / "peers" / "bench_all_sides.sh"


def _script_overrides() -> list[str]:
    p = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, text=True, capture_output=True, timeout=60,
                       env=dict(os.environ, DRY="1"))
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_device_script_is_valid_bash_and_its_overrides_compose():
    """``bash -n`` passes, and the bench's overrides (``DRY=1`` prints them) compose as Hydra composes them
    (``--cfg job``): the 8B proxy at GBS 8 (micro-batch 1), every side in one call, one block per side."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    args = _script_overrides()
    assert "bench.interleave=once" in args and "bench.candidate={engine.fp8:tensorwise}" in args
    assert "bench.against=[torch_compile,torchao_float8_tensorwise,torchao_float8_rowwise]" in args
    p = subprocess.run([sys.executable, "-m", "forgetrain.bench", *args, "--cfg", "job"], cwd=ROOT, text=True,
                       capture_output=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-2000:]
    import yaml

    job = yaml.safe_load(p.stdout)
    assert job["model"]["num_layers"] == 4 and job["model"]["seq_length"] == 8192
    assert job["train"]["micro_batch_size"] == 1 and job["train"]["global_batch_size"] == 8
    assert job["bench"]["candidate"] == {"engine.fp8": "tensorwise"} and job["bench"]["single_micro_batch"] is True


def test_device_script_request_passes_the_bench_checks_on_an_h200(monkeypatch):
    """With an H200 (compute capability 9.0, 139.8 GiB) and torchao present, as the device has them, the script's
    request passes every check the bench makes before building anything (sides, candidate, memory); below 8.9 it is
    the torchao sides' one line."""
    import importlib.util
    import types

    from forgetrain import bench, cli, extras
    from forgetrain.config import register_configs
    from forgetrain.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec",
                        lambda m, *a: real("torch") if m == "torchao" else real(m, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(total_memory=150_110_000_000, name="NVIDIA H200"))
    register_configs()
    bench.register()
    args = _script_overrides()
    cli.check_job("bench", args)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match="torchao_float8_tensorwise.*compute capability 8.0"):
        cli.check_job("bench", args)
