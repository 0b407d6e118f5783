"""``engine.free_qkv``: V is copied out of the fused QKV GEMM output so a decoder layer's saved tensors no longer
keep that whole buffer alive (the memory it frees: ``tests/test_memory.py``). Declared tier: tolerance (on the GPU
another V stride may select another attention kernel); on CPU the same values reach the same kernels, so every loss
and final weight is bitwise equal to the run without it, which is what is checked here, with the switch proven to
take effect (the saved V is its own storage)."""

from __future__ import annotations

import pytest
import torch

from forgetrain import memory
from forgetrain.config import validate
from forgetrain.errors import ConfigError
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import hopper_cfg as _cfg_for, same_run as _same, train_hopper as _train


@pytest.mark.parametrize("extra", [{}, {"grad_accum_fusion": True}, {"recompute": "full"}],
                         ids=["fast", "fast_fused", "fast_recompute"])
def test_free_qkv_changes_no_bit_on_cpu(extra):
    init = Hopper(_cfg_for("fast"), "cpu").export_hf_weights()
    base = _train(_cfg_for("fast", **extra), init)
    got = _train(_cfg_for("fast", free_qkv=True, **extra), init)
    assert _same(base, got), (base[0], got[0])


@pytest.mark.parametrize("free_qkv", [False, True])
def test_the_switch_reaches_every_layer(free_qkv):
    """SDPA saves V: with the switch in its own storage, without it in (a view of) the layer's QKV output."""
    cfg = _cfg_for("fast", free_qkv=free_qkv)
    eng = Hopper(cfg, "cpu")
    m = cfg.model
    ids = torch.randint(0, m.vocab_size, (2, 33))
    qkv = 2 * (2 * 32) * (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim  # bf16 [b, s, (nq + 2 nkv) d]
    assert all(layer.free_qkv == free_qkv for layer in eng.model.layers)
    _, rows = memory.saved_storages(eng.model, ids[:, :-1], ids[:, 1:], exclude=list(eng.model.parameters()))
    v_shape = (2, m.num_query_groups, 32, m.head_dim)  # as SDPA gets it: [b, nkv, s, d]
    v_rows = [r for r in rows if v_shape in r["shapes"] and r["bytes"] in (qkv, qkv * m.num_query_groups // (
        m.num_attention_heads + 2 * m.num_query_groups))]
    assert len(v_rows) >= m.num_layers  # k too, the RoPE output of the same shape
    in_qkv = sum(r["bytes"] == qkv for r in v_rows)
    assert in_qkv == (0 if free_qkv else m.num_layers), v_rows


def test_exact_mode_refuses_it():
    with pytest.raises(ConfigError, match="engine.free_qkv=true needs engine.mode=fast"):
        validate(_cfg_for("exact", free_qkv=True), engine_cls=Hopper)
