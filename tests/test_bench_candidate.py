"""``bench.candidate``: a second forged engine with a few ``engine.*`` / ``kernels.*`` overrides, timed beside the
forged one in the same process (an A/B of a switch without a second process); and the CLI's did-you-mean, which
must not compose again and again for a key it cannot drop.

Speeds are benchmarks (docs/benchmarks.md), never asserted here: only who gets which config, the shared init, the
rows and the refusals.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
# the Hopper engine on CPU at the llama_micro shape, its Triton switches off (the interpreter is slow)
FAST = ["scenario=llama1b_h200", "hardware=cpu", "model=llama_micro", "kernels.adamw=torch", "kernels.swiglu=torch",
        "kernels.ce_chunk=torch",
        "engine.onepass_optimizer=false", "engine.compile=false", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.threads=1"]


def _obj(overrides: list[str]) -> dict:
    """The composed config as a plain dict, as the CLI and bench_task hand it to candidate_config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from forgetrain import bench

    bench.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="bench", overrides=overrides), resolve=True)


def test_candidate_config_applies_only_its_overrides():
    from forgetrain import bench
    from forgetrain.config import to_run_config

    obj = _obj(FAST)
    assert bench.candidate_config(obj, {}) is None
    cand = bench.candidate_config(obj, {"engine.free_qkv": True})
    base = to_run_config({k: v for k, v in obj.items() if k not in ("bench",)})
    assert cand.engine.free_qkv is True and base.engine.free_qkv is False
    assert cand.model == base.model and cand.train == base.train and cand.kernels == base.kernels
    assert obj["engine"]["free_qkv"] is False  # the composed config is not touched


@pytest.mark.parametrize("candidate", [["engine.free_qkv"], "engine.free_qkv", 5])
def test_a_candidate_that_is_not_a_dict_is_refused(candidate):
    from forgetrain import bench
    from forgetrain.errors import ConfigError

    with pytest.raises(ConfigError, match="bench.candidate must be a dict of overrides"):
        bench.candidate_config(_obj(FAST), candidate)
    assert bench.candidate_config(_obj(FAST), {}) is None and bench.candidate_config(_obj(FAST), None) is None


def test_the_configured_run_is_checked_before_the_candidate():
    """A mistake in the configured run is reported as it is, not as the candidate's."""
    from forgetrain import bench
    from forgetrain.errors import ConfigError

    obj = _obj([o for o in FAST if o != "engine.onepass_optimizer=false"])  # one-pass needs kernels.adamw=triton
    with pytest.raises(ConfigError, match="^engine.onepass_optimizer=true needs"):
        bench.candidate_config(obj, {"engine.free_qkv": True})


@pytest.mark.parametrize("key,value,match", [
    ("model.num_layers", 2, "must be <group>.<name> with group engine or kernels"),
    ("train.global_batch_size", 8, "not the workload"),
    ("engine", True, "must be <group>.<name>"),
    ("kernels.swigluu", "triton", "kernels has no 'swigluu'"),
    # values are typed by the group's schema, as a command-line override is
    ("engine.free_qkv", "maybe", "engine.free_qkv': Value 'maybe' is not a valid bool"),
    ("engine.free_qkv", {"a": True}, "is not a valid bool"),
    ("engine.free_qkv", None, "is not Optional"),
    ("engine.ce_chunk_tokens", 1.5, "could not be converted to Integer"),
    ("engine.ce_chunk_tokens", "abc", "could not be converted to Integer"),
    # a switch's needs are checked as for any run (kernels.ce_chunk=triton replaces a part of the chunked LM head)
    ("kernels.ce_chunk", "triton", "bench.candidate: .*ce_chunk"),
])
def test_candidate_config_refuses(key, value, match):
    from forgetrain import bench
    from forgetrain.errors import ConfigError

    obj = _obj([*FAST, "kernels.cross_entropy=torch"])
    with pytest.raises(ConfigError, match=match):
        bench.candidate_config(obj, {key: value})


@pytest.mark.parametrize("interleave", ["always", "never"])
def test_the_candidate_engine_gets_the_candidate_config_and_the_forged_init(monkeypatch, interleave):
    """Interleaved and in A-B-A blocks: the forged engine is built with the run's config, the candidate with its
    overrides, both from the same weights; the rows name both and the candidate's ratio is its own median over the
    forged one's."""
    import statistics

    import torch

    from forgetrain import bench, registry
    from forgetrain.config import to_run_config

    obj = _obj(FAST)
    cfg = to_run_config({k: v for k, v in obj.items() if k != "bench"})
    cand = bench.candidate_config(obj, {"engine.free_qkv": True})
    real = registry.resolve_engine
    built = []  # (free_qkv, weights right after the bench loaded its init)

    def spy(path):
        cls = real(path)

        class _Spy(cls):
            def train_step(self, batch):
                if not getattr(self, "_seen", False):
                    self._seen = True
                    built.append((self.cfg.engine.free_qkv,
                                  {k: v.clone() for k, v in self.export_hf_weights().items()}))
                return super().train_step(batch)
        return _Spy

    monkeypatch.setattr(registry, "resolve_engine", spy)
    mode, times = bench.timed_sides(cfg, [], steps=1, warmup=0, interleave=interleave, candidate=cand)
    assert mode == ("interleaved" if interleave == "always" else "sequential A-B-A")
    flags = [f for f, _ in built]
    assert flags[:2] == [False, True] and set(flags) == {False, True}, flags
    w0, w1 = built[0][1], built[1][1]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)  # the same init
    rows = {r["side"]: r for r in bench.summarize(cfg, times)}
    assert set(rows) == {"forged", "candidate"}
    assert rows["candidate"]["forged_speedup"] == pytest.approx(
        statistics.median(times["candidate"]) / statistics.median(times["forged"]))
    line = bench.candidate_line({"engine.free_qkv": True}, times)
    assert line.startswith("candidate {engine.free_qkv=true}: step_s ") and ("faster" in line or "slower" in line)


def test_candidate_line_says_faster_and_slower():
    from forgetrain import bench

    assert bench.candidate_line({"k.x": 1}, {"forged": [1.0], "candidate": [0.9]}).endswith("(10.0% faster)")
    assert bench.candidate_line({"k.x": 1}, {"forged": [1.0], "candidate": [1.2]}).endswith("(20.0% slower)")
    assert bench.candidate_line({"e.a": True, "e.b": None}, {"forged": [1.0], "candidate": [1.0]}).startswith(
        "candidate {e.a=true, e.b=null}: ")


def test_warmup_zero_is_warned_about():
    from forgetrain import bench

    assert bench.warmup_warning(bench.BenchConfig(warmup=1)) is None
    assert "first timed step includes its one-time costs" in bench.warmup_warning(bench.BenchConfig(warmup=0))


def _bench(tmp_path, *extra, timeout=None):
    return subprocess.run([sys.executable, "-m", "forgetrain.bench", *FAST, "bench.against=[]", "bench.steps=1",
                           "bench.warmup=0", *extra, f"bench.out_dir={tmp_path}"],
                          cwd=ROOT, text=True, capture_output=True, timeout=timeout or hang_s(),
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_bench_cli_times_the_candidate_and_records_it(tmp_path):
    p = _bench(tmp_path / "b", "bench.candidate={engine.free_qkv:true}", "bench.single_micro_batch=false")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert res["candidate"] == {"engine.free_qkv": True}
    assert {r["side"] for r in res["rows"]} == {"forged", "candidate"}
    assert "candidate {engine.free_qkv=true}: step_s" in p.stdout
    assert any("bench.warmup=0" in w for w in res["warnings"])  # printed and recorded


def test_bench_cli_refuses_a_workload_candidate_in_one_line(tmp_path):
    out = tmp_path / "b"
    p = _bench(out, "bench.candidate={model.num_layers:1}")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "error: bench.candidate key 'model.num_layers' must be <group>.<name>" in p.stderr + p.stdout
    assert not out.exists()


def test_did_you_mean_composes_once_for_a_key_it_cannot_drop(monkeypatch):
    """An unknown key inside a dict-valued override (``train={lrr:1e-3}``: the bad key train.lrr, the override's
    key train) is dropped with the override above it; before, the suggestion's own composition failed the same way
    and looked for a suggestion again, recursively (each composition takes seconds; the recursion took minutes)."""
    from forgetrain import bench, cli
    from forgetrain.errors import ConfigError

    bench.register()
    calls = []
    real = cli.compose_config

    def counting(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(cli, "compose_config", counting)
    with pytest.raises(ConfigError, match="did you mean train.lr"):
        cli.compose_config("bench", ["model=llama_micro", "train={lrr:1e-3}"])
    assert len(calls) == 2, calls
    calls.clear()
    with pytest.raises(ConfigError, match="did you mean train.lr"):  # the suggestion itself still works
        cli.compose_config("bench", ["model=llama_micro", "train.lrr=1e-3"])
    assert len(calls) == 2 and "train.lrr=1e-3" not in calls[1]
