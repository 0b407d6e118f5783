"""``engine.compile_tuning``: one switch for the inductor options of every ``torch.compile`` a forged engine makes
(the blocks, the recomputed layers, the chunked cross-entropy). Its effect is on the GPU's generated kernels; here:
the values and modes it accepts, that inductor knows its option keys, and that every compile site receives them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgetrain.config import COMPILE_TUNINGS, EngineOptions, KernelsConfig, inductor_options, validate
from forgetrain.errors import ConfigError
from scenarios.llama1b_h200 import fast
from scenarios.llama1b_h200.engine import Engine as Hopper
from tests.helpers import ladder_cfg as _cfg


def _with_engine(**engine) -> object:
    c = _cfg()
    return dataclasses.replace(c, engine=EngineOptions(**engine), kernels=KernelsConfig(cross_entropy="chunked"))


def test_values_and_modes():
    ok = validate(_with_engine(mode="fast", compile=True, compile_tuning="coordinate_descent"), engine_cls=Hopper)
    assert ok.engine.compile_tuning == "coordinate_descent"
    with pytest.raises(ConfigError, match=r"engine.compile_tuning must be none\|coordinate_descent, got 'fastest'"):
        validate(_with_engine(mode="fast", compile_tuning="fastest"), engine_cls=Hopper)
    with pytest.raises(ConfigError, match="needs engine.mode=fast .*drop engine.compile_tuning"):
        validate(_with_engine(mode="exact", compile_tuning="coordinate_descent"), engine_cls=Hopper)


@pytest.mark.parametrize("tuning", sorted(COMPILE_TUNINGS))
def test_inductor_knows_every_option_key(tuning):
    """torch.compile checks ``options`` against inductor's config when it is called: an unknown key raises."""
    opts = inductor_options(EngineOptions(mode="fast", compile_tuning=tuning))
    assert (opts is None) == (tuning == "none")
    torch.compile(lambda x: x + 1, options=opts)  # not run: the check is at the call
    with pytest.raises(RuntimeError):
        torch.compile(lambda x: x + 1, options={"no_such_inductor_option": True})


@pytest.fixture
def compiled(monkeypatch):
    """torch.compile recorded and bypassed: (fn, options) per call."""
    calls = []

    def record(fn, *a, options=None, **kw):
        calls.append((fn, options))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    monkeypatch.setattr(fast, "_ce_chunk_compiled", {})
    return calls


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_every_compile_site_gets_the_options(compiled, monkeypatch, recompute):
    want = {"coordinate_descent_tuning": True}
    eng = Hopper(_with_engine(mode="fast", compile=True, compile_tuning="coordinate_descent", recompute=recompute,
                              ce_chunk_tokens=24), "cpu")
    n_layers = len(eng.model.layers)
    assert len(compiled) == n_layers and all(o == want for _, o in compiled)  # the blocks or the layer runner
    # the chunked cross-entropy compiles on CUDA only; its cache is keyed by the options
    f1 = fast._ce_fn(torch.device("cuda"), want)
    f0 = fast._ce_fn(torch.device("cuda"), None)
    assert fast._ce_fn(torch.device("cuda"), dict(want)) is f1
    assert compiled[n_layers:] == [(fast._ce_chunk, want), (fast._ce_chunk, None)] and f0 is fast._ce_chunk
    # the model's chunked CE hands the engine's options to it
    seen = []
    monkeypatch.setattr(fast, "_ce_fn",
                        lambda device, options=None, kernel="torch": seen.append(options) or fast._ce_chunk)
    eng.train_step([torch.randint(0, eng.model.cfg.vocab_size, (2, 33)) for _ in range(2)])
    assert seen and all(o == want for o in seen)
