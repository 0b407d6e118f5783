"""Hydra entry points. ``python -m forgetrain [overrides]`` trains; ``-m`` runs sweeps.

Every action is ``python -m forgetrain.<action>``: ``prepare``, ``verify``, ``bench``, ``kernels``, ``forge``.
Bad input (unknown scenario or key, invalid values, missing/corrupt data) ends with one line on stderr
(``error: ...``) and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

_HYDRA_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "--version", "--shell-completion",
                "--multirun", "-m", "--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp",
                "--resolve", "--package", "-p", "--experimental-rerun")


# FutureWarnings that the libraries raise about their own or torch's deprecated APIs (a warning is attributed to
# the module that its stacklevel points at): not the user's to act on. A FutureWarning from the user's own code,
# or from torch about a call in the user's code, still shows.
LIBRARY_WARNING_MODULES = r"(torch|megatron|deepspeed|torchtitan|transformer_engine|apex)(\..*)?$"


def quiet_libraries() -> None:
    """Silence the reference libraries' start-up noise: their FutureWarnings (:data:`LIBRARY_WARNING_MODULES`), the
    missing Transformer Engine / Apex notices, torch.distributed's and megatron's info logs."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=LIBRARY_WARNING_MODULES)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def precheck_overrides(config_name: str, argv: list[str]) -> None:
    """Compose and validate the run (every job of a ``-m`` sweep) with Hydra's compose API before Hydra creates
    anything, so that a mistake is one ConfigError line and writes nothing.

    Skipped when Hydra's other flags are present (--cfg, --info, --config-name ...), which Hydra itself handles.
    Raises ConfigError.
    """
    from forgetrain.errors import ConfigError

    flags = [a for a in argv if a in _HYDRA_FLAGS or a.split("=")[0] in _HYDRA_FLAGS]
    multirun = any(a in ("-m", "--multirun") for a in flags)
    if len(flags) > sum(a in ("-m", "--multirun") for a in flags):
        return
    overrides = [a for a in argv if a not in ("-m", "--multirun") and not a.startswith(("hydra.", "+hydra."))]
    from forgetrain import registry
    from forgetrain.config import register_configs

    register_configs()
    if config_name in ("verify", "bench", "forge"):
        importlib.import_module(f"forgetrain.{config_name}").register()
    for o in overrides:  # friendlier message for the most common mistake
        if o.startswith("scenario=") and o.split("=", 1)[1] not in registry.scenarios():
            raise ConfigError(f"unknown scenario '{o.split('=', 1)[1]}'; known scenarios: "
                              f"{', '.join(registry.scenarios())}")
    jobs, swept = _sweep_jobs(overrides) if multirun else ([overrides], [])
    out_dirs: dict[str, int] = {}
    for num, job in enumerate(jobs):
        try:
            out = check_job(config_name, job)
        except ConfigError as e:
            if len(jobs) == 1:
                raise
            raise ConfigError(f"sweep job #{num} ({' '.join(job[i] for i in swept)}): {e}") from None
        if out:
            out_dirs[out] = out_dirs.get(out, 0) + 1
    for out, n in out_dirs.items():
        if n > 1:
            raise ConfigError(f"{n} jobs of the sweep would share the output directory {out}; leave train.out_dir "
                              f"unset (each job gets its own directory under hydra.sweep.dir) or sweep it too")


def compose_config(config_name: str, overrides: list[str], hydra_node: bool = False, hint: bool = True):
    """Hydra's compose API over ForgeTrain's conf dir (with the ``hydra`` node when ``hydra_node``); Hydra's and
    OmegaConf's errors become one ConfigError line (with a did-you-mean for an unknown key unless ``hint`` is
    false: the suggestion's own composition never looks for one, so a key it cannot drop costs one retry, not a
    recursion of compositions)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from forgetrain.errors import ConfigError

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra_node)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        msg = lines[0] if lines else type(e).__name__
        cause = str(e.__cause__).strip().splitlines()[0] if e.__cause__ is not None and str(e.__cause__).strip() else None
        detail = cause or (lines[1] if len(lines) > 1 and not lines[1].startswith(("See ", "full_key")) else None)
        for i, x in enumerate(lines):
            if x.startswith("Available options"):
                opts = []
                for y in lines[i + 1:]:
                    if y.startswith("Config search path"):
                        break
                    if not y.endswith("_schema"):
                        opts.append(y)
                detail = x.rstrip(":") + ": " + ", ".join(opts)
        unknown = _unknown_option(msg, detail)
        if unknown:
            raise ConfigError(unknown) from None
        bad = getattr(e.__cause__, "full_key", None) or getattr(e, "full_key", None)
        close = _did_you_mean(config_name, overrides, bad) if hint and bad and "not in" in f"{detail} {msg}" else None
        if close:
            detail = f"{detail}; did you mean {close}?" if detail else f"did you mean {close}?"
        raise ConfigError(f"{msg}" + (f" ({detail})" if detail else "")) from None


def _unknown_option(msg: str, detail: str | None) -> str | None:
    """Hydra's "In 'verify': Could not find 'tier/bitwse'" with its "Available options in 'tier': ..." as one line
    in the field's words, "unknown tier 'bitwse'; did you mean tier=bitwise? (known: bitwise, ...)", or None when
    ``msg`` is another error."""
    import difflib
    import re

    m = re.search(r"Could not find '([\w/]+)/([^']+)'", msg)
    known = re.match(r"Available options in '[^']+': (.*)", detail or "")
    if not (m and known):
        return None
    group, name = m.groups()
    opts = [o.strip() for o in known.group(1).split(",") if o.strip()]
    close = difflib.get_close_matches(name, opts, n=1)
    hint = f"; did you mean {group}={close[0]}?" if close else ""
    return f"unknown {group} '{name}'{hint} (known: {', '.join(opts)})"


def _did_you_mean(config_name: str, overrides: list[str], bad: str) -> str | None:
    """The known key closest to the unknown ``bad`` (``train.lrr`` -> ``train.lr``), or None."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = bad.rpartition(".")
    def related(key: str) -> bool:  # the bad key itself, a key under it, or one above it (a dict value that holds it)
        return (key + ".").startswith(bad + ".") or (bad + ".").startswith(key + ".")

    rest = [o for o in overrides if not related(o.lstrip("+~").split("=")[0])]
    try:
        cfg = compose_config(config_name, rest, hint=False)
    except Exception:  # noqa: BLE001 - no suggestion then
        return None
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return None
    close = difflib.get_close_matches(leaf, [str(k) for k in node.keys()], n=1)
    return f"{parent + '.' if parent else ''}{close[0]}" if close else None


def _sweep_jobs(overrides: list[str]) -> tuple[list[list[str]], list[int]]:
    """The override list of every job of a ``-m`` sweep, expanded the way Hydra's basic sweeper does (the
    cartesian product of every ``key=a,b,...`` choice, in order), and the positions of the swept overrides.
    Raises ConfigError on a malformed override."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from forgetrain.errors import ConfigError

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)) from None
    lists = []
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            lists.append([f"{key}={o.get_value_element_as_str()}"])
        elif o.is_discrete_sweep():
            lists.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            raise ConfigError(f"{o.input_line}: the basic sweeper runs choice and range sweeps only")
    return [list(x) for x in itertools.product(*lists)], [i for i, x in enumerate(lists) if len(x) > 1]


def check_job(config_name: str, overrides: list[str]) -> str | None:
    """Compose one run and validate its values and output directories. Returns its train.out_dir (None when
    unset). Raises ConfigError."""
    from omegaconf import OmegaConf, open_dict

    from forgetrain.config import check_model_choice, check_scenario_choice, to_run_config, validate

    if config_name == "forge":  # a value whose type composing loses (agent.command=true is a boolean)
        importlib.import_module("forgetrain.forge").check_overrides(overrides)
    cfg = compose_config(config_name, overrides, hydra_node=True)
    choices = OmegaConf.select(cfg, "hydra.runtime.choices")
    with open_dict(cfg):
        del cfg["hydra"]
    obj = OmegaConf.to_container(cfg, resolve=True)
    scenario = str(obj.get("scenario", {}).get("name"))
    check_scenario_choice(scenario, choices.get("scenario"))
    check_model_choice(str(obj.get("model", {}).get("name")), choices.get("model"), scenario)
    if config_name in ("verify", "bench", "forge"):  # the command's own request (tier, references, kernel...)
        importlib.import_module(f"forgetrain.{config_name}").check_request(obj)
    for extra in ("verify", "bench", "forge"):  # their own output directories, checked like train.out_dir
        check_out_dir(f"{extra}.out_dir", (obj.get(extra) or {}).get("out_dir"))
    for extra in ("verify", "tier", "bench", "forge", "agent"):
        obj.pop(extra, None)
    out = obj.get("train", {}).get("out_dir")
    check_out_dir("train.out_dir", out)
    # the forge's scenario engine is the seed its agent adapts (forgetrain.forge.loop.forge validates it so)
    validate(to_run_config(obj), world_size=int(os.environ.get("WORLD_SIZE", "1")), template=config_name == "forge")
    return os.path.abspath(out) if out else None


def _help(config_name: str, argv: list[str]) -> str:
    """``--help``: :func:`forgetrain.usage.help_text` for this command line's composition (the defaults' when the
    command line does not compose)."""
    from forgetrain.config import register_configs
    from forgetrain.errors import ConfigError
    from forgetrain.usage import help_text

    register_configs()
    if config_name in ("verify", "bench", "forge"):
        importlib.import_module(f"forgetrain.{config_name}").register()
    overrides = [a for a in argv if not a.startswith("-") and "=" in a and not a.startswith(("hydra.", "+hydra."))]
    try:
        cfg = compose_config(config_name, overrides)
    except ConfigError:
        cfg = compose_config(config_name, [])
    return help_text(config_name, cfg, CONF_DIR)


def check_out_dir(key: str, path) -> None:
    """An output directory must be creatable and writable: the nearest existing ancestor is a writable
    directory. Checked before Hydra creates anything; a directory that already exists is remembered, so that a
    rejected run never removes it. Raises ConfigError naming ``key``."""
    from pathlib import Path

    from forgetrain.errors import ConfigError

    if not path:
        return
    if os.path.isdir(path):  # a rejected run must not remove a directory it did not create
        _PREEXISTING.add(os.path.abspath(path))
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    _STOPS.add(str(p))  # the nearest directory that exists: a rejected run's cleanup stops below it
    if not p.is_dir():
        raise ConfigError(f"{key}={path} cannot be created: {p} is a file, not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path} cannot be created: {p} is not writable")


def _triton_interpreter_default() -> None:
    """Without a CUDA device, Triton kernels (``kernels.*=triton``) run in Triton's CPU interpreter, which reads
    ``TRITON_INTERPRET`` when Triton is first imported. megatron-core imports Triton too, before any forged kernel
    module, so the variable is set here, at the start of every command, unless the caller has set it."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def run_hydra(config_name: str, task, argv: list[str] | None = None) -> None:
    """Run ``task(cfg)`` under ``@hydra.main`` with ForgeTrain's conf dir and one-line error handling."""
    import hydra

    from forgetrain.config import register_configs
    from forgetrain.errors import ForgeTrainError, print_error

    quiet_libraries()
    _triton_interpreter_default()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if "--help" in argv or "-h" in argv:  # the command's own help, not Hydra's generic one (--hydra-help)
            print(_help(config_name, argv))
            sys.exit(0)
        precheck_overrides(config_name, argv)
    except ForgeTrainError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # every torchrun rank checks the same config: one says so
            print_error(str(e))
        sys.exit(e.exit_code)
    register_configs()

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    def _main(cfg):
        try:
            return task(cfg)
        except ForgeTrainError as e:
            print_error(str(e))
            _remove_empty_run_dir()
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            print_error("interrupted")
            sys.exit(130)
        except OSError as e:  # a full disk anywhere: one line (errors.full_disk_line), other OSErrors propagate
            from forgetrain.errors import full_disk_line

            line = full_disk_line(e)
            if line is None:
                raise
            print_error(line)
            sys.exit(1)
        except MemoryError as e:  # torch.OutOfMemoryError is not one; see _out_of_memory_line
            print(f"error: out of host memory: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        except RuntimeError as e:
            line = _out_of_memory_line(e)
            if line is None:
                raise
            print(line, file=sys.stderr, flush=True)
            _remove_empty_run_dir()
            sys.exit(1)
        finally:
            from forgetrain.distributed import destroy_process_group

            destroy_process_group()  # a torchrun group too: an NCCL group left to its destructor stalls the exit

    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _main()


def _out_of_memory_line(e: BaseException) -> str | None:
    """The one ``error:`` line for a device out-of-memory error (``torch.OutOfMemoryError``, a RuntimeError),
    with the allocator's own figures and what to change; None for any other error."""
    import torch

    if not isinstance(e, torch.OutOfMemoryError):
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"
    first = first.split(" See documentation")[0].split(" If reserved but unallocated")[0].rstrip()
    return (f"error: out of GPU memory ({first}); lower train.micro_batch_size (gradient accumulation keeps the "
            f"global batch), the model size or train.seq_length")


def train_task(cfg) -> None:
    from forgetrain.config import to_run_config
    from forgetrain.distributed import collective_errors
    from forgetrain.train import train

    rc = to_run_config(cfg)
    with collective_errors(rc.parallel.timeout_s):  # a dead/hung peer rank -> one line, exit 1
        train(rc, record=cfg)


def _remove_empty_run_dir() -> None:
    """After a rejected run: remove the run directory Hydra created for it, if it is still empty (a directory
    that existed before the run is left alone)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        d = HydraConfig.get().runtime.output_dir
    except Exception:  # noqa: BLE001 - not under Hydra
        return
    d = os.path.abspath(d) if d else None
    below = [os.path.abspath(os.getcwd()), *_STOPS]
    first = True
    while d and d not in _PREEXISTING and d not in _STOPS \
            and (first or any(d.startswith(b + os.sep) for b in below)) and os.path.isdir(d) and not os.listdir(d):
        # and the empty parents Hydra made for it: outputs/<scenario>/ up to the working directory, or those of a
        # given out_dir up to the nearest directory that existed before the command
        os.rmdir(d)
        d, first = os.path.dirname(d), False


_PREEXISTING: set[str] = set()  # output directories that existed before this command started
_STOPS: set[str] = set()  # for each given output directory, its nearest ancestor that existed before the command


def main() -> None:
    run_hydra("config", train_task)
