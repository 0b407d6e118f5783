"""The reference's side of a ladder run, in a process of its own that never sees the candidate.

``python -m forgetrain.forge._golden --spec SPEC --out DIR`` makes every golden the spec's tiers need and that
``golden_root`` does not hold yet (:func:`missing_goldens`): for bitwise and tolerance the reference's short run
(and, below fp32, its fp32 oracle run), for loss_curve and surpass one run per reference seed
(``forgetrain.verify.verify`` with ``make_golden``). A judge's spec (one with ``drawn`` values,
:mod:`forgetrain.forge.secret`) gets its data window cut first, into the dir its ``data.path`` names, and the CPU
peak the reference's runs measured is written to ``golden_root/peak.json`` for the candidate's config.
``--time-steps N --times F`` times the reference and the surpass tier's peers instead
(the B block of surpass's process-separated A-B-A timing; :func:`forgetrain.bench.time_engine`).

The ladder process starts this before any candidate process, so a golden is never made by a process that also
runs the candidate. The reference's run dirs under ``DIR`` are deleted once stored. Exit 0 on success, 3 when the
reference (or its configuration) failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import traceback
from pathlib import Path

def is_pair(tier: str) -> bool:
    """Whether ``tier`` is a pair tier (one short reference run, its own golden) in the tier registry."""
    from forgetrain.equivalence import registry

    return registry.find(tier).kind == registry.PAIR


def curve_tier_of(tier: str) -> str:
    """The curve tier whose seeds' golden ``tier`` (a curve or speed tier) is judged against: itself, or the
    curve tier a speed tier rests on."""
    from forgetrain.equivalence import registry

    t = registry.find(tier)
    return t.name if t.kind == registry.CURVE else t.rests_on


def golden_tiers(spec: dict) -> list[str]:
    """The tiers whose goldens a ladder run of ``spec`` needs: each pair tier it tries, and the curve tier of each
    curve or speed tier it tries (one golden serves a curve tier and the speed tier resting on it)."""
    out = []
    for t in spec["tiers"]:
        g = t if is_pair(t) else curve_tier_of(t)
        if g not in out:
            out.append(g)
    return out


def golden_location(rc, vcfg, tier: str) -> Path:
    """Where the golden of ``tier`` lives under ``forgetrain.verify.GOLDEN_ROOT`` (set to the spec's
    ``golden_root`` by the caller)."""
    import forgetrain.verify as fv

    return fv.golden_dir(rc, tier) if is_pair(tier) else fv.curve_golden_dir(rc, vcfg)


def missing_goldens(rc, vcfg, spec: dict) -> list[str]:
    """The tiers of :func:`golden_tiers` whose golden is absent or incomplete."""
    out = []
    for tier in golden_tiers(spec):
        g = golden_location(rc, vcfg, tier)
        if is_pair(tier):
            from forgetrain.equivalence import registry

            need = [g / "trace" / "trace.jsonl", g / "init.safetensors"]
            if registry.find(tier).oracle and rc.train.precision != "fp32":
                need.append(g / "oracle_fp32" / "trace" / "trace.jsonl")
        else:
            need = [g / f"seed_{s}" / "trace" / "trace.jsonl" for s in vcfg.seeds]
        if not all(p.is_file() for p in need):
            out.append(tier)
    return out


def _write_peak(rc, golden_root: Path) -> None:
    """``golden_root/peak.json``: the CPU matmul peak the reference's runs used (none for a GPU or a datasheet
    peak), so that the candidate's run divides by the same value without touching the shared peak cache."""
    if rc.hardware.device != "cpu" or rc.hardware.peak_tflops:
        return
    import torch

    from forgetrain.metrics import measured_cpu_peak_flops
    from forgetrain.trace import atomic_write_json

    if rc.train.threads:
        torch.set_num_threads(rc.train.threads)
    atomic_write_json(golden_root / "peak.json", {"peak_tflops": measured_cpu_peak_flops() / 1e12,
                                                   "label": "measured CPU matmul peak (the reference's side)"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m forgetrain.forge._golden", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True, help="scratch dir of the reference's runs")
    ap.add_argument("--time-steps", type=int, default=0)
    ap.add_argument("--times", default=None, help="with --time-steps: where to write the step seconds (JSON)")
    a = ap.parse_args(argv)
    try:
        import forgetrain.verify as fv
        from forgetrain.cli import quiet_libraries
        from forgetrain.config import to_run_config
        from forgetrain.trace import atomic_write_json

        quiet_libraries()
        spec = json.loads(Path(a.spec).read_text())
        rc, vcfg = to_run_config(spec["run_config"]), fv.VerifyConfig(**spec["verify"])
        fv.GOLDEN_ROOT = Path(spec["golden_root"])  # this process only: the forge run's goldens
        out = Path(a.out).resolve()
        if a.time_steps:
            from forgetrain import registry
            from forgetrain.bench import time_engine

            from forgetrain.bench.sides import make_side, side_config
            from forgetrain.equivalence.tiers.surpass import peers_for
            from forgetrain.equivalence.verdict import tier_config

            ref_cls = registry.load_engine_class("references", vcfg.reference)
            peers = peers_for(tier_config("surpass", vcfg.reference),
                              fp8=str(getattr(rc.engine, "fp8", "none")) != "none")
            times = {"reference": time_engine(rc, ref_cls, a.time_steps),
                     "peers": {p: time_engine(rc, lambda c, d, p=p: make_side(p, side_config(c, None), d),
                                              a.time_steps) for p in peers}}
            atomic_write_json(Path(a.times), times)
            return 0
        if spec.get("drawn") and spec.get("source_data"):
            from forgetrain.forge.secret import build_window

            window = Path(spec["run_config"]["data"]["path"]).parent
            if not (window / "manifest.json").is_file():
                build_window(spec, window)
        for tier in missing_goldens(rc, vcfg, spec):
            print(f"[golden] making the {tier} golden at {golden_location(rc, vcfg, tier)}", file=sys.stderr,
                  flush=True)
            fv.verify(rc, dataclasses.replace(vcfg, make_golden=True), tier, out / tier)
            shutil.rmtree(out / tier, ignore_errors=True)
        _write_peak(rc, fv.GOLDEN_ROOT)
        return 0
    except Exception:  # noqa: BLE001 - the ladder reports it
        traceback.print_exc()
        return 3


if __name__ == "__main__":
    sys.exit(main())
