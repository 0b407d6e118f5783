"""The paired loss-curve test against the live Megatron reference on CPU: a candidate from each reference seed's
init and batches, judged by the equivalence test of conf/tier/loss_curve.yaml (paired), beside the unpaired band.

llama_micro, 3 seeds x 80 steps at lr 1e-3 (4 windows of 20): the forged CPU engine mirrors the reference to
the bit, so its paired differences are zero; a learning rate x0.9 lags by about 1.6% of the late loss.
"""

import copy
import dataclasses

import numpy as np
import pytest

from forgetrain import equivalence as eq
from forgetrain import verify as V
from forgetrain.equivalence import inits
from forgetrain.equivalence.verdict import tier_config
from forgetrain.errors import ConfigError
from scenarios.llama_tiny_cpu.engine import Engine
from tests.helpers import ladder_cfg as _cfg

STEPS, SEEDS = 80, [1234, 1235, 1236]


def _curve_cfg():
    c = _cfg()
    return dataclasses.replace(c, train=dataclasses.replace(
        c.train, micro_batch_size=4, global_batch_size=8, lr_warmup_steps=10, lr=1e-3, min_lr=1e-4, steps=STEPS))


def _vcfg(**kw):
    return V.VerifyConfig(**{"curve_steps": STEPS, "seeds": SEEDS, "digests": False, **kw})


class LrTimes09(Engine):
    """A planted regression: the learning rate (and its floor) x0.9."""

    def __init__(self, cfg, device):
        cfg = copy.deepcopy(cfg)
        cfg.train = dataclasses.replace(cfg.train, lr=cfg.train.lr * 0.9, min_lr=cfg.train.min_lr * 0.9)
        super().__init__(cfg, device)


class NoisyLoss(Engine):
    """An honest engine whose reported loss carries added noise (sd 0.3 nats a step, seeded)."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self._rng = np.random.default_rng(cfg.train.seed)

    def train_step(self, micro_batches):
        r = super().train_step(micro_batches)
        r.loss = float(r.loss + self._rng.normal(0.0, 0.3))
        return r


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The reference seeds' traces and exported inits (live runs)."""
    out = tmp_path_factory.mktemp("paired_refs")
    return V._curve_references(_curve_cfg(), _vcfg(), out, V.curve_golden_dir(_curve_cfg(), _vcfg()))


def _judge(live, tmp_path, engine_cls):
    refs, inits = live
    runs = V.curve_candidate_runs(_curve_cfg(), _vcfg(), tmp_path, inits, engine_cls)
    assert len(runs.paired) == 3 and len(runs.unpaired) == 3
    return V.judge("loss_curve", tier_config("loss_curve", "megatron"), refs, runs)[-1]


def test_honest_engine_passes_paired_with_zero_difference(live, tmp_path):
    v = _judge(live, tmp_path, None)
    assert v.passed, v.summary
    pe = v.evidence["paired"]
    assert pe["late_diff_per_seed"] == [0.0, 0.0, 0.0] and v.evidence["mode"] == "paired+unpaired"


def test_lr_times_09_fails_paired_while_the_unpaired_band_passes_it(tmp_path):
    """Through verify itself (live reference runs, then 3 paired and 3 unpaired candidate runs)."""
    v = V.verify(_curve_cfg(), _vcfg(), "loss_curve", tmp_path, engine_cls=LrTimes09)[-1]
    assert not v.passed, v.summary
    pe = v.evidence["paired"]
    assert not pe["late_inside"] and pe["ci"][0] > pe["delta"] > 0, v.summary  # lags: higher loss, beyond +delta
    assert v.evidence["unpaired"]["passed"] and v.evidence["drift"]["passed"], v.summary
    assert "paired: FAIL" in v.summary and "unpaired: pass" in v.summary
    assert (tmp_path / "verdict.json").is_file() and not list(tmp_path.rglob("init.safetensors"))


def test_added_loss_noise_does_not_pass_more_easily(live, tmp_path):
    honest = _judge(live, tmp_path / "honest", None)
    noisy = _judge(live, tmp_path / "noisy", NoisyLoss)
    assert honest.passed and not noisy.passed, noisy.summary
    assert noisy.evidence["paired"]["ci_half_width"] > honest.evidence["paired"]["ci_half_width"]
    assert noisy.evidence["unpaired"]["passed"]  # the band alone would have taken it


def test_golden_stores_init_hashes_and_a_changed_hash_is_refused_in_one_line(golden_root, tmp_path):
    import json

    cfg = _curve_cfg()
    V.verify(cfg, _vcfg(make_golden=True), "loss_curve", tmp_path / "g")
    gdir = V.curve_golden_dir(cfg, _vcfg())
    for s in SEEDS:
        info = json.loads((gdir / f"seed_{s}" / "init.json").read_text())
        assert len(info["sha256"]) == 64 and info["n_params"] > 0
    assert info["sha256"] == inits.init_sha256(inits.reference_init(cfg, _vcfg(), SEEDS[-1]))  # rebuilt from the seed
    cache = tmp_path / "inits"
    v = V.verify(cfg, _vcfg(golden=True, candidate_seeds=[], init_cache=str(cache)), "loss_curve", tmp_path / "j")[-1]
    assert v.passed and v.evidence["mode"] == "paired", v.summary
    assert len(list(cache.rglob("*.safetensors"))) == 3
    f = gdir / "seed_1235" / "init.json"
    f.write_text(json.dumps(dict(json.loads(f.read_text()), sha256="0" * 64)))
    with pytest.raises(ConfigError) as e:
        V.verify(cfg, _vcfg(golden=True, candidate_seeds=[]), "loss_curve", tmp_path / "bad")
    assert "seed 1235" in str(e.value) and "sha256" in str(e.value) and "\n" not in str(e.value)
    assert not list((tmp_path / "bad").glob("candidate*"))  # every hash is checked before any candidate runs
    assert not list((tmp_path / "g").rglob("*.safetensors"))  # the golden's maker keeps the hashes, not weights


def test_golden_without_init_hashes_is_judged_unpaired_or_pinned(golden_root, tmp_path, capsys):
    cfg = _curve_cfg()
    V.verify(cfg, _vcfg(make_golden=True), "loss_curve", tmp_path / "g")
    gdir = V.curve_golden_dir(cfg, _vcfg())
    for s in SEEDS:
        (gdir / f"seed_{s}" / "init.json").unlink()
    v = V.verify(cfg, _vcfg(golden=True), "loss_curve", tmp_path / "u")[-1]
    assert v.evidence["mode"] == "unpaired" and "judged unpaired only" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="verify.paired=true: .*pin_init"):
        V.verify(cfg, _vcfg(golden=True, paired=True), "loss_curve", tmp_path / "p")
    assert V.verify(cfg, _vcfg(golden=True, pin_init=True), "loss_curve", tmp_path / "pin") == []
    v = V.verify(cfg, _vcfg(golden=True, candidate_seeds=[]), "loss_curve", tmp_path / "paired")[-1]
    assert v.passed and v.evidence["mode"] == "paired", v.summary


@pytest.mark.parametrize("kw, match", [
    ({"candidate_seeds": [1234, 9, 10]}, "reference seeds too"),
    ({"candidate_seeds": [9, 10]}, ">= 3 candidate seeds"),
    ({"candidate_seeds": [9, 9, 10]}, "distinct integers"),
    ({"candidate_seeds": [-1, -2, -3]}, "distinct integers in"),
    ({"seeds": [1234, 1234, 1235]}, "verify.seeds must be distinct"),  # one run counted twice as independent
    ({"paired": False, "candidate_seeds": []}, "no candidate run"),
    ({"pin_init": True}, "pin_init=true records"),
    ({"init_cache": "/proc/forbidden/x"}, "cannot be written"),
])
def test_curve_requests_that_cannot_be_judged_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        V._check_request(_vcfg(**kw), V._tier("loss_curve"))


def test_surpass_refuses_an_unpaired_only_request():
    with pytest.raises(ConfigError, match="rests on the paired loss_curve"):
        V._check_request(_vcfg(paired=False), V._tier("surpass"))


def test_pin_init_refuses_before_pinning_any_seed(golden_root, tmp_path):
    import json

    cfg = _curve_cfg()
    V.verify(cfg, _vcfg(make_golden=True), "loss_curve", tmp_path / "g")
    gdir = V.curve_golden_dir(cfg, _vcfg())
    for s in SEEDS:
        (gdir / f"seed_{s}" / "init.json").unlink()
    meta = gdir / "seed_1236" / "trace" / "meta.json"
    m = json.loads(meta.read_text())
    m["versions"]["torch"] = "0.0.0"
    meta.write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="torch 0.0.0"):
        V.verify(cfg, _vcfg(golden=True, pin_init=True), "loss_curve", tmp_path / "pin")
    assert not list(gdir.rglob("init.json"))


def _as_if_made_on(gdir, gpu: str, now_gpu: str, monkeypatch):
    """The golden's traces claim ``gpu``; this process claims ``now_gpu`` (the software versions kept equal)."""
    import json

    from forgetrain import train as T

    real = T.versions()
    for s in SEEDS:
        (gdir / f"seed_{s}" / "init.json").unlink()
        meta = gdir / f"seed_{s}" / "trace" / "meta.json"
        m = json.loads(meta.read_text())
        m["versions"] = {**real, "gpu": gpu, "cuda": "13.0"}
        m["versions"].pop("cpu", None)
        meta.write_text(json.dumps(m))
    monkeypatch.setattr(T, "versions", lambda: {**real, "gpu": now_gpu, "cuda": "13.0"})


def test_pin_on_another_gpu_needs_the_traces_first_step_reproduced(golden_root, tmp_path, monkeypatch):
    """Pinning on another GPU model than the golden's: each rebuilt init must reproduce its trace's step 1 (loss and
    grad norm within conf/tier/loss_curve.yaml's pin: tolerances). The right inits pin; an init that is another
    seed's (as a device whose RNG drew differently would rebuild) is refused in one line, and nothing is pinned."""
    import json

    cfg = _curve_cfg()
    V.verify(cfg, _vcfg(make_golden=True), "loss_curve", tmp_path / "g")
    gdir = V.curve_golden_dir(cfg, _vcfg())
    _as_if_made_on(gdir, "NVIDIA H200", "NVIDIA H100 80GB HBM3", monkeypatch)
    real_init = inits.reference_init
    monkeypatch.setattr(inits, "reference_init", lambda c, v, s: real_init(c, v, 1235 if s == 1236 else s))
    with pytest.raises(ConfigError) as e:
        V.verify(cfg, _vcfg(golden=True, pin_init=True), "loss_curve", tmp_path / "bad")
    msg = str(e.value)
    assert "seed 1236" in msg and "does not reproduce the trace's first step" in msg and "\n" not in msg
    assert not list(gdir.rglob("init.json"))  # a refusal pins none, not even the seeds checked before it
    monkeypatch.setattr(inits, "reference_init", real_init)
    assert V.verify(cfg, _vcfg(golden=True, pin_init=True), "loss_curve", tmp_path / "pin") == []
    info = json.loads((gdir / "seed_1236" / "init.json").read_text())
    assert "reproduced the trace's" in info["recorded"]
