"""Combiner.draw (its written-out backward pass) against the same steps recorded by autograd."""

from __future__ import annotations

import torch
from bdsgd.stages.model.runtime_model import Combiner
from torch.nn import functional as F


def recorded_draw(combiner: Combiner, z0, h, noise):
    """The path step by step under autograd, as ``Combiner.forward`` defines each step."""
    z, steps, locs, scales = z0.expand(noise.shape[0], -1), [], [], []
    for t in range(noise.shape[1]):
        c = 0.5 * (torch.tanh(combiner.z_to_hidden(z)) + h[:, t])
        loc, scale = combiner.to_loc(c), F.softplus(combiner.to_scale(c)) + 1e-3
        z = loc + scale * noise[:, t]
        steps.append(z)
        locs.append(loc)
        scales.append(scale)
    return torch.stack(steps, 1), torch.stack(locs, 1), torch.stack(scales, 1)


def _case(dtype=torch.float64, m=3, steps=6, k=2, hidden=5):
    torch.manual_seed(0)
    combiner = Combiner(k, hidden).to(dtype)
    z0 = torch.randn(k, dtype=dtype, requires_grad=True)
    h = torch.randn(m, steps, hidden, dtype=dtype, requires_grad=True)
    noise = torch.randn(m, steps, k, dtype=dtype)
    return combiner, z0, h, noise


def _grads(outputs, weights, inputs):
    loss = sum((o * w).sum() for o, w in zip(outputs, weights, strict=True))
    return torch.autograd.grad(loss, inputs)


def test_path_and_every_gradient_match_the_recorded_steps():
    combiner, z0, h, noise = _case()
    ours, theirs = combiner.draw(z0, h, noise), recorded_draw(combiner, z0, h, noise)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    weights = [torch.randn_like(o) for o in ours]  # a loss that weighs path, loc and scale
    inputs = [z0, h, *combiner.parameters()]
    assert len(inputs) == 8
    for a, b in zip(_grads(ours, weights, inputs), _grads(theirs, weights, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_an_unused_output_counts_as_zero_gradient():
    # the KL uses loc and scale, the model the path; a loss on the path alone must still work
    combiner, z0, h, noise = _case()
    ours, theirs = combiner.draw(z0, h, noise)[0], recorded_draw(combiner, z0, h, noise)[0]
    g_ours = torch.autograd.grad(ours.square().sum(), [z0, h])
    g_theirs = torch.autograd.grad(theirs.square().sum(), [z0, h])
    for a, b in zip(g_ours, g_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_float32_at_a_fits_size_matches_to_rounding():
    combiner, z0, h, noise = _case(torch.float32, m=16, steps=48, k=8, hidden=64)
    ours, theirs = combiner.draw(z0, h, noise), recorded_draw(combiner, z0, h, noise)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_noise_that_wants_a_gradient_gets_the_recorded_one():
    combiner, z0, h, noise = _case()
    noise.requires_grad_(True)
    weights = [torch.randn(3, 6, 2, dtype=torch.float64) for _ in range(3)]
    ours = _grads(combiner.draw(z0, h, noise), weights, [noise])[0]
    theirs = _grads(recorded_draw(combiner, z0, h, noise), weights, [noise])[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


def test_outputs_of_one_step_or_one_row_are_not_views_of_saved_buffers():
    for m, steps in ((1, 4), (3, 1)):
        combiner, z0, h, noise = _case(m=m, steps=steps)
        path, loc, scale = combiner.draw(z0, h, noise)
        path.add_(1.0)  # in place on an output: the saved buffers must not move with it
        grad = torch.autograd.grad((path + loc + scale).sum(), [z0])[0]
        assert torch.isfinite(grad).all()
