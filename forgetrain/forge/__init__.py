"""The forge loop (docs/design.md and docs/forge.md): brief -> agent -> guard -> ladder -> record -> learn -> seal.

``python -m forgetrain.forge scenario=NAME agent.command="..." forge.max_rounds=N forge.target_tier=bitwise``
(or ``kernel=NAME``: the kernel target, :mod:`.kernel`) drives any coding-agent CLI (a command that takes a prompt and edits files) inside a harness-owned git
*workspace* seeded from ``scenarios/NAME/``. See docs/forge.md for the workflow and real agent command lines.

Pieces (each its own module): :mod:`.workspace` (seeding, git snapshots, the write guard, loading the candidate
engine from source), :mod:`.brief` (the per-round brief), :mod:`.knowledge` (the cross-run knowledge base),
:mod:`.sandbox` (the escape classes, the gate set, the checks outside the candidate), :mod:`.runtime_guard` (the
audit hook in the candidate's process), :mod:`.isolate` (the operating system's isolation of that process),
:mod:`.secret` (each gate run's secret values and data window), :mod:`.recheck` (the judge's checks of a trace),
:mod:`.content` (the content check against the reference frameworks), :mod:`.bracket` (what the judge reads
outside the repository, around every round), :mod:`.procs` (the agent and the ladder as processes),
:mod:`._ladder` (the gates and the verdict), :mod:`._golden` and :mod:`._candidate` (the reference's and the
candidate's processes), :mod:`.loop` (the rounds, state, log), :mod:`.startup` (the checks before a run, the run dir's lock),
:mod:`.report` (the closing table), :mod:`.seal` (the installed copy's re-check, the seal), :mod:`.install` (copy a
sealed engine into ``scenarios/``).

This module holds the Hydra schema (``forge_schema``, registered by :func:`register`) and the entry point; it
imports neither torch nor megatron. Neither the loop nor the ladder imports a candidate engine: the candidate
runs in a process of its own (docs/forge.md, threat model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from forgetrain.config import RunConfig

MODES = ("full", "goal_only")


@dataclass
class AgentConfig:
    """The coding agent: any CLI that takes a prompt and edits files in its working directory."""

    # Shell command run in the workspace each round. ``{brief}`` -> path of BRIEF.md, ``{workspace}`` -> the
    # workspace dir, ``{round}`` -> the round number; $FORGE_BRIEF holds the brief's path. stdin is empty: an
    # agent that reads its prompt from stdin gets it with ``< {brief}``.
    command: Optional[str] = None
    timeout_s: float = 1800.0  # wall-clock limit per round; the agent's process group is killed past it


@dataclass
class ForgeOptions:
    """Options of the forge loop (``forge.*``)."""

    max_rounds: int = 5  # agent rounds (the baseline ladder run is round 0 and does not count)
    target_tier: str = "bitwise"  # bitwise | tolerance | loss_curve | surpass: stop and seal once reached
    target_mfu_pct: Optional[float] = None  # also require this candidate MFU (%) before sealing; None: tier only
    ladder_from: str = "bitwise"  # strictest tier the ladder tries first (skip tiers known to be out of reach)
    mode: str = "full"  # full (evidence, lessons, workflow in the brief) | goal_only (goal + gate command only)
    resume: bool = False  # continue an existing run after its last completed round
    overwrite: bool = False  # start over, deleting an existing run in out_dir
    baseline: bool = True  # run the ladder on the seeded engine before round 1 (round 0)
    seed_from: Optional[str] = None  # a sealed engine dir (with seal.json) to start from instead of the template
    kb_path: Optional[str] = None  # knowledge base JSONL; default $FORGETRAIN_CACHE or ~/.cache/forgetrain
    verify_steps: int = 3  # optimizer steps per bitwise/tolerance gate run (the least a run draws)
    verify_steps_max: Optional[int] = None  # the most a gate run draws; None: verify_steps + 2 (forgetrain.forge.secret)
    gate_window: float = 0.5  # fraction of the corpus's documents in each gate run's secret data window
    curve_steps: int = 200  # steps per run for loss_curve / surpass gates
    timing_steps: int = 10  # surpass: timed steps per engine
    reference: str = "megatron"  # the golden reference package under references/
    ladder_timeout_s: float = 900.0  # wall-clock limit of one ladder run (a hung candidate is killed)
    out_dir: Optional[str] = None  # default outputs/forge/<scenario>/<mode>
    install: Optional[str] = None  # after sealing, install the sealed engine into this dir (e.g. scenarios/X)
    # kernel targets (kernel=NAME, forgetrain.forge.kernel); seed_from may name a kernel .py to start from
    kernel_store: Optional[str] = None  # sealed kernel references; default outputs/forge/kernel_store
    kernel_timer: str = "auto"  # auto (cuda events on CUDA, wall clock on CPU) | cuda | wall | fake (tests only)
    kernel_repeats: int = 30  # timed blocks per side and bench shape in the speed gate (>= 10)


@dataclass
class ForgeRunConfig(RunConfig):
    agent: AgentConfig = field(default_factory=AgentConfig)
    forge: ForgeOptions = field(default_factory=ForgeOptions)
    kernel: Optional[str] = None  # kernel=NAME: forge a kernel of forgetrain.kernels instead of the engine


def register() -> None:
    """Register ``forge_schema`` (and every group schema) with Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    from forgetrain.config import register_configs

    register_configs()
    ConfigStore.instance().store(name="forge_schema", node=ForgeRunConfig)


def check_request(obj: dict) -> None:
    """The forge's own request, checked before Hydra writes anything (``forgetrain.cli``): a ``kernel=NAME`` target
    must name a kernel of :mod:`forgetrain.kernels`; the gate's secret ranges (``forge.verify_steps``,
    ``forge.verify_steps_max``, ``forge.gate_window``) must be sound; and the ``forge.*`` / ``agent.*`` options
    must pass the loop's own checks (the engine loop's or the kernel loop's ``check_request``), so a bad option is one
    line and leaves no Hydra run directory behind. Raises ForgeTrainError."""
    from forgetrain.config import to_run_config

    f = obj.get("forge") or {}
    if "gate_window" in f:
        from forgetrain.forge.secret import declare

        declare(int(f.get("verify_steps") or 1), f.get("verify_steps_max"), float(f["gate_window"]))
    kernel = obj.get("kernel")
    if kernel:
        from forgetrain.kernels import module_of

        module_of(str(kernel))
    agent, opts = AgentConfig(**obj["agent"]), ForgeOptions(**obj["forge"])
    if kernel:
        from forgetrain.forge.kernel import check_request as check_kernel_request

        check_kernel_request(str(kernel), opts, agent)
    else:
        from forgetrain.forge.loop import check_request as check_engine_request

        run_obj = {k: v for k, v in obj.items() if k not in ("agent", "forge", "kernel")}
        check_engine_request(to_run_config(run_obj), opts, agent)


def check_overrides(overrides: list[str]) -> None:
    """The forge's command-line overrides as Hydra parses them, before they are composed (where a value's type is
    lost): ``agent.command=true`` is a boolean, not the shell command ``true``. Raises ForgeTrainError."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from forgetrain.forge.startup import check_agent_command

    for o in OverridesParser.create().parse_overrides([x for x in overrides if x.split("=", 1)[0].lstrip("+~")
                                                       == "agent.command"]):
        if not o.is_delete() and not o.is_sweep_override():
            check_agent_command(o.value())


def forge_task(cfg) -> None:
    import sys

    from omegaconf import OmegaConf

    from forgetrain.config import to_run_config
    from forgetrain.forge.loop import forge

    obj = OmegaConf.to_container(cfg, resolve=True)
    agent, opts = AgentConfig(**obj.pop("agent")), ForgeOptions(**obj.pop("forge"))
    kernel = obj.pop("kernel", None)
    if kernel:
        from forgetrain.forge.kernel import forge_kernel

        state = forge_kernel(to_run_config(obj), kernel, opts, agent)
    else:
        state = forge(to_run_config(obj), opts, agent)
    sys.exit(0 if state.get("status") == "sealed" else 1)


def main() -> None:
    from forgetrain.cli import run_hydra

    register()
    run_hydra("forge", forge_task)


def __getattr__(name):  # lazy: ``from forgetrain.forge import forge`` without importing the loop up front
    if name == "forge":
        from forgetrain.forge.loop import forge

        return forge
    raise AttributeError(name)
