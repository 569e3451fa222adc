"""The post-clip norm from the clip's one factor (agent/_clip_factor.py, issue 40): exact for a clip by
the global norm, found out by its check for anything else, never used for half-precision gradients."""

import math

import pytest
import torch
from torch import nn

from gradwatch._clip_factor import ClipFactor
from gradwatch._quantities import factor_spread, global_norm, layer_norms


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6))).to(dtype)
    model(torch.randn(16, 32, dtype=dtype)).square().sum().backward()
    return model


def _measured(model):
    grads = [p.grad for p in model.parameters()]
    per_layer = layer_norms(grads, grads[0])
    return grads, per_layer, global_norm(per_layer)


def _trusted(params):
    factor = ClipFactor(params)
    factor.verdict(False)
    return factor


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e6])  # cuts hard, cuts, leaves alone
def test_a_clip_by_the_global_norm_gives_the_exact_post_clip_norm(max_norm):
    model = _model()
    factor = _trusted(list(model.parameters()))
    assert len(factor.layers) == 8  # spread over the 12 tensors, first and last included
    grads, per_layer, pre = _measured(model)
    probes = factor.probes(grads)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    post, spread = factor.post_clip(probes, grads, pre)
    truth = math.sqrt(sum(p.grad.norm().item() ** 2 for p in model.parameters()))
    assert post.item() == pytest.approx(truth, rel=1e-6) and spread.item() < 1e-6
    full_spread = factor_spread(per_layer, layer_norms(grads, grads[0]))
    assert factor.check(probes, grads, pre, torch.tensor(truth), full_spread).item() == 0.0


def test_a_rewrite_that_is_no_single_factor_is_found_by_its_check_and_turns_the_shortcut_off():
    model = _model()
    factor = ClipFactor(list(model.parameters()))
    assert factor.post_clip(None, [], None) is None  # unverified: read fully
    grads, per_layer, pre = _measured(model)
    probes = factor.probes(grads)
    nn.utils.clip_grad_value_(model.parameters(), 1e-3)
    after = layer_norms(grads, grads[0])
    wrong = factor.check(probes, grads, pre, global_norm(after), factor_spread(per_layer, after))
    assert wrong.item() == 1.0
    factor.verdict(True)
    assert factor.state == "off" and factor.probes(grads) is None
    factor.verdict(False)  # a later right check does not bring it back
    assert factor.state == "off"


def test_half_precision_gradients_are_always_read_fully():
    model = _model(torch.bfloat16)
    assert ClipFactor(list(model.parameters())).state == "off"


def test_an_inf_written_after_backward_and_clipped_away_is_a_nan_post_clip_norm():
    """A clip of a non-finite total multiplies every gradient by 0 and leaves NaN where the inf was:
    the post-clip norm is NaN, not 0 times the finite norm measured before the inf was written."""
    model = _model()
    factor = _trusted(list(model.parameters()))
    grads, _, pre = _measured(model)
    probes = factor.probes(grads)
    model[3].weight.grad[5, 5] = math.inf
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    post, _ = factor.post_clip(probes, grads, pre)
    assert math.isnan(post.item())
