"""Engine levers and engine specs: how a forged engine declares its ``engine.*`` switches and what it implements.

A **lever** is one ``engine.*`` field: its name, type, default, allowed values, its value under each mode preset
(``mode=exact``, ``mode=fast_base``), the equivalence tier it declares, what it needs and a one-line doc
(:class:`Lever`). An engine package declares its levers in one table, ``<package>/levers.py``, as
``SPEC = EngineSpec(levers=(...), ...)`` (:class:`EngineSpec`), beside what the engine implements (its modes,
recompute, optimizer offload, the kernel switches it honours) and its engine-specific rules (``check``).

The harness reads the tables and nothing else about a lever: the ``engine.*`` config group is the union of every
forged engine's levers (:func:`options_class`, via :func:`forgetrain.registry.lever_specs`), each value is checked
against its lever (:func:`value_error`), the rules of each table run in ``forgetrain.config.validate``, and the mode
presets are derived from the table (:func:`preset`). It imports no other ForgeTrain module but two leaves: the tier
registry when a lever is made, and ``forgetrain.errors`` when :func:`spec_of` refuses a class.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable, Optional

# engine.compile_tuning values -> the inductor config keys of every torch.compile a forged engine makes
# (``torch._inductor.config``; :func:`forgetrain.config.inductor_options`)
COMPILE_TUNINGS = {"none": {}, "coordinate_descent": {"coordinate_descent_tuning": True}}
KEEP = "keep"  # a preset value: the lever stays as the scenario sets it (memory layout, fast-only knobs exact ignores)
PRESETS = ("exact", "fast_base")  # the mode presets, ``mode=<name>`` (forgetrain.config.schema.mode_presets)


def declarable_tiers() -> tuple:
    """The tiers a lever may declare: the registry's equivalence tiers, strictest first
    (``forgetrain.equivalence.registry.EQUIVALENCE_TIERS``; a speed tier is no numerics claim)."""
    from forgetrain.equivalence.registry import EQUIVALENCE_TIERS  # a leaf module: no import cycle

    return tuple(EQUIVALENCE_TIERS)


@dataclass(frozen=True)
class Lever:
    """One ``engine.<name>`` switch of an engine.

    ``type``: the field's Python type for the Hydra schema (``bool``, ``str``, ``int``, ``float``,
    ``Optional[int]``); an override of another type is refused by OmegaConf before validation. ``values``: the
    allowed values, or None when ``rule`` checks the value itself. ``exact`` / ``fast_base``: the value under
    ``mode=exact`` / ``mode=fast_base``, or :data:`KEEP`. ``tier``: the weakest tier the lever declares it may be
    judged at (:func:`declarable_tiers`; its evidence lives in the engine's ``optimisations.yaml``). ``needs``: what it needs
    (other levers, kernel switches, precision, layout), for people; ``rule(cfg, reference) -> str | None`` enforces
    it: the message of the one-line refusal, or None (``reference``: a reference engine runs the config).
    ``doc``: one line."""

    name: str
    type: Any
    default: Any
    tier: str
    doc: str
    values: Optional[tuple] = None
    exact: Any = KEEP
    fast_base: Any = KEEP
    needs: str = ""
    rule: Optional[Callable[[Any, bool], Optional[str]]] = None

    def __post_init__(self):
        if self.tier not in (tiers := declarable_tiers()):
            raise ValueError(f"lever {self.name}: tier must be one of {'|'.join(tiers)}, got {self.tier!r}")
        if self.values is not None and self.default not in self.values:
            raise ValueError(f"lever {self.name}: default {self.default!r} is not one of {self.values}")

    def preset_value(self, preset: str) -> Any:
        """The lever's value under ``mode=<preset>`` (:data:`PRESETS`), or :data:`KEEP`. Raises KeyError for an
        unknown preset."""
        return {"exact": self.exact, "fast_base": self.fast_base}[preset]


@dataclass(frozen=True)
class EngineSpec:
    """What an engine class implements, declared once: the class attribute ``spec`` of every engine, forged
    (usually its package's ``levers.SPEC``) or reference (``references/<name>/engine.py``). The harness reads what
    an engine implements from here alone (:func:`spec_of`); a field left at its default means not implemented.

    ``levers``: its ``engine.*`` switches (:class:`Lever`), in the order of the config group. ``modes``: the
    ``engine.mode`` values it runs (None: not checked, e.g. a forge candidate or a reference). ``recompute``,
    ``recompute_num_layers``, ``optimizer_offload``: whether it implements ``engine.recompute=full``, a block of
    recomputed layers, and ``engine.optimizer_offload_fraction > 0``. ``kernel_switches``: the ``kernels.*``
    values it honours, ``engine.mode[/device] -> {switch: values}`` (forgetrain/kernels/switches.py). ``check``:
    engine-specific rules beyond each lever's own, ``check(cfg, reference) -> None``, raising ConfigError.
    ``model_features``: the names of :data:`MODEL_FEATURES` it implements (a config that sets another is refused).

    For ``forgetrain.bench`` and ``forgetrain.verify``: ``bench_only``: a speed baseline with no per-token losses
    or digests, which verify refuses as a reference. ``bench_side``: the bench builds it as
    ``Engine(cfg, device, bench_side=True)``, the timed form its framework's users run (the reference's module doc
    says what that changes). ``fixed_grad_accum``: its gradient-accumulation steps are fixed when it is built, so
    the bench builds it again for another micro-batch split."""

    levers: tuple = ()
    modes: Optional[tuple] = None
    recompute: bool = False
    recompute_num_layers: bool = False
    optimizer_offload: bool = False
    kernel_switches: dict = field(default_factory=dict)
    check: Optional[Callable[[Any, bool], None]] = None
    model_features: tuple = ()  # the ModelConfig features beyond Llama it implements (:data:`MODEL_FEATURES`)
    bench_only: bool = False
    bench_side: bool = False
    fixed_grad_accum: bool = False

    def lever(self, name: str) -> Lever:
        """The lever called ``name``. Raises KeyError naming the known ones."""
        for lv in self.levers:
            if lv.name == name:
                return lv
        raise KeyError(f"no lever {name!r}; known: {', '.join(lv.name for lv in self.levers)}")


def spec_of(engine_cls) -> EngineSpec:
    """The :class:`EngineSpec` of the engine class ``engine_cls``: its ``spec`` attribute (inherited by a
    subclass), the one place an engine states what it implements. Raises ConfigError naming the class when it
    declares no :class:`EngineSpec` there."""
    spec = getattr(engine_cls, "spec", None)
    if not isinstance(spec, EngineSpec):
        from forgetrain.errors import ConfigError

        name = f"{getattr(engine_cls, '__module__', '?')}:{getattr(engine_cls, '__qualname__', engine_cls)}"
        raise ConfigError(f"engine {name} declares no EngineSpec (got spec={spec!r}): give the class "
                          f"spec = forgetrain.levers.EngineSpec(...), saying what it implements")
    return spec


# ModelConfig fields beyond the Llama decoder, each off at the value given here; an engine implements one only where
# its spec's ``model_features`` names it (forgetrain.config.checks refuses the rest in one line)
MODEL_FEATURES = {"qk_layernorm": False, "share_embeddings_and_output_weights": False, "kv_channels": None,
                  "num_experts": None}
# the ModelConfig fields that shape a mixture of experts: read (and hashed) only when ``num_experts`` is set
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_router_load_balancing_type",
              "moe_router_score_function", "moe_expert_capacity_factor")


def missing_features(model_cfg, spec: EngineSpec) -> list[str]:
    """The :data:`MODEL_FEATURES` that ``model_cfg`` sets away from their off value and ``spec`` does not
    implement, as ``"model.<name>=<value>"`` strings (empty: the engine runs this model)."""
    return [f"model.{k}={getattr(model_cfg, k)}" for k, off in MODEL_FEATURES.items()
            if getattr(model_cfg, k) != off and k not in spec.model_features]


# the harness's own lever: every engine runs some mode, and the presets select it
MODE = Lever("mode", str, "exact", "bitwise", "exact: the op-by-op Megatron mirror (bitwise) | fast: the optimised "
             "path, each optimisation at its own tier", values=("exact", "fast"), exact="exact", fast_base="fast")


def merge(specs) -> tuple:
    """The levers of the ``engine.*`` group: :data:`MODE`, then each spec's levers in order, each name once.
    Raises ValueError when two specs declare one name differently (one name, one meaning)."""
    out: dict[str, Lever] = {MODE.name: MODE}
    for spec in specs:
        for lv in spec.levers:
            if lv.name in out and out[lv.name] != lv:
                raise ValueError(f"engine.{lv.name} is declared twice, differently ({out[lv.name]} and {lv})")
            out[lv.name] = lv
    return tuple(out.values())


def options_class(levers, module: str = __name__):
    """The ``EngineOptions`` dataclass of ``levers``: one field per lever (its type and default), in order;
    ``module`` is its ``__module__`` (where pickles and Hydra find it)."""
    fields = [(lv.name, lv.type, field(default=lv.default)) for lv in levers]
    doc = ("How a forged engine runs: one field per lever of the engines' lever tables (``<engine package>/"
           "levers.py``, forgetrain/levers.py); ``mode=exact`` mirrors Megatron op by op (bitwise tier), "
           "``mode=fast`` is the optimised path. Fields: " + "; ".join(f"{lv.name}: {lv.doc}" for lv in levers))
    return make_dataclass("EngineOptions", fields, namespace={"__doc__": doc, "__module__": module})


def value_error(lv: Lever, value) -> Optional[str]:
    """The refusal for ``engine.<lv.name>=value`` when ``lv.values`` does not hold it (``engine.fp8 must be
    none|tensorwise, got 'x'``), else None."""
    if lv.values is None or value in lv.values:
        return None
    if lv is MODE:
        return f"engine.mode must be exact or fast, got '{value}'"
    return f"engine.{lv.name} must be {'|'.join(map(str, lv.values))}, got '{value}'"


def preset(levers, name: str) -> dict:
    """``{lever: value}`` that ``mode=<name>`` sets (:data:`PRESETS`), the :data:`KEEP` levers left out. Raises
    KeyError for an unknown preset."""
    return {lv.name: v for lv in levers if (v := lv.preset_value(name)) != KEEP}


def rows(levers) -> list[dict]:
    """One dict per lever (name, type, default, exact, fast_base, tier, needs, doc), for listings and docs."""
    return [{"name": f"engine.{lv.name}", "type": getattr(lv.type, "__name__", str(lv.type)), "default": lv.default,
             "exact": lv.exact, "fast_base": lv.fast_base, "tier": lv.tier, "needs": lv.needs, "doc": lv.doc}
            for lv in levers]


def table(levers) -> str:
    """``levers`` as aligned text, one line per lever: name, default, exact, fast_base, tier, needs
    (``python -m forgetrain.levers`` prints the forged engines' table)."""
    cols = ("name", "default", "exact", "fast_base", "tier", "needs")
    data = [[str(r[c]) for c in cols] for r in rows(levers)]
    width = [max(len(c), *(len(d[i]) for d in data)) for i, c in enumerate(cols)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, width)).rstrip()
                     for line in [list(cols), *data])


if __name__ == "__main__":
    from forgetrain import registry

    print(table(merge(registry.lever_specs())))
