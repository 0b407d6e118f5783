"""The tier registry: every tier's name, order, kind and runner, written once.

verify, the ladder, the report, the forge and the tests read the tiers from here and from nowhere else. The
order is the order of :data:`TIERS` (strictest first); :data:`TIER_ORDER` and :data:`EQUIVALENCE_TIERS` are live,
read-only views of it, so a name imported from here (``from forgetrain.equivalence.registry import TIER_ORDER``)
follows every later :func:`register`.

A tier's *kind* says what it compares, hence how verify produces its inputs and how the ladder feeds it:

* ``pair``  -- one reference run and the candidate, same init and batches, a short run (``verify.steps``).
  Runner: ``judge(ref_dir, cand_dir, cfg) -> Verdict``; with ``oracle=True`` verify also passes ``oracle_dir=``
  (an fp32 run of the reference from the same weights, for reduced precision, else None).
* ``curve`` -- several reference seeds and the candidate, a long run (``verify.curve_steps``).
  Runner: ``judge(ref_dirs, cand_dir, cfg) -> Verdict``.
* ``speed`` -- not an equivalence level: the verdict of the curve tier named by ``rests_on`` plus side-by-side
  step times. Runner: ``judge(equivalence_verdict, timings_ref, timings_cand, cfg) -> Verdict``.

Adding a tier (docs/design.md, "The tier registry") touches three files: ``forgetrain/equivalence/tiers/<name>.py``
(the runner, returning ``Verdict(<name>, ...)``), ``conf/tier/<name>.yaml`` (``name``, ``version`` and its
thresholds with their sources) and one :class:`Tier` line in :data:`TIERS`, at its place in the order.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

PAIR, CURVE, SPEED = "pair", "curve", "speed"
KINDS = (PAIR, CURVE, SPEED)


@dataclass(frozen=True)
class Tier:
    """One tier.

    name: the tier's name; also its ``conf/tier/<name>.yaml`` and the ``tier`` of the verdicts it returns.
    kind: ``pair`` | ``curve`` | ``speed`` (module docstring).
    runner: ``"module:function"``, the judge; imported on first use, so reading the registry stays cheap.
    oracle: pair tiers only: verify runs an fp32 oracle of the reference at reduced precision and passes it.
    digests: the tier compares per-step digests, so verify refuses ``verify.digests=false`` for it.
    rests_on: speed tiers only: the curve tier whose verdict the speed claim rests on.

    Raises ValueError on an unknown kind, a malformed runner, or ``oracle`` / ``rests_on`` on the wrong kind.
    """

    name: str
    kind: str
    runner: str
    oracle: bool = False
    digests: bool = False
    rests_on: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tier {self.name}: kind {self.kind!r} is not one of {KINDS}")
        mod, _, fn = self.runner.partition(":")
        if not mod or not fn:
            raise ValueError(f"tier {self.name}: runner {self.runner!r} must read 'module:function'")
        if self.oracle and self.kind != PAIR:
            raise ValueError(f"tier {self.name}: only a pair tier takes an fp32 oracle")
        if (self.rests_on is None) != (self.kind != SPEED):
            raise ValueError(f"tier {self.name}: a speed tier, and only a speed tier, names the tier it rests_on")

    @property
    def equivalence(self) -> bool:
        """Whether passing this tier makes the candidate equivalent (every kind but ``speed``)."""
        return self.kind != SPEED

    def judge(self) -> Callable:
        """The runner function (imported now). Raises ImportError / AttributeError when it does not exist."""
        mod, _, fn = self.runner.partition(":")
        return getattr(importlib.import_module(mod), fn)


_PKG = "forgetrain.equivalence.tiers"

TIERS: list[Tier] = [
    Tier("bitwise", PAIR, f"{_PKG}.bitwise:bitwise", digests=True),
    Tier("tolerance", PAIR, f"{_PKG}.tolerance:tolerance", oracle=True),
    Tier("loss_curve", CURVE, f"{_PKG}.loss_curve:loss_curve"),
    Tier("surpass", SPEED, f"{_PKG}.surpass:surpass", rests_on="loss_curve"),
]
"""Every tier, strictest first. Edit this list (or call :func:`register`) to add one; nothing else lists tiers."""


def find(name: str) -> Tier | None:
    """The registered tier called ``name``, or None."""
    return next((t for t in TIERS if t.name == name), None)


def names(kind: str | None = None) -> tuple[str, ...]:
    """Registered tier names, strictest first; only those of ``kind`` when given."""
    return tuple(t.name for t in TIERS if kind is None or t.kind == kind)


def _check(tiers: Sequence[Tier]) -> None:
    seen: dict[str, Tier] = {}
    for t in tiers:
        if t.name in seen:
            raise ValueError(f"tier {t.name} is registered twice")
        if t.rests_on is not None:
            base = seen.get(t.rests_on)
            if base is None or base.kind != CURVE:
                raise ValueError(f"tier {t.name} rests on {t.rests_on!r}, which must be a curve tier before it")
        seen[t.name] = t


def register(tier: Tier, *, after: str | None = None, before: str | None = None) -> None:
    """Insert ``tier`` into the order: right after ``after``, right before ``before``, or last (neither given).

    For tiers defined outside this file (a plugin, a test); a tier of the project gets its line in
    :data:`TIERS`. Raises ValueError for a duplicate name, an unknown anchor, both anchors, or a speed tier whose
    ``rests_on`` is not a curve tier ahead of it (the registry is left unchanged).
    """
    if after is not None and before is not None:
        raise ValueError("register: give after= or before=, not both")
    anchor = after if after is not None else before
    if anchor is not None and find(anchor) is None:
        raise ValueError(f"register: no tier {anchor!r}; known: {', '.join(names())}")
    at = len(TIERS) if anchor is None else names().index(anchor) + (1 if after is not None else 0)
    new = TIERS[:at] + [tier] + TIERS[at:]
    _check(new)
    TIERS[:] = new


def unregister(name: str) -> Tier:
    """Remove the tier called ``name`` and return it. Raises ValueError when it is unknown or another tier rests
    on it."""
    t = find(name)
    if t is None:
        raise ValueError(f"unregister: no tier {name!r}")
    rest = [x for x in TIERS if x is not t]
    _check(rest)
    TIERS[:] = rest
    return t


class _Names(Sequence):
    """A read-only, live view of the registered names (strictest first) that pass a filter: indexing, slicing
    (returns a tuple), ``in``, ``index``, iteration and ``len`` all read :data:`TIERS` at the time of the call."""

    def __init__(self, keep: Callable[[Tier], bool], what: str):
        self._keep, self._what = keep, what

    def _names(self) -> tuple[str, ...]:
        return tuple(t.name for t in TIERS if self._keep(t))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def index(self, name, *args) -> int:
        return self._names().index(name, *args)

    def __eq__(self, other) -> bool:
        if isinstance(other, (_Names, tuple, list)):
            return self._names() == tuple(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"{self._what}{self._names()!r}"


TIER_ORDER: Sequence[str] = _Names(lambda t: True, "TIER_ORDER")
"""Every tier's name, strictest first. ``surpass`` is not an equivalence level: it is ``loss_curve`` plus speed."""

EQUIVALENCE_TIERS: Sequence[str] = _Names(lambda t: t.equivalence, "EQUIVALENCE_TIERS")
"""The tiers whose pass makes a candidate equivalent (all but the speed tiers), strictest first."""
