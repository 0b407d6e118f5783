"""Equivalence tiers and the ladder: compare a candidate's trace with the reference's and write a verdict.

See :mod:`forgetrain.equivalence.tiers` for the rules and :mod:`forgetrain.equivalence.report` for the outputs;
the thresholds and their rationale live in ``conf/tier/*.yaml``.
"""

from forgetrain.equivalence.report import format_verdict_table, print_verdict_table, write_report
from forgetrain.equivalence.tiers import (EQUIVALENCE_TIERS, TIER_ORDER, LadderResult, Verdict, bitwise,
                                          describe_divergence, ladder, load_tier, loss_curve, surpass, t_quantile,
                                          tolerance)

__all__ = ["EQUIVALENCE_TIERS", "TIER_ORDER", "LadderResult", "Verdict", "bitwise", "describe_divergence",
           "format_verdict_table", "ladder", "load_tier", "loss_curve", "print_verdict_table", "surpass",
           "t_quantile", "tolerance", "write_report"]
