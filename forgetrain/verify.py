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


def curve_golden_dir(cfg: RunConfig, vcfg: VerifyConfig) -> Path:
    """The loss-curve golden of this run: ``<platform>/<scenario>-loss_curve-<hash>/seed_<N>/trace/``, the hash
    taken over the reference run's own config (``curve_steps`` steps, the LR schedule pinned) with the seed set
    to 0, so every seed of one configuration lands in one directory. Shared by the curve and speed tiers
    (loss_curve, surpass)."""
    from forgetrain.train import config_hash

    run = _run_cfg(cfg, Path("."), steps=vcfg.curve_steps, digests=False, seed=0)
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
    return train(_run_cfg(cfg, out, **over), kind="references", engine_name=vcfg.reference, progress=False,
                 export_init=final_params if export_init is None else export_init, final_params=final_params)


def init_sha256(state: dict) -> str:
    """sha256 of HF-layout weights: for each name in sorted order, the name, dtype, shape and the tensor's raw
    bytes (C order, on the CPU). Equal hashes mean bit-identical weights under the same names."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def reference_init(cfg: RunConfig, vcfg: VerifyConfig, seed: int) -> dict:
    """Seed ``seed``'s reference init weights (HF layout, fp32, CPU), rebuilt from the seed alone: the reference
    engine is built as a ``curve_steps`` run of that seed builds it (:func:`forgetrain.train.build_engine`), and
    its weights are exported; no data is read and no step is taken. The device memory is freed afterwards.
    Megatron-core's init is deterministic in the seed on one platform and software stack; the golden's sha256
    (``init.json``) proves it."""
    import os

    import torch

    from forgetrain import registry
    from forgetrain.distributed import set_deterministic
    from forgetrain.train import build_engine

    rc = _run_cfg(cfg, Path("."), steps=vcfg.curve_steps, digests=False, seed=seed)
    set_deterministic(rc.train.deterministic, rc.hardware.device)
    device = torch.device("cpu" if rc.hardware.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    engine = build_engine(rc, device, registry.load_engine_class("references", vcfg.reference))
    state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in engine.export_hf_weights().items()}
    del engine
    _release_device_memory()
    return state


def run_candidate_ref_oracle(cfg: RunConfig, vcfg: VerifyConfig, out: Path, steps: int, init: Path) -> Path:
    """The reference in fp32 from ``init``: the oracle that reduced-precision tolerance is judged against."""
    from safetensors.torch import load_file

    from forgetrain.train import train

    return train(_run_cfg(cfg, out, steps=steps, digests=False), kind="references", engine_name=vcfg.reference,
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
            train(_run_cfg(cfg, out, stop_after=vcfg.resume_at, **over), init_hf=init_hf,
                  progress=False, engine_cls=engine_cls)
            return train(_run_cfg(cfg, out, resume=True, **over), progress=False, engine_cls=engine_cls,
                         final_params=final_params)
        finally:
            if _is_rank0():
                shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return train(_run_cfg(cfg, out, **over), init_hf=init_hf, progress=False, engine_cls=engine_cls,
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
        if _is_rank0():
            how = f"from reference seed {seed}'s init, its batches" if kind == "paired" else \
                f"from its own init, seed {seed}"
            print(f"candidate run {i}/{len(plan)}: {kind}, {how}, {vcfg.curve_steps} steps", file=sys.stderr,
                  flush=True)
        state = init() if callable(init) else init
        d = out / (f"candidate_paired_seed{seed}" if kind == "paired" else f"candidate_seed{seed}")
        (paired if kind == "paired" else unpaired).append(
            run_candidate(cfg, vq, d, vcfg.curve_steps, state, engine_cls, seed=seed, final_params=False) / "trace")
        del state
        _release_device_memory()
    return CurveRuns(tuple(paired), tuple(unpaired))


def _release_device_memory() -> None:
    """Between two engines in one process: drop the finished one's compiled graphs and cached device memory, so
    the next one starts with the device's memory free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch._dynamo.reset()  # compiled frames keep the finished engine's modules alive
        gc.collect()
        torch.cuda.empty_cache()


def _golden_init_hashes(gdir: Path, seeds: list) -> dict | None:
    """``{seed: sha256}`` of each seed's reference init stored in the golden (``seed_<N>/init.json``), or None
    when any seed lacks one (a golden made before init hashes were stored). Raises ConfigError on a damaged
    file."""
    import json

    out = {}
    for s in seeds:
        f = gdir / f"seed_{s}" / "init.json"
        if not f.is_file():
            return None
        try:
            out[s] = str(json.loads(f.read_text())["sha256"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{f} is damaged ({type(e).__name__}: {e}); remake it with verify.pin_init=true "
                              f"\"verify.seeds=[{s}]\"") from e
    return out


def golden_init(cfg: RunConfig, vcfg: VerifyConfig, gdir: Path, seed: int, sha: str) -> dict:
    """Seed ``seed``'s reference init for a paired run against the golden ``gdir``: from ``verify.init_cache`` when
    a copy there still hashes to ``sha``, else regenerated from the seed (:func:`reference_init`) and kept there.
    Raises ConfigError (one line) when the regenerated init's sha256 differs from the golden's: the candidate would
    not start where the golden's reference started."""
    from safetensors.torch import load_file, save

    from forgetrain.trace import atomic_write_bytes

    cache = Path(vcfg.init_cache) / gdir.name / f"seed_{seed}.safetensors" if vcfg.init_cache else None
    if cache is not None and cache.is_file():
        try:
            state = load_file(str(cache))
            if init_sha256(state) == sha:
                return state
        except Exception:  # noqa: BLE001 - a damaged cache entry is regenerated
            pass
        print(f"warning: the cached init {cache} does not hash to the golden's init of seed {seed} (damaged, "
              f"or the golden's hash changed); rebuilding it from the seed", file=sys.stderr)
    state = reference_init(cfg, vcfg, seed)
    got = init_sha256(state)
    if got != sha:
        raise ConfigError(f"the reference init regenerated from seed {seed} has sha256 {got[:16]}..., the golden "
                          f"{gdir.name} stores {sha[:16]}...: this platform, reference version or config does not "
                          f"rebuild the golden's init; judge unpaired (verify.paired=false) or remake the golden "
                          f"(verify.make_golden=true)")
    if cache is not None and _is_rank0():
        atomic_write_bytes(cache, save(state))
    return state


def first_step_problem(cfg: RunConfig, vcfg: VerifyConfig, seed: int, state: dict, trace: Path,
                       tol: dict) -> tuple[str | None, str]:
    """Does the reference init ``state`` (HF layout, rebuilt from ``seed`` on this device) start the golden trace
    ``trace``? The reference runs its step 1 from it on the seed's first batch (the golden's run config, one step)
    and its loss (nats) and grad norm are compared with the trace's step 1, a function of the init
    and that batch alone (the update comes after the norm is taken). It runs at micro-batch 1 whatever the golden's
    (the same global batch, split into more micro-batches: only the rounding differs, far inside the tolerances): ``tol["loss_abs"]`` nats and
    ``tol["grad_norm_rel"]`` of the norm (``conf/tier/loss_curve.yaml``, ``pin:``, where the rationale is).
    Returns (a problem or None, how the hash was recorded). Raises ConfigError when ``tol`` lacks either key."""
    import tempfile

    from forgetrain.trace import read_trace
    from forgetrain.train import train, versions

    if not {"loss_abs", "grad_norm_rel"} <= set(tol):
        raise ConfigError("conf/tier/loss_curve.yaml pin: needs loss_abs and grad_norm_rel")
    want = read_trace(trace)[1][0]
    with tempfile.TemporaryDirectory(prefix="ft_pin_") as tmp:  # a 1-step run: the batch order is a function of
        # the step alone (forgetrain/data/loader.py), and _run_cfg keeps the full run's LR schedule. Micro-batch 1:
        # the same global batch, so the same step-1 loss and gradient up to rounding, at the reference's least
        # activation memory (the 1B real shape's reference needs more than an H100 holds at micro-batch 2).
        run = train(_run_cfg(cfg, Path(tmp), steps=1, digests=False, seed=seed, lr_decay_steps=vcfg.curve_steps,
                             micro_batch_size=1),
                    kind="references", engine_name=vcfg.reference, init_hf=state, progress=False)
        got = read_trace(Path(run) / "trace")[1][0]
    _release_device_memory()
    dl = abs(float(got["loss"]) - float(want["loss"]))
    dg = abs(float(got["grad_norm"]) - float(want["grad_norm"])) / max(abs(float(want["grad_norm"])), 1e-12)
    seen = (f"step 1 loss {got['loss']:.6f} vs the trace's {want['loss']:.6f}, grad norm {got['grad_norm']:.6f} vs "
            f"{want['grad_norm']:.6f}")
    if dl > tol["loss_abs"] or dg > tol["grad_norm_rel"]:
        return (f"does not reproduce the trace's first step ({seen}; tolerance {tol['loss_abs']:g} nats, "
                f"{tol['grad_norm_rel']:.2%} of the norm)"), ""
    return None, (f"regenerated from the seed on {versions().get('gpu')}, another GPU than the trace's, where the "
                  f"reference's first step from it reproduced the trace's ({seen})")


def _write_init_hash(seed_dir: Path, sha: str, n: int, recorded: str) -> str:
    """Write ``seed_dir/init.json``: the sha256 ``sha`` of the reference init a golden seed starts from (``n``
    parameters), how it was recorded, and the versions that made it. Returns the hash."""
    from forgetrain.trace import atomic_write_json
    from forgetrain.train import versions

    atomic_write_json(seed_dir / "init.json", {"sha256": sha, "n_params": n, "recorded": recorded,
                                               "versions": versions()})
    return sha


def pin_init(cfg: RunConfig, vcfg: VerifyConfig, gdir: Path) -> None:
    """``verify.pin_init=true``: for each seed in ``verify.seeds`` of the loss-curve golden ``gdir``, regenerate the
    reference init from the seed and record its sha256 (``init.json``), so the golden allows paired runs. Refused
    (ConfigError) when a seed's trace is missing, or the trace was made with another torch / reference / CUDA
    version or on CPU where this process runs on a GPU (or the reverse): the hash would not prove the trace's init.
    On another GPU model than the trace's (an H100 for an H200 golden), each rebuilt init must first reproduce the
    trace's first step (:func:`first_step_problem`): the reference's step 1 from it, on that seed's first batch,
    must give the trace's loss and grad norm within the tolerances of ``conf/tier/loss_curve.yaml`` (``pin:``),
    else ConfigError and nothing is pinned. With ``verify.init_cache`` the inits are kept there for the paired runs
    that follow."""
    import json

    from forgetrain.train import versions

    traces = _curve_golden_traces(gdir, vcfg)
    now = versions()
    other_gpu = {}
    for s, t in zip(vcfg.seeds, traces):  # every seed first: a refusal pins none
        made = json.loads((t / "meta.json").read_text()).get("versions", {})
        keys = ("torch", "megatron-core", "cuda") if made.get("gpu") else ("torch", "megatron-core", "cpu")
        diff = [f"{k} {made.get(k)} -> {now.get(k)}" for k in keys if made.get(k) != now.get(k)]
        if made.get("gpu") and not now.get("gpu"):
            diff.append(f"gpu {made.get('gpu')} -> none")
        if diff:
            raise ConfigError(f"the golden {t} was made with other versions than this process runs "
                              f"({'; '.join(diff)}); its init cannot be pinned here: remake it with "
                              f"verify.make_golden=true \"verify.seeds=[{s}]\"")
        if made.get("gpu") and made.get("gpu") != now.get("gpu"):
            other_gpu[s] = made["gpu"]
    pin_tol = tier_config("loss_curve", vcfg.reference).get("pin") or {}
    pins = []  # (seed, trace, sha256, n_params, how): written once every seed has passed
    for s, t in zip(vcfg.seeds, traces):
        state = reference_init(cfg, vcfg, s)
        how = "regenerated from the seed after the trace was made, with the trace's versions and device"
        if s in other_gpu:
            problem, how = first_step_problem(cfg, vcfg, s, state, t, pin_tol)
            if problem:
                raise ConfigError(f"seed {s}'s init, rebuilt on {now.get('gpu')} for the golden made on "
                                  f"{other_gpu[s]}, {problem}: no init is pinned here; pin on {other_gpu[s]}")
        pins.append((s, t, init_sha256(state), sum(int(v.numel()) for v in state.values()), how))
        if vcfg.init_cache and _is_rank0():  # the paired runs that follow read it from there (hash-checked)
            from safetensors.torch import save

            from forgetrain.trace import atomic_write_bytes

            atomic_write_bytes(Path(vcfg.init_cache) / gdir.name / f"seed_{s}.safetensors", save(state))
        del state
    if _is_rank0():
        for s, t, sha, n, how in pins:
            _write_init_hash(t.parent, sha, n, how)
            print(f"init of seed {s}: sha256 {sha[:16]}... recorded in {t.parent / 'init.json'}", file=sys.stderr)


def _tier(tier_name: str):
    """The registry Tier called ``tier_name``. Raises ConfigError naming the known tiers."""
    from forgetrain.equivalence import registry

    tier = registry.find(tier_name)
    if tier is None:
        raise ConfigError(f"unknown tier '{tier_name}'; known: {', '.join(registry.TIER_ORDER)}")
    return tier


def tier_config(tier_name: str, reference: str, tier_cfg: dict | None = None) -> dict:
    """The rules of ``tier_name``: ``tier_cfg`` (default ``conf/tier/<tier>.yaml``) with the reference's own,
    versioned overrides merged over it (:func:`_with_reference_overrides`)."""
    from forgetrain import equivalence as eq

    return _with_reference_overrides(dict(tier_cfg or eq.load_tier(tier_name)), reference, tier_name)


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
          oracle: Path | None = None, times: tuple[list, list] | None = None) -> list:
    """The verdicts of ``tier_name`` from traces alone (no engine runs here): ``refs`` are the reference trace
    dirs (one for a pair tier, one per seed for a curve or speed tier), ``cand`` the candidate's trace dir (a
    curve or speed tier also takes a ``CurveRuns`` of paired and unpaired runs), ``oracle`` the
    fp32 oracle trace (a pair tier with ``oracle``, reduced precision), ``times`` (reference step seconds,
    candidate step seconds) for a speed tier, whose curve tier's verdict comes first. Writes the report into
    ``out`` when given (rank 0). Raises ValueError when a speed tier gets no timings."""
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
        verdicts.append(tier.judge()(verdicts[0], times[0], times[1], tier_cfg))
    if out is not None and _is_rank0():
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
    out.mkdir(parents=True, exist_ok=True)
    if tier.kind == registry.PAIR:
        steps = vcfg.steps
        gdir = golden_dir(cfg, tier_name)
        oracle = None
        if vcfg.golden and not (vcfg.regenerate or vcfg.make_golden):
            if not (gdir / "trace" / "trace.jsonl").exists():
                raise ConfigError(f"no golden at {gdir}; run with verify.regenerate=true first")
            _check_golden(gdir)
            ref = gdir
            if tier.oracle and (gdir / "oracle_fp32" / "trace" / "trace.jsonl").exists():
                oracle = gdir / "oracle_fp32"
            if _is_rank0():
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
            if _is_rank0():
                (out / f"reference_seed{s}" / "init.safetensors").unlink(missing_ok=True)
        return []
    cand = curve_candidate_runs(cfg, vcfg, out, inits, engine_cls)
    for init in inits or []:  # a live reference's exported inits: rebuilt from the seed when needed again
        if isinstance(init, Path) and _is_rank0():
            init.unlink(missing_ok=True)
    if _is_rank0():
        shutil.rmtree(out / TEMP_INITS, ignore_errors=True)
    times = None
    if tier.kind == registry.SPEED:
        from forgetrain.bench import side_by_side_step_times

        times = side_by_side_step_times(cfg, vcfg.reference, vcfg.timing_steps, engine_cls=engine_cls)
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
        refs = _curve_golden_traces(gdir, vcfg)
        hashes = _golden_init_hashes(gdir, list(vcfg.seeds)) if want else None
        if _is_rank0():
            print(f"reference: the stored golden {gdir}, seeds {list(vcfg.seeds)} (not re-run)", file=sys.stderr)
        if want and hashes is None:
            why = (f"the golden {gdir.name} lacks the init hash of some seeds, so paired runs cannot start from "
                   f"its inits; record them with verify.pin_init=true")
            if vcfg.paired:
                raise ConfigError(f"verify.paired=true: {why}")
            if _is_rank0():
                print(f"note: judged unpaired only: {why}", file=sys.stderr)
        if hashes is None:
            return refs, None
        # every seed's init rebuilt and checked before any candidate runs (kept in verify.init_cache, else in
        # a directory of the output that verify deletes afterwards), so a wrong hash costs no candidate run
        vc = vcfg if vcfg.init_cache else dataclasses.replace(vcfg, init_cache=str(out / TEMP_INITS))
        for s in vcfg.seeds:
            golden_init(cfg, vc, gdir, s, hashes[s])
        return refs, [lambda s=s: golden_init(cfg, vc, gdir, s, hashes[s]) for s in vcfg.seeds]
    store = (vcfg.regenerate or vcfg.make_golden) and _is_rank0()
    refs, inits = [], []
    for s in vcfg.seeds:
        ref = run_reference(cfg, vq, out / f"reference_seed{s}", vcfg.curve_steps, seed=s, final_params=False,
                            export_init=want or store)
        if store:
            _store_golden(ref, gdir / f"seed_{s}", with_init=False)
            from safetensors.torch import load_file

            state = load_file(str(ref / "init.safetensors"))
            _write_init_hash(gdir / f"seed_{s}", init_sha256(state), sum(int(v.numel()) for v in state.values()),
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

    try:
        ref_cls = registry.load_engine_class("references", vcfg.reference)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - an optional reference whose framework is not installed
        raise ConfigError(f"reference '{vcfg.reference}' cannot be loaded: {type(e).__name__}: {e}") from e
    if getattr(ref_cls, "bench_only", False):
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
    from forgetrain.train import _out_dir

    obj = OmegaConf.to_container(cfg, resolve=True)
    vd, td = obj.pop("verify"), obj.pop("tier")
    rc = to_run_config(obj)
    vcfg = VerifyConfig(**vd)
    if not isinstance(td, dict) or "name" not in td:
        raise ConfigError(f"choose a tier: tier={'|'.join(registry.TIER_ORDER)}")
    from forgetrain.distributed import init_distributed

    env = init_distributed(rc.parallel)  # under torchrun: every rank runs both sides; rank 0 reports
    out = Path(env.broadcast_object(str(Path(vcfg.out_dir) if vcfg.out_dir else _out_dir(rc))))
    verdicts = verify(rc, vcfg, td["name"], out, tier_cfg=td)
    if env.rank == 0:
        from forgetrain.train import _record_config

        _record_config(out, cfg, resume=False)  # beside the report: the request that produced it
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
