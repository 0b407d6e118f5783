"""The sides of ``forgetrain.bench``: which engines are timed, each side's config (``bench.side_recompute``,
``bench.candidate``), how each is built from the same init, what it is in words, and why one cannot run here."""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch

from forgetrain.bench.steps import bench_device
from forgetrain.config import RunConfig, to_run_config


def unavailable_reason(name: str, exc: Exception) -> str:
    """The one-line reason a bench side cannot run in this environment: the ImportError that building it raised
    (e.g. a general framework whose release needs a newer torch), with the torch it met; or the side's own
    :class:`~forgetrain.errors.CannotRunHere` reason (e.g. DeepSpeed's ZeRO-Offload needing more host memory than
    the machine has), as ``<side>: cannot run here: <reason>``. Stored in bench.json under "unavailable" and
    printed in place of its row."""
    from forgetrain.errors import CannotRunHere

    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, CannotRunHere):
        return f"{name}: cannot run here: {first}"
    return f"{name} cannot run here (torch {torch.__version__}): {type(exc).__name__}: {first}"


def side_config(cfg: RunConfig, side_recompute: Optional[str]) -> RunConfig:
    """The config a bench side is built with: ``cfg`` itself, or with ``side_recompute`` (``bench.side_recompute``:
    none | full) as its ``engine.recompute``; under ``none`` the recompute depth (``engine.recompute_num_layers``)
    is dropped too. The forged engine always runs ``cfg``."""
    if side_recompute is None or side_recompute == cfg.engine.recompute:
        return cfg
    rnl = cfg.engine.recompute_num_layers if side_recompute == "full" else None
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, recompute=side_recompute,
                                                               recompute_num_layers=rnl))


# What a candidate may change: how the forged engine runs, never what it trains (the rows' MFU and tokens/s are the
# workload's, computed once from the forged config).
CANDIDATE_GROUPS = ("engine", "kernels")


def candidate_config(obj: dict, candidate, world_size: int = 1) -> Optional[RunConfig]:
    """The run config of ``bench.candidate`` (dotted key -> value, e.g. {"kernels.swiglu": "triton"}) applied to
    ``obj``, the composed config as a plain dict (keys outside RunConfig's groups are ignored). The values are typed
    by the group's schema as a command-line override is (OmegaConf: "yes" is a bool, 1.5 is not an int), then the
    run is validated like any run (:func:`forgetrain.config.validate`: a switch's needs, sealed kernels, memory),
    after the configured run itself, so that a mistake in it is not blamed on the candidate. None when
    ``candidate`` is None or empty. Raises ConfigError for a candidate that is not a dict, a key outside
    :data:`CANDIDATE_GROUPS`, a key the group does not have, a value of the wrong type, or a value the config
    refuses."""
    if candidate is None or (isinstance(candidate, dict) and not candidate):
        return None
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import typing

    from forgetrain.config import validate
    from forgetrain.errors import ConfigError

    if not isinstance(candidate, dict):
        raise ConfigError(f"bench.candidate must be a dict of overrides, e.g. bench.candidate={{kernels.swiglu:triton}}"
                          f" (null or {{}}: no candidate), got {type(candidate).__name__} {candidate!r}")
    hints = typing.get_type_hints(RunConfig)
    schemas = {g: hints[g] for g in CANDIDATE_GROUPS}  # EngineOptions, KernelsConfig
    run_keys = {f.name for f in dataclasses.fields(RunConfig)}
    plain = {k: v for k, v in obj.items() if k in run_keys}
    validate(to_run_config(plain), world_size=world_size)  # the configured run first: its own errors, unprefixed
    nodes = {g: OmegaConf.merge(OmegaConf.structured(cls), plain.get(g) or {}) for g, cls in schemas.items()}
    for key, value in candidate.items():
        group, _, name = str(key).partition(".")
        if group not in CANDIDATE_GROUPS or not name or "." in name:
            raise ConfigError(f"bench.candidate key '{key}' must be <group>.<name> with group "
                              f"{' or '.join(CANDIDATE_GROUPS)} (the candidate changes how the engine runs, "
                              f"not the workload)")
        if name not in nodes[group]:
            raise ConfigError(f"bench.candidate key '{key}': {group} has no '{name}' "
                              f"(known: {', '.join(sorted(nodes[group]))})")
        try:
            nodes[group][name] = value
        except OmegaConfBaseException as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"bench.candidate key '{key}': {why}") from None
    rc = to_run_config({**plain, **{g: OmegaConf.to_object(n) for g, n in nodes.items()}})
    try:
        return validate(rc, world_size=world_size)
    except ConfigError as e:
        raise ConfigError(f"bench.candidate: {e}") from None


def value_text(v) -> str:
    """A candidate value as the command line writes it (true, false, null; the rest as str)."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def side_label(name: str, cfg: Optional[RunConfig] = None) -> str:
    """What side ``name`` is, in words, for the table's legend, each row's "label" and the block lines: the forged
    engine (of ``cfg``'s scenario), the candidate, or a reference's ``bench_label`` (megatron: "Megatron-core
    0.16.1 local spec (no Transformer Engine)"); a reference without one, or one that cannot be imported here, is
    its name."""
    if name in ("forged", "candidate"):
        what = f"forged engine of scenario {cfg.scenario.name}" if cfg is not None else "forged engine"
        return what if name == "forged" else f"{what} with bench.candidate's overrides"
    from forgetrain import registry

    try:
        return getattr(registry.load_engine_class("references", name), "bench_label", name)
    except Exception:  # noqa: BLE001 - unknown here, or its framework cannot be imported: the name says it
        return name


def make_side(name: str, cfg: RunConfig, device: torch.device):
    """Build reference ``name`` as a bench side. A reference whose spec declares ``bench_side`` is built with
    ``bench_side=True``: the timed form a user of that framework runs (references/deepspeed: SDPA attention, no
    gradient snapshot or per-token losses, which only the equivalence harness reads). The bench is the one place
    that says "this engine is being timed"; what that means is each reference's own (its module doc). ``cfg`` is
    the side's config (:func:`side_config`)."""
    from forgetrain import registry
    from forgetrain.levers import spec_of

    cls = registry.load_engine_class("references", name)
    if spec_of(cls).bench_side:
        return cls(cfg, device, bench_side=True)
    return cls(cfg, device)


def oom_reason(exc: BaseException, stage: str) -> str:
    """Why a bench side ran out of device memory, in one line: where (``stage``: building the engine, or which
    step) and the numbers of torch's CUDA caching allocator message (the request, what PyTorch had allocated, the
    device's capacity; torch's ``c10/cuda/CUDACachingAllocator.cpp`` words it "Tried to allocate X. GPU 0 has a
    total capacity of Y of which Z is free ... Of the allocated memory A is allocated by PyTorch"). Falls back to
    the message's first line when it is worded otherwise. Stored in bench.json under "oom_reason"."""
    msg = str(exc)
    found = {k: re.search(rx, msg) for k, rx in (("asked", r"Tried to allocate ([\d.]+ [KMGT]?i?B)"),
                                                  ("capacity", r"total capacity of ([\d.]+ [KMGT]?i?B)"),
                                                  ("free", r"of which ([\d.]+ [KMGT]?i?B) is free"),
                                                  ("held", r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch"))}
    if found["asked"] and found["held"] and found["capacity"]:
        why = (f"asked for {found['asked'].group(1)} more with {found['held'].group(1)} allocated by PyTorch "
               f"of the device's {found['capacity'].group(1)}"
               + (f" ({found['free'].group(1)} free)" if found["free"] else ""))
    else:
        why = (msg.strip().splitlines() or ["(no message)"])[0][:300]
    return f"out of memory while {stage}: {why}"


def build_sides(cfg: RunConfig, against: list[str], engine_cls=None, unavailable: Optional[dict] = None,
                side_recompute: Optional[str] = None, candidate: Optional[RunConfig] = None) -> dict:
    """{"forged": engine, "candidate": engine (with ``candidate``, :func:`candidate_config`), "<ref>": engine,
    ...}, all loaded with the first reference's (or forged) init. A side
    whose construction raises ImportError or CannotRunHere is left out and, when ``unavailable`` is given, its
    :func:`unavailable_reason` is stored there (side -> line); without it the error propagates. The sides are
    built with :func:`side_config` (``side_recompute``), the forged engine with ``cfg``."""
    from forgetrain import registry
    from forgetrain.errors import CannotRunHere

    device = bench_device(cfg)
    sides = {}
    init = None
    for name in against:
        torch.manual_seed(cfg.train.seed)
        try:
            eng = make_side(name, side_config(cfg, side_recompute), device)
        except (ImportError, CannotRunHere) as e:
            if unavailable is None:
                raise
            unavailable[name] = unavailable_reason(name, e)
            continue
        if init is None:
            init = eng.export_hf_weights()
        else:
            eng.load_hf_weights(init)
        sides[name] = eng
    torch.manual_seed(cfg.train.seed)
    forged = (engine_cls or registry.resolve_engine(cfg.scenario.engine))(cfg, device)
    if init is not None:
        forged.load_hf_weights(init)
    out = {"forged": forged}
    if candidate is not None:
        torch.manual_seed(cfg.train.seed)
        out["candidate"] = registry.resolve_engine(candidate.scenario.engine)(candidate, device)
        out["candidate"].load_hf_weights(init if init is not None else forged.export_hf_weights())
    return {**out, **sides}


def engine_info(eng) -> dict | None:
    """What an engine says about how it ran (its optional ``bench_info`` dict, e.g. the forged Hopper engine's
    gradient-accumulation GEMM path); stored under "engine_info" in bench.json."""
    return getattr(eng, "bench_info", None)


def bytes_per_engine(cfg: RunConfig) -> float:
    """The forged engine's estimated step footprint (``forgetrain.memory.estimate``), bytes per GPU."""
    from forgetrain.memory import estimate

    return float(estimate(cfg).total_bytes)


def check_sides(rc: RunConfig, against: list) -> None:
    """Each side's own refusal of this run before anything is built: a reference's optional ``check_run(cfg)``
    classmethod (e.g. the torchao float8 sides, on a machine without FP8 GEMMs). Raises ConfigError."""
    from forgetrain import registry

    for name in against:
        check = getattr(registry.load_engine_class("references", name), "check_run", None)
        if check is not None:
            check(rc)


def recompute_warnings(rc, against: list, side_recompute: Optional[str] = None) -> list[str]:
    """One ``warning:`` line per side in ``against`` whose engine has no activation recompute
    (its spec's ``recompute``, :func:`forgetrain.levers.spec_of`) while its config (:func:`side_config`: ``engine.recompute`` or ``side_recompute``)
    asks for it: that side stores its activations; or that recomputes every layer (no
    ``recompute_num_layers``) while ``engine.recompute_num_layers`` asks for fewer."""
    from forgetrain import registry
    from forgetrain.levers import spec_of

    rc = side_config(rc, side_recompute)
    if rc.engine.recompute == "none":
        return []
    out = []
    rnl = rc.engine.recompute_num_layers
    asked = (f"bench.side_recompute={side_recompute} applies to the sides that implement it"
             if side_recompute is not None else
             f"engine.recompute={rc.engine.recompute} applies to the forged engine and the sides that implement it")
    for n in against:
        cls = registry.load_engine_class("references", n)
        spec = spec_of(cls)
        if not spec.recompute:
            out.append(f"warning: bench side '{n}' has no activation recompute; it runs with its activations stored "
                       f"({asked})")
        elif rnl is not None and not spec.recompute_num_layers:
            out.append(f"warning: bench side '{n}' recomputes every layer; engine.recompute_num_layers={rnl} "
                       f"applies to the forged engine and the sides that implement it")
    return out


def single_micro_batch_config(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with one micro-batch per step: train.global_batch_size = micro-batch x DP."""
    t = cfg.train
    return dataclasses.replace(cfg, train=dataclasses.replace(
        t, global_batch_size=t.micro_batch_size * cfg.parallel.data_parallel_size))
