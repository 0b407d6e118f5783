"""Equivalence tiers and the ladder: compare a candidate's trace with the reference's and write a verdict.

Strictest first (the order and each tier's kind: :mod:`forgetrain.equivalence.registry`):

* :func:`bitwise`    -- every step's loss, grad norm and lr equal (``==``); per-step digests of the per-token
  losses, every gradient and every parameter equal; module and final-parameter tensors equal when present.
* :func:`tolerance`  -- per-step relative error of loss / grad norm / lr and the final parameters' relative L2
  error within per-dtype thresholds (``conf/tier/tolerance.yaml``).
* :func:`loss_curve` -- the candidate's windowed loss stays inside a band calibrated from >= 3 reference seeds,
  with no late drift.
* :func:`surpass`    -- an equivalence verdict passed, and the candidate's throughput beats the reference's by
  more than the measured noise.

Each tier's rules are in its module under :mod:`forgetrain.equivalence.tiers`; what they share (the
:class:`Verdict`, :func:`load_tier`) in :mod:`forgetrain.equivalence.verdict`; :func:`ladder` runs a list of tiers
over given traces; :mod:`forgetrain.equivalence.report` writes the outputs. The thresholds and their rationale live
in ``conf/tier/*.yaml``.
"""

from forgetrain.equivalence.ladder import LadderResult, ladder
from forgetrain.equivalence.registry import EQUIVALENCE_TIERS, TIER_ORDER, Tier
from forgetrain.equivalence.report import format_verdict_table, print_verdict_table, write_report
from forgetrain.equivalence.tiers.bitwise import bitwise
from forgetrain.equivalence.tiers.loss_curve import loss_curve, t_quantile
from forgetrain.equivalence.tiers.surpass import surpass
from forgetrain.equivalence.tiers.tolerance import tolerance
from forgetrain.equivalence.verdict import Verdict, describe_divergence, load_tier

__all__ = ["EQUIVALENCE_TIERS", "TIER_ORDER", "LadderResult", "Tier", "Verdict", "bitwise", "describe_divergence",
           "format_verdict_table", "ladder", "load_tier", "loss_curve", "print_verdict_table", "surpass",
           "t_quantile", "tolerance", "write_report"]
