"""Kernel switches: the one declaration of every ``kernels.<op>=<value>`` switch.

Each :class:`Switch` names the op, its default value and every value it accepts; each :class:`Value` states the
weakest equivalence tier an engine running it may be judged at (relaxation is monotonic: the default is the plain
op, bitwise against Megatron-core) and whether it runs a forged Triton kernel of :mod:`forgetrain.kernels`.
Everything else reads this table:

* :class:`forgetrain.config.KernelsConfig` is built from it (one string field per switch, plus
  ``allow_unsealed``), and :func:`forgetrain.config.validate` calls :func:`check`;
* :mod:`forgetrain.kernels` takes its kernel names and public functions from it;
* the switch-matrix tests (tests/test_fast_tiers.py, tests/test_hopper_cpu.py) iterate :func:`matrix`;
* ``python -m forgetrain.kernels switches`` prints it (:func:`table`), and docs/kernels.md points there.

An engine declares the switches it honours in its spec (``EngineSpec.kernel_switches``, forgetrain/levers.py; a
reference's class attribute ``kernel_switches``): a dict whose keys are an
``engine.mode`` (``"fast"``), or a mode and a device type (``"fast/cuda"``), and whose values map a switch to the
non-default values honoured there. A switch set to a non-default value that the engine does not honour in the
configured mode on the configured device is refused (:func:`check`), and so is a forged value whose kernel has no
current seal for the device in ``forgetrain/kernels/registry.json`` (never sealed, or sealed from other source
bytes: STALE), unless ``kernels.allow_unsealed=true``.

This module imports neither torch nor Triton.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from forgetrain.errors import ConfigError

KERNEL_DIR = Path(__file__).resolve().parent
REGISTRY_PATH = KERNEL_DIR / "registry.json"  # the seal registry (forgetrain.kernels.seal writes it)


@dataclasses.dataclass(frozen=True)
class Value:
    """One value of a switch: ``tier`` is the weakest tier it may be judged at end to end; ``forged`` marks the
    value that runs the switch's Triton kernel (it needs a current seal)."""

    name: str
    tier: str
    what: str
    forged: bool = False


@dataclasses.dataclass(frozen=True)
class Switch:
    """``kernels.<name>``. ``kernel``: the module under :mod:`forgetrain.kernels` holding the forged kernel (None:
    the switch has no forged value); ``api``: that module's public functions, the first one being the kernel;
    ``needs``: ``((switch, value), ...)`` that every non-default value of this switch requires (it switches a
    part of that value's code path; :func:`forgetrain.config.validate` refuses it otherwise); ``in_layers``: the
    kernel runs inside the decoder layers, which ``engine.compile`` compiles (on CPU Triton's interpreter cannot run
    there, so validate refuses that pair)."""

    name: str
    default: str
    values: tuple
    kernel: str | None = None
    api: tuple = ()
    needs: tuple = ()
    in_layers: bool = False

    def required(self, value: str) -> dict:
        """``{switch: value}`` that setting this switch to ``value`` needs (``needs``, for every non-default value:
        e.g. ``kernels.ce_chunk=triton`` replaces a part of ``kernels.cross_entropy=chunked``)."""
        return {} if value == self.default else dict(self.needs)

    def value(self, name: str) -> Value | None:
        return next((v for v in self.values if v.name == name), None)

    @property
    def names(self) -> tuple:
        return tuple(v.name for v in self.values)


_TORCH = Value("torch", "bitwise", "the plain torch op, as Megatron-core runs it")
_TRITON = Value("triton", "tolerance", "the forged Triton kernel (validated against an fp64 oracle)", forged=True)

SWITCHES: tuple[Switch, ...] = (
    Switch("rmsnorm", "torch", (_TORCH, _TRITON), "rmsnorm", ("rmsnorm_residual",), in_layers=True),
    Switch("swiglu", "torch", (_TORCH, _TRITON), "swiglu", ("swiglu", "swiglu_packed"), in_layers=True),
    Switch("rope", "torch", (_TORCH, _TRITON), "rope", ("apply_rope", "rope_tables"), in_layers=True),
    Switch("cross_entropy", "torch", (
        Value("torch", "bitwise", "full logits, then cross-entropy"),
        Value("chunked", "tolerance", "LM head + cross-entropy per token chunk (logsumexp form; dW per chunk)"),
        _TRITON), "cross_entropy", ("fused_linear_cross_entropy",)),
    Switch("ce_chunk", "torch", (
        Value("torch", "bitwise", "the chunked LM head's per-chunk cross-entropy as torch ops (compiled by inductor "
                                  "on CUDA)"),
        _TRITON), "ce_chunk", ("ce_chunk",), needs=(("cross_entropy", "chunked"),)),
    Switch("adamw", "torch", (
        Value("torch", "bitwise", "torch's foreach (CUDA) / single-tensor (CPU) AdamW"),
        Value("fused", "tolerance", "torch's fused AdamW kernel (its own FMA order)"),
        _TRITON), "adamw", ("adamw_step",)),
)
BY_NAME = {s.name: s for s in SWITCHES}
OVERRIDE = "allow_unsealed"  # kernels.allow_unsealed=true: run kernels without a current seal


def get(name: str) -> Switch:
    """The switch ``kernels.<name>``. Raises ConfigError naming the known switches."""
    if name not in BY_NAME:
        raise ConfigError(f"unknown kernel switch '{name}'; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def kernels() -> tuple[str, ...]:
    """The forged kernels' module names, in declaration order."""
    return tuple(s.kernel for s in SWITCHES if s.kernel)


def matrix(engine_cls=None, mode: str = "fast", device: str = "cpu") -> list[tuple[str, dict, str]]:
    """Every non-default value of every switch, alone but for the values it needs (:attr:`Switch.needs`):
    ``[(case name, {switch: value, **needed}, declared tier)]``; with ``engine_cls``, only the values it honours
    in ``mode`` on ``device``. The switch-matrix tests parametrize over this, so a new switch or value is tested
    without editing them."""
    ok = honoured(engine_cls, mode, device) if engine_cls is not None else None
    return [(f"{v.name}_{s.name}", {**s.required(v.name), s.name: v.name}, v.tier) for s in SWITCHES
            for v in s.values if v.name != s.default and (ok is None or v.name in ok.get(s.name, ()))]


def tier_of(kernels: dict) -> list[str]:
    """The tiers declared by the switch values in ``kernels`` (``{switch: value}``)."""
    return [get(k).value(v).tier for k, v in kernels.items() if get(k).value(v) is not None]


def set_values(kernels_cfg) -> dict[str, str]:
    """``{switch: value}`` of ``kernels_cfg`` (a KernelsConfig) for the switches not at their default."""
    return {s.name: getattr(kernels_cfg, s.name) for s in SWITCHES if getattr(kernels_cfg, s.name) != s.default}


def honoured(engine_cls, mode: str, device: str) -> dict[str, tuple]:
    """``{switch: values}`` that ``engine_cls`` honours in ``engine.mode=mode`` on device type ``device``, read from
    its spec's ``kernel_switches`` (:func:`forgetrain.levers.spec_of`; none declared: none)."""
    from forgetrain.levers import spec_of

    decl = spec_of(engine_cls).kernel_switches or {}
    out: dict[str, set] = {}
    for key in (mode, f"{mode}/{device}"):
        for sw, vals in (decl.get(key) or {}).items():
            out.setdefault(sw, set()).update(vals)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def seal_state(kernel: str, device: str, registry: Path | None = None, source: Path | None = None) -> str:
    """``"sealed"``, ``"STALE"`` (the sealed sha256 differs from the source's) or ``"unsealed"`` (no seal for the
    device type ``device``) for ``kernel``'s module file (or ``source``) in the seal registry."""
    reg_path = Path(registry) if registry else REGISTRY_PATH
    try:
        reg = json.loads(reg_path.read_text()) if reg_path.exists() else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"corrupt kernel registry {reg_path}: {e}") from None
    entry = (reg.get("kernels") or {}).get(kernel, {}).get("cuda" if device.startswith("cuda") else "cpu")
    if not entry:
        return "unsealed"
    src = Path(source) if source else KERNEL_DIR / f"{kernel}.py"
    return "sealed" if entry.get("source_sha256") == file_sha256(src) else "STALE"


def check(kernels_cfg, engine_cls, engine_name: str, mode: str, device: str,
          registry: Path | None = None) -> None:
    """Refuse a switch the engine does not honour, or a forged kernel without a current seal for ``device``.

    ``kernels_cfg``: a KernelsConfig; ``engine_cls``: the engine class that will run; ``mode``: ``engine.mode``;
    ``device``: ``cpu`` or ``cuda``. Raises ConfigError (one line naming the switch and the engine); a forged value
    without Triton installed names the ``kernels`` extra (:func:`forgetrain.extras.require`)."""
    honours = honoured(engine_cls, mode, device)
    for name, val in set_values(kernels_cfg).items():
        sw = BY_NAME[name]
        if sw.value(val) is None:
            raise ConfigError(f"kernels.{name} must be one of {'|'.join(sw.names)}, got '{val}'")
        if val not in honours.get(name, ()):
            ok = ", ".join(f"{k}={'|'.join(v)}" for k, v in sorted(honours.items())) or "none"
            raise ConfigError(f"kernels.{name}={val} is not honoured by engine {engine_name} in engine.mode={mode} "
                              f"on {device} (it honours: {ok}); set kernels.{name}={sw.default}")
        if sw.value(val).forged:  # a forged kernel is a Triton kernel (on CPU under its interpreter)
            from forgetrain.extras import require

            require("kernels", ("triton",), f"kernels.{name}={val}")
    if getattr(kernels_cfg, OVERRIDE, False):
        return
    for name, val in set_values(kernels_cfg).items():
        sw = BY_NAME[name]
        if sw.value(val).forged:
            state = seal_state(sw.kernel, device, registry)
            if state != "sealed":
                why = "was never sealed" if state == "unsealed" else \
                    "is STALE (its source changed since it was sealed)"
                raise ConfigError(f"kernels.{name}={val}: kernel {sw.kernel} {why} on {device} (engine "
                                  f"{engine_name}); seal it with `python -m forgetrain.kernels seal --kernel "
                                  f"{sw.kernel} --device {device}`, or pass kernels.{OVERRIDE}=true to run it "
                                  f"unsealed")


def table() -> list[str]:
    """One line per switch value: ``kernels.<name>=<value>``, the tier it declares, default/forged marks."""
    rows = [(f"kernels.{s.name}={v.name}", v.tier, v.what + (" (default)" if v.name == s.default else
             f" (kernel {s.kernel}, needs a seal)" if v.forged else "")) for s in SWITCHES for v in s.values]
    w = max(len(r[0]) for r in rows)
    return [f"{a:<{w}}  tier {t:<10} {what}" for a, t, what in rows]
