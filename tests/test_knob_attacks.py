"""Attacks on two Hopper-engine memory knobs declared bitwise: ``engine.recompute_num_layers`` (the first N layers
recomputed, the rest stored; ``scenarios/_llama/recompute.py``) and ``engine.optimizer_offload_fraction`` (AdamW
moments streamed from host memory; ``scenarios/_llama/optim.HostMoments``).

* the memory estimate's offload staging is the engine's own: two slots of the largest *offloaded tensor's* chunk,
  which is the fc1 weight ``[2f, h]`` (or QKV), not the embedding, when the vocabulary is small;
* combinations the per-option tests leave out change no bit: offload in fp32 (the main weights are the model's
  own parameters) with a prime chunk size, offload with per-layer weights and block recompute at grad-accum 3,
  and a checkpoint written at one offload fraction resumed at another.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgetrain import memory
from forgetrain.config import validate
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import hopper_cfg as _cfg_for, same_run as _same
from tests.helpers import check_resumes_bitwise

BOTH = {"recompute": "full", "bf16_weights": "per_layer"}


def _train(cfg, init: dict, steps: int = 3, accum: int = 2):
    torch.manual_seed(0)
    mbs = [[torch.randint(0, 256, (2, 33)) for _ in range(accum)] for _ in range(steps)]
    eng = Hopper(cfg, "cpu")
    eng.load_hf_weights(init)
    return [eng.train_step(m).loss for m in mbs], eng.export_hf_weights(), eng


def _staging_estimate(cfg) -> int:
    """The estimate's staging bytes: its Adam moments at F=1 (no moment left on the device)."""
    return memory.estimate(dataclasses.replace(
        cfg, engine=dataclasses.replace(cfg.engine, optimizer_offload_fraction=1.0))).adam_moments


@pytest.mark.parametrize("vocab", [256, 4096], ids=["fc1_largest", "embedding_largest"])
@pytest.mark.parametrize("chunk", [1000, 1 << 25], ids=["chunk_1000", "chunk_default"])
def test_estimated_staging_is_the_engines(monkeypatch, vocab, chunk):
    """At vocab 256 (h 64, f 176) the fc1 weight [352, 64] has more elements than the embedding [256, 64]: the
    engine's staging slots hold a chunk of it, and the estimate must count them (it counted V*h)."""
    monkeypatch.setattr(memory, "OFFLOAD_CHUNK_ELEMS", chunk)
    c = _cfg_for("exact", optimizer_offload_fraction=1.0)
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=vocab))
    eng = Hopper(c, "cpu")
    assert eng.offload.staging_bytes == _staging_estimate(c)


@pytest.mark.parametrize("chunk", [7, 1000])
def test_fp32_offload_with_a_prime_chunk_changes_no_bit(monkeypatch, chunk):
    """fp32: the main weights are the model's own parameters, updated in place chunk by chunk."""
    monkeypatch.setattr(memory, "OFFLOAD_CHUNK_ELEMS", chunk)
    init = Hopper(_cfg_for("exact", precision="fp32"), "cpu").export_hf_weights()
    base = _train(_cfg_for("exact", precision="fp32"), init, steps=2)
    cfg = _cfg_for("exact", precision="fp32", optimizer_offload_fraction=1.0)
    validate(cfg, engine_cls=Hopper)
    got = _train(cfg, init, steps=2)
    assert got[2].offload.chunk == chunk and _same(base, got), (base[0], got[0])


def test_offload_with_per_layer_block_recompute_at_accum_3_changes_no_bit(monkeypatch):
    monkeypatch.setattr(memory, "OFFLOAD_CHUNK_ELEMS", 1000)
    init = Hopper(_cfg_for("fast"), "cpu").export_hf_weights()
    base = _train(_cfg_for("fast", grad_accum_fusion=True), init, accum=3)
    cfg = _cfg_for("fast", grad_accum_fusion=True, optimizer_offload_fraction=0.6, recompute_num_layers=1, **BOTH)
    validate(cfg, engine_cls=Hopper)
    got = _train(cfg, init, accum=3)
    assert _same(base, got), (base[0], got[0])


@pytest.mark.parametrize("before,after", [(0.0, 0.6), (0.6, 0.0)])
def test_a_checkpoint_resumes_bitwise_at_another_offload_fraction(monkeypatch, before, after):
    """The checkpoint holds whole moments wherever they lived: a run saved with its moments on the device resumes
    with them in host memory, and back, to the uninterrupted run's bits."""
    monkeypatch.setattr(memory, "OFFLOAD_CHUNK_ELEMS", 1000)
    a, b = _cfg_for("exact", optimizer_offload_fraction=before), _cfg_for("exact", optimizer_offload_fraction=after)
    assert (Hopper(b, "cpu").offload is None) == (after == 0.0)
    check_resumes_bitwise(a, b)
