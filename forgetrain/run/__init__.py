"""One training run, in pieces (:func:`forgetrain.train.train` runs them in order): :mod:`.identity` (what a run
is: its config hash, engine settings, versions), :mod:`.outdir` (the output directory: lock, claim, disk check,
config record), :mod:`.phases` (setup, sinks, finish), :mod:`.resume` (continuing a run) and :mod:`.loop` (the
steps). Nothing is imported here, so that importing one piece loads only what it needs."""
