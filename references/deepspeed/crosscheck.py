"""Judge one reference's trace against another's: ``python -m references.deepspeed.crosscheck [options] [overrides]``.

The two references (by default Megatron as the reference side, DeepSpeed as the candidate side) run on the same
config, the candidate from the reference's exported initial weights and on the same batches, exactly as
``forgetrain.verify`` runs a forged engine. The harness's own tiers then judge the pair: bitwise, tolerance and,
with ``--curve-steps``, loss_curve (each side calibrating a band from its own seeds, the other side run from its
own init, as ``verify`` does). Every run also records, per step, the grad norm each engine reports next to the
fp64 norm of the pre-clip gradients it exports, which separates "the gradients differ" from "the norm
arithmetic differs" (README.md, "Gradient norm").

Options: ``--ref NAME --cand NAME`` (references/ packages), ``--steps N``, ``--curve-steps N`` (0 = skip),
``--seeds a,b,c``, ``--out DIR``; everything else is a Hydra override of ``conf/config.yaml``
(e.g. ``model=llama_micro train.precision=bf16 parallel.zero_stage=2``). Writes ``<out>/crosscheck.json`` and
prints a table. Exit code 0 whatever the verdicts (this is a measurement, not a gate).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def compose(overrides: list[str]):
    """A RunConfig from conf/config.yaml plus Hydra overrides."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from forgetrain.config import register_configs, to_run_config

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_run_config(hcompose(config_name="config", overrides=list(overrides)))


def recording(engine_cls, sink: list):
    """``engine_cls`` whose train_step also appends {reported, fp64} grad norms (fp64 norm of the exported grads)."""

    class Recording(engine_cls):
        def train_step(self, micro_batches):
            res = super().train_step(micro_batches)
            grads = self.export_hf_grads()
            exact = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
            sink.append({"reported": res.grad_norm, "fp64_of_exported_grads": exact})
            return res

    Recording.__name__ = f"Recording{engine_cls.__name__}"
    return Recording


def run(cfg, name: str, out: Path, steps: int, *, init: Path | None = None, seed: int | None = None,
        digests: bool = True, norms: list | None = None) -> Path:
    """Train reference ``name`` for ``steps`` (from ``init`` if given); returns the output dir."""
    from safetensors.torch import load_file

    from forgetrain import registry
    from forgetrain.equivalence.runs import run_cfg
    from forgetrain.train import train

    over = {"steps": steps, "digests": digests}
    if seed is not None:
        over["seed"] = seed
    cls = registry.load_engine_class("references", name)
    if norms is not None:
        cls = recording(cls, norms)
    return train(run_cfg(cfg, out, **over), kind="references", engine_name=name, engine_cls=cls,
                 init_hf=load_file(str(init)) if init is not None else None, progress=False,
                 export_init=init is None)


def _norm_summary(norms: list[dict]) -> dict:
    rel = [abs(n["reported"] - n["fp64_of_exported_grads"]) / n["fp64_of_exported_grads"] for n in norms]
    return {"per_step": norms, "max_rel_reported_vs_fp64": max(rel) if rel else None}


def crosscheck(cfg, ref: str, cand: str, out: Path, steps: int, curve_steps: int, seeds: list[int]) -> dict:
    from forgetrain import equivalence as eq

    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"ref": ref, "cand": cand, "steps": steps, "precision": cfg.train.precision,
                    "model": cfg.model.name, "zero_stage": cfg.parallel.zero_stage}
    n_ref, n_cand = [], []
    r = run(cfg, ref, out / ref, steps, norms=n_ref)
    c = run(cfg, cand, out / cand, steps, init=r / "init.safetensors", norms=n_cand)
    # fp64 norms of the two sides' gradients against each other: how far the gradients themselves differ.
    grad_rel = [abs(a["fp64_of_exported_grads"] - b["fp64_of_exported_grads"]) / a["fp64_of_exported_grads"]
                for a, b in zip(n_ref, n_cand)]
    result["grad_norm"] = {ref: _norm_summary(n_ref), cand: _norm_summary(n_cand),
                           "max_rel_fp64_ref_vs_cand": max(grad_rel) if grad_rel else None}
    verdicts = [eq.bitwise(r / "trace", c / "trace", eq.load_tier("bitwise"))]
    oracle = None
    if cfg.train.precision != "fp32":
        fp32 = copy.deepcopy(cfg)
        fp32.train = dataclasses.replace(fp32.train, precision="fp32")
        oracle = run(fp32, ref, out / "oracle_fp32", steps, init=r / "init.safetensors", digests=False) / "trace"
    verdicts.append(eq.tolerance(r / "trace", c / "trace", eq.load_tier("tolerance"), oracle_dir=oracle))
    if curve_steps:
        curves = {}
        for side in (ref, cand):
            curves[side] = [run(cfg, side, out / f"curve_{side}_seed{s}", curve_steps, seed=s, digests=False) / "trace"
                            for s in seeds]
        lc = eq.load_tier("loss_curve")
        for band, other in ((ref, cand), (cand, ref)):
            v = eq.loss_curve(curves[band], curves[other][0], lc)
            v.evidence["band_from"], v.evidence["candidate"] = band, f"{other} seed {seeds[0]}"
            verdicts.append(v)
    result["verdicts"] = [{"tier": v.tier, "passed": v.passed, "summary": v.summary,
                           "first_divergence": v.first_divergence,
                           **({"metrics": v.evidence.get("metrics"),
                               "final_params": {k: v.evidence["final_params"].get(k) for k in
                                                ("total_rel_l2", "max_tensor_rel_l2", "worst_tensor")}}
                              if v.tier == "tolerance" else {}),
                           **({"band_from": v.evidence.get("band_from"), "candidate": v.evidence.get("candidate")}
                              if v.tier == "loss_curve" else {})}
                          for v in verdicts]
    strictest = next((v.tier for v in verdicts if v.passed), None)
    result["strictest_shared_tier"] = strictest
    from forgetrain.equivalence.report import jsonable

    (out / "crosscheck.json").write_text(json.dumps(jsonable(result), indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="megatron")
    ap.add_argument("--cand", default="deepspeed")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--curve-steps", type=int, default=0)
    ap.add_argument("--seeds", default="1234,1235,1236")
    ap.add_argument("--out", default="outputs/crosscheck")
    ap.add_argument("--threads", type=int, default=None)
    args, overrides = ap.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose(overrides)
    res = crosscheck(cfg, args.ref, args.cand, Path(args.out), args.steps, args.curve_steps,
                     [int(s) for s in args.seeds.split(",")])
    g = res["grad_norm"]
    print(f"{args.cand} judged against {args.ref}: {res['model']} {res['precision']} zero_stage="
          f"{res['zero_stage']}, {args.steps} steps", file=sys.stderr)
    for v in res["verdicts"]:
        extra = f" [band: {v['band_from']}, candidate: {v['candidate']}]" if v["tier"] == "loss_curve" else ""
        print(f"  {v['tier']:10s} {'PASS' if v['passed'] else 'FAIL'}  {v['summary']}{extra}", file=sys.stderr)
    print(f"  grad norm, reported vs fp64 of own exported grads (max rel): {args.ref} "
          f"{g[args.ref]['max_rel_reported_vs_fp64']:.2e}, {args.cand} {g[args.cand]['max_rel_reported_vs_fp64']:.2e};"
          f" fp64 norms {args.ref} vs {args.cand}: {g['max_rel_fp64_ref_vs_cand']:.2e}", file=sys.stderr)
    print(f"  strictest shared tier: {res['strictest_shared_tier']}   ({args.out}/crosscheck.json)", file=sys.stderr)


if __name__ == "__main__":
    main()
