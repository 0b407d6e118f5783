"""``python -m forgetrain.verify scenario=NAME tier=bitwise|tolerance|loss_curve|surpass [verify.*]``.

Runs the golden reference and the forged engine on the same initial weights (the reference initialises and
exports them in the HF layout) and the same batches, then judges the candidate's trace against the reference's
with the requested tier. Prints a verdict table, writes ``verdict.json`` and ``loss_curves.png`` and exits 0 on a
pass, 1 on a failure (2 on bad input).

* ``verify.golden=true`` compares against the stored golden reference trace (``references/goldens/<platform>/``)
  instead of re-running the reference; ``verify.regenerate=true`` re-runs the reference and stores it;
  ``verify.make_golden=true`` only runs the reference and stores it (no candidate, no verdict). For
  ``loss_curve`` / ``surpass`` the golden is one trace per reference seed (``seed_<N>/``), keyed by the run's
  config hash without the seed, so seeds can be added to it run by run (``verify.seeds=[...]``).
* verify keeps no checkpoints: its runs save none, except the resume gate's, which is deleted afterwards;
  loss-curve runs write no final parameters either (the tier reads only the loss curve).
* ``verify.resume_at=K`` stops the forged run at step K, resumes it from its checkpoint and judges the resumed
  trace (the "resume" gate).
* ``loss_curve`` runs the reference with every seed in ``verify.seeds`` (>= 3) to calibrate the band;
  ``surpass`` adds a side-by-side timing of the two engines in this process (``forgetrain.bench``: interleaved
  A/B when both fit in device memory, else A-B-A blocks).
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from forgetrain.config import RunConfig, to_run_config
from forgetrain.errors import ConfigError

GOLDEN_ROOT = Path(__file__).resolve().parent.parent / "references" / "goldens"
TIERS = ("bitwise", "tolerance", "loss_curve", "surpass")


@dataclass
class VerifyConfig:
    """Options of ``forgetrain.verify``."""

    reference: str = "megatron"  # a package under references/
    steps: int = 8  # optimizer steps per run (loss_curve/surpass: see curve_steps)
    curve_steps: int = 200  # steps per run for loss_curve / surpass
    digests: bool = True  # per-step param/grad digests and step-1 module probes (bitwise evidence)
    golden: bool = False  # judge against the stored golden reference trace
    regenerate: bool = False  # re-run the reference and store it as the golden
    make_golden: bool = False  # only run the reference and store it as the golden; no candidate, no verdict
    seeds: list = field(default_factory=lambda: [1234, 1235, 1236])  # loss-curve calibration seeds (>= 3)
    resume_at: Optional[int] = None  # stop the candidate at this step and resume it
    timing_steps: int = 10  # surpass: timed steps per engine (per block under A-B-A) after warmup
    out_dir: Optional[str] = None  # defaults to Hydra's run directory


@dataclass
class VerifyRunConfig(RunConfig):
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    tier: Any = None


def register() -> None:
    from hydra.core.config_store import ConfigStore

    from forgetrain.config import register_configs

    register_configs()
    ConfigStore.instance().store(name="verify_schema", node=VerifyRunConfig)


def _run_cfg(cfg: RunConfig, out: Path, **train_overrides) -> RunConfig:
    """The configured run, cut to ``steps``: the LR schedule stays the full run's (lr_decay_steps pinned)."""
    c = copy.deepcopy(cfg)
    if "steps" in train_overrides and cfg.train.lr_decay_steps is None:
        train_overrides.setdefault("lr_decay_steps", max(cfg.train.steps, train_overrides["steps"]))
    train_overrides.setdefault("overwrite", not train_overrides.get("resume", False))  # verify owns `out`
    # no checkpoints, except for a run that stops to be resumed, or resumes (the resume gate)
    train_overrides.setdefault("save", bool(train_overrides.get("stop_after") or train_overrides.get("resume")))
    c.train = dataclasses.replace(c.train, out_dir=str(out), sample_tokens=0, save_interval=0,
                                  **train_overrides)
    c.logger = dataclasses.replace(c.logger, name="none", plots=False)
    return c


def golden_dir(cfg: RunConfig, tier_name: str) -> Path:
    from forgetrain.train import config_hash

    return GOLDEN_ROOT / cfg.hardware.name / f"{cfg.scenario.name}-{tier_name}-{config_hash(cfg)}"


CURVE_TIERS = ("loss_curve", "surpass")


def curve_golden_dir(cfg: RunConfig, vcfg: VerifyConfig) -> Path:
    """The loss-curve golden of this run: ``<platform>/<scenario>-loss_curve-<hash>/seed_<N>/trace/``, the hash
    taken over the reference run's own config (``curve_steps`` steps, the LR schedule pinned) with the seed set
    to 0, so every seed of one configuration lands in one directory. Shared by loss_curve and surpass."""
    from forgetrain.train import config_hash

    run = _run_cfg(cfg, Path("."), steps=vcfg.curve_steps, digests=False, seed=0)
    ref = "" if vcfg.reference == "megatron" else f"{vcfg.reference}-"
    return GOLDEN_ROOT / cfg.hardware.name / f"{cfg.scenario.name}-{ref}loss_curve-{config_hash(run)}"


def run_reference(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, seed: int | None = None,
                  final_params: bool = True) -> Path:
    """Run the reference for ``steps``; returns its output dir (trace/ and init.safetensors inside)."""
    from forgetrain.train import train

    over = {"steps": steps, "digests": vcfg.digests}
    if seed is not None:
        over["seed"] = seed
    return train(_run_cfg(cfg, out, **over), kind="references", engine_name=vcfg.reference, progress=False,
                 export_init=final_params, final_params=final_params)


def run_candidate_ref_oracle(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, init: Path) -> Path:
    """The reference in fp32 from ``init``: the oracle that reduced-precision tolerance is judged against."""
    from safetensors.torch import load_file

    from forgetrain.train import train

    return train(_run_cfg(cfg, out, steps=steps, digests=False), kind="references", engine_name=vcfg.reference,
                 init_hf=load_file(str(init)), progress=False)


def run_candidate(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, init: Path | None,
                  engine_cls=None, seed: int | None = None, final_params: bool = True) -> Path:
    """Run the forged engine from ``init`` (HF safetensors) for ``steps``, optionally stopping and resuming.
    Leaves no checkpoint behind: the resume gate's is deleted once the resumed run has finished."""
    from safetensors.torch import load_file

    from forgetrain.train import train

    init_hf = load_file(str(init)) if init is not None else None
    over = {"steps": steps, "digests": vcfg.digests}
    if seed is not None:
        over["seed"] = seed
    if vcfg.resume_at:
        if not 0 < vcfg.resume_at < steps:
            raise ConfigError(f"verify.resume_at={vcfg.resume_at} must lie in (0, {steps})")
        try:
            train(_run_cfg(cfg, out, stop_after=vcfg.resume_at, **over), init_hf=init_hf,
                  progress=False, engine_cls=engine_cls)
            return train(_run_cfg(cfg, out, resume=True, **over), progress=False, engine_cls=engine_cls,
                         final_params=final_params)
        finally:
            if _is_rank0():
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return train(_run_cfg(cfg, out, **over), init_hf=init_hf, progress=False, engine_cls=engine_cls,
                 final_params=final_params)


def verify(cfg: RunConfig, vcfg: VerifyConfig, tier_name: str, out: Path, engine_cls=None,
           tier_cfg: dict | None = None) -> list:
    """Run the requested tier; returns the list of Verdicts (the last one is the requested tier).

    ``engine_cls`` replaces the scenario's engine (tests feed deliberately wrong engines here).
    Raises ConfigError for an unknown tier or missing golden.
    """
    from forgetrain import equivalence as eq

    _check_request(vcfg, tier_name)
    tier_cfg = _with_reference_overrides(dict(tier_cfg or eq.load_tier(tier_name)), vcfg.reference, tier_name)
    out.mkdir(parents=True, exist_ok=True)
    if tier_name in ("bitwise", "tolerance"):
        steps = vcfg.steps
        gdir = golden_dir(cfg, tier_name)
        if vcfg.make_golden:
            _store_golden(run_reference(cfg, vcfg, out / "reference", steps), gdir)
            return []
        if vcfg.golden and not vcfg.regenerate:
            if not (gdir / "trace" / "trace.jsonl").exists():
                raise ConfigError(f"no golden at {gdir}; run with verify.regenerate=true first")
            _check_golden(gdir)
            ref = gdir
            if _is_rank0():
                print(f"reference: the stored golden {gdir} (not re-run)", file=sys.stderr)
        else:
            ref = run_reference(cfg, vcfg, out / "reference", steps)
            if vcfg.regenerate:
                _store_golden(ref, gdir)
        cand = run_candidate(cfg, vcfg, out / "candidate", steps, ref / "init.safetensors", engine_cls)
        if tier_name == "bitwise":
            verdicts = [eq.bitwise(ref / "trace", cand / "trace", tier_cfg)]
        else:
            oracle = None
            if cfg.train.precision != "fp32":  # fp32 oracle run of the reference, same init and batches
                fp32 = copy.deepcopy(cfg)
                fp32.train = dataclasses.replace(fp32.train, precision="fp32")
                oracle = run_candidate_ref_oracle(fp32, vcfg, out / "oracle_fp32", steps, ref / "init.safetensors")
            verdicts = [eq.tolerance(ref / "trace", cand / "trace", tier_cfg,
                                     oracle_dir=oracle / "trace" if oracle else None)]
        if _is_rank0():
            eq.write_report(verdicts, out, [ref / "trace"], cand / "trace")
        return verdicts
    # loss_curve / surpass
    steps = vcfg.curve_steps
    lc_cfg = dict(eq.load_tier("loss_curve")) if tier_name == "surpass" else tier_cfg
    vq = dataclasses.replace(vcfg, digests=False)
    gdir = curve_golden_dir(cfg, vcfg)
    if vcfg.golden and not (vcfg.regenerate or vcfg.make_golden):
        refs = _curve_golden_traces(gdir, vcfg)
        if _is_rank0():
            print(f"reference: the stored golden {gdir}, seeds {list(vcfg.seeds)} (not re-run)", file=sys.stderr)
    else:
        refs = []
        for s in vcfg.seeds:
            ref = run_reference(cfg, vq, out / f"reference_seed{s}", steps, seed=s, final_params=False)
            if (vcfg.regenerate or vcfg.make_golden) and _is_rank0():
                _store_golden(ref, gdir / f"seed_{s}", with_init=False)
            refs.append(ref / "trace")
        if vcfg.make_golden:
            return []
    cand = run_candidate(cfg, vq, out / "candidate", steps, None, engine_cls, seed=vcfg.seeds[0],
                         final_params=False) / "trace"
    verdicts = [eq.loss_curve(refs, cand, lc_cfg)]
    if tier_name == "surpass":
        from forgetrain.bench import side_by_side_step_times

        t_ref, t_cand = side_by_side_step_times(cfg, vcfg.reference, vcfg.timing_steps, engine_cls=engine_cls)
        verdicts.append(eq.surpass(verdicts[0], t_ref, t_cand, tier_cfg))
    if _is_rank0():
        eq.write_report(verdicts, out, refs, cand)
    return verdicts


def check_request(obj: dict) -> None:
    """The verify request of a composed config (``obj["verify"]``, ``obj["tier"]``), checked by ``forgetrain.cli``
    before Hydra creates anything. Raises ConfigError."""
    td = obj.get("tier")
    if not isinstance(td, dict) or "name" not in td:
        raise ConfigError("choose a tier: tier=bitwise|tolerance|loss_curve|surpass")
    _check_request(VerifyConfig(**obj["verify"]), td["name"])


def _check_request(vcfg: VerifyConfig, tier_name: str) -> None:
    """Reject, before any run, requests that cannot produce a verdict. Raises ConfigError."""
    from forgetrain import registry

    if tier_name not in TIERS:
        raise ConfigError(f"unknown tier '{tier_name}'; known: {', '.join(TIERS)}")
    try:
        ref_cls = registry.load_engine_class("references", vcfg.reference)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - an optional reference whose framework is not installed
        raise ConfigError(f"reference '{vcfg.reference}' cannot be loaded: {type(e).__name__}: {e}") from e
    if getattr(ref_cls, "bench_only", False):
        raise ConfigError(f"references/{vcfg.reference} is a speed baseline for bench (no per-token losses or "
                          f"digests); verify against megatron, deepspeed or torchtitan")
    if tier_name == "bitwise" and not vcfg.digests:
        raise ConfigError("tier=bitwise compares per-step digests; drop verify.digests=false")
    if tier_name in ("bitwise", "tolerance") and vcfg.resume_at is not None and not 0 < vcfg.resume_at < vcfg.steps:
        raise ConfigError(f"verify.resume_at={vcfg.resume_at} must lie in (0, verify.steps={vcfg.steps})")
    if tier_name in CURVE_TIERS and len(vcfg.seeds) < (1 if vcfg.make_golden else 3):  # a golden: seed by seed
        raise ConfigError(f"loss_curve needs >= 3 reference seeds, got verify.seeds={list(vcfg.seeds)}")


def _check_golden(gdir: Path) -> None:
    """A stored golden must be complete and readable. Raises ConfigError naming what is wrong."""
    import json

    try:
        json.loads((gdir / "trace" / "meta.json").read_text())
        for line in (gdir / "trace" / "trace.jsonl").read_text().splitlines():
            json.loads(line)
        if not (gdir / "init.safetensors").is_file():
            raise FileNotFoundError(str(gdir / "init.safetensors"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"the golden at {gdir} is incomplete or corrupt ({type(e).__name__}: {e}); "
                          f"regenerate it with verify.regenerate=true") from e


def _curve_golden_traces(gdir: Path, vcfg: VerifyConfig) -> list[Path]:
    """The stored reference trace of every seed in ``verify.seeds``. Raises ConfigError naming the missing or
    damaged seeds and the command that makes them."""
    import json

    missing = [s for s in vcfg.seeds if not (gdir / f"seed_{s}" / "trace" / "trace.jsonl").is_file()]
    if missing:
        have = sorted(int(d.name[5:]) for d in gdir.glob("seed_*") if d.name[5:].isdigit()) if gdir.is_dir() else []
        raise ConfigError(f"no loss-curve golden for seeds {missing} at {gdir} (stored: {have or 'none'}); make "
                          f"them with verify.make_golden=true verify.seeds={missing}, or choose stored seeds")
    traces = []
    for s in vcfg.seeds:
        t = gdir / f"seed_{s}" / "trace"
        try:
            meta = json.loads((t / "meta.json").read_text())
            recs = [json.loads(line) for line in (t / "trace.jsonl").read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            raise ConfigError(f"the golden {t} is incomplete or corrupt ({type(e).__name__}: {e}); remake it "
                              f"with verify.make_golden=true verify.seeds=[{s}]") from e
        if meta.get("side") != f"references/{vcfg.reference}" or len(recs) != vcfg.curve_steps:
            raise ConfigError(f"the golden {t} is not a {vcfg.curve_steps}-step run of references/{vcfg.reference} "
                              f"(side {meta.get('side')}, {len(recs)} steps); remake it with "
                              f"verify.make_golden=true verify.seeds=[{s}]")
        traces.append(t)
    return traces


def _is_rank0() -> bool:
    """True outside torchrun and on global rank 0 (under torchrun only rank 0 writes the report)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _with_reference_overrides(tier_cfg: dict, reference: str, tier_name: str) -> dict:
    """Merge a reference's own, versioned tier entry (``references/<name>/<tier>.yaml``, key ``<tier>``) over the
    tier config. Used where a reference's arithmetic is measured to differ (e.g. DeepSpeed's fp64 grad norm vs
    Megatron's fp32 one); the file carries the measurement that justifies each number."""
    path = GOLDEN_ROOT.parent / reference / f"{tier_name}.yaml"
    if not path.exists():
        return tier_cfg
    from omegaconf import OmegaConf

    over = OmegaConf.to_container(OmegaConf.load(path), resolve=True).get(tier_name) or {}

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out.get(k) or {}, v) if isinstance(v, dict) else v
        return out

    merged = merge(tier_cfg, over)
    merged["reference_override"] = str(path.relative_to(GOLDEN_ROOT.parent.parent))
    return merged


def _store_golden(ref_out: Path, gdir: Path, with_init: bool = True) -> None:
    """Copy a reference run's trace (and its init weights) to ``gdir``, replacing it atomically."""
    tmp = gdir.with_name(gdir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "trace").mkdir(parents=True)
    for f in ("meta.json", "trace.jsonl", "modules.json", "final.safetensors"):
        if (ref_out / "trace" / f).exists():
            shutil.copy2(ref_out / "trace" / f, tmp / "trace" / f)
    if with_init:
        shutil.copy2(ref_out / "init.safetensors", tmp / "init.safetensors")
    old = gdir.with_name(gdir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if gdir.exists():
        gdir.rename(old)  # a crash from here on leaves either the old golden (as .old) or the new one complete
    tmp.rename(gdir)
    shutil.rmtree(old, ignore_errors=True)


def verify_task(cfg) -> None:
    from omegaconf import OmegaConf

    from forgetrain import equivalence as eq
    from forgetrain.train import _out_dir

    obj = OmegaConf.to_container(cfg, resolve=True)
    vd, td = obj.pop("verify"), obj.pop("tier")
    rc = to_run_config(obj)
    vcfg = VerifyConfig(**vd)
    if not isinstance(td, dict) or "name" not in td:
        raise ConfigError("choose a tier: tier=bitwise|tolerance|loss_curve|surpass")
    from forgetrain.distributed import init_distributed

    env = init_distributed(rc.parallel)  # under torchrun: every rank runs both sides; rank 0 reports
    out = Path(env.broadcast_object(str(Path(vcfg.out_dir) if vcfg.out_dir else _out_dir(rc))))
    verdicts = verify(rc, vcfg, td["name"], out, tier_cfg=td)
    if env.rank == 0:
        from forgetrain.train import _record_config

        _record_config(out, cfg, resume=False)  # beside the report: the request that produced it
    if vcfg.make_golden:
        if env.rank == 0:
            where = curve_golden_dir(rc, vcfg) if td["name"] in CURVE_TIERS else golden_dir(rc, td["name"])
            print(f"golden stored: {where}", file=sys.stderr)
        sys.exit(0)
    if env.rank == 0:
        eq.print_verdict_table(verdicts)
        print(f"report: {out / 'verdict.json'}  plot: {out / 'loss_curves.png'}", file=sys.stderr)
    sys.exit(0 if all(v.passed for v in verdicts) else 1)


def main() -> None:
    from forgetrain.cli import run_hydra

    register()
    run_hydra("verify", verify_task)


if __name__ == "__main__":
    main()
