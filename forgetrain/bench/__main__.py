"""``python -m forgetrain.bench scenario=NAME bench.against=[megatron] [bench.steps=10]``: side-by-side timing.

Every side (the forged engine first, then each reference in ``bench.against``) is built in this one process on
the same initial weights and fed the same real-token micro-batches. After ``bench.warmup`` untimed steps per side,
steps are timed interleaved (A B A B ...), each with CUDA events on the GPU (host timer on CPU), and the median
is reported with its spread (IQR); a side whose IQR exceeds :data:`NOISY_IQR_PCT` percent of its median gets a
``warning:`` line (and ``noisy`` in its row of bench.json). Output: a table of step_s, tokens_per_s, mfu_pct,
mem_gib and each side's speed ratio vs the forged engine, plus ``bench.json`` under Hydra's run directory. Models
too big to hold every side at once are timed in sequential A-B-A blocks (``bench.interleave=never``, or
``auto``'s choice), or with ``bench.interleave=once`` in one block per side, each side built once, timed at both
batches and freed before the next (:func:`once_times`). Every row carries what its side is (``label``,
:func:`side_label`).

The headline rows are the configured global batch, which should be production-like (gradient accumulation >= 8;
one warning line otherwise). With ``bench.single_micro_batch`` (default) every side is timed again at one
micro-batch per step (global batch = micro-batch x DP) and reported beside it; every row carries its
``global_batch_size`` and ``grad_accum``.

With ``bench.profile=true`` one extra, untimed step of each side (after its timed steps, at the headline batch)
runs under ``torch.profiler``: a per-category table (:data:`PROFILE_RULES`; CUDA kernel time on the GPU, self
CPU time of the ops on CPU) is printed and stored under "profile" in bench.json, and the Chrome trace is written
to ``profile_<side>.json`` beside it. Under torchrun every rank runs that step; the table and trace are rank 0's.

MFU comes from ``forgetrain.metrics`` under both of its labelled conventions (``mfu_pct``: PaLM's, attention
without causal halving; ``mfu_causal_pct``: Megatron-LM's causal one) against ``hardware.peak_tflops`` (or a
measured matmul peak on CPU) times the number of devices.

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank builds the same sides with the run's parallel layout and feeds
its data-parallel share of each global batch (Megatron's sampler order); a step's time is the slowest rank's
(all-reduce MAX per step, since the step ends when the last rank's collectives do), memory is the largest rank's,
and only rank 0 prints and writes ``bench.json``.
"""

from forgetrain.bench import main

if __name__ == "__main__":
    main()
