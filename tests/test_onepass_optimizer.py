"""The one-pass optimizer step of the fast Hopper engine (``engine.onepass_optimizer``, with ``kernels.adamw=triton``).

Claim (``scenarios/llama1b_h200/optimisations.yaml``): the same arithmetic as the clip pass, the Triton AdamW kernel
and the fp32 -> bf16 copy, done in one pass. So on CPU (Triton interpreter) it must be **bitwise** equal to
``kernels.adamw=triton`` without it, in fp32 and in bf16, with clipping active on every step (``train.clip_grad``
far below the grad norm); a kernel that ignores the clip coefficient must not be. Its end-to-end tolerance verdict
against Megatron-core is in ``tests/test_fast_tiers.py`` (the ``triton_onepass`` switch).
Each case runs in its own process: ``TRITON_INTERPRET=1`` must be set before triton is imported.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs triton")


def _run(code: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=hang_s())
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_onepass_is_bitwise_the_separate_passes(precision):
    assert _run(f"from tests.switch_helpers import compare_onepass; compare_onepass({precision!r})") == "same"


def test_a_kernel_that_ignores_the_clip_coefficient_is_caught():
    out = _run("from tests.switch_helpers import compare_onepass; compare_onepass('bf16', drop_scale=True)")
    assert out.startswith("differ at step 1"), out


def test_kernel_grad_scale_equals_scaling_the_grads():
    code = """
import torch
from forgetrain.kernels import adamw_step
g0 = torch.Generator().manual_seed(1)
shapes = [(33, 7), (100,), (64, 48)]
def state():
    g = torch.Generator().manual_seed(2)
    w = [torch.randn(*s, generator=g) for s in shapes]
    return ([x.to(torch.bfloat16) for x in w], [torch.randn(*s, generator=g) * 1e-2 for s in shapes],
            [torch.zeros(*s) for s in shapes], [torch.zeros(*s) for s in shapes], w)
c = torch.tensor([0.37])
p1, g1, m1, v1, w1 = state(); p2, g2, m2, v2, w2 = state()
adamw_step(p1, g1, m1, v1, w1, step=3, lr=1e-3, beta2=0.95, wd=0.1, grad_scale=c)
adamw_step(p2, [g * c for g in g2], m2, v2, w2, step=3, lr=1e-3, beta2=0.95, wd=0.1)
same = all(torch.equal(x, y) for a, b in ((p1, p2), (m1, m2), (v1, v2), (w1, w2)) for x, y in zip(a, b))
untouched = all(torch.equal(a, b) for a, b in zip(g1, g2))
for bad in (torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.5, 0.5])):
    try:
        adamw_step(p1, g1, m1, v1, w1, step=3, lr=1e-3, grad_scale=bad)
        print("accepted a bad grad_scale"); raise SystemExit
    except ValueError:
        pass
print("ok" if same and untouched else f"same={same} grads_untouched={untouched}")
"""
    assert _run(code) == "ok"


def test_onepass_needs_fast_triton_and_no_zero():
    from forgetrain.config import validate
    from forgetrain.errors import ConfigError
    from scenarios.llama1b_h200.engine import Engine as Hopper
    from tests.helpers import fast_cfg

    # The tiny default scenario honours no kernel switch: the check is of the Hopper engine that runs this option.
    for kernels, engine in (({"adamw": "fused"}, {}), ({"adamw": "triton"}, {"mode": "exact"})):
        c = fast_cfg(kernels, {"onepass_optimizer": True})
        c = dataclasses.replace(c, engine=dataclasses.replace(c.engine, **engine))
        with pytest.raises(ConfigError, match="engine.onepass_optimizer=true needs"):
            validate(c, engine_cls=Hopper)
    validate(fast_cfg({"adamw": "triton"}, {"onepass_optimizer": True}), engine_cls=Hopper)
