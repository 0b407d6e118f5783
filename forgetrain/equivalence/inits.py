"""The reference inits of the loss-curve goldens: what a golden's seed directory holds beside its trace, and how
verify rebuilds and pins the init a seed's reference run started from.

A loss-curve golden (``<scenario>-loss_curve-<hash>/seed_<N>/``, :func:`forgetrain.verify.curve_golden_dir`) keeps
per seed its reference trace (``trace/``) and, where recorded, ``init.json``: the sha256 of the reference init
(HF layout, :func:`init_sha256`), its parameter count, how it was recorded and the versions that made it. The init
itself is not stored: it is rebuilt from the seed (:func:`reference_init`) and checked against that hash
(:func:`golden_init`), so a paired run starts exactly where the golden's reference started. ``verify.pin_init=true``
records the hash for a golden made before hashes were kept (:func:`pin_init`; on another GPU model than the
trace's, each rebuilt init must first reproduce the trace's step 1: :func:`first_step_problem`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from forgetrain.distributed import free_device, is_rank0
from forgetrain.equivalence.runs import run_cfg
from forgetrain.equivalence.verdict import tier_config
from forgetrain.errors import ConfigError

if TYPE_CHECKING:
    from forgetrain.config import RunConfig
    from forgetrain.verify import VerifyConfig


def curve_golden_traces(gdir: Path, vcfg: VerifyConfig) -> list[Path]:
    """The stored reference trace directories ``gdir/seed_<N>/trace`` of every seed in ``vcfg.seeds``, in that
    order. Raises ConfigError naming the missing or damaged seeds (or a trace that is not a ``curve_steps``-step
    run of ``vcfg.reference``) and the command that makes them."""
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


def golden_init_hashes(gdir: Path, seeds: list) -> dict | None:
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

    rc = run_cfg(cfg, Path("."), steps=vcfg.curve_steps, digests=False, seed=seed)
    set_deterministic(rc.train.deterministic, rc.hardware.device)
    device = torch.device("cpu" if rc.hardware.device == "cpu" else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    engine = build_engine(rc, device, registry.load_engine_class("references", vcfg.reference))
    state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in engine.export_hf_weights().items()}
    del engine
    free_device()
    return state


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
    if cache is not None and is_rank0():
        atomic_write_bytes(cache, save(state))
    return state


def first_step_problem(cfg: RunConfig, vcfg: VerifyConfig, seed: int, state: dict, trace: Path,
                       tol: dict) -> tuple[str | None, str]:
    """Does the reference init ``state`` (HF layout, rebuilt from ``seed`` on this device) start the golden trace
    ``trace``? The reference runs its step 1 from it on the seed's first batch (the golden's run config, one step)
    and its loss (nats) and grad norm are compared with the trace's step 1, a function of the init and that batch
    alone (the update comes after the norm is taken). It runs at micro-batch 1 whatever the golden's (the same
    global batch, split into more micro-batches: only the rounding differs, far inside the tolerances):
    ``tol["loss_abs"]`` nats and ``tol["grad_norm_rel"]`` of the norm (``conf/tier/loss_curve.yaml``, ``pin:``,
    where the rationale is).
    Returns (a problem or None, how the hash was recorded). Raises ConfigError when ``tol`` lacks either key."""
    import tempfile

    from forgetrain.trace import read_trace
    from forgetrain.train import train, versions

    if not {"loss_abs", "grad_norm_rel"} <= set(tol):
        raise ConfigError("conf/tier/loss_curve.yaml pin: needs loss_abs and grad_norm_rel")
    want = read_trace(trace)[1][0]
    with tempfile.TemporaryDirectory(prefix="ft_pin_") as tmp:  # a 1-step run: the batch order is a function of
        # the step alone (forgetrain/data/loader.py), and run_cfg keeps the full run's LR schedule. Micro-batch 1:
        # the same global batch, so the same step-1 loss and gradient up to rounding, at the reference's least
        # activation memory (the 1B real shape's reference needs more than an H100 holds at micro-batch 2).
        run = train(run_cfg(cfg, Path(tmp), steps=1, digests=False, seed=seed, lr_decay_steps=vcfg.curve_steps,
                             micro_batch_size=1),
                    kind="references", engine_name=vcfg.reference, init_hf=state, progress=False)
        got = read_trace(Path(run) / "trace")[1][0]
    free_device()
    dl = abs(float(got["loss"]) - float(want["loss"]))
    dg = abs(float(got["grad_norm"]) - float(want["grad_norm"])) / max(abs(float(want["grad_norm"])), 1e-12)
    seen = (f"step 1 loss {got['loss']:.6f} vs the trace's {want['loss']:.6f}, grad norm {got['grad_norm']:.6f} vs "
            f"{want['grad_norm']:.6f}")
    if dl > tol["loss_abs"] or dg > tol["grad_norm_rel"]:
        return (f"does not reproduce the trace's first step ({seen}; tolerance {tol['loss_abs']:g} nats, "
                f"{tol['grad_norm_rel']:.2%} of the norm)"), ""
    return None, (f"regenerated from the seed on {versions().get('gpu')}, another GPU than the trace's, where the "
                  f"reference's first step from it reproduced the trace's ({seen})")


def write_init_hash(seed_dir: Path, sha: str, n: int, recorded: str) -> str:
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

    traces = curve_golden_traces(gdir, vcfg)
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
        if vcfg.init_cache and is_rank0():  # the paired runs that follow read it from there (hash-checked)
            from safetensors.torch import save

            from forgetrain.trace import atomic_write_bytes

            atomic_write_bytes(Path(vcfg.init_cache) / gdir.name / f"seed_{s}.safetensors", save(state))
        del state
    if is_rank0():
        for s, t, sha, n, how in pins:
            write_init_hash(t.parent, sha, n, how)
            print(f"init of seed {s}: sha256 {sha[:16]}... recorded in {t.parent / 'init.json'}", file=sys.stderr)
