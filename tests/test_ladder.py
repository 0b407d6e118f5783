"""The forged engine against the live Megatron-core reference on CPU, and every mutant rejected at the right place.

The reference runs once per test run (``ref`` fixture); each candidate is judged against its trace.
Shapes: llama_micro (2 layers, width 64, GQA 4/2), micro-batch 2 x grad-accum 2, clipping active.
"""

from pathlib import Path

import pytest

from forgetrain import equivalence as eq
from forgetrain.config import to_run_config
from forgetrain.engine import forward_names
from forgetrain.verify import VerifyConfig, run_candidate, run_reference
from tests.mutants import EXPECTED
from tests.helpers import ladder_cfg as _cfg

ROOT = Path(__file__).resolve().parent.parent


STEPS = 4


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return run_reference(_cfg(), VerifyConfig(steps=STEPS), out, STEPS)


def _cand(ref_out, tmp_path, engine_cls=None, resume_at=None, cfg=None):
    v = VerifyConfig(steps=STEPS, resume_at=resume_at)
    return run_candidate(cfg or _cfg(), v, tmp_path / "cand", STEPS, ref_out / "init.safetensors", engine_cls)


def test_forged_matches_reference_bitwise(ref, tmp_path):
    v = eq.bitwise(ref / "trace", _cand(ref, tmp_path) / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary
    ev = v.evidence
    assert ev["digests"]["compared"] and ev["modules"]["compared"] and ev["final_params"]["compared"]
    # the forged engine's own clipped grads equal those derived for the reference (Megatron's clip arithmetic)
    assert ev["digests"]["clipped_grads_steps"] == STEPS


def test_resume_matches_reference_bitwise(ref, tmp_path):
    v = eq.bitwise(ref / "trace", _cand(ref, tmp_path, resume_at=2) / "trace", eq.load_tier("bitwise"))
    assert v.passed, v.summary


@pytest.mark.parametrize("mutant", list(EXPECTED), ids=lambda m: m.__name__)
def test_bitwise_rejects_mutant_at_the_right_place(mutant, ref, tmp_path):
    kind, where, step = EXPECTED[mutant]
    v = eq.bitwise(ref / "trace", _cand(ref, tmp_path, mutant) / "trace", eq.load_tier("bitwise"))
    assert not v.passed
    fd = v.first_divergence
    assert fd["kind"] == kind and fd["step"] == step, fd
    if where:
        assert fd.get("module", fd.get("tensor")) == where, fd
    if kind == "module_grad":  # the output gradient of the module named: computed by the next one's backward
        names = list(forward_names(2))
        assert fd["produced_by"] == (names + ["loss"])[names.index(where) + 1], fd


@pytest.mark.parametrize("mutant", list(EXPECTED), ids=lambda m: m.__name__)
def test_tolerance_rejects_mutant(mutant, ref, tmp_path):
    v = eq.tolerance(ref / "trace", _cand(ref, tmp_path, mutant) / "trace", eq.load_tier("tolerance"))
    assert not v.passed, v.summary
    assert v.first_divergence is not None


def test_tolerance_accepts_a_reordered_reduction(ref, tmp_path):
    """A correct engine whose grad norm is summed in another order: not bitwise, but within fp32 tolerance."""
    from scenarios.llama_tiny_cpu.engine import Engine

    class Reordered(Engine):
        def _norm_order(self):
            return list(reversed(super()._norm_order()))

    cand = _cand(ref, tmp_path, Reordered) / "trace"
    assert not eq.bitwise(ref / "trace", cand, eq.load_tier("bitwise")).passed  # the change is real
    v = eq.tolerance(ref / "trace", cand, eq.load_tier("tolerance"))
    assert v.passed, v.summary


@pytest.fixture(scope="module")
def ref_bf16(tmp_path_factory):
    """bf16 Megatron reference plus its fp32 oracle run from the same (bf16-representable) weights."""
    from forgetrain.verify import run_candidate_ref_oracle

    out = tmp_path_factory.mktemp("ref_bf16")
    ref = run_reference(_cfg(precision="bf16"), VerifyConfig(steps=8, digests=False), out / "ref", 8)
    oracle = run_candidate_ref_oracle(_cfg(), VerifyConfig(), out / "oracle", 8, ref / "init.safetensors")
    return ref, oracle


def _bf16_cand(ref, tmp_path, engine_cls=None):
    return run_candidate(_cfg(precision="bf16"), VerifyConfig(steps=8, digests=False), tmp_path / "cand", 8,
                         ref / "init.safetensors", engine_cls)


def test_bf16_autocast_passes_tolerance(ref_bf16, tmp_path):
    ref, oracle = ref_bf16
    v = eq.tolerance(ref / "trace", _bf16_cand(ref, tmp_path) / "trace", eq.load_tier("tolerance"),
                     oracle_dir=oracle / "trace")
    assert v.passed, v.summary


# A 10x smaller RMSNorm epsilon moves the loss by ~2e-4 here: invisible at bf16 thresholds (fp32 tolerance and
# bitwise catch it above), so the bf16 rejection tests use defects that bf16 noise cannot hide.
@pytest.mark.parametrize("mutant", ["MissingScale", "DroppedMicroBatch", "WrongQKVPermutation"])
def test_bf16_tolerance_with_oracle_still_rejects_mutants(mutant, ref_bf16, tmp_path):
    import tests.mutants as M

    ref, oracle = ref_bf16
    v = eq.tolerance(ref / "trace", _bf16_cand(ref, tmp_path, getattr(M, mutant)) / "trace",
                     eq.load_tier("tolerance"), oracle_dir=oracle / "trace")
    assert not v.passed, v.summary


def test_default_tiny_shape_is_bitwise(tmp_path):
    """The full llama_tiny_cpu shape (8 x 128 tokens per micro-batch): many repeated tokens exercise the
    embedding-gradient accumulation order, which needs the harness's deterministic mode on CPU too."""
    from hydra import compose, initialize_config_dir

    from forgetrain.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config"))
    v = VerifyConfig(steps=2)
    ref = run_reference(cfg, v, tmp_path / "ref", 2)
    cand = run_candidate(cfg, v, tmp_path / "cand", 2, ref / "init.safetensors")
    verdict = eq.bitwise(ref / "trace", cand / "trace", eq.load_tier("bitwise"))
    assert verdict.passed, verdict.summary
