"""tests/limits.py: the tests' hang limit is generous, grows with the machine's load, and rejects a bad override."""

import pytest

from tests import limits


def test_hang_limit_scales_with_load_per_core(monkeypatch):
    monkeypatch.delenv("FORGETRAIN_TEST_HANG_S", raising=False)
    monkeypatch.setattr(limits.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(limits.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert limits.hang_s() == limits.HANG_S  # an idle machine: the base, never less
    monkeypatch.setattr(limits.os, "getloadavg", lambda: (30.0, 30.0, 30.0))  # the load a 300 s limit died under
    assert limits.hang_s() == 15 * limits.HANG_S
    assert limits.HANG_S >= 1800


def test_hang_limit_override(monkeypatch):
    monkeypatch.setattr(limits.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setenv("FORGETRAIN_TEST_HANG_S", "60")
    assert limits.hang_s() == 60.0


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "soon"])
def test_hang_limit_rejects_a_bad_override(monkeypatch, bad):
    monkeypatch.setenv("FORGETRAIN_TEST_HANG_S", bad)
    with pytest.raises(ValueError, match="FORGETRAIN_TEST_HANG_S"):
        limits.hang_s()
