"""``python -m forgetrain.verify scenario=NAME tier=bitwise|tolerance|loss_curve|surpass [verify.*]``.

Runs the golden reference and the forged engine on the same initial weights (the reference initialises and
exports them in the HF layout) and the same batches, then judges the candidate's trace against the reference's
with the requested tier. Prints a verdict table, writes ``verdict.json`` and ``loss_curves.png`` and exits 0 on a
pass, 1 on a failure (2 on bad input). The tiers, and which runs each needs (its kind: ``pair``, ``curve`` or
``speed``), come from :mod:`forgetrain.equivalence.registry`.

* ``verify.golden=true`` compares against the stored golden reference trace (``references/goldens/<platform>/``)
  instead of re-running the reference; ``verify.regenerate=true`` re-runs the reference and stores it;
  ``verify.make_golden=true`` only runs the reference and stores it (no candidate, no verdict); a tolerance
  golden below fp32 stores the reference's fp32 oracle run beside it (``oracle_fp32/``). For
  ``loss_curve`` / ``surpass`` the golden is one trace per reference seed (``seed_<N>/``), keyed by the run's
  config hash without the seed, so seeds can be added to it run by run (``verify.seeds=[...]``).
* verify keeps no checkpoints: its runs save none, except the resume gate's, which is deleted afterwards;
  loss-curve runs write no final parameters either (the tier reads only the loss curve).
* ``verify.resume_at=K`` stops the forged run at step K, resumes it from its checkpoint and judges the resumed
  trace (the "resume" gate).
* ``loss_curve`` runs the reference with every seed in ``verify.seeds`` (>= 3) to calibrate the band;
  ``surpass`` adds a side-by-side timing in this process of the candidate, the reference and the strongest peer of
  the candidate's precision (``peers`` of ``conf/tier/surpass.yaml``; ``forgetrain.bench``: interleaved when all
  fit in device memory, else A-B-A blocks).
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
from forgetrain.distributed import free_device, is_rank0
from forgetrain.equivalence.inits import (curve_golden_traces, golden_init, golden_init_hashes, init_sha256, pin_init,
                                          write_init_hash)
from forgetrain.equivalence.runs import run_cfg
from forgetrain.equivalence.verdict import REFERENCES_DIR, tier_config
from forgetrain.errors import ConfigError

GOLDEN_ROOT = REFERENCES_DIR / "goldens"
TEMP_INITS = "reference_inits"  # verify's own cache of a golden's rebuilt inits when verify.init_cache is unset


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
    # curve tiers: judge paired (the candidate from each reference seed's init, reading its batches). null: paired
    # wherever every seed's reference init can be had (a live reference, or a golden that stores its init hashes),
    # else unpaired with a note; true: paired or refuse; false: unpaired only
    paired: Optional[bool] = None
    # curve tiers: the unpaired runs' seeds (the candidate's own init and data order; >= 3 for the two-sample
    # test, none of them a reference seed); [] skips the unpaired check
    candidate_seeds: list = field(default_factory=lambda: [2234, 2235, 2236])
    # curve tiers with a golden: keep the reference inits regenerated from the seeds here (a safetensors file per
    # seed, checked against the golden's sha256 before each reuse); null regenerates them every time
    init_cache: Optional[str] = None
    # loss-curve golden made before init hashes were stored: regenerate each seed's reference init and record its
    # sha256 beside the trace (same versions and device as the trace's meta.json, else refused); no candidate
    pin_init: bool = False
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


def golden_dir(cfg: RunConfig, tier_name: str) -> Path:
    from forgetrain.train import config_hash

    return GOLDEN_ROOT / cfg.hardware.name / f"{cfg.scenario.name}-{tier_name}-{config_hash(cfg)}"


def curve_golden_dir(cfg: RunConfig, vcfg: VerifyConfig) -> Path:
    """The loss-curve golden of this run: ``<platform>/<scenario>-loss_curve-<hash>/seed_<N>/trace/``, the hash
    taken over the reference run's own config (``curve_steps`` steps, the LR schedule pinned) with the seed set
    to 0, so every seed of one configuration lands in one directory. Shared by the curve and speed tiers
    (loss_curve, surpass)."""
    from forgetrain.train import config_hash

    run = run_cfg(cfg, Path("."), steps=vcfg.curve_steps, digests=False, seed=0)
    ref = "" if vcfg.reference == "megatron" else f"{vcfg.reference}-"
    return GOLDEN_ROOT / cfg.hardware.name / f"{cfg.scenario.name}-{ref}loss_curve-{config_hash(run)}"


def run_reference(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, seed: int | None = None,
                  final_params: bool = True, export_init: bool | None = None) -> Path:
    """Run the reference for ``steps``; returns its output dir (trace/, and init.safetensors when ``export_init``,
    which defaults to ``final_params``)."""
    from forgetrain.train import train

    over = {"steps": steps, "digests": vcfg.digests}
    if seed is not None:
        over["seed"] = seed
    return train(run_cfg(cfg, out, **over), kind="references", engine_name=vcfg.reference, progress=False,
                 export_init=final_params if export_init is None else export_init, final_params=final_params)


def run_candidate_ref_oracle(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, init: Path) -> Path:
    """The reference in fp32 from ``init``: the oracle that reduced-precision tolerance is judged against."""
    from safetensors.torch import load_file

    from forgetrain.train import train

    return train(run_cfg(cfg, out, steps=steps, digests=False), kind="references", engine_name=vcfg.reference,
                 init_hf=load_file(str(init)), progress=False)


def run_candidate(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, init: Path | dict | None,
                  engine_cls=None, seed: int | None = None, final_params: bool = True) -> Path:
    """Run the forged engine from ``init`` (an HF safetensors file, or the HF-layout state itself; None: the
    engine's own init) for ``steps``, optionally stopping and resuming. Leaves no checkpoint behind: the resume
    gate's is deleted once the resumed run has finished."""
    from safetensors.torch import load_file

    from forgetrain.train import train

    init_hf = load_file(str(init)) if isinstance(init, (str, Path)) else init
    over = {"steps": steps, "digests": vcfg.digests}
    if seed is not None:
        over["seed"] = seed
    if vcfg.resume_at:
        if not 0 < vcfg.resume_at < steps:
            raise ConfigError(f"verify.resume_at={vcfg.resume_at} must lie in (0, {steps})")
        try:
            train(run_cfg(cfg, out, stop_after=vcfg.resume_at, **over), init_hf=init_hf,
                  progress=False, engine_cls=engine_cls)
            return train(run_cfg(cfg, out, resume=True, **over), progress=False, engine_cls=engine_cls,
                         final_params=final_params)
        finally:
            if is_rank0():
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return train(run_cfg(cfg, out, **over), init_hf=init_hf, progress=False, engine_cls=engine_cls,
                 final_params=final_params)


def curve_candidate_runs(cfg: RunConfig, vcfg: VerifyConfig, out: Path, inits: list | None, engine_cls=None):
    """The candidate's runs of a curve tier, ``verify.curve_steps`` steps each, without digests: paired, one per
    reference seed in ``verify.seeds`` from that seed's reference init (``inits``: per seed a safetensors path, or a
    callable returning the HF-layout state; None: no paired runs), reading that seed's batches; unpaired, one per
    ``verify.candidate_seeds`` from the candidate's own init and data order. Each run's progress is one line on
    stderr. Returns a :class:`forgetrain.equivalence.tiers.loss_curve.CurveRuns` of trace directories."""
    from forgetrain.equivalence.tiers.loss_curve import CurveRuns

    vq = dataclasses.replace(vcfg, digests=False)
    plan = [("paired", s, init) for s, init in zip(vcfg.seeds, inits)] if inits is not None else []
    plan += [("unpaired", u, None) for u in vcfg.candidate_seeds]
    paired, unpaired = [], []
    for i, (kind, seed, init) in enumerate(plan, 1):
        if is_rank0():
            how = f"from reference seed {seed}'s init, its batches" if kind == "paired" else \
                f"from its own init, seed {seed}"
            print(f"candidate run {i}/{len(plan)}: {kind}, {how}, {vcfg.curve_steps} steps", file=sys.stderr,
                  flush=True)
        state = init() if callable(init) else init
        d = out / (f"candidate_paired_seed{seed}" if kind == "paired" else f"candidate_seed{seed}")
        (paired if kind == "paired" else unpaired).append(
            run_candidate(cfg, vq, d, vcfg.curve_steps, state, engine_cls, seed=seed, final_params=False) / "trace")
        del state
        free_device()
    return CurveRuns(tuple(paired), tuple(unpaired))


def _tier(tier_name: str):
    """The registry Tier called ``tier_name``. Raises ConfigError naming the known tiers."""
    from forgetrain.equivalence import registry

    tier = registry.find(tier_name)
    if tier is None:
        raise ConfigError(f"unknown tier '{tier_name}'; known: {', '.join(registry.TIER_ORDER)}")
    return tier


def reference_oracle(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, init: Path) -> Path | None:
    """The fp32 oracle run of the reference (same init and batches) that reduced-precision tolerance is judged
    against; None for an fp32 run (it needs none). Returns the run's output dir (``trace/`` inside)."""
    if cfg.train.precision == "fp32":
        return None
    fp32 = copy.deepcopy(cfg)
    fp32.train = dataclasses.replace(fp32.train, precision="fp32")
    return run_candidate_ref_oracle(fp32, vcfg, out, steps, init)


def candidate_trace(cfg: RunConfig, vcfg: VerifyConfig, tier_name: str, out: Path, init: Path | None,
                    engine_cls=None) -> Path:
    """Run the candidate once the way ``tier_name`` judges it and return its trace dir: a ``pair`` tier runs
    ``verify.steps`` steps from the reference's ``init`` weights with digests; a ``curve`` or ``speed`` tier runs
    one unpaired run of ``verify.curve_steps`` steps from the candidate's own init with the first reference seed,
    without digests (the forge's gate; verify itself runs :func:`curve_candidate_runs`)."""
    from forgetrain.equivalence import registry

    if _tier(tier_name).kind == registry.PAIR:
        return run_candidate(cfg, vcfg, out, vcfg.steps, init, engine_cls) / "trace"
    vq = dataclasses.replace(vcfg, digests=False)
    return run_candidate(cfg, vq, out, vcfg.curve_steps, None, engine_cls, seed=vcfg.seeds[0],
                         final_params=False) / "trace"


def judge(tier_name: str, tier_cfg: dict, refs: list[Path], cand, out: Path | None = None, *,
          oracle: Path | None = None, times: tuple | None = None) -> list:
    """The verdicts of ``tier_name`` from traces alone (no engine runs here): ``refs`` are the reference trace
    dirs (one for a pair tier, one per seed for a curve or speed tier), ``cand`` the candidate's trace dir (a
    curve or speed tier also takes a ``CurveRuns`` of paired and unpaired runs), ``oracle`` the
    fp32 oracle trace (a pair tier with ``oracle``, reduced precision), ``times`` (reference step seconds,
    candidate step seconds[, peer name -> step seconds]) for a speed tier, whose curve tier's verdict comes first.
    Writes the report into ``out`` when given (rank 0). Raises ValueError when a speed tier gets no timings."""
    from forgetrain import equivalence as eq
    from forgetrain.equivalence import registry

    from forgetrain.equivalence.tiers.loss_curve import CurveRuns

    tier = _tier(tier_name)
    if tier.kind == registry.PAIR:
        extra = {"oracle_dir": oracle} if tier.oracle else {}
        verdicts = [tier.judge()(refs[0], cand, tier_cfg, **extra)]
    elif tier.kind == registry.CURVE:
        verdicts = [tier.judge()(refs, cand, tier_cfg)]
    else:
        if times is None:
            raise ValueError(f"the {tier.name} tier needs the step times of both engines")
        curve = registry.find(tier.rests_on)
        verdicts = [curve.judge()(refs, cand, dict(eq.load_tier(curve.name)))]
        peers = {"timings_peers": times[2]} if len(times) > 2 else {}
        verdicts.append(tier.judge()(verdicts[0], times[0], times[1], tier_cfg, **peers))
    if out is not None and is_rank0():
        eq.write_report(verdicts, out, refs, cand.first if isinstance(cand, CurveRuns) else cand)
    return verdicts


def verify(cfg: RunConfig, vcfg: VerifyConfig, tier_name: str, out: Path, engine_cls=None,
           tier_cfg: dict | None = None) -> list:
    """Run the requested tier; returns the list of Verdicts (the last one is the requested tier).

    How it runs follows the tier's kind (:mod:`forgetrain.equivalence.registry`): a ``pair`` tier runs the
    reference and the candidate for ``verify.steps`` from the same init (plus an fp32 oracle of the reference at
    reduced precision when the tier takes one); a ``curve`` tier runs the reference once per seed in
    ``verify.seeds`` and the candidate for ``verify.curve_steps``; a ``speed`` tier runs the curve tier it rests on,
    then times both engines side by side, and returns both verdicts.

    ``engine_cls`` replaces the scenario's engine (tests feed deliberately wrong engines here).
    Raises ConfigError for an unknown tier or missing golden.
    """
    from forgetrain.equivalence import registry

    tier = _tier(tier_name)
    _check_request(vcfg, tier)
    tier_cfg = tier_config(tier_name, vcfg.reference, tier_cfg)
    peers: list[str] = []
    if tier.kind == registry.SPEED:  # a peer that cannot run here stops the request before any run, in one line
        from forgetrain.bench.sides import check_sides
        from forgetrain.equivalence.tiers.surpass import peers_for

        peers = peers_for(tier_cfg, fp8=str(getattr(cfg.engine, "fp8", "none")) != "none")
        check_sides(cfg, peers)
    out.mkdir(parents=True, exist_ok=True)
    if tier.kind == registry.PAIR:
        steps = vcfg.steps
        gdir = golden_dir(cfg, tier_name)
        oracle = None
        if vcfg.golden and not (vcfg.regenerate or vcfg.make_golden):
            if not (gdir / "trace" / "trace.jsonl").exists():
                raise ConfigError(f"no golden at {gdir}; run with verify.regenerate=true first")
            check_golden(gdir)
            ref = gdir
            if tier.oracle and (gdir / "oracle_fp32" / "trace" / "trace.jsonl").exists():
                oracle = gdir / "oracle_fp32"
            if is_rank0():
                print(f"reference: the stored golden {gdir} (not re-run)", file=sys.stderr)
        else:
            ref = run_reference(cfg, vcfg, out / "reference", steps)
            if tier.oracle:
                oracle = reference_oracle(cfg, vcfg, out / "oracle_fp32", steps, ref / "init.safetensors")
            if vcfg.regenerate or vcfg.make_golden:
                _store_golden(ref, gdir, oracle=oracle)
            if vcfg.make_golden:
                return []
        cand = candidate_trace(cfg, vcfg, tier_name, out / "candidate", ref / "init.safetensors", engine_cls)
        if tier.oracle and oracle is None:
            oracle = reference_oracle(cfg, vcfg, out / "oracle_fp32", steps, ref / "init.safetensors")
        return judge(tier_name, tier_cfg, [ref / "trace"], cand, out, oracle=oracle / "trace" if oracle else None)
    # a curve tier, or a speed tier and the curve tier it rests on
    gdir = curve_golden_dir(cfg, vcfg)
    if vcfg.pin_init:
        pin_init(cfg, vcfg, gdir)
        return []
    refs, inits = _curve_references(cfg, vcfg, out, gdir)
    if vcfg.make_golden:
        for s in vcfg.seeds:  # the hashes are stored; the weights are not kept
            if is_rank0():
                (out / f"reference_seed{s}" / "init.safetensors").unlink(missing_ok=True)
        return []
    cand = curve_candidate_runs(cfg, vcfg, out, inits, engine_cls)
    for init in inits or []:  # a live reference's exported inits: rebuilt from the seed when needed again
        if isinstance(init, Path) and is_rank0():
            init.unlink(missing_ok=True)
    if is_rank0():
        shutil.rmtree(out / TEMP_INITS, ignore_errors=True)
    times = None
    if tier.kind == registry.SPEED:
        from forgetrain.bench import side_by_side_step_times

        t = side_by_side_step_times(cfg, [vcfg.reference, *peers], vcfg.timing_steps, engine_cls=engine_cls)
        times = (t[vcfg.reference], t["forged"], {n: t[n] for n in peers})
    return judge(tier_name, tier_cfg, refs, cand, out, times=times)


def _curve_references(cfg: RunConfig, vcfg: VerifyConfig, out: Path, gdir: Path) -> tuple[list[Path], list | None]:
    """The reference traces of a curve tier (one per seed in ``verify.seeds``: the stored golden's, or live runs,
    stored as the golden when asked) and where each seed's reference init comes from for paired runs: a path of
    a live run's export, a callable regenerating it against the golden's hash, or None for no pairing
    (``verify.paired``, or a golden without init hashes: unpaired, with a note). Raises ConfigError when
    ``verify.paired=true`` cannot be honoured."""
    vq = dataclasses.replace(vcfg, digests=False)
    want = vcfg.paired is not False
    if vcfg.golden and not (vcfg.regenerate or vcfg.make_golden):
        refs = curve_golden_traces(gdir, vcfg)
        hashes = golden_init_hashes(gdir, list(vcfg.seeds)) if want else None
        if is_rank0():
            print(f"reference: the stored golden {gdir}, seeds {list(vcfg.seeds)} (not re-run)", file=sys.stderr)
        if want and hashes is None:
            why = (f"the golden {gdir.name} lacks the init hash of some seeds, so paired runs cannot start from "
                   f"its inits; record them with verify.pin_init=true")
            if vcfg.paired:
                raise ConfigError(f"verify.paired=true: {why}")
            if is_rank0():
                print(f"note: judged unpaired only: {why}", file=sys.stderr)
        if hashes is None:
            return refs, None
        # every seed's init rebuilt and checked before any candidate runs (kept in verify.init_cache, else in
        # a directory of the output that verify deletes afterwards), so a wrong hash costs no candidate run
        vc = vcfg if vcfg.init_cache else dataclasses.replace(vcfg, init_cache=str(out / TEMP_INITS))
        for s in vcfg.seeds:
            golden_init(cfg, vc, gdir, s, hashes[s])
        return refs, [lambda s=s: golden_init(cfg, vc, gdir, s, hashes[s]) for s in vcfg.seeds]
    store = (vcfg.regenerate or vcfg.make_golden) and is_rank0()
    refs, inits = [], []
    for s in vcfg.seeds:
        ref = run_reference(cfg, vq, out / f"reference_seed{s}", vcfg.curve_steps, seed=s, final_params=False,
                            export_init=want or store)
        if store:
            _store_golden(ref, gdir / f"seed_{s}", with_init=False)
            from safetensors.torch import load_file

            state = load_file(str(ref / "init.safetensors"))
            write_init_hash(gdir / f"seed_{s}", init_sha256(state), sum(int(v.numel()) for v in state.values()),
                             "exported by the reference run that made the trace")
            del state
            if not want:  # exported for the hash alone
                (ref / "init.safetensors").unlink()
        refs.append(ref / "trace")
        inits.append(ref / "init.safetensors")
    return refs, inits if want else None


def check_request(obj: dict) -> None:
    """The verify request of a composed config (``obj["verify"]``, ``obj["tier"]``), checked by ``forgetrain.cli``
    before Hydra creates anything. Raises ConfigError."""
    from forgetrain.equivalence import registry

    td = obj.get("tier")
    if not isinstance(td, dict) or "name" not in td:
        raise ConfigError(f"choose a tier: tier={'|'.join(registry.TIER_ORDER)}")
    _check_request(VerifyConfig(**obj["verify"]), _tier(td["name"]))


def _check_request(vcfg: VerifyConfig, tier) -> None:
    """Reject, before any run, requests that cannot produce a verdict (``tier``: a registry Tier). Raises
    ConfigError."""
    from forgetrain import registry
    from forgetrain.equivalence.registry import PAIR
    from forgetrain.levers import spec_of

    try:
        ref_cls = registry.load_engine_class("references", vcfg.reference)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - an optional reference whose framework is not installed
        raise ConfigError(f"reference '{vcfg.reference}' cannot be loaded: {type(e).__name__}: {e}") from e
    if spec_of(ref_cls).bench_only:
        raise ConfigError(f"references/{vcfg.reference} is a speed baseline for bench (no per-token losses or "
                          f"digests); verify against megatron, deepspeed or torchtitan")
    for name in ("steps", "curve_steps", "timing_steps"):  # named as the user set them, not as train.steps
        v = getattr(vcfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"verify.{name} must be a positive integer, got {v!r}")
    if tier.digests and not vcfg.digests:
        raise ConfigError(f"tier={tier.name} compares per-step digests; drop verify.digests=false")
    if tier.kind == PAIR and vcfg.resume_at is not None and not 0 < vcfg.resume_at < vcfg.steps:
        raise ConfigError(f"verify.resume_at={vcfg.resume_at} must lie in (0, verify.steps={vcfg.steps})")
    if tier.kind != PAIR and len(vcfg.seeds) < (1 if (vcfg.make_golden or vcfg.pin_init) else 3):  # seed by seed
        curve = tier.name if tier.rests_on is None else tier.rests_on
        raise ConfigError(f"{curve} needs >= 3 reference seeds, got verify.seeds={list(vcfg.seeds)}")
    _check_curve_request(vcfg, tier)


def _check_curve_request(vcfg: VerifyConfig, tier) -> None:
    """The curve tiers' own options (paired, candidate_seeds, pin_init). Raises ConfigError."""
    from forgetrain.equivalence.registry import PAIR

    from forgetrain.config import SEED_MAX
    from forgetrain.equivalence.registry import SPEED

    if vcfg.paired not in (None, True, False):
        raise ConfigError(f"verify.paired must be true, false or null, got {vcfg.paired!r}")
    seeds = list(vcfg.candidate_seeds)
    for name, xs in (("seeds", list(vcfg.seeds)), ("candidate_seeds", seeds)):
        if (any(isinstance(u, bool) or not isinstance(u, int) or not 0 <= u <= SEED_MAX for u in xs)
                or len(set(xs)) != len(xs)):  # a repeated seed would count one run twice as independent
            raise ConfigError(f"verify.{name} must be distinct integers in [0, {SEED_MAX}], got {xs}")
    if tier.kind == SPEED and vcfg.paired is False:
        raise ConfigError(f"tier={tier.name} rests on the paired {tier.rests_on} test: drop verify.paired=false")
    if vcfg.init_cache is not None:
        _check_writable_dir(Path(vcfg.init_cache), "verify.init_cache")
    shared = sorted(set(seeds) & set(vcfg.seeds))
    if shared:
        raise ConfigError(f"verify.candidate_seeds {shared} are reference seeds too: an unpaired run must not share "
                          f"its data order with a reference seed; pick others")
    if vcfg.pin_init and (tier.kind == PAIR or vcfg.make_golden or vcfg.regenerate or not vcfg.golden):
        raise ConfigError("verify.pin_init=true records the init hashes of a stored loss-curve golden: use it with "
                          "tier=loss_curve verify.golden=true, without make_golden or regenerate")
    if tier.kind != PAIR and not (vcfg.make_golden or vcfg.pin_init):
        if vcfg.paired is False and not seeds:
            raise ConfigError("verify.paired=false with verify.candidate_seeds=[] leaves no candidate run to judge")
        if 0 < len(seeds) < 3:
            raise ConfigError(f"the unpaired check compares >= 3 candidate seeds with the reference seeds (a "
                              f"two-sample test), got verify.candidate_seeds={seeds}; give 3 or more, or [] to "
                              f"skip it")


def _check_writable_dir(d: Path, what: str) -> None:
    """Raise ConfigError unless ``d`` is, or can be made as, a directory: its nearest existing ancestor takes a
    probe directory (made and removed at once, so a refused request writes nothing)."""
    import tempfile

    top = next((p for p in [d, *d.parents] if p.exists()), None)
    try:
        if top is None or not top.is_dir():
            raise NotADirectoryError(str(top))
        Path(tempfile.mkdtemp(dir=top, prefix=".ft-probe-")).rmdir()
    except OSError as e:
        raise ConfigError(f"{what}={d} cannot be written ({type(e).__name__}: {e})") from e


def check_golden(gdir: Path) -> None:
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


def _store_golden(ref_out: Path, gdir: Path, with_init: bool = True, oracle: Path | None = None) -> None:
    """Copy a reference run's trace (and its init weights, and the fp32 oracle run's trace as
    ``oracle_fp32/trace/`` when given) to ``gdir``, replacing it atomically."""
    tmp = gdir.with_name(gdir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for src, dst in [(ref_out, tmp)] + ([(oracle, tmp / "oracle_fp32")] if oracle is not None else []):
        (dst / "trace").mkdir(parents=True)
        for f in ("meta.json", "trace.jsonl", "modules.json", "final.safetensors"):
            if (src / "trace" / f).exists():
                shutil.copy2(src / "trace" / f, dst / "trace" / f)
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
    from forgetrain.equivalence import registry
    from forgetrain.run.outdir import out_dir as default_out_dir

    obj = OmegaConf.to_container(cfg, resolve=True)
    vd, td = obj.pop("verify"), obj.pop("tier")
    rc = to_run_config(obj)
    vcfg = VerifyConfig(**vd)
    if not isinstance(td, dict) or "name" not in td:
        raise ConfigError(f"choose a tier: tier={'|'.join(registry.TIER_ORDER)}")
    from forgetrain.distributed import init_distributed

    env = init_distributed(rc.parallel)  # under torchrun: every rank runs both sides; rank 0 reports
    out = Path(env.broadcast_object(str(Path(vcfg.out_dir) if vcfg.out_dir else default_out_dir(rc))))
    verdicts = verify(rc, vcfg, td["name"], out, tier_cfg=td)
    if env.rank == 0:
        from forgetrain.run.outdir import record_config

        record_config(out, cfg, resume=False)  # beside the report: the request that produced it
    if vcfg.make_golden or vcfg.pin_init:
        if env.rank == 0:
            pair = registry.find(td["name"]).kind == registry.PAIR
            where = golden_dir(rc, td["name"]) if pair else curve_golden_dir(rc, vcfg)
            print(f"golden {'init hashes recorded' if vcfg.pin_init else 'stored'}: {where}", file=sys.stderr)
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
