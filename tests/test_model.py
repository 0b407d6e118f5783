"""The forged llama_tiny_cpu engine: shapes, HF layout round trip, GQA, and a loss that falls."""

import dataclasses

import torch

from forgetrain.config import ModelConfig, RunConfig, TrainConfig
from forgetrain.engine import hf_param_names
from forgetrain.metrics import param_counts
from scenarios.llama_tiny_cpu.engine import Engine

MICRO = ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=176, seq_length=32)


def _cfg(**train):
    return RunConfig(model=MICRO, train=dataclasses.replace(TrainConfig(), micro_batch_size=2, global_batch_size=4,
                                                             steps=30, lr_warmup_steps=2, lr=3e-3, **train))


def test_shapes_and_param_count():
    eng = Engine(_cfg(), "cpu")
    ids = torch.randint(0, 256, (2, 32))
    logits = eng.logits(ids)
    assert logits.shape == (2, 32, 256)
    n = sum(p.numel() for p in eng.model.parameters())
    assert n == param_counts(MICRO)["total"]
    qkv = eng.model.layers[0].attn.qkv
    assert qkv.shape == ((4 + 2 * 2) * 16, 64)  # GQA: 4 q heads + 2 k + 2 v heads of 16


def test_hf_round_trip_is_exact():
    eng = Engine(_cfg(), "cpu")
    hf = eng.export_hf_weights()
    assert list(hf) == hf_param_names(2) or set(hf) == set(hf_param_names(2))
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    other = Engine(_cfg(seed=7), "cpu")
    other.load_hf_weights(hf)
    for k, v in other.export_hf_weights().items():
        assert torch.equal(v, hf[k]), k


def test_loss_falls_on_a_repeated_batch():
    torch.manual_seed(0)
    eng = Engine(_cfg(), "cpu")
    mbs = [torch.randint(0, 256, (2, 33)) for _ in range(2)]
    losses = [eng.train_step(mbs).loss for _ in range(30)]
    assert losses[0] > 5.0  # ~ln(256) = 5.55
    assert losses[-1] < losses[0] - 2.0


def test_first_step_uses_megatron_warmup_lr_zero():
    eng = Engine(_cfg(), "cpu")
    r = eng.train_step([torch.randint(0, 256, (2, 33))] * 2)
    assert r.lr == 0.0
    assert eng.train_step([torch.randint(0, 256, (2, 33))] * 2).lr == 3e-3 / 2
