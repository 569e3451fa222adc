"""What is computed: the training-health quantities, as pure functions of tensors on their device.

No function here synchronises with the device (no .item(), .tolist(), .cpu(), no data-dependent
Python branching); each returns tensors that the StepBuffer later moves to the host in one transfer.
Host-side derivations from the transferred values live at the bottom and run on the sender thread.

On the device: layer_norms (grad/norm, param/norm, grad/global_norm), update_ratios (update/ratio),
unchanged_counts (the counts behind update/rounded_away_frac), log2_histograms (grad/hist).
On the host: fp16_fractions (grad/underflow_frac, grad/precision_loss_frac, grad/overflow_frac),
zero_fraction (grad/zero_frac), rounded_away_fraction (update/rounded_away_frac), safe_scale_band
(amp/safe_scale_min, amp/safe_scale_max).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# log2 histogram bins: bin e counts |g| in [2^(e-1), 2^e) (torch.frexp's exponent), e in
# [EXPONENT_MIN, EXPONENT_MAX]; smaller magnitudes fall into the first bin, larger into the last.
# The range covers fp16's thresholds (2^-24, 2^-14, 2^16) at any loss scale from 2^-40 to 2^56.
EXPONENT_MIN = -80
EXPONENT_MAX = 40
N_BINS = EXPONENT_MAX - EXPONENT_MIN + 1
# Columns of one layer's histogram row: N_BINS exponent bins, then zeros, then non-finite values.
ZERO_COLUMN = N_BINS
NON_FINITE_COLUMN = N_BINS + 1

FP16_SMALLEST_SUBNORMAL = 2.0**-24  # below this (scaled) a gradient becomes 0 in fp16
FP16_SMALLEST_NORMAL = 2.0**-14  # below this it loses precision (subnormal)
FP16_MAX = 65504.0  # above this it becomes inf


def layer_norms(tensors: Sequence[Any], like: Any) -> Any:
    """L2 norm of each tensor, in float32, stacked into one 1-d tensor (one value per layer).

    `tensors` may contain None (a layer without a gradient this step): its norm is 0.
    `like`: a tensor on the device the result should live on.
    """
    import torch

    present = [t for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors), dtype=torch.float32, device=like.device)
    norms: tuple[torch.Tensor, ...] | list[torch.Tensor] = torch._foreach_norm(
        present, 2, dtype=torch.float32
    )
    if len(present) != len(tensors):
        it = iter(norms)
        zero = torch.zeros((), dtype=torch.float32, device=like.device)
        norms = [next(it) if t is not None else zero for t in tensors]
    if len({n.device for n in norms}) > 1:  # model parallel: gather the scalars on one device
        norms = [n.to(like.device, non_blocking=True) for n in norms]
    return torch.stack(norms)


def global_norm(per_layer: Any) -> Any:
    """The global L2 norm from per-layer L2 norms (sqrt of the sum of squares)."""
    import torch

    return torch.linalg.vector_norm(per_layer)


class Snapshot:
    """Copies of the parameters and their norms, taken before an optimizer step (update ratio)."""

    def __init__(self, params: Sequence[Any]) -> None:
        import torch

        with torch.no_grad():
            self.copies = torch._foreach_mul([p.detach() for p in params], 1.0)
            self.norms = torch.stack(torch._foreach_norm(self.copies, 2, dtype=torch.float32))


def snapshot(params: Sequence[Any]) -> Snapshot:
    """Take a Snapshot of `params` (one copy of the model: memory bounded by the model's size)."""
    return Snapshot(params)


def unchanged_counts(params: Sequence[Any], grads: Sequence[Any], before: Snapshot) -> Any:
    """Per layer, [elements whose stored value did not change in the step although their gradient
    was non-zero and finite, elements with a non-zero finite gradient]: an int64 tensor [layers, 2].

    Exact equality of the stored values (W_after == W_before): for bf16/fp16 weights an update below
    half an ulp of W is rounded away; for fp32 weights it is ~never. A layer without a gradient
    (None, or a sparse one) gives [0, 0]. Call before update_ratios, which spends the snapshot.
    Costs three elementwise passes per layer; meant for sampled steps.
    """
    import torch

    rows = []
    with torch.no_grad():
        for p, g, copy in zip(params, grads, before.copies, strict=True):
            if g is None or g.layout != torch.strided:
                rows.append(torch.zeros(2, dtype=torch.int64, device=copy.device))
                continue
            g = g.detach()
            stepped = (g != 0) & torch.isfinite(g)
            unchanged = (copy == p.detach()) & stepped
            rows.append(torch.stack((unchanged.sum(), stepped.sum())))
    device = before.norms.device
    if not rows:
        return torch.zeros(0, 2, dtype=torch.int64, device=device)
    if len({row.device for row in rows}) > 1:  # model parallel: gather the counts on one device
        rows = [row.to(device, non_blocking=True) for row in rows]
    return torch.stack(rows)


def update_ratios(params: Sequence[Any], before: Snapshot) -> Any:
    """||W_after − W_before|| / ||W_before|| per layer, float32 (inf where W_before is all zeros).

    The difference is taken in place in the snapshot's copies (no second model-sized allocation);
    the snapshot is spent afterwards.
    """
    import torch

    with torch.no_grad():
        torch._foreach_sub_(before.copies, [p.detach() for p in params])  # W_before - W_after
        delta_norms = torch.stack(torch._foreach_norm(before.copies, 2, dtype=torch.float32))
        return delta_norms / before.norms


def _exponent_column_map(device: Any) -> Any:
    """Column of the output row for each float32 biased exponent E (0..255).

    A normal float32 with biased exponent E lies in [2^(E-127), 2^(E-126)): frexp exponent E - 126.
    E = 0 holds zeros and fp32 subnormals (|g| < 2^-126, far below anything fp16 can hold at any
    loss scale): both are counted as zeros. E = 255 holds NaN and ±Inf.
    """
    import torch

    columns = [min(max(e - 126, EXPONENT_MIN), EXPONENT_MAX) - EXPONENT_MIN for e in range(256)]
    columns[0] = ZERO_COLUMN
    columns[255] = NON_FINITE_COLUMN
    return torch.tensor(columns, dtype=torch.int64, device=device)


def log2_histograms(tensors: Sequence[Any], like: Any) -> Any:
    """Per layer, counts of |g| per power-of-two bin plus zero and non-finite counts.

    Returns an int64 tensor [layers, N_BINS + 2]; column e - EXPONENT_MIN counts |g| in
    [2^(e-1), 2^e); ZERO_COLUMN counts zeros (and fp32 subnormals, |g| < 2^-126), NON_FINITE_COLUMN
    NaN and ±Inf. Exact: every element is counted once, NaN/Inf are never dropped. A missing tensor
    (None) gives a zero row.

    Cost: the exponent is read from the float32 bit pattern, so each layer takes three passes over
    its gradient (shift, mask, bincount) and no float math.
    """
    import torch

    rows = []
    for t in tensors:
        if t is None:
            rows.append(torch.zeros(256, dtype=torch.int64, device=like.device))
            continue
        flat = t.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        biased_exponent = flat.view(torch.int32).bitwise_right_shift(23).bitwise_and_(0xFF)
        counts = torch.bincount(biased_exponent, minlength=256)
        rows.append(counts.to(like.device, non_blocking=True))
    out = torch.zeros(len(rows), N_BINS + 2, dtype=torch.int64, device=like.device)
    out.index_add_(1, _exponent_column_map(like.device), torch.stack(rows))
    return out


# -- host side (sender thread): derivations from transferred histograms --------------------------


def _bin_lower_edge(column: int) -> float:
    return 2.0 ** (column + EXPONENT_MIN - 1)


def _bin_upper_edge(column: int) -> float:
    return 2.0 ** (column + EXPONENT_MIN)


def fp16_fractions(row: Sequence[float], scale: float) -> tuple[float, float, float]:
    """(underflow, precision-loss, overflow) fractions of one layer's non-zero finite gradients at
    loss scale `scale`: |g·S| < 2^-24, |g·S| < 2^-14, |g·S| > 65504.

    Counted from whole bins, so exact when S is a power of two (GradScaler's scales are); otherwise
    a bin straddling a threshold is counted on the safe side (not underflowing / not overflowing).
    NaN when the layer has no non-zero finite gradient.
    """
    counted = sum(row[:N_BINS])
    if counted == 0 or not (scale > 0 and math.isfinite(scale)):
        return math.nan, math.nan, math.nan
    underflow = precision_loss = overflow = 0.0
    for column in range(N_BINS):
        count = row[column]
        if not count:
            continue
        if _bin_upper_edge(column) * scale <= FP16_SMALLEST_SUBNORMAL:
            underflow += count
        if _bin_upper_edge(column) * scale <= FP16_SMALLEST_NORMAL:
            precision_loss += count
        if _bin_lower_edge(column) * scale > FP16_MAX:
            overflow += count
    return underflow / counted, precision_loss / counted, overflow / counted


def zero_fraction(row: Sequence[float]) -> float:
    """Fraction of one layer's gradient elements that are zero (|g| < 2^-126: zero or an fp32
    subnormal), from its histogram row; NaN when the row counts nothing (no gradient at all)."""
    total = sum(row)
    return row[ZERO_COLUMN] / total if total else math.nan


def rounded_away_fraction(unchanged: float, stepped: float) -> float:
    """Fraction of a layer's elements with a non-zero finite gradient whose stored value did not
    change in the optimizer step (unchanged_counts' two columns); NaN when no element had one."""
    return unchanged / stepped if stepped else math.nan


def safe_scale_band(rows: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(low, high): loss scales S with eps_fp16 / g_min < S < 65504 / g_max, from all layers' bins.

    g_min is taken as the lower edge of the smallest non-empty bin and g_max as the upper edge of the
    largest, so the band is conservative (never wider than the true one). NaN when nothing counted.
    """
    lowest = highest = None
    for row in rows:
        for column in range(N_BINS):
            if row[column]:
                lowest = column if lowest is None else min(lowest, column)
                highest = column if highest is None else max(highest, column)
    if lowest is None or highest is None:
        return math.nan, math.nan
    return FP16_SMALLEST_SUBNORMAL / _bin_lower_edge(lowest), FP16_MAX / _bin_upper_edge(highest)
