"""How long a test waits for a subprocess (or for a condition a subprocess brings about) before calling it hung.

A test judges results. Its time limits only catch a hang, so they must not fire on a slow machine: one run of the
suite on these 2-core machines saw load average 30 and ``tests/test_train.py::test_loss_falls_on_real_text``
killed by its fixed 300 s limit at step 3 of 40, with nothing wrong in its results. So every such limit is
:func:`hang_s`: one generous base, :data:`HANG_S`, scaled by the machine's load when the wait starts.

A limit that *is* the result (an agent killed after its ``timeout_s``, a dead peer ending a job within the
collective timeout, a killed launcher's workers gone within seconds) is not a hang-catcher and stays as it is.
"""

from __future__ import annotations

import os

# Base limit in seconds, idle machine: 30 min. The slowest single subprocess of the default run, the bad-input
# sweep (tests/test_bad_input_sweep.py, every case in one forked process), takes about 5 min on 2 idle cores;
# the slowest training subprocesses 1-3 min. 30 min is 6x the slowest, and still ends a real hang inside a CI job.
# FORGETRAIN_TEST_HANG_S=<seconds> replaces the base (e.g. a much slower machine, or a short one to debug a hang).
HANG_S = 1800.0


def hang_s() -> float:
    """The hang limit for a wait that starts now, in seconds: the base (:data:`HANG_S`, or
    ``FORGETRAIN_TEST_HANG_S``) times the machine's load per core (1-minute load average / CPU count) when that
    exceeds 1 -- a machine loaded 15x runs each subprocess about 15x slower. Raises ValueError when
    ``FORGETRAIN_TEST_HANG_S`` is not a positive number."""
    raw = os.environ.get("FORGETRAIN_TEST_HANG_S")
    try:
        base = HANG_S if raw is None else float(raw)
    except ValueError:
        base = float("nan")
    if not base > 0:  # NaN too
        raise ValueError(f"FORGETRAIN_TEST_HANG_S must be a positive number of seconds, got {raw!r}")
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        per_core = 1.0
    return base * max(1.0, per_core)
