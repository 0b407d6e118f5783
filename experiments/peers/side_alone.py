"""Time one bench side alone in a fresh process, with nothing built before it, or (``--after-forged``) after the
forged engine was built, stepped and freed the way ``bench.interleave=once`` does. Both forms print the median step
time and MFU under both conventions.

The question it answers: is a side's step time in ``forgetrain.bench`` the side's own, or does the harness (the
process state a forged block leaves behind) add to it? Run both forms in one device call and compare with the same
side's row of ``bench_all_sides.sh``.

    python3 experiments/peers/side_alone.py --side torch_compile [--after-forged] [--steps 6] [--warmup 2] \
        [--profile OUT.json] -- scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 ...

Prints one ``side_alone {json}`` line: side, after_forged, step_s (median, s), step_s_all (s), mfu_pct (PaLM),
mfu_causal_pct (Megatron causal), mem_gib, and with ``--profile`` the per-category breakdown of one extra step
(``forgetrain.bench.profile``). Errors: one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_config(overrides: list[str]):
    """The RunConfig of ``python -m forgetrain.bench <overrides>`` (the bench node dropped)."""
    from omegaconf import OmegaConf

    from forgetrain import bench
    from forgetrain.cli import compose_config, precheck_overrides
    from forgetrain.config import to_run_config, validate

    bench.register()
    precheck_overrides("bench", overrides)
    obj = OmegaConf.to_container(compose_config("bench", overrides), resolve=True)
    obj.pop("bench")
    rc = to_run_config(obj)
    validate(rc, world_size=1)
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", required=True, help="a bench side: references/<name>")
    ap.add_argument("--after-forged", action="store_true", help="build, step and free the forged engine first")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", default=None, help="write one extra step's category breakdown here (JSON)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    from forgetrain.errors import ConfigError

    from forgetrain import registry

    try:
        rc = run_config(a.overrides)
        registry.load_engine_class("references", a.side)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from forgetrain.bench.profile import print_profile, profile_step
    from forgetrain.bench.sides import make_side, side_config
    from forgetrain.bench.steps import StepTimer, bench_device, step_batches
    from forgetrain.bench.timing import free_device
    from forgetrain.metrics import mfu_metrics, peak_flops

    device = bench_device(rc)
    batches = step_batches(rc, a.warmup + a.steps + 1)
    init = None
    if a.after_forged:  # what the bench's forged block leaves behind: its compile, its kernels, its allocator state
        torch.manual_seed(rc.train.seed)
        eng = registry.resolve_engine(rc.scenario.engine)(rc, device)
        init = eng.export_hf_weights()
        for b in batches[:a.warmup + a.steps]:
            eng.train_step(b)
        del eng
        free_device(device)
    torch.manual_seed(rc.train.seed)
    side = make_side(a.side, side_config(rc, None), device)
    if init is not None:
        side.load_hf_weights(init)
    del init
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i, b in enumerate(batches[:a.warmup + a.steps]):
        with StepTimer(device) as tm:
            side.train_step(b)
        if i >= a.warmup:
            times.append(tm.s)
    med = statistics.median(times)
    peak, _ = peak_flops(rc.hardware)
    tokens = rc.train.global_batch_size * rc.model.seq_length
    out = {"side": a.side, "after_forged": a.after_forged, "step_s": med, "step_s_all": times,
           **mfu_metrics(rc.model, tokens / med, peak, 1),
           "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if a.profile:
        out["profile"] = profile_step(side, batches[-1], device)
        Path(a.profile).write_text(json.dumps(out, indent=1))
    print("side_alone " + json.dumps({k: v for k, v in out.items() if k != "profile"}))
    if a.profile:
        print_profile(a.side, out["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
