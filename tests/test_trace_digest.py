"""The step digests of the bitwise tier: :func:`forgetrain.trace.tensor_digest` keeps the exact values it has
always had (the stored goldens hold them), and :func:`forgetrain.trace.tensor_digests` (the threaded form the
training loop uses) returns the same values."""
import hashlib

import pytest
import torch

from forgetrain.trace import tensor_digest, tensor_digests


def _spec_digest(t: torch.Tensor) -> str:
    """The digest as first defined (2026-11): ``t + 0.0``, bf16 as int16, sha256 of dtype, shape and bytes."""
    t = t.detach()
    if t.is_floating_point():
        t = t + 0.0
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = t.contiguous().cpu().numpy()
    h = hashlib.sha256()
    h.update(f"{a.dtype}:{tuple(a.shape)}:".encode())
    h.update(a.tobytes())
    return h.hexdigest()[:16]


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(33, 17, generator=g)
    w[0, :5] = -0.0
    return {
        "fp32": w,
        "bf16": w.to(torch.bfloat16),
        "fp16": w.to(torch.float16),
        "fp64": w.double(),
        "transposed": w.t(),
        "strided": w[::2, 1::3],
        "scalar": torch.tensor(-0.0),
        "empty": torch.empty(0, 4),
        "int64": torch.arange(-5, 12).view(1, 17),
        "bool": w > 0,
        "big": torch.randn(1 << 20, generator=g),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_digest_is_the_stored_definition(name):
    t = _cases()[name]
    assert tensor_digest(t) == _spec_digest(t)


def test_negative_zero_hashes_as_positive_zero_and_the_input_is_untouched():
    t = torch.tensor([-0.0, 1.0])
    assert tensor_digest(t) == tensor_digest(torch.tensor([0.0, 1.0]))
    assert torch.signbit(t[0])  # the canonicalisation ran on a copy


def test_digest_tells_values_dtype_and_shape_apart():
    w = _cases()["fp32"]
    nudged = w.clone()
    nudged[3, 3] = torch.nextafter(nudged[3, 3], torch.tensor(float("inf")))
    assert tensor_digest(nudged) != tensor_digest(w)  # one ulp
    assert tensor_digest(w.reshape(17, 33)) != tensor_digest(w)
    assert tensor_digest(w.double()) != tensor_digest(w)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_threaded_digests_equal_one_by_one(workers):
    named = _cases()
    assert tensor_digests(named, workers=workers) == {k: tensor_digest(v) for k, v in named.items()}
    assert list(tensor_digests(named, workers=workers)) == list(named)  # the caller's order
