"""Megatron <-> HF-Llama conversion: exact round trips, the documented row layouts, and a model-level check that
the conversion is the right one (an independent HF-layout Llama forward matches Megatron's logits) and that wrong
permutations are caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forgetrain.config import ModelConfig
from forgetrain.engine import hf_param_names
from references.megatron import convert

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, seq_length=32)


def random_hf(cfg: ModelConfig = CFG, std: float = 0.2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = cfg.hidden_size // cfg.num_attention_heads
    h, ffn, kv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    out = {}
    for k in hf_param_names(cfg.num_layers):
        shp = shapes[k]
        out[k] = (1.0 + 0.1 * torch.randn(shp, generator=g)) if len(shp) == 1 else std * torch.randn(shp, generator=g)
    return out


def test_round_trips_are_exact():
    hf = random_hf()
    meg = convert.hf_to_megatron(hf, CFG)
    assert set(meg) == set(convert.megatron_param_names(CFG.num_layers))
    back = convert.megatron_to_hf(meg, CFG)
    assert list(back) == hf_param_names(CFG.num_layers)
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    again = convert.hf_to_megatron(back, CFG)
    assert all(torch.equal(again[k], meg[k]) for k in meg)
    # _extra_state entries of a real GPTModel state dict are ignored
    meg_with_extra = dict(meg, **{"output_layer._extra_state": None})
    assert all(torch.equal(convert.megatron_to_hf(meg_with_extra, CFG)[k], hf[k]) for k in hf)


def test_qkv_and_fc1_row_layout():
    """Label every row with (kind, head) and check Megatron's grouped order: per group, its q heads, k, v."""
    d, per = 16, 2
    q = torch.arange(4).repeat_interleave(d).float().unsqueeze(1)  # q head id per row
    k = 100 + torch.arange(2).repeat_interleave(d).float().unsqueeze(1)
    v = 200 + torch.arange(2).repeat_interleave(d).float().unsqueeze(1)
    qkv = convert.merge_qkv(q, k, v, CFG)[:, 0].view(-1, d)[:, 0].tolist()
    assert qkv == [0, 1, 100, 200, 2, 3, 101, 201]
    assert per == CFG.num_attention_heads // CFG.num_query_groups
    hf = random_hf()
    meg = convert.hf_to_megatron(hf, CFG)
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf["model.layers.0.mlp.up_proj.weight"])


def test_wrong_qkv_permutation_breaks_round_trip():
    hf = random_hf()
    meg = convert.hf_to_megatron(hf, CFG)
    p = "model.layers.0.self_attn."
    naive = torch.cat([hf[p + "q_proj.weight"], hf[p + "k_proj.weight"], hf[p + "v_proj.weight"]])
    assert naive.shape == meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape
    assert not torch.equal(naive, meg["decoder.layers.0.self_attention.linear_qkv.weight"])
    q, _, _ = convert.split_qkv(naive, CFG)
    assert not torch.equal(q, hf[p + "q_proj.weight"])


def test_bad_inputs_raise():
    hf = random_hf()
    with pytest.raises(KeyError):
        convert.hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, CFG)
    meg = convert.hf_to_megatron(hf, CFG)
    meg["decoder.layers.0.mlp.linear_fc1.weight"] = meg["decoder.layers.0.mlp.linear_fc1.weight"][:100]
    with pytest.raises(ValueError):
        convert.megatron_to_hf(meg, CFG)


# --------------------------------------------------------------------------- model-level check
def hf_llama_logits(w: dict[str, torch.Tensor], tokens: torch.Tensor, cfg: ModelConfig = CFG) -> torch.Tensor:
    """An independent HF-layout Llama forward (batch-first, fp64): RMSNorm, rotate-half RoPE, GQA, SwiGLU."""
    w = {k: v.double() for k, v in w.items()}
    b, s = tokens.shape
    nh, ng = cfg.num_attention_heads, cfg.num_query_groups
    d = cfg.hidden_size // nh

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_epsilon) * wt

    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # [b, heads, s, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = w["model.embed_tokens.weight"][tokens]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        hdn = rms(x, w[p + "input_layernorm.weight"])
        q = (hdn @ w[p + "self_attn.q_proj.weight"].T).view(b, s, nh, d).transpose(1, 2)
        k = (hdn @ w[p + "self_attn.k_proj.weight"].T).view(b, s, ng, d).transpose(1, 2)
        v = (hdn @ w[p + "self_attn.v_proj.weight"].T).view(b, s, ng, d).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // ng, dim=1), v.repeat_interleave(nh // ng, dim=1)
        att = (q @ k.transpose(-1, -2)) / d ** 0.5
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(b, s, nh * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        hdn = rms(x, w[p + "post_attention_layernorm.weight"])
        act = F.silu(hdn @ w[p + "mlp.gate_proj.weight"].T) * (hdn @ w[p + "mlp.up_proj.weight"].T)
        x = x + act @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.fixture(scope="module")
def megatron_engine():
    pytest.importorskip("megatron.core")
    from forgetrain.config import RunConfig, TrainConfig
    from references.megatron.engine import Engine

    return Engine(RunConfig(model=CFG, train=TrainConfig(micro_batch_size=2, global_batch_size=4, steps=10,
                                                         lr_warmup_steps=2)), torch.device("cpu"))


def _rel_err(e, w: dict[str, torch.Tensor], tokens: torch.Tensor, ref: torch.Tensor) -> float:
    e.load_hf_weights(w)
    got = e.logits(tokens).double()
    return float((got - ref).abs().max() / ref.abs().max())


def test_conversion_matches_an_independent_hf_forward_and_catches_wrong_layouts(megatron_engine):
    hf = random_hf()
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), generator=torch.Generator().manual_seed(1))
    ref = hf_llama_logits(hf, tokens)
    assert _rel_err(megatron_engine, hf, tokens, ref) < 1e-5  # fp32 Megatron vs fp64 HF-layout forward

    # [Q;K;V] concatenated instead of Megatron's per-group interleave.
    bad = dict(hf)
    for i in range(CFG.num_layers):
        p = f"model.layers.{i}.self_attn."
        naive = torch.cat([hf[p + "q_proj.weight"], hf[p + "k_proj.weight"], hf[p + "v_proj.weight"]])
        bad[p + "q_proj.weight"], bad[p + "k_proj.weight"], bad[p + "v_proj.weight"] = convert.split_qkv(naive, CFG)
    assert _rel_err(megatron_engine, bad, tokens, ref) > 1e-2

    # gate and up swapped in fc1.
    bad = dict(hf)
    for i in range(CFG.num_layers):
        p = f"model.layers.{i}.mlp."
        bad[p + "gate_proj.weight"], bad[p + "up_proj.weight"] = hf[p + "up_proj.weight"], hf[p + "gate_proj.weight"]
    assert _rel_err(megatron_engine, bad, tokens, ref) > 1e-2
