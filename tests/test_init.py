"""The forged engines' own initialisation draws from the reference's distribution, tensor by tensor.

The loss-curve and surpass tiers run the candidate from its own init, so its distribution must be Megatron-core's:
N(0, init_method_std) for QKV, fc1, the embedding and the LM head, N(0, init_method_std / sqrt(2 L)) for the output
projections (attention proj, MLP fc2), ones for RMSNorm weights. The bitwise and tolerance tiers cannot see this
(there the candidate loads the reference's weights). Compared per tensor at 8 layers, where the scaled std is a
quarter of the unscaled one, against the sampling error of a standard deviation.
"""

import dataclasses
import math

import pytest
import torch

from forgetrain import registry
from forgetrain.config import EngineOptions, KernelsConfig
from tests.helpers import ladder_cfg as _cfg

LAYERS = 8


def _cfg8(mode: str | None = None):
    c = _cfg()
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, num_layers=LAYERS))
    if mode is not None:
        c = dataclasses.replace(c, engine=EngineOptions(mode=mode, compile=False), kernels=KernelsConfig())
    return c


@pytest.fixture(scope="module")
def reference_init():
    ref = registry.load_engine_class("references", "megatron")(_cfg8(), torch.device("cpu"))
    return {k: v.detach().float().clone() for k, v in ref.export_hf_weights().items()}


def _forged_init(engine: str, mode: str | None):
    cfg = _cfg8(mode)
    eng = registry.resolve_engine(registry.engine_spec(engine))(cfg, torch.device("cpu"))
    return {k: v.detach().float().clone() for k, v in eng.export_hf_weights().items()}


def assert_same_distribution(ref: dict, cand: dict) -> None:
    """Per tensor: the same names and shapes; 1-D tensors equal (ones); for matrices, the sample std agrees within
    6 standard errors of the ratio of two independent sample stds (each has relative s.e. 1/sqrt(2n)), and the
    mean is within 6 standard errors of 0."""
    assert sorted(ref) == sorted(cand)
    for k in ref:
        r, c = ref[k], cand[k]
        assert r.shape == c.shape, k
        if r.dim() == 1:
            assert torch.equal(r, c), k
            continue
        n = r.numel()
        se_ratio = math.sqrt(2.0) / math.sqrt(2.0 * n)
        ratio = float(c.std()) / float(r.std())
        assert abs(ratio - 1.0) < 6 * se_ratio, f"{k}: candidate std {float(c.std()):.5f} vs reference " \
                                                f"{float(r.std()):.5f} (ratio {ratio:.3f})"
        assert abs(float(c.mean())) < 6 * float(r.std()) / math.sqrt(n), k


@pytest.mark.parametrize("engine,mode", [("llama_tiny_cpu", None), ("llama1b_h200", "exact"),
                                         ("llama1b_h200", "fast")])
def test_forged_init_matches_reference_distribution(reference_init, engine, mode):
    assert_same_distribution(reference_init, _forged_init(engine, mode))


def test_output_projections_are_scaled_in_the_reference(reference_init):
    """The fact the forged init mirrors, read off Megatron-core itself: o_proj / down_proj at std/sqrt(2L)."""
    std = _cfg8().model.init_method_std
    o = reference_init["model.layers.0.self_attn.o_proj.weight"]
    q = reference_init["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(o.std()) / (std / math.sqrt(2 * LAYERS)) - 1) < 0.1
    assert abs(float(q.std()) / std - 1) < 0.1


def test_unscaled_init_is_rejected(reference_init):
    """The check fails for the old init (every matrix at init_method_std)."""
    cand = _forged_init("llama1b_h200", "fast")
    std = _cfg8().model.init_method_std
    g = torch.Generator().manual_seed(0)
    for k, v in cand.items():
        if v.dim() > 1:
            cand[k] = torch.empty_like(v).normal_(0.0, std, generator=g)
    with pytest.raises(AssertionError, match="o_proj|down_proj"):
        assert_same_distribution(reference_init, cand)
