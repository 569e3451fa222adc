"""What every rule type is made of: the steps it is fed (StepData), its verdicts (Finding, CLEAR, None),
its parameters (Param) and the RuleType base class, with the helpers the rule modules share."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeGuard, TypeVar, cast

from ...._text import power_of_two
from ..evidence import Evidence
from .states import OverflowHistory

__all__ = ["CLEAR", "LOSS_KEYS", "Finding", "Param", "RuleType", "StepData", "Verdict"]

MAX_EVIDENCE_POINTS = 50
# Bounds of the step-count parameters: what a rule keeps per run and does per point stays small whatever a
# project configures (a rule's state lives in the ingest transaction).
MAX_WINDOW = 10_000
MAX_STEPS = 1_000_000
MAX_EVIDENCE_LAYERS = 20
# What "N of the last M steps overflowed" looks back over: the last RECENT_STEPS steps with amp/skipped.
RECENT_STEPS = 100


@dataclass
class StepData:
    """What one rank reported at one step: scalar values, per-layer vectors, events (kind, data)."""

    step: int
    rank: int
    scalars: dict[str, float] = field(default_factory=dict)
    vectors: dict[str, list[float]] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def signature(self) -> frozenset[str]:
        """The scalar and vector keys and event kinds this step holds."""
        return frozenset(self.scalars).union(self.vectors, (kind for kind, _ in self.events))


@dataclass(frozen=True)
class Finding:
    """The rule's condition holds at `step`; evidence is JSON-ready (its rule's type in evidence.py)."""

    step: int
    title: str
    evidence: Evidence
    cause: str = ""  # a key of advice.HINTS naming the likeliest cause, "" for the rule's default


class _Clear:
    def __repr__(self) -> str:
        return "CLEAR"


CLEAR = _Clear()
Verdict = Finding | _Clear | None


MAX_TEXT_PARAM = 200  # characters of a text parameter (a series key such as grad/underflow_frac)


@dataclass(frozen=True)
class Param:
    default: float | int | str | bool
    minimum: float | None = None
    maximum: float | None = None
    integer: bool = False
    exclusive_minimum: bool = False
    doc: str = ""

    def check(self, rule: str, name: str, value: Any) -> float | int | str | bool:
        if isinstance(self.default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{rule}: {name} must be true or false, got {value!r}")
            return value
        if isinstance(self.default, str):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{rule}: {name} must be a non-empty string, got {value!r}")
            if len(value) > MAX_TEXT_PARAM:  # a key name, not a document
                raise ValueError(
                    f"{rule}: {name} must be at most {MAX_TEXT_PARAM} characters, got {len(value)}"
                )
            if any(ord(c) < 32 or ord(c) == 127 for c in value):  # NUL cannot even be stored in PostgreSQL
                raise ValueError(f"{rule}: {name} must be plain text without NUL or control characters")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{rule}: {name} must be a number, got {value!r}")
        if self.integer and value != int(value):
            raise ValueError(f"{rule}: {name} must be a whole number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{rule}: {name} must be finite, got {value!r}")
        if self.minimum is not None:
            if self.exclusive_minimum and value <= self.minimum:
                raise ValueError(f"{rule}: {name} must be greater than {self.minimum:g}, got {value!r}")
            if value < self.minimum:
                raise ValueError(f"{rule}: {name} must be at least {self.minimum:g}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{rule}: {name} must be at most {self.maximum:g}, got {value!r}")
        return int(value) if self.integer else float(value)


State = TypeVar("State")  # the rule type's state: a TypedDict of states.py


class RuleType(Generic[State]):
    """Base of the rule types. Subclasses set name, params, the keys they read, and observe()."""

    name: ClassVar[str]
    description: ClassVar[str]
    severity: ClassVar[str] = "warning"
    params: ClassVar[dict[str, Param]] = {}
    scalar_keys: ClassVar[frozenset[str]] = frozenset()
    vector_keys: ClassVar[frozenset[str]] = frozenset()
    event_kinds: ClassVar[frozenset[str]] = frozenset()
    all_ranks: ClassVar[bool] = False  # False: only rank 0's data is evaluated
    cooldown_steps: ClassVar[int] = 100  # default: a re-trigger this soon after firing reopens silently
    periodic: ClassVar[bool] = False  # evaluated by the server's clock, not by steps
    # Findings of one family in one run group into one incident (see incidents.py): "precision" (the
    # loss scale, overflow, underflow), "divergence", "data", "stalled" (no learning), "liveness".
    family: ClassVar[str] = "precision"

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        given = dict(params or {})
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise ValueError(f"{self.name}: unknown parameter {unknown[0]!r} (parameters: {known})")
        self.values: dict[str, Any] = {
            name: spec.check(self.name, name, given[name]) if name in given else spec.default
            for name, spec in self.params.items()
        }
        self.__dict__.update(self.values)  # parameters as plain attributes: read on every point
        self.validate()

    def validate(self) -> None:
        """Cross-parameter checks; raise ValueError naming the bad values."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def reads(self, data: StepData) -> bool:
        """Whether a step holds anything this rule reads (others are not fed to it)."""
        return self.reads_signature(data.rank, data.signature())

    def reads_signature(self, rank: int, present: frozenset[str]) -> bool:
        """reads() from a step's rank and the keys and event kinds it holds (StepData.signature): the
        engine asks once per distinct signature of a batch, not once per step."""
        if not self.all_ranks and rank != 0:
            return False
        return not present.isdisjoint(self.scalar_keys | self.vector_keys | self.event_kinds)

    def initial_state(self) -> State:
        """The state of a run this rule has seen nothing of (a TypedDict of states.py)."""
        return cast(State, {})

    def observe(self, state: State, data: StepData, layers: list[str]) -> Verdict:
        raise NotImplementedError


def _finite(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def _names(value: Any) -> list[str]:
    """A list of names from event data (a free-form document: anything else reads as no names)."""
    return [str(name) for name in value] if isinstance(value, list) else []


def _skip_layers(data: StepData) -> list[str]:
    layers: list[str] = []
    for kind, event in data.events:
        if kind == "skip":
            layers.extend(_names(event.get("non_finite_layers")))
    return layers


def _common_layers(entries: list[list[Any]]) -> list[str]:
    """Layers named by skip events, most frequent first."""
    counts = Counter(name for _, names in entries for name in names)
    return [name for name, _ in counts.most_common(MAX_EVIDENCE_LAYERS)]


def _recent_overflows(state: OverflowHistory, data: StepData) -> None:
    """Keep state["recent"]: one character per step with amp/skipped ("x" skipped, "." applied), the
    last RECENT_STEPS of them (a short string: cheap to store and the same after a JSON round trip)."""
    skipped = data.scalars.get("amp/skipped")
    if skipped is not None:
        recent = state.get("recent", "") + ("x" if skipped >= 0.5 else ".")
        state["recent"] = recent[-RECENT_STEPS:]


def _overflowed(state: OverflowHistory) -> str:
    """ "N of the last M steps overflowed", counted in the steps _recent_overflows kept; "" before any."""
    recent: str = state.get("recent", "")
    if not recent:
        return ""
    return f"{recent.count('x')} of the last {len(recent)} steps overflowed"


def _times(ratio: float) -> str:
    """A ratio for a title: 3.2x, 47x, 3,234x."""
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.3g}x"


def _power_of_two(value: float | None) -> str:
    if value is None:
        return "unknown"
    return power_of_two(value) or f"{value:.3g}"


LOSS_KEYS = ("loss", "amp/loss")


def _loss_of(data: StepData) -> tuple[str, float] | None:
    """The step's loss: what the user logged as "loss", else what the agent took from scaler.scale()."""
    for key in LOSS_KEYS:
        if key in data.scalars:
            return key, data.scalars[key]
    return None
