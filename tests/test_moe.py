"""The Qwen3-MoE engine (``scenarios/qwen3_moe``, scenario ``qwen3_moe_tiny_cpu``) and the harness's MoE fields:
bitwise against Megatron-core's MoE GPTModel on CPU at the ``qwen3_moe_micro`` shape (fp32, bf16), wrong engines
rejected (top-k probabilities not renormalised, aux-loss weight x2, expert outputs summed in another order), the
HF Qwen3-MoE exchange, the parameter counts and the active-parameter MFU, the config refusals, and the MoE metrics
of the progress line and W&B (load-balancing loss, expert load imbalance, dropped tokens) and of the bitwise tier."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forgetrain.config import RunConfig
from forgetrain.config.schema import ModelConfig
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
MOE_MICRO = ModelConfig(name="qwen3_moe_micro", vocab_size=4096, hidden_size=64, num_layers=2, num_attention_heads=4,
                        num_query_groups=2, kv_channels=32, ffn_hidden_size=176, seq_length=32, rotary_base=1e6,
                        norm_epsilon=1e-6, qk_layernorm=True, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.001)
VERIFY = ["scenario=qwen3_moe_tiny_cpu", "model=qwen3_moe_micro", "train.micro_batch_size=2",
          "train.global_batch_size=4", "train.lr_warmup_steps=2", "verify.steps=4", "tier=bitwise", "train.threads=1"]


def _verify(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forgetrain.verify", *VERIFY, f"verify.out_dir={out}", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=hang_s())


def _verdict(out: Path) -> dict:
    return json.loads((out / "verdict.json").read_text())["verdicts"][0]


def test_moe_config_file_matches_the_test_shape():
    import yaml

    assert ModelConfig(**yaml.safe_load((ROOT / "conf/model/qwen3_moe_micro.yaml").read_text())) == MOE_MICRO


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_engine_is_bitwise_vs_megatron(tmp_path, precision):
    p = _verify(tmp_path, f"train.precision={precision}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "strictest equivalence tier passed: bitwise" in p.stdout
    # both sides report the same routing statistics, every step (StepResult.extra in the trace)
    recs = {side: [json.loads(x) for x in (tmp_path / side / "trace" / "trace.jsonl").read_text().splitlines()]
            for side in ("reference", "candidate")}
    for r, c in zip(recs["reference"], recs["candidate"]):
        assert r["moe_tokens_per_expert"] == c["moe_tokens_per_expert"]
        assert r["moe_load_balancing_loss"] == c["moe_load_balancing_loss"]
        # 2 micro-batches x 64 tokens x top-2 routed per layer
        assert [sum(x) for x in r["moe_tokens_per_expert"]] == [256, 256]
    # the tier compared them, and rejects the same candidate with one layer's routing doctored (losses equal)
    from forgetrain.equivalence import bitwise

    ok = bitwise(tmp_path / "reference" / "trace", tmp_path / "candidate" / "trace")
    assert ok.passed and "MoE routing" in ok.summary, ok.summary
    assert ok.evidence["moe"]["steps_compared"] == {"moe_tokens_per_expert": 4, "moe_load_balancing_loss": 4}
    bad = tmp_path / "doctored"
    shutil.copytree(tmp_path / "candidate" / "trace", bad)
    cand = [dict(c) for c in recs["candidate"]]
    tpe = [list(layer) for layer in cand[1]["moe_tokens_per_expert"]]
    tpe[0][0], tpe[0][1] = tpe[0][0] + 1, tpe[0][1] - 1  # one token moved between experts: same total
    cand[1]["moe_tokens_per_expert"] = tpe
    (bad / "trace.jsonl").write_text("".join(json.dumps(c, sort_keys=True) + "\n" for c in cand))
    v = bitwise(tmp_path / "reference" / "trace", bad)
    assert not v.passed and v.evidence["mismatch_counts"] == {"moe_tokens_per_expert": 1}, v.summary
    d = v.first_divergence
    assert (d["step"], d["kind"], d["layer"], d["cand"]) == (2, "moe_tokens_per_expert", 0, tpe[0]), d
    assert "step 2 moe_tokens_per_expert layer 0" in v.summary


# ------------------------------------------------------------------------------------------ wrong engines
def _unnormalised(logits, topk):
    """The top-k probabilities as softmax over all experts, not renormalised over the k chosen."""
    _, idx = torch.topk(logits, k=topk, dim=1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, idx).type_as(logits)
    return (torch.zeros_like(logits).scatter(1, idx, probs),
            torch.zeros_like(logits).int().scatter(1, idx, 1).bool())


def _reversed_unpermute(permuted, sorted_indices, restore_shape):
    """The expert outputs summed into each token in reverse expert order."""
    out = torch.zeros(restore_shape, dtype=permuted.dtype, device=permuted.device)
    idx = sorted_indices.flip(0)
    out.scatter_add_(0, idx.unsqueeze(1).expand(-1, restore_shape[-1]), permuted.flip(0))
    return out


def _mutant(kind: str):
    from scenarios.qwen3_moe import moe
    from scenarios.qwen3_moe.engine import Engine as Good

    class Mutant(Good):
        def __init__(self, cfg, device):
            super().__init__(cfg, device)
            if kind == "unnormalised":
                moe.topk_softmax_routing = _unnormalised
            elif kind == "aux_x2":
                for layer in self.model.moe_layers():
                    layer.coeff *= 2.0
            else:
                moe.unpermute = _reversed_unpermute
    return Mutant


MUTANTS = {"unnormalised": "UnnormalisedMutant", "aux_x2": "AuxX2Mutant", "sum_order": "SumOrderMutant"}


def __getattr__(name):  # the mutants, built on first access (scenario.engine=tests.test_moe:<name>)
    for kind, attr in MUTANTS.items():
        if name == attr:
            return _mutant(kind)
    raise AttributeError(name)


@pytest.mark.parametrize("kind,extra,where", [
    # the probabilities scale each expert's activations: layer 0's MoE output differs in the first forward
    ("unnormalised", [], ("module_fwd", "layers.0.mlp")),
    # the forward is unchanged; the aux loss's gradient reaches the router logits, so layer 1's MoE input
    # gradient (the pre-MLP norm's output) is the first to differ
    ("aux_x2", [], ("module_grad", "layers.1.pre_mlp_norm")),
    # with top-2 the two addends of a token commute exactly (0 + a + b == 0 + b + a), so the order shows from top-3
    ("sum_order", ["model.moe_router_topk=3"], ("module_fwd", "layers.0.mlp")),
])
def test_bitwise_rejects_a_wrong_moe_engine(tmp_path, kind, extra, where):
    p = _verify(tmp_path, f"scenario.engine=tests.test_moe:{MUTANTS[kind]}", *extra)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    d = _verdict(tmp_path)["first_divergence"]
    assert d["step"] == 1 and (d["kind"], d["module"]) == where, d


def test_top2_sum_order_is_exact():
    """Why the sum-order mutant needs top-3: two addends into a zero buffer give the same bits in either order."""
    from scenarios.qwen3_moe import moe

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 5, generator=g)
    idx = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    assert torch.equal(moe.unpermute(rows, idx, (4, 5)), _reversed_unpermute(rows, idx, (4, 5)))


# ------------------------------------------------------------------------------------------ weights exchange
def _hf_state(m: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    from scenarios.qwen3_moe import layout
    from scenarios.qwen3_moe.engine import Engine

    e = Engine(RunConfig(model=m), "cpu")
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in e.export_hf_weights().items()}


def test_moe_weights_round_trip_through_engine_and_megatron_layout():
    from forgetrain.engine import hf_names
    from references.megatron import convert
    from scenarios.qwen3_moe.engine import Engine

    m = MOE_MICRO
    hf = _hf_state(m)
    assert set(hf) == set(hf_names(m))  # the engine exports HF Qwen3-MoE names
    assert hf["model.layers.1.mlp.gate.weight"].shape == (4, 64)
    assert hf["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 32)
    meg = convert.hf_to_megatron(hf, m)
    assert set(meg) == set(convert.megatron_param_names(2, qk_layernorm=True, num_experts=4))
    fc1 = meg["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.experts.2.gate_proj.weight"],
                                       hf["model.layers.0.mlp.experts.2.up_proj.weight"]]))
    back = convert.megatron_to_hf(meg, m)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    e = Engine(RunConfig(model=m), "cpu")
    e.load_hf_weights(hf)
    out = e.export_hf_weights()
    assert all(torch.equal(out[k], hf[k]) for k in hf)


def test_moe_engine_checkpoint_round_trip():
    from scenarios.qwen3_moe.engine import Engine

    cfg = RunConfig(model=MOE_MICRO)
    cfg.train.micro_batch_size = 2
    e = Engine(cfg, "cpu")
    batch = [torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    e.train_step(batch)

    def clone(x):
        return {k: clone(v) for k, v in x.items()} if isinstance(x, dict) else (
            x.clone() if isinstance(x, torch.Tensor) else x)
    state = clone(e.state_dict())
    r1 = e.train_step(batch)
    f = Engine(cfg, "cpu")
    f.load_state_dict(state)
    r2 = f.train_step(batch)
    assert (r1.loss, r1.grad_norm, r1.extra) == (r2.loss, r2.grad_norm, r2.extra)


# ------------------------------------------------------------------------------------------ counts and MFU
def test_param_counts_and_active_mfu():
    from forgetrain import metrics
    from scenarios.qwen3_moe.engine import Engine

    m = MOE_MICRO
    c = metrics.param_counts(m)
    assert c["total"] == sum(p.numel() for p in Engine(RunConfig(model=m), "cpu").model.parameters())
    h, fe, L = 64, 32, 2
    # per layer 4 experts x 3 h fe, of which top-2 run per token; the router [E, h] counts whole
    assert c["non_embedding"] - c["active_non_embedding"] == L * (4 - 2) * 3 * h * fe
    assert metrics.flops_per_token(m) == 6 * c["active_non_embedding"] + 12 * L * h * m.seq_length
    assert metrics.MOE_MFU_NOTE in metrics.mfu_formula_label("peak X", m)
    assert "active" not in metrics.mfu_formula_label("peak X", dataclasses.replace(m, num_experts=None))
    dense = dataclasses.replace(m, num_experts=None)
    assert metrics.param_counts(dense)["active_non_embedding"] == metrics.param_counts(dense)["non_embedding"]
    # Qwen3-30B-A3B (its model card: 30.5B parameters, 29.9B non-embedding, 3.3B activated: 3.353B here with the
    # embedding and LM head, which the card's one decimal states as 3.3B)
    big = dataclasses.replace(m, vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
                              num_query_groups=4, kv_channels=128, num_experts=128, moe_router_topk=8,
                              moe_ffn_hidden_size=768)
    b = metrics.param_counts(big)
    assert round(b["total"] / 1e9, 1) == 30.5
    assert round((b["non_embedding"] - big.vocab_size * big.hidden_size) / 1e9, 1) == 29.9  # both embeddings out
    assert 3.3e9 <= b["active_non_embedding"] + b["embedding"] < 3.4e9


# ------------------------------------------------------------------------------------------ config
def test_dense_config_hash_is_unchanged_by_the_moe_fields():
    from forgetrain.train import config_hash, hashed_config

    rc = RunConfig()
    assert not {"num_experts", "moe_router_topk", "moe_aux_loss_coeff"} & set(hashed_config(rc)["model"])
    moe = dataclasses.replace(rc, model=dataclasses.replace(rc.model, num_experts=4))
    assert "moe_router_topk" in hashed_config(moe)["model"] and config_hash(moe) != config_hash(rc)


@pytest.mark.parametrize("args,match", [
    (["scenario=qwen3_tiny_cpu", "model=qwen3_moe_micro"],
     "model.num_experts=4 is not implemented by engine scenarios.qwen3_0p6b_h200.engine:Engine"),
    (["scenario=qwen3_tiny_cpu", "model.moe_aux_loss_coeff=0.01"],
     "model.moe_aux_loss_coeff=0.01 needs model.num_experts"),
    (["scenario=qwen3_moe_tiny_cpu", "model.moe_router_topk=9"], "model.moe_router_topk must lie in [1, "),
    (["scenario=qwen3_moe_tiny_cpu", "model.moe_expert_capacity_factor=1.0"], "only dropless routing"),
])
def test_bad_moe_combinations_are_one_error_line(tmp_path, args, match):
    p = subprocess.run([sys.executable, "-m", "forgetrain", *args, "train.steps=2", f"train.out_dir={tmp_path}/o"],
                       cwd=ROOT, capture_output=True, text=True, timeout=hang_s())
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (p.returncode, p.stderr)
    assert match in lines[0], lines[0]


# ------------------------------------------------------------------------------------------ MoE metrics
def test_moe_metrics_scalars_and_honest_dropped_tokens():
    from forgetrain.metrics import moe_metrics, moe_progress_fields

    rec = {"moe_tokens_per_expert": [[60, 68, 70, 58], [100, 28, 64, 64]], "moe_load_balancing_loss": [1.0, 1.5]}
    got = moe_metrics(rec, MOE_MICRO)
    assert got == {"moe_lb_loss": 1.25, "moe_max_load": 100 / 64, "moe_dropped_tokens": 0}
    assert moe_progress_fields(got) == {"moe_lb_loss": "1.2500", "moe_max_load": "1.56x", "moe_dropped_tokens": "0"}
    # a capacity factor without a reported count: unknown, never shown as 0; a reported count (per layer) is summed
    capped = dataclasses.replace(MOE_MICRO, moe_expert_capacity_factor=1.0)
    assert "moe_dropped_tokens" not in moe_metrics(rec, capped)
    assert moe_metrics({**rec, "moe_dropped_tokens": [3, 4]}, capped)["moe_dropped_tokens"] == 7
    # no aux loss reported (moe_aux_loss_coeff 0): no moe_lb_loss; a dense model: nothing
    assert set(moe_metrics({"moe_tokens_per_expert": rec["moe_tokens_per_expert"]}, MOE_MICRO)) == \
        {"moe_max_load", "moe_dropped_tokens"}
    assert moe_metrics({"loss": 1.0}, dataclasses.replace(MOE_MICRO, num_experts=None)) == {}


def _train_cfg(out: Path, *overrides: str):
    """A 2-step CPU run of the composed config with ``overrides`` (no checkpoints, eval or sample; a fixed peak)."""
    from hydra import compose, initialize_config_dir

    from forgetrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = to_run_config(compose(config_name="config", overrides=list(overrides)))
    return dataclasses.replace(
        c, train=dataclasses.replace(c.train, steps=2, micro_batch_size=2, global_batch_size=4, lr_warmup_steps=1,
                                     save=False, sample_tokens=0, eval_interval=0, out_dir=str(out)),
        hardware=dataclasses.replace(c.hardware, peak_tflops=1.0), logger=dataclasses.replace(c.logger, name="wandb"))


class _FakeWandb:
    """Stands in for forgetrain.metrics.WandbLogger: keeps what each step logs."""
    logged: list = []

    def __init__(self, *args, **kwargs):
        self.run = type("R", (), {"id": "fake", "url": "-"})()
        _FakeWandb.logged = []

    def log(self, metrics, step):
        _FakeWandb.logged.append((step, metrics))

    def finish(self):
        pass


def _last_postfix(err: str) -> dict[str, str]:
    """The key=value fields of the progress bar's last drawing of step 2/2."""
    post = re.findall(r"\| 2/2 \[([^\]]*)\]", err)  # [elapsed<left, rate, key=value, ...]
    assert post, err[-2000:]
    return dict(kv.split("=", 1) for kv in post[-1].split(", ") if "=" in kv)


@pytest.mark.parametrize("model", ["moe", "dense"])
def test_progress_line_and_wandb_show_moe_metrics_for_moe_only(tmp_path, capsys, monkeypatch, model):
    from forgetrain.metrics import MOE_METRIC_KEYS, moe_metrics, moe_progress_fields
    from forgetrain.run import phases
    from forgetrain.train import train
    from tests.helpers import records

    monkeypatch.setattr(phases, "WandbLogger", _FakeWandb)
    over = ["scenario=qwen3_moe_tiny_cpu", "model=qwen3_moe_micro"] if model == "moe" else ["model=llama_micro"]
    c = _train_cfg(tmp_path / "run", *over)
    train(c, progress=True)
    shown = _last_postfix(capsys.readouterr().err)
    last = records(tmp_path / "run")[-1]
    logged = dict(_FakeWandb.logged)[2]
    if model == "dense":
        assert "loss" in shown and not [k for k in shown if k.startswith("moe")], shown
        assert not [k for k in logged if k.startswith("moe")], logged
        return
    want = moe_metrics(last, c.model)
    assert set(want) == set(MOE_METRIC_KEYS) and want["moe_dropped_tokens"] == 0  # dropless
    assert 1.0 <= want["moe_max_load"] <= c.model.num_experts / c.model.moe_router_topk
    assert {k: shown[k] for k in MOE_METRIC_KEYS} == moe_progress_fields(want), shown
    assert {k: logged[k] for k in MOE_METRIC_KEYS} == want
    assert logged["moe_tokens_per_expert"] == last["moe_tokens_per_expert"]


def _moe_run(n_layers: int = 2, n_experts: int = 4) -> dict:
    """:func:`tests.equivalence_helpers.base_run` with a mixture of experts' routing statistics in every record."""
    from tests.equivalence_helpers import base_run

    run = base_run()
    for r in run["records"]:
        s = r["step"]
        r["moe_tokens_per_expert"] = [[64 + (s + i + e) % 3 - 1 for e in range(n_experts)] for i in range(n_layers)]
        r["moe_load_balancing_loss"] = [1.0 + 0.01 * s + 0.001 * i for i in range(n_layers)]
    return run


def _judge(tmp_path, mutate=None, ref_mutate=None):
    import copy

    from forgetrain.equivalence import bitwise
    from tests.equivalence_helpers import write_run

    run = _moe_run()
    ref, cand = copy.deepcopy(run), copy.deepcopy(run)
    for m, r in ((ref_mutate, ref), (mutate, cand)):
        if m is not None:
            m(r)
    return bitwise(write_run(tmp_path / "ref", ref), write_run(tmp_path / "cand", cand))


def test_bitwise_compares_moe_routing_exactly(tmp_path):
    import math

    ok = _judge(tmp_path / "ok")
    assert ok.passed and "MoE routing" in ok.summary
    assert ok.evidence["moe"]["steps_compared"] == {"moe_tokens_per_expert": 6, "moe_load_balancing_loss": 6}

    def moved(run):  # step 4, layer 1: one token moved between experts; loss, grads and params all equal
        tpe = run["records"][3]["moe_tokens_per_expert"][1]
        tpe[0], tpe[2] = tpe[0] - 1, tpe[2] + 1
    v = _judge(tmp_path / "tpe", moved)
    assert not v.passed and v.evidence["mismatch_counts"] == {"moe_tokens_per_expert": 1}
    d = v.first_divergence
    assert (d["step"], d["kind"], d["layer"]) == (4, "moe_tokens_per_expert", 1) and d["ref"] != d["cand"]
    assert "step 4 moe_tokens_per_expert layer 1" in v.summary

    def ulp(run):  # one ulp of layer 0's load-balancing loss at step 2
        lb = run["records"][1]["moe_load_balancing_loss"]
        lb[0] = math.nextafter(lb[0], math.inf)
    v = _judge(tmp_path / "lb", ulp)
    assert not v.passed and (v.first_divergence["step"], v.first_divergence["kind"]) == (2, "moe_load_balancing_loss")
    assert "step 2 moe_load_balancing_loss layer 0" in v.summary

    def nan(run):
        run["records"][0]["moe_load_balancing_loss"][1] = float("nan")
    v = _judge(tmp_path / "nan", nan, ref_mutate=nan)  # NaN on both sides never passes
    assert not v.passed and v.first_divergence["kind"] == "moe_load_balancing_loss"

    def fewer_layers(run):
        run["records"][0]["moe_tokens_per_expert"].pop()
    v = _judge(tmp_path / "layers", fewer_layers)
    assert not v.passed and v.first_divergence["kind"] == "moe_tokens_per_expert"


def test_bitwise_moe_routing_missing_from_the_candidate_fails_and_from_the_reference_is_said(tmp_path):
    def strip(run):
        for r in run["records"]:
            del r["moe_tokens_per_expert"], r["moe_load_balancing_loss"]
    v = _judge(tmp_path / "cand", strip)  # an engine that hides its routing from the judge is not judged bitwise
    assert not v.passed and not v.evidence["moe"]["compared"]
    assert "the candidate's trace lacks moe_load_balancing_loss, moe_tokens_per_expert" in " ".join(
        v.evidence["problems"]), v.evidence["problems"]
    v = _judge(tmp_path / "ref", lambda run: None, ref_mutate=strip)  # a reference that does not report them
    assert v.passed and not v.evidence["moe"]["compared"]
    assert "MoE routing NOT compared (only the candidate records moe_load_balancing_loss, moe_tokens_per_expert)" \
        in v.summary, v.summary
