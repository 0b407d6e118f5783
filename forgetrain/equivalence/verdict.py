"""What every tier shares: the :class:`Verdict` it returns, its config (``conf/tier/<name>.yaml``), and helpers.

Thresholds never live in code: each tier's are in ``conf/tier/<name>.yaml`` with their rationale, loaded by
:func:`load_tier`; a caller's ``cfg`` (for instance Hydra's ``cfg.tier``) overrides them key by key.

A verdict's ``first_divergence`` is ``None`` or a dict with at least ``step``, ``kind`` (one of
:data:`DIVERGENCE_KINDS`), ``ref`` and ``cand``, plus ``tensor`` (parameter name) or ``module`` (neutral module
name) or ``layer`` (a mixture of experts' layer index, for the ``moe_*`` kinds) where one applies.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from forgetrain.engine import forward_names, hf_param_names
from forgetrain.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
TIER_CONF_DIR = REPO_ROOT / "conf" / "tier"
REFERENCES_DIR = REPO_ROOT / "references"  # a reference's own tier overrides: references/<name>/<tier>.yaml

DIVERGENCE_KINDS = ("tokens", "loss", "grad_norm", "lr", "per_token_loss", "param", "grad", "clipped_grad",
                    "module_fwd", "module_grad", "moe_tokens_per_expert", "moe_load_balancing_loss")


# ----------------------------------------------------------------------------------------------------------------
# Verdict and config
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    """The outcome of one tier.

    tier: the tier's name (a name in :data:`forgetrain.equivalence.registry.TIERS`).
    passed: whether the candidate passed.
    summary: one line a person can act on (the reason when failed).
    evidence: JSON-serialisable dict of the numbers behind the verdict (non-finite floats may appear; the report
        writer turns them into strings).
    first_divergence: ``None`` or the first point where the candidate left the reference (see module docstring).
    """

    tier: str
    passed: bool
    summary: str
    evidence: dict = field(default_factory=dict)
    first_divergence: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def load_tier(name: str) -> dict:
    """Return ``conf/tier/<name>.yaml`` as a plain dict (read with OmegaConf, interpolations resolved).

    Raises ConfigError when the file does not exist or its ``name`` field differs from ``name``.
    """
    from omegaconf import OmegaConf

    path = TIER_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in TIER_CONF_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown tier {name!r}: no {path} (known: {known})")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(cfg, dict) or cfg.get("name") != name:
        raise ConfigError(f"{path}: expected a mapping with name: {name}")
    return cfg


def merge_settings(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_settings(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, Mapping) else v
    return out


def tier_config(tier_name: str, reference: str, tier_cfg: dict | None = None) -> dict:
    """The rules of ``tier_name`` for judging against ``reference`` (a package under references/): ``tier_cfg``
    (default :func:`load_tier`'s ``conf/tier/<tier>.yaml``) with the reference's own, versioned entry
    (``references/<reference>/<tier>.yaml``, key ``<tier>``) merged over it key by key, and then
    ``reference_override`` naming that file. Used where a reference's arithmetic is measured to differ (e.g.
    DeepSpeed's fp64 grad norm vs Megatron's fp32 one); the file carries the measurement that justifies each number.
    Raises ConfigError for an unknown tier (when ``tier_cfg`` is not given)."""
    cfg = dict(tier_cfg or load_tier(tier_name))
    path = REFERENCES_DIR / reference / f"{tier_name}.yaml"
    if not path.exists():
        return cfg
    from omegaconf import OmegaConf

    merged = merge_settings(cfg, OmegaConf.to_container(OmegaConf.load(path), resolve=True).get(tier_name) or {})
    merged["reference_override"] = str(path.relative_to(REPO_ROOT))
    return merged


def tier_settings(name: str, cfg: Any) -> dict:
    """The tier's yaml, overridden key by key (recursively) by ``cfg`` (a dict or an OmegaConf node, or None)."""
    base = load_tier(name)
    if cfg is None:
        return base
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"tier config for {name} must be a mapping, got {type(cfg).__name__}")
    if cfg.get("name", name) != name:
        raise ConfigError(f"tier config is for {cfg.get('name')!r}, not {name!r}")
    return merge_settings(base, cfg)


# ----------------------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _num_layers(names: Iterable[str]) -> int:
    idx = [int(m.group(1)) for n in names if (m := _LAYER_RE.search(n))]
    return max(idx) + 1 if idx else 0


def _ordered(names: Iterable[str], canonical: Callable[[int], Iterable[str]]) -> list[str]:
    """``names`` in canonical forward order (layer count inferred from the names); unknown names last, sorted."""
    names = set(names)
    canon = [n for n in canonical(_num_layers(names)) if n in names]
    return canon + sorted(names - set(canon))


_EXPERT_RE = re.compile(r"\.mlp\.experts\.(\d+)\.")


def param_order(names: Iterable[str]) -> list[str]:
    names = list(names)
    experts = [int(m.group(1)) for n in names if (m := _EXPERT_RE.search(n))]  # HF Qwen3-MoE expert names
    num_experts = max(experts) + 1 if experts else None
    return _ordered(names, lambda n: hf_param_names(n, qk_layernorm=True, num_experts=num_experts))


def module_order(names: Iterable[str]) -> list[str]:
    return _ordered(names, lambda n: list(forward_names(n)))


def by_step(records: list[dict]) -> tuple[dict[int, dict], list[int]]:
    """Records keyed by step, and the steps that occur more than once."""
    out: dict[int, dict] = {}
    dup = []
    for r in records:
        s = int(r["step"])
        if s in out:
            dup.append(s)
        out[s] = r
    return out, dup


def _isnum(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite(x: Any) -> bool:
    return _isnum(x) and math.isfinite(x)


def exact_equal(a: Any, b: Any) -> bool:
    """Python ``==`` on two numbers; NaN (never equal to itself) and missing values never pass."""
    return _isnum(a) and _isnum(b) and a == b


def trace_length(records: list[dict]) -> int:
    return max((int(r["step"]) for r in records), default=0)


def fmt_num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}" if abs(x) >= 1e-3 or x == 0 or not math.isfinite(x) else f"{x:.3e}"
    return str(x)


def _fmt_list(x: Any, width: int = 60) -> str:
    """A list value, shortened to ``width`` characters (``...]`` marks the cut)."""
    s = str(x)
    return s if len(s) <= width else s[: width - 4] + "...]"


def describe_divergence(d: dict | None) -> str:
    """One short line for a ``first_divergence`` dict (``-`` when None), used in summaries and the table."""
    if not d:
        return "-"
    where = d.get("tensor") or d.get("module") or (f"layer {d['layer']}" if d.get("layer") is not None else "")
    out = f"step {d.get('step')} {d.get('kind')}" + (f" {where}" if where else "")
    ref, cand = d.get("ref"), d.get("cand")
    if isinstance(ref, dict) and "l2" in ref:
        ref = ref["l2"]
    if isinstance(cand, dict) and "l2" in cand:
        cand = cand["l2"]
    if isinstance(ref, dict) and "mean" in ref:
        ref = ref["mean"]
    if _isnum(ref) or _isnum(cand) or ref is None or cand is None:
        r, c = fmt_num(ref), fmt_num(cand)
        if r == c and ref != cand:  # e.g. 1 ulp apart: show every digit
            r, c = repr(ref), repr(cand)
        out += f" (ref {r}, cand {c})"
    elif isinstance(ref, str) and isinstance(cand, str):
        out += f" (digest {ref[:8]} != {cand[:8]})"
    elif isinstance(ref, list) or isinstance(cand, list):  # e.g. one layer's tokens per expert
        r, c = _fmt_list(ref), _fmt_list(cand)
        out += f" (ref {r}, cand {c})"
    return out
