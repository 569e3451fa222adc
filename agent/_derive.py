"""Host-side derivation: what the sender thread computes from a watcher's transferred values.

Pure functions of plain host values (the steps, floats and lists of a Resolved packet; no torch, no
device, no watcher): skip events naming the layers whose gradients went non-finite, weights too large
for fp16, the loss scale falling below 1, fp16 underflow / precision-loss / overflow and zero fractions
from the gradient histograms, the safe-scale band, update ratios and rounded-away fractions with the
skipped steps left out, what rewrote the gradients after backward (a clip's threshold), and
parameters the optimizer does not hold (from the comparisons _coverage records). derive() applies
them all to one packet; WatchDerivation binds it to one watched model and keeps the once-per-run
state. The histogram
arithmetic itself (fp16_fractions, safe_scale_band…) lives with the other quantities in _quantities.

The agent-internal keys (leading "_") are recorded by the Watcher for this module only; they never
leave the process (Resolved.wire_fields drops them).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _quantities

if TYPE_CHECKING:
    from ._buffer import Resolved
    from ._clip_factor import ClipFactor

SCALE_BEFORE = "_amp/scale_before"  # the loss scale a step was taken with (before scaler.update)
UNCHANGED_COUNTS = "_update/unchanged_counts"  # per layer [unchanged, non-zero gradient] → rounded_away_frac
CLIP_MAX_NORM = "grad/clip_max_norm"
POST_CLIP_NORM = "grad/global_norm_post_clip"
# per step of a fused optimizer under a GradScaler: the per-layer norms, kept for the skipped steps
NORMS_IF_SKIPPED = "_grad/norm_if_skipped"
REWRITE_SPREAD = "_grad/rewrite_spread"  # per rewritten step: how unevenly the layers were scaled
CLIP_FACTOR_CHECK = "_grad/clip_factor_wrong"  # on a step read fully: 1 if the clip's factor was wrong
# Once scaled gradients were rewritten before scaler.unscale_: their global norm just before it (÷S),
# and how unevenly that rewrite scaled the layers, to tell a clip there (a misuse) from a division
SCALED_REWRITE = "_grad/rewritten_before_unscale"
SCALED_REWRITE_SPREAD = "_grad/rewritten_before_unscale_spread"
MAX_ABS_WEIGHT = "_setup/max_abs_weight"  # the model's largest |weight|, once, when watching fp16 starts
MAX_LAYERS_IN_EVENT = 50
# + a token: per candidate of one _coverage comparison, 1.0 where its weights did not change
UNHELD_UNCHANGED_PREFIX = "_optimizer/unheld_unchanged/"

Scalars = dict[str, list[tuple[int, float]]]
Vectors = dict[str, list[tuple[int, list[float]]]]
Matrices = dict[str, list[tuple[int, list[list[float]]]]]
Event = dict[str, Any]


def oversized_weight_events(scalars: Scalars) -> list[Event]:
    """`weights_exceed_fp16` events: the model's largest |weight| (MAX_ABS_WEIGHT) is above 65504."""
    return [
        {
            "step": step,
            "kind": "weights_exceed_fp16",
            "data": {
                "max_abs_weight": largest,
                "hint": f"a weight of magnitude {largest:.3g} does not fit in fp16 (max 65504): fp16 "
                "autocast will produce inf. Train in bf16, or keep that layer in fp32.",
            },
        }
        for step, largest in scalars.get(MAX_ABS_WEIGHT, [])
        if largest > _quantities.FP16_MAX
    ]


@dataclass(frozen=True)
class UnheldCandidates:
    """Parameters with a gradient that no param group holds (see _coverage): their layer names and
    element counts, and the elements of every parameter with a gradient (held or not)."""

    names: tuple[str, ...]
    elements: tuple[int, ...]
    gradient_elements: int


def unheld_parameter_events(vectors: Vectors, expected: dict[int, UnheldCandidates]) -> list[Event]:
    """One `params_not_in_optimizer` event per comparison (UNHELD_UNCHANGED_PREFIX keys, taken out of
    `vectors`) in which some candidate did not change: the layers, how many, their elements and the
    fraction of the gradient-carrying elements they are. `expected`: the candidates by token (entries
    read are removed)."""
    events = []
    for key in [k for k in vectors if k.startswith(UNHELD_UNCHANGED_PREFIX)]:
        points = vectors.pop(key)
        candidates = expected.pop(int(key[len(UNHELD_UNCHANGED_PREFIX) :]), None)
        if candidates is None:
            continue
        for step, flags in points:
            unchanged = [i for i, flag in enumerate(flags) if flag >= 0.5 and i < len(candidates.names)]
            if not unchanged:
                continue
            elements = sum(candidates.elements[i] for i in unchanged)
            events.append(
                {
                    "step": step,
                    "kind": "params_not_in_optimizer",
                    "data": {
                        "layers": [candidates.names[i] for i in unchanged[:MAX_LAYERS_IN_EVENT]],
                        "count": len(unchanged),
                        "elements": elements,
                        "gradient_elements": candidates.gradient_elements,
                        "fraction": elements / candidates.gradient_elements
                        if candidates.gradient_elements
                        else 1.0,
                    },
                }
            )
    return events


def skipped_steps(scalars: Scalars) -> set[int]:
    """The steps whose optimizer update was skipped (amp/skipped is 1)."""
    return {step for step, flag in scalars.get("amp/skipped", []) if flag >= 0.5}


def _keep_skipped_steps_norms(vectors: Vectors, skipped: set[int]) -> None:
    """grad/norm on every skipped step: a fused optimizer's steps send their per-layer norms aside
    (NORMS_IF_SKIPPED: whether a step skipped was known on the device only); the skipped ones join
    grad/norm (they name the non-finite layers), the others go no further."""
    aside = [(step, norms) for step, norms in vectors.get(NORMS_IF_SKIPPED, []) if step in skipped]
    if aside:
        vectors["grad/norm"] = sorted([*vectors.get("grad/norm", []), *aside], key=lambda row: row[0])


def skip_events(
    skipped: set[int], scalars: Scalars, vectors: Vectors, layer_names: Sequence[str]
) -> list[Event]:
    """One `skip` event per skipped step, in step order: the scale before and after, and, where the
    step's per-layer gradient norms were taken, the layers whose norm is not finite (NaN/Inf)."""
    before = dict(scalars.get(SCALE_BEFORE, []))
    after = dict(scalars.get("amp/scale", []))
    layer_norms = dict(vectors.get("grad/norm", []))
    events = []
    for step in sorted(skipped):
        norms = layer_norms.get(step)
        data: dict[str, Any] = {"scale_before": before.get(step), "scale_after": after.get(step)}
        if norms is not None:
            bad = [name for name, norm in zip(layer_names, norms, strict=True) if not math.isfinite(norm)]
            data["non_finite_layers"] = bad[:MAX_LAYERS_IN_EVENT]
            data["non_finite_layer_count"] = len(bad)
        events.append({"step": step, "kind": "skip", "data": data})
    return events


def rounded_away_fractions(matrices: Matrices, skipped: set[int]) -> list[tuple[int, list[float]]]:
    """update/rounded_away_frac per layer from the unchanged counts, skipped steps left out (nothing
    changed there because nothing was applied)."""
    return [
        (step, [_quantities.rounded_away_fraction(unchanged, stepped) for unchanged, stepped in rows])
        for step, rows in matrices.get(UNCHANGED_COUNTS, [])
        if step not in skipped
    ]


def scale_below_one_event(scalars: Scalars) -> Event | None:
    """A `scale_below_one` event at the first step whose amp/scale is below 1, else None."""
    for step, value in scalars.get("amp/scale", []):
        if value < 1.0:
            return {
                "step": step,
                "kind": "scale_below_one",
                "data": {
                    "scale": value,
                    "hint": "the loss scale fell below 1: gradients overflow even unscaled; look for a "
                    "layer producing inf (skip events name it), lower the learning rate or switch to bf16",
                },
            }
    return None


class GradientRewrites:
    """What rewrote the gradients between the end of backward and the optimizer step, learned over
    the steps from their global norms before (grad/global_norm) and after (POST_CLIP_NORM) and how
    evenly each layer was scaled (REWRITE_SPREAD); one per watched model, on the sender thread.

    - A clip by the global norm multiplies every gradient by max_norm / (norm + 1e-6) when that is
      below 1: each layer alike, and every step it cuts ends at the same max_norm = post * (norm +
      1e-6) / norm. Two cuts that agree (among the last eight) make it known (grad/clip_max_norm,
      6 significant digits: float32 rounding); it is repeated on the steps it left as they were.
    - A division by a constant after backward (gradient accumulation averaged as p.grad.div_(k))
      scales each layer alike too, by the same factor on every step, ending at norms that vary: two
      steps with one factor and different ends make it known, or one whose factor is 1/k of its k
      micro-batches. The norms recorded are then those
      after it, what a clip after it sees (grad/global_norm and grad/norm times the factor).
    - Anything else scales the layers unevenly (clip_grad_value_, a hand-written all-reduce, some
      layers zeroed), or unevenly over the steps (a division by each step's token count): it is no
      clip, so no max_norm is made up from it; the norms stay those backward left (an event says so).
    A packet's own steps are judged with what all of them tell (the first cut gets the threshold its
    second confirms); cuts of earlier packets that the confirming cut agrees with get it in the packet
    that makes it known (a slow run sends each step in a packet of its own: its threshold would start
    a step later than a fast run's). Their other values stay as sent.
    """

    def __init__(self) -> None:
        self.max_norm: float | None = None
        self.max_norm_step: int | None = None  # the step that made max_norm known
        self.factor: float | None = None  # a constant rescale after backward, once known
        # (factor, post, max_norm, step) of the last cuts not yet explained: a clip's cuts and a
        # rescale's steps may alternate (a clip that cuts some steps after a division)
        self._candidates: deque[tuple[float, float, float, int]] = deque(maxlen=8)
        self._confirmed: list[int] = []  # earlier cuts the cut that made max_norm known agreed with
        self._reported: set[str] = set()

    def apply(self, scalars: Scalars, vectors: Vectors) -> list[Event]:
        pre = dict(scalars.get("grad/global_norm", []))
        spread = dict(scalars.get(REWRITE_SPREAD, []))
        rewrites = [
            (step, pre[step], post, spread.get(step, 0.0))
            for step, post in scalars.get(POST_CLIP_NORM, [])
            if step in pre and math.isfinite(pre[step]) and pre[step] > 0 and math.isfinite(post)
        ]
        events = self.learn(rewrites, dict(scalars.get("amp/micro_batches", [])))
        even = {step: (norm, post) for step, norm, post, uneven in rewrites if uneven <= 1e-4}
        if self.factor is not None and even:
            _rescale(scalars, vectors, set(even), self.factor)
        thresholds = []
        judged = {step for step, *_ in rewrites}
        for step, _ in scalars.get(POST_CLIP_NORM, []):
            if self.max_norm is None:
                break
            if step not in judged:  # a non-finite step says nothing of the clip: it stays as it was
                thresholds.append((step, self.max_norm))
            if step not in even:
                continue
            norm, post = even[step]
            norm *= self.factor or 1.0
            if abs(post / norm - 1) <= 1e-5 or _close(_max_norm(norm, post), self.max_norm, 1e-4):
                thresholds.append((step, self.max_norm))
        if self._confirmed and self.max_norm is not None:
            known = {step for step, _ in scalars.get(POST_CLIP_NORM, [])}
            thresholds += [(step, self.max_norm) for step in self._confirmed if step not in known]
            thresholds.sort()
        self._confirmed = []
        if thresholds:
            scalars[CLIP_MAX_NORM] = thresholds
        return events

    def known_max_norm(self) -> tuple[int, float] | None:
        """(the step that made it known, max_norm), once two cuts agreed on one."""
        if self.max_norm is None or self.max_norm_step is None:
            return None
        return self.max_norm_step, self.max_norm

    def learn(
        self,
        rewrites: Sequence[tuple[int, float, float, float]],
        micro_batches: dict[int, float] | None = None,
    ) -> list[Event]:
        """Learn from (step, norm before, norm after, spread) of rewritten steps, in step order, and
        each step's micro-batches (amp/micro_batches) where known."""
        counts = micro_batches or {}
        events = [
            self._learn(step, norm, post, uneven, counts.get(step, 1.0))
            for step, norm, post, uneven in rewrites
        ]
        return [event for event in events if event is not None]

    def _learn(
        self, step: int, norm: float, post: float, uneven: float, micro_batches: float
    ) -> Event | None:
        if uneven > 1e-4:
            return self._report_once(step, "gradients_rewritten", {"spread": uneven, "hint": _UNEVEN_HINT})
        norm *= self.factor or 1.0
        factor = post / norm
        if abs(factor - 1) <= 1e-5 or post <= 0:
            return None  # a clip that cut nothing (a multiply by 1.0), or everything zeroed
        max_norm = _max_norm(norm, post)
        if self.max_norm is not None and _close(max_norm, self.max_norm, 1e-4):
            return None
        agreeing = [seen[3] for seen in self._candidates if _close(max_norm, seen[2], 1e-4)]
        if agreeing:
            self.max_norm, self.max_norm_step = max_norm, step
            self._confirmed = agreeing
        elif self.factor is None and (
            # 1/k of a step of k micro-batches is a division by them, at once (a clip's coefficient
            # does not fall on it), or two steps with one factor and different ends
            (micro_batches >= 2 and _close(factor, 1 / micro_batches, 1e-5))
            or any(
                _close(factor, seen[0], 1e-5) and not _close(post, seen[1], 1e-3) for seen in self._candidates
            )
        ):
            self.factor = factor
            self._candidates.clear()  # their max_norm were taken before the rescale was known
            return self._report_once(step, "gradients_rescaled", {"factor": factor, "hint": _RESCALE_HINT})
        self._candidates.append((factor, post, max_norm, step))
        return None

    def _report_once(self, step: int, kind: str, data: dict[str, Any]) -> Event | None:
        if kind in self._reported:
            return None
        self._reported.add(kind)
        return {"step": step, "kind": kind, "data": data}


_RESCALE_HINT = (
    "after backward the gradients are multiplied by this same factor on every step (a division by the "
    "accumulation steps?): grad/global_norm and grad/norm are the norms after it, as a clip after it "
    "sees them, from this step's packet on; histograms stay binned as backward left the gradients"
)
_UNEVEN_HINT = (
    "after backward the gradients were rewritten unevenly across layers (clip_grad_value_, a "
    "hand-written all-reduce, some layers zeroed): no clip by the global norm, so no "
    "grad/clip_max_norm is inferred; grad/global_norm and grad/norm are the norms backward left, "
    "grad/global_norm_post_clip the norm the optimizer stepped with"
)


def clip_before_unscale_events(scalars: Scalars, rewrites: GradientRewrites) -> list[Event]:
    """`clip_before_unscale` (a misuse, once) when what rewrote the still-scaled gradients before
    scaler.unscale_ (SCALED_REWRITE, once such a rewrite was seen) is a clip by the global norm: its
    cuts, in the scaled gradients' units (× the step's scale), agree on one max_norm. A division there
    (by the accumulation steps) is harmless: nothing is said (the norms after it are told apart with
    the other rewrites, at the optimizer step)."""
    if rewrites.max_norm is not None:
        return []
    pre, scale = dict(scalars.get("grad/global_norm", [])), dict(scalars.get(SCALE_BEFORE, []))
    spread = dict(scalars.get(SCALED_REWRITE_SPREAD, []))
    rows = [
        (step, pre[step] * scale[step], norm * scale[step], spread.get(step, 0.0))
        for step, norm in scalars.get(SCALED_REWRITE, [])
        if step in pre
        and step in scale
        and all(map(math.isfinite, (pre[step], norm, scale[step])))
        and pre[step] > 0
    ]
    rewrites.learn(rows)
    known = rewrites.known_max_norm()
    if known is None:
        return []
    step, max_norm = known
    return [
        {
            "step": step,
            "kind": "clip_before_unscale",
            "data": {"max_norm": max_norm, "hint": CLIP_BEFORE_UNSCALE_HINT},
        }
    ]


CLIP_BEFORE_UNSCALE_HINT = (
    "the gradients are clipped while still SCALED (before scaler.unscale_): clip_grad_norm_ there "
    "compares S*||g|| with max_norm, clips on nearly every step and shrinks the true gradient to "
    "max_norm/S. Call scaler.unscale_(optimizer) before clipping."
)


def _max_norm(norm: float, post: float) -> float:
    return float(f"{post * (norm + 1e-6) / norm:.6g}")


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _rescale(scalars: Scalars, vectors: Vectors, steps: set[int], factor: float) -> None:
    scalars["grad/global_norm"] = [
        (step, value * factor if step in steps else value) for step, value in scalars["grad/global_norm"]
    ]
    if "grad/norm" in vectors:
        vectors["grad/norm"] = [
            (step, [v * factor for v in norms] if step in steps else norms)
            for step, norms in vectors["grad/norm"]
        ]


def histogram_fractions(
    histograms: list[tuple[int, list[list[float]]]], scale_at: dict[int, float] | None
) -> tuple[Vectors, Scalars]:
    """From the grad/hist matrices: per layer grad/zero_frac and, when the run scales its loss
    (`scale_at`: the scale each step was taken with; 1.0 where a step's is unknown), the fp16
    fractions grad/underflow_frac, grad/precision_loss_frac, grad/overflow_frac, their grad/global_*
    scalars over all layers and the safe-scale band amp/safe_scale_min / amp/safe_scale_max.
    Returns (vectors, scalars), keys in first-recorded order."""
    vectors: Vectors = {}
    scalars: Scalars = {}
    for step, rows in histograms:
        vectors.setdefault("grad/zero_frac", []).append(
            (step, [_quantities.zero_fraction(row) for row in rows])
        )
        if scale_at is None:
            continue
        scale = scale_at.get(step, 1.0)
        columns = _quantities.fp16_columns(scale) if scale > 0 and math.isfinite(scale) else None
        fractions = [_quantities.fp16_fractions(row, scale, columns) for row in rows]
        for index, key in enumerate(
            ("grad/underflow_frac", "grad/precision_loss_frac", "grad/overflow_frac")
        ):
            vectors.setdefault(key, []).append((step, [f[index] for f in fractions]))
        total = [sum(column) for column in zip(*rows, strict=True)] if rows else []
        if total:
            under, precision, over = _quantities.fp16_fractions(total, scale, columns)
            scalars.setdefault("grad/global_underflow_frac", []).append((step, under))
            scalars.setdefault("grad/global_precision_loss_frac", []).append((step, precision))
            scalars.setdefault("grad/global_overflow_frac", []).append((step, over))
        low, high = _quantities.safe_scale_band(rows)
        scalars.setdefault("amp/safe_scale_min", []).append((step, low))
        scalars.setdefault("amp/safe_scale_max", []).append((step, high))
    return vectors, scalars


def derive(
    resolved: Resolved,
    layer_names: Sequence[str],
    *,
    loss_scaling: bool,
    partial_norms: bool,
    report_scale_below_one: bool = True,
    rewrites: GradientRewrites | None = None,
    scaled_rewrites: GradientRewrites | None = None,
) -> bool:
    """Add one packet's host-side quantities and events to `resolved`, in place; drop the update
    ratios of skipped steps. loss_scaling: the run uses a GradScaler (fp16 fractions are computed);
    partial_norms: this rank's norms cover its shard only (no clip threshold from them);
    report_scale_below_one: look for the scale falling below 1; rewrites: what rewrote the gradients
    after backward, as learned from the earlier packets (updated here); scaled_rewrites: the same for
    what rewrote still-scaled gradients before scaler.unscale_. Returns whether that event was added."""
    scalars, vectors = resolved.scalars, resolved.vectors
    resolved.layers = list(layer_names)
    resolved.events.extend(oversized_weight_events(scalars))
    skipped = skipped_steps(scalars)
    _keep_skipped_steps_norms(vectors, skipped)
    resolved.events.extend(skip_events(skipped, scalars, vectors, layer_names))
    if "update/ratio" in vectors and skipped:
        vectors["update/ratio"] = [(s, v) for s, v in vectors["update/ratio"] if s not in skipped]
    rounded_away = rounded_away_fractions(resolved.matrices, skipped)
    if rounded_away:
        vectors["update/rounded_away_frac"] = rounded_away
    below_one = scale_below_one_event(scalars) if report_scale_below_one else None
    if below_one is not None:
        resolved.events.append(below_one)
    if not partial_norms and SCALED_REWRITE in scalars and scaled_rewrites is not None:
        resolved.events.extend(clip_before_unscale_events(scalars, scaled_rewrites))
    if not partial_norms and POST_CLIP_NORM in scalars:
        resolved.events.extend((rewrites or GradientRewrites()).apply(scalars, vectors))
        if scaled_rewrites is not None and scaled_rewrites.max_norm is not None:
            scalars.pop(CLIP_MAX_NORM, None)  # max_norm/S, a clip before unscale_'s: its event tells it
    scale_at = dict(scalars.get(SCALE_BEFORE, [])) if loss_scaling else None
    fraction_vectors, fraction_scalars = histogram_fractions(resolved.matrices.get("grad/hist", []), scale_at)
    for key, rows in fraction_vectors.items():
        vectors.setdefault(key, []).extend(rows)
    for key, points in fraction_scalars.items():
        scalars.setdefault(key, []).extend(points)
    return below_one is not None


class WatchDerivation:
    """derive() for one watched model, called by the sender thread on each packet (a Packet deriver).

    Holds the once-per-run state: a `scale_below_one` event is reported once; what rewrote the
    gradients after backward (a clip's threshold) is carried to the packets after it; `unheld` holds
    the candidates of the optimizer-coverage comparisons in flight (written by the training thread
    before their values are recorded, read and removed here). Set loss_scaling to False when the
    loss scale cannot be read (the fp16 fractions would be taken at a wrong scale).
    """

    def __init__(self, layer_names: Sequence[str], *, loss_scaling: bool, partial_norms: bool) -> None:
        self.layer_names = list(layer_names)
        self.loss_scaling = loss_scaling
        self.partial_norms = partial_norms
        self.scale_below_one_reported = False
        self.rewrites = GradientRewrites()
        self.scaled_rewrites = GradientRewrites()  # before scaler.unscale_: a clip there is a misuse
        self.unheld: dict[int, UnheldCandidates] = {}
        self.clip_factor: ClipFactor | None = None  # the post-clip shortcut the checks are judged for

    def __call__(self, resolved: Resolved) -> None:
        checks = resolved.scalars.pop(CLIP_FACTOR_CHECK, None)
        if checks and self.clip_factor is not None:
            self.clip_factor.verdict(any(value != 0 for _, value in checks))
        if self.unheld:
            resolved.events.extend(unheld_parameter_events(resolved.vectors, self.unheld))
        if derive(
            resolved,
            self.layer_names,
            loss_scaling=self.loss_scaling,
            partial_norms=self.partial_norms,
            report_scale_below_one=not self.scale_below_one_reported,
            rewrites=self.rewrites,
            scaled_rewrites=self.scaled_rewrites,
        ):
            self.scale_below_one_reported = True
