"""The Qwen3 dense engine (``scenarios/qwen3_0p6b_h200``, scenario ``qwen3_tiny_cpu``) and the harness's Qwen3
features (QK-norm, tied embeddings, ``kv_channels``): bitwise against Megatron-core on CPU at the ``qwen3_micro``
shape in fp32 and bf16 (and at DP=2, slow), a wrong engine rejected, the HF exchange both ways, the parameter
count with tying, and the config refusals."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forgetrain import equivalence as eq
from forgetrain.config import RunConfig
from forgetrain.config.schema import ModelConfig
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
QWEN3_MICRO = ModelConfig(name="qwen3_micro", vocab_size=4096, hidden_size=64, num_layers=2, num_attention_heads=4,
                          num_query_groups=2, kv_channels=32, ffn_hidden_size=176, seq_length=32,
                          rotary_base=1e6, norm_epsilon=1e-6, qk_layernorm=True,
                          share_embeddings_and_output_weights=True)
VERIFY = ["scenario=qwen3_tiny_cpu", "model=qwen3_micro", "train.micro_batch_size=2", "train.global_batch_size=4",
          "train.lr_warmup_steps=2", "verify.steps=4", "tier=bitwise", "train.threads=1"]


def _engine_cls():
    from scenarios.qwen3_0p6b_h200.engine import Engine

    return Engine


def _mutant(kind: str):
    Good = _engine_cls()

    class Mutant(Good):
        def __init__(self, cfg, device):
            super().__init__(cfg, device)
            for blk in self.model.layers:
                for norm in (blk.attn.q_norm, blk.attn.k_norm):
                    if kind == "no_qk_norm":  # the q/k heads only scaled by the weight, never normalised
                        norm.forward = (lambda n: (lambda x: x * n.weight))(norm)
                    else:  # the q/k norms' epsilon 1e-5 (Llama's) instead of the config's 1e-6
                        norm.eps = 1e-5
    return Mutant


def _verify(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgetrain.verify", *VERIFY, f"verify.out_dir={out}", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=hang_s())


def _verdict(out: Path) -> dict:
    return json.loads((out / "verdict.json").read_text())["verdicts"][0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwen3_engine_is_bitwise_vs_megatron(tmp_path, precision):
    p = _verify(tmp_path, f"train.precision={precision}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "strictest equivalence tier passed: bitwise" in p.stdout


@pytest.mark.parametrize("kind", ["no_qk_norm", "eps"])
def test_bitwise_rejects_a_wrong_qwen3_engine(tmp_path, kind):
    p = _verify(tmp_path, f"scenario.engine=tests.test_qwen3:{'NoQKNormMutant' if kind == 'no_qk_norm' else 'EpsMutant'}")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    d = _verdict(tmp_path)["first_divergence"]
    assert d["step"] == 1, d
    # both change layer 0's attention output in the first forward, where the verdict names them
    assert d["kind"] == "module_fwd" and d["module"] == "layers.0.self_attention", d


def __getattr__(name):  # the mutants, built on first access (scenario.engine=tests.test_qwen3:<name>)
    if name == "NoQKNormMutant":
        return _mutant("no_qk_norm")
    if name == "EpsMutant":
        return _mutant("eps")
    raise AttributeError(name)


# ------------------------------------------------------------------------------------------ weights exchange
def _hf_state(m: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    from forgetrain.engine import hf_names

    g = torch.Generator().manual_seed(seed)
    shapes = {}
    d, h = m.head_dim, m.hidden_size
    for n in hf_names(m):
        if n.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[n] = (d,)
        elif n.endswith("norm.weight") or n.endswith("layernorm.weight"):
            shapes[n] = (h,)
        elif n.endswith("q_proj.weight"):
            shapes[n] = (m.num_attention_heads * d, h)
        elif n.endswith(("k_proj.weight", "v_proj.weight")):
            shapes[n] = (m.num_query_groups * d, h)
        elif n.endswith("o_proj.weight"):
            shapes[n] = (h, m.num_attention_heads * d)
        elif n.endswith(("gate_proj.weight", "up_proj.weight")):
            shapes[n] = (m.ffn_hidden_size, h)
        elif n.endswith("down_proj.weight"):
            shapes[n] = (h, m.ffn_hidden_size)
        else:
            shapes[n] = (m.vocab_size, h)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_megatron_conversion_round_trips_qk_norms_and_tied_embedding():
    from references.megatron import convert

    m = QWEN3_MICRO
    hf = _hf_state(m)
    assert "lm_head.weight" not in hf and "model.layers.1.self_attn.q_norm.weight" in hf
    meg = convert.hf_to_megatron(hf, m)
    assert set(meg) == set(convert.megatron_param_names(2, qk_layernorm=True, tied=True))
    assert "output_layer.weight" not in meg
    assert torch.equal(meg["decoder.layers.0.self_attention.k_layernorm.weight"],
                       hf["model.layers.0.self_attn.k_norm.weight"])
    back = convert.megatron_to_hf(meg, m)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # HF's in-memory state dict carries the tied head as the same values: accepted; a different one is refused
    assert set(convert.hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}, m)) == set(meg)
    with pytest.raises(ValueError, match="differs"):
        convert.hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"] + 1}, m)
    # a Llama config keeps its untied names
    llama = dataclasses.replace(m, qk_layernorm=False, share_embeddings_and_output_weights=False, kv_channels=None)
    assert "output_layer.weight" in convert.megatron_param_names(2)
    assert set(convert.megatron_to_hf(convert.hf_to_megatron(_hf_state(llama), llama), llama)) == set(
        _hf_state(llama))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwen3_engine_weights_and_checkpoint_round_trip(precision):
    """HF weights in and out of the engine unchanged (one tied matrix), and its state dict restores a step."""
    cfg = RunConfig(model=QWEN3_MICRO)
    cfg.train.precision, cfg.train.micro_batch_size = precision, 2
    Engine = _engine_cls()
    e = Engine(cfg, "cpu")
    hf = _hf_state(QWEN3_MICRO, seed=3)
    e.load_hf_weights(hf)
    out = e.export_hf_weights()
    assert set(out) == set(hf) and all(torch.equal(out[k], hf[k]) for k in hf)
    assert e.model.output_layer.weight is e.model.embedding.weight
    batch = [torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    e.train_step(batch)
    def clone(x):  # the state dict holds live tensors; the next step changes them in place
        return {k: clone(v) for k, v in x.items()} if isinstance(x, dict) else (
            x.clone() if isinstance(x, torch.Tensor) else x)
    state = clone(e.state_dict())
    r1 = e.train_step(batch)
    f = Engine(cfg, "cpu")
    f.load_state_dict(state)
    r2 = f.train_step(batch)
    assert (r1.loss, r1.grad_norm) == (r2.loss, r2.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(e.export_hf_weights().values(), f.export_hf_weights().values()))


def test_param_counts_count_a_tied_embedding_once():
    from forgetrain.metrics import param_counts

    m = QWEN3_MICRO
    untied = dataclasses.replace(m, share_embeddings_and_output_weights=False)
    a, b = param_counts(m), param_counts(untied)
    assert b["total"] - a["total"] == m.vocab_size * m.hidden_size
    assert a["embedding"] == m.vocab_size * m.hidden_size and a["non_embedding"] == a["total"] - a["embedding"]
    n_engine = sum(p.numel() for p in _engine_cls()(RunConfig(model=m), "cpu").model.parameters())
    assert n_engine == a["total"]
    # Qwen3-0.6B: 0.60B parameters, 0.44B without the (tied) embedding, as its model card states
    big = dataclasses.replace(m, vocab_size=151936, hidden_size=1024, num_layers=28, num_attention_heads=16,
                              num_query_groups=8, kv_channels=128, ffn_hidden_size=3072)
    c = param_counts(big)
    assert (round(c["total"] / 1e9, 2), round(c["non_embedding"] / 1e9, 2)) == (0.6, 0.44)


# ------------------------------------------------------------------------------------------ config
def test_llama_config_hash_is_unchanged_by_the_qwen3_fields():
    from forgetrain.train import config_hash, hashed_config

    rc = RunConfig()
    assert not {"qk_layernorm", "share_embeddings_and_output_weights", "kv_channels"} & set(
        hashed_config(rc)["model"])
    q = dataclasses.replace(rc, model=dataclasses.replace(rc.model, qk_layernorm=True))
    assert config_hash(q) != config_hash(rc)


@pytest.mark.parametrize("args,match", [
    (["scenario=llama_tiny_cpu", "model=qwen3_micro"], "model.qk_layernorm=True, "
     "model.share_embeddings_and_output_weights=True, model.kv_channels=32 is not implemented by engine "
     "scenarios.llama_tiny_cpu.engine:Engine"),
    (["scenario=qwen3_tiny_cpu", "model.kv_channels=0"], "model.kv_channels must be positive"),
    (["scenario=qwen3_tiny_cpu", "engine.mode=fast"], "engine.mode=fast is not implemented"),
])
def test_bad_qwen3_combinations_are_one_error_line(tmp_path, args, match):
    p = subprocess.run([sys.executable, "-m", "forgetrain", *args, "train.steps=2", f"train.out_dir={tmp_path}/o"],
                       cwd=ROOT, capture_output=True, text=True, timeout=hang_s())
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (p.returncode, p.stderr)
    assert match in lines[0], lines[0]


def test_a_reference_without_the_features_refuses_them():
    from forgetrain.config.checks import validate
    from forgetrain.errors import ConfigError
    from forgetrain.registry import load_engine_class

    cfg = RunConfig(model=QWEN3_MICRO)
    cfg.scenario.name, cfg.scenario.engine = "qwen3_tiny_cpu", "scenarios.qwen3_0p6b_h200.engine:Engine"
    validate(cfg, engine_cls=load_engine_class("references", "megatron"), reference=True)
    try:
        ds = load_engine_class("references", "deepspeed")
    except ConfigError:
        pytest.skip("deepspeed extra not installed")
    with pytest.raises(ConfigError, match="not implemented by engine references.deepspeed"):
        validate(cfg, engine_cls=ds, reference=True)


def test_forge_brief_names_the_model_features():
    from forgetrain.forge import brief
    from forgetrain.forge.loop import brief_features

    rc = RunConfig(model=QWEN3_MICRO)
    feats = brief_features(rc)
    assert feats == ["model.qk_layernorm=True", "model.share_embeddings_and_output_weights=True",
                     "model.kv_channels=32"]
    lines = brief._constraints({"agent_timeout_s": 60, "model_features": feats})
    assert any("model_features=" in x and "`model.qk_layernorm=True`" in x for x in lines)
    assert brief_features(RunConfig()) == [] and not brief._features({"model_features": []})


# ------------------------------------------------------------------------------------------ DP=2 (gloo), slow
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwen3_dp2_is_bitwise_vs_reference_dp2(tmp_path_factory, precision):
    from tests.helpers import session_cache
    from tests.helpers import run_jobs

    tmp = tmp_path_factory.mktemp(f"qwen3_dp2_{precision}")
    over = ["scenario=qwen3_tiny_cpu", "model=qwen3_micro", "train.deterministic=true", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.lr_warmup_steps=2", "train.steps=4", "parallel=dp2",
            f"train.precision={precision}"]
    ref, cand = tmp / "ref", tmp / "cand"
    p = run_jobs([{"side": "reference", "out": str(ref), "overrides": over},
                  {"side": "candidate", "out": str(cand), "overrides": over, "init": str(ref / "init.safetensors")}],
                 tmp, session_cache(tmp_path_factory))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    v = eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary
