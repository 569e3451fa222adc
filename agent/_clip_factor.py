"""The post-clip gradient norm from the clip's one factor, without a second read of the gradients.

Every clip in common use (torch's clip_grad_norm_ and its two-part form, FSDP's, Accelerate's,
DeepSpeed's, Lightning's, a hand-written one) multiplies every gradient by one factor
c = min(1, max_norm / total). The post-clip global norm is then c times the pre-clip one, which is
measured anyway. c is read from a few gradient elements ("probes": the first and last element of up to
8 layers) kept when the gradients are measured and read again when the optimizer steps: after /
before, on the device, no sync. For float32 gradients that is exact to float rounding (each element is
one multiply by c), far inside the 1e-5 the truth tests ask for.

Verification: on the per-layer sampling steps the Watcher still reads the clipped gradients fully (it
records their per-layer norms anyway) and records, as an agent-internal value, whether the factor would
have been wrong there: a rewrite that is not one factor (a clip_grad_value_, a clip per layer) or a
factor the probes got wrong. The sender thread reads it with the rest of the step's values (no sync in
the training thread) and gives its verdict here: the factor is trusted from the first verification that
found it right (until then, about one flush, every clipped step is read fully) and turned off for the
rest of the run by one that found it wrong (every clipped step is then read fully; the sender's
`gradients_rewritten` event says once that the rewrite was no clip by the global norm). Half-precision
gradients (bf16 or fp16 weights) are always read fully: their multiply rounds each element to 8 or 11
bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._quantities import rewrite_factors

PROBE_LAYERS = 8
# Relative. The post-clip norm must come within 1e-5 of a full read's (the truth tests' bound; float32
# rounding puts them ~1e-6 apart). The per-layer factors of one clip differ by the rounding of each
# layer's norm, up to ~1e-5 for a small layer: within 1e-4 they are one factor (as _derive counts).
MISS_TOLERANCE = 1e-5
SPREAD_TOLERANCE = 1e-4


class ClipFactor:
    """Probes of one Watcher's gradients and whether the one-factor shortcut holds: "unverified", then
    "trusted" or "off". Probes and checks are taken on the training thread; verdicts come from the
    sender thread (a plain attribute write)."""

    def __init__(self, params: Sequence[Any]) -> None:
        import torch

        self._torch = torch
        count = len(params)
        self.state = "unverified" if count and all(p.dtype == torch.float32 for p in params) else "off"
        # Spread over the model (first and last layer included): one layer's elements may all be 0 (an
        # embedding's padding row, a dead unit), several seldom are.
        picks = min(PROBE_LAYERS, count)
        self.layers = sorted({round(i * (count - 1) / max(picks - 1, 1)) for i in range(picks)})

    def probes(self, grads: Sequence[Any]) -> Any:
        """The probed elements of these gradients (a 1-d device tensor), or None when the shortcut is
        off or a probed layer has no gradient (read fully then)."""
        if self.state == "off":
            return None
        picked = [grads[i] for i in self.layers]
        if any(g is None or g.numel() == 0 for g in picked):
            return None
        elements = []
        for g in picked:  # views: indexing reads one element each, never the tensor
            elements.append(g[(0,) * g.dim()])
            elements.append(g[(-1,) * g.dim()])
        return self._torch.stack(elements).to(self._torch.float32)

    def post_clip(self, before: Any, grads: Sequence[Any], pre_clip_global: Any) -> tuple[Any, Any] | None:
        """(post-clip global norm, spread of the probed factors) from the probes taken when the
        gradients were measured (`before`) and the same elements now, once the factor is trusted;
        None: read fully."""
        if self.state != "trusted":
            return None
        return self._estimate(before, grads, pre_clip_global)

    def check(self, before: Any, grads: Sequence[Any], pre_clip_global: Any, post: Any, spread: Any) -> Any:
        """On a step read fully (its post-clip norm `post`, its per-layer factor `spread`): whether the
        factor would have been wrong there, 1.0 or 0.0 on the device (recorded for the sender's verdict);
        None when there is nothing to check."""
        estimate = None if self.state == "off" else self._estimate(before, grads, pre_clip_global)
        if estimate is None:
            return None
        miss = (estimate[0] - post).abs() > MISS_TOLERANCE * post.abs()
        wrong = (spread > SPREAD_TOLERANCE) | (miss & self._torch.isfinite(post))
        return wrong.to(self._torch.float32)

    def verdict(self, wrong: bool) -> None:
        """The sender thread's reading of a check: wrong turns the shortcut off for good; right trusts
        it (unless it is already off)."""
        if wrong:
            self.state = "off"
        elif self.state == "unverified":
            self.state = "trusted"

    def _estimate(self, before: Any, grads: Sequence[Any], pre_clip_global: Any) -> tuple[Any, Any] | None:
        after = self.probes(grads)
        if after is None or before is None or after.shape != before.shape:
            return None
        torch = self._torch
        largest, spread, any_valid = rewrite_factors(before, after)
        # No element to read a factor from (all 0): taken as untouched, and the next verification tells.
        factor = torch.where(any_valid, largest, 1.0)
        # A clip multiplies by 0 only when its total was not finite (an inf written after the measured
        # backward): the gradients it leaves hold NaN where the inf was, and so does their norm.
        post = torch.where((factor == 0) & (pre_clip_global > 0), torch.nan, factor * pre_clip_global)
        return post, spread
