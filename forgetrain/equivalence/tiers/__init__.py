"""One module per tier, each holding its runner (the function that judges traces and returns a Verdict):
:mod:`.bitwise`, :mod:`.tolerance`, :mod:`.loss_curve`, :mod:`.surpass`.

Which tiers exist, their order, their kinds and how each is run are in :mod:`forgetrain.equivalence.registry`;
the runners are re-exported by :mod:`forgetrain.equivalence`.
"""
