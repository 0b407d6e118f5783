"""``engine.optimizer_offload_fraction``: AdamW moments in host memory, streamed through the device chunk by chunk
for the update (``scenarios/_llama/optim.HostMoments``), declared bitwise in
``scenarios/llama1b_h200/optimisations.yaml``.

On CPU the "host" and the device are the same memory, but the code path is the offload's: separate host tensors,
the staging slots, the chunking. The checks:

* every loss and final weight is bitwise the resident run's, at fractions 0.5 and 1, with chunks smaller than a
  tensor (so chunk boundaries fall inside tensors), for the torch and Triton AdamW forms, in exact and fast mode;
* the chosen moments really live outside the engine's device tensors, and a checkpoint round trip resumes bitwise;
* three deliberately wrong streams are caught: moments never written back, a chunk skipped, and a slot reused
  before its copy back;
* bad values and combinations are refused with one line; the memory estimate drops by 8 bytes per offloaded
  parameter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgetrain import memory
from forgetrain.config import validate
from forgetrain.errors import ConfigError
from scenarios._llama import optim
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import hopper_cfg as _cfg_for, same_run as _same, train_hopper as _train
from tests.helpers import check_resumes_bitwise


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(memory, "OFFLOAD_CHUNK_ELEMS", 1000)  # llama_micro's largest tensors have 4096+ elements


def _cfg(mode: str = "exact", adamw: str = "torch", **engine):
    c = _cfg_for(mode, **engine)
    return dataclasses.replace(c, kernels=dataclasses.replace(c.kernels, adamw=adamw))


@pytest.mark.parametrize("mode,adamw", [("exact", "torch"), ("fast", "torch"), ("fast", "triton")])
def test_offload_changes_no_bit(small_chunks, mode, adamw):
    init = Hopper(_cfg(mode, adamw), "cpu").export_hf_weights()
    base = _train(_cfg(mode, adamw), init)
    for frac in (0.5, 1.0):
        cfg = _cfg(mode, adamw, optimizer_offload_fraction=frac)
        validate(cfg, engine_cls=Hopper)
        got = _train(cfg, init)
        assert _same(base, got), (frac, base[0], got[0])
        eng = got[2]
        assert eng.offload is not None and eng.offload.chunk == 1000
        n_off = sum(eng.main[k].numel() for k in eng.offload.names)
        assert n_off >= frac * sum(v.numel() for v in eng.main.values())


def test_offloaded_moments_are_separate_tensors_and_resume_bitwise(small_chunks):
    cfg = _cfg("fast", optimizer_offload_fraction=1.0, grad_accum_fusion=True)
    eng = check_resumes_bitwise(cfg)
    assert set(eng.offload.names) == set(eng.main)
    main_ptrs = {t.data_ptr() for t in eng.main.values()} | {t.data_ptr() for t in eng.main_grad.values()}
    for k in eng.offload.names:
        st = eng.adam_state[k]
        assert eng.offload.holds(st)
        assert st["exp_avg"].data_ptr() not in main_ptrs and st["exp_avg_sq"].data_ptr() not in main_ptrs


def _broken(monkeypatch, how: str):
    orig = optim.adamw_apply

    def apply(p, g, m, v, *a, **k):
        orig(p, g, m, v, *a, **k)
        if how == "no_write_back":  # the moments updated in the slot, then lost: the slot is zeroed
            for t in m + v:
                t.zero_()

    if how == "no_write_back":
        monkeypatch.setattr(optim, "adamw_apply", apply)
    elif how == "skip_chunk":
        calls = [0]

        def skipping(p, g, m, v, *a, **k):
            calls[0] += 1
            if calls[0] != 2:
                orig(p, g, m, v, *a, **k)

        monkeypatch.setattr(optim, "adamw_apply", skipping)
    elif how == "stale_slot":  # every chunk reads the moments the slot held, not its own
        orig_update = optim.HostMoments.update

        def update(self, p, g, states, *a, **k):
            real = torch.Tensor.copy_

            def copy_(dst, src, non_blocking=False):
                if any(dst.data_ptr() == s[0].data_ptr() or dst.data_ptr() == s[1].data_ptr()
                       for s in self._stage):
                    return dst  # the copy in never happens
                return real(dst, src, non_blocking=non_blocking)

            monkeypatch.setattr(torch.Tensor, "copy_", copy_)
            try:
                return orig_update(self, p, g, states, *a, **k)
            finally:
                monkeypatch.setattr(torch.Tensor, "copy_", real)

        monkeypatch.setattr(optim.HostMoments, "update", update)


@pytest.mark.parametrize("how", ["no_write_back", "skip_chunk", "stale_slot"])
def test_a_broken_stream_is_caught(small_chunks, monkeypatch, how):
    init = Hopper(_cfg(), "cpu").export_hf_weights()
    base = _train(_cfg(), init)
    _broken(monkeypatch, how)
    assert not _same(base, _train(_cfg(optimizer_offload_fraction=1.0), init)), how


def test_offload_names_largest_first():
    sizes = {"a": 10, "b": 40, "c": 30, "d": 20}
    assert memory.offload_names(sizes, 0.0) == []
    assert memory.offload_names(sizes, 0.4) == ["b"]
    assert memory.offload_names(sizes, 0.41) == ["b", "c"]
    assert memory.offload_names(sizes, 1.0) == ["b", "c", "d", "a"]


@pytest.mark.parametrize("engine,parallel,match", [
    ({"optimizer_offload_fraction": 1.5}, {}, "must be a number from 0 to 1"),
    ({"optimizer_offload_fraction": -0.1}, {}, "must be a number from 0 to 1"),
    ({"optimizer_offload_fraction": 0.5}, {"zero_stage": 1}, "needs parallel.zero_stage=0"),
])
def test_bad_values_are_refused(engine, parallel, match):
    c = _cfg(**engine)
    c = dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, **parallel))
    with pytest.raises(ConfigError, match=match):
        validate(c, engine_cls=Hopper)


def test_an_engine_without_offload_refuses_it():
    c = _cfg(optimizer_offload_fraction=0.5)  # the default scenario's engine is the tiny CPU engine
    with pytest.raises(ConfigError, match="engine.optimizer_offload_fraction is not implemented by engine"):
        validate(c)


def test_estimate_frees_the_offloaded_moments():
    from forgetrain.metrics import param_counts

    c = _cfg()
    n = param_counts(c.model)["total"]
    base = memory.estimate(c)
    c_off = dataclasses.replace(c, engine=dataclasses.replace(c.engine, optimizer_offload_fraction=1.0))
    off = memory.estimate(c_off)
    staging = Hopper(c_off, "cpu").offload.staging_bytes  # the engine's own slots (tests/test_knob_attacks.py)
    assert base.adam_moments == 8 * n
    assert off.adam_moments == staging
    assert off.total_bytes == base.total_bytes - 8 * n + staging


def test_offloaded_moments_are_never_made_on_the_device():
    """The moments of the chosen tensors are created in host memory (at 8B a device copy first would be a 64 GB
    transient); a state whose moments are still on the device is refused."""
    made = optim.fresh_state({"a": torch.ones(3), "b": torch.ones(2)}, host=["a"])
    assert made["a"]["exp_avg"].device.type == "cpu" and torch.equal(made["a"]["exp_avg_sq"], torch.zeros(3))
    with pytest.raises(ValueError, match="offloaded moment a.exp_avg is on meta"):
        optim.HostMoments({"a": {"step": 0.0, "exp_avg": torch.empty(3, device="meta"),
                                 "exp_avg_sq": torch.empty(3, device="meta")}}, ["a"], torch.device("cpu"))


def test_resume_loads_host_moments_in_place_and_survives_a_damaged_newer_checkpoint(tmp_path, monkeypatch):
    """The resume template shares page-locked host tensors (the offloaded moments) instead of copying them: at 8B
    a copy would add 64 GB of host memory. A damaged newer checkpoint may write part of them; the older good one
    then rewrites every key."""
    from forgetrain import checkpoint

    live = {"m": torch.zeros(4), "w": torch.zeros(3)}
    pinned = live["m"].data_ptr()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.data_ptr() == pinned)  # no CUDA here
    tree = checkpoint.to_cpu_tree(live, share_pinned=True)
    assert tree["m"].data_ptr() == pinned and tree["w"].data_ptr() != live["w"].data_ptr()
    assert checkpoint.to_cpu_tree(live)["m"].data_ptr() != pinned  # the default still copies everything

    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, {"m": torch.full((4,), 1.0), "w": torch.full((3,), 1.0)}, {"step": 1})
    checkpoint.save(root, 2, {"m": torch.full((4,), 2.0), "w": torch.full((3,), 2.0)}, {"step": 2})
    for f in (root / "step_000002").glob("*.distcp"):  # keep the metadata, damage the data
        f.write_bytes(f.read_bytes()[:10])
    state, harness, path, skipped = checkpoint.load_newest_good(
        root, lambda: checkpoint.to_cpu_tree(live, share_pinned=True))
    assert path.name == "step_000001" and len(skipped) == 1 and harness["step"] == 1
    assert torch.equal(live["m"], torch.full((4,), 1.0)) and state["m"].data_ptr() == pinned
    assert torch.equal(state["w"], torch.full((3,), 1.0))
