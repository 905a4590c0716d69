"""gru_sequence against nn.GRU's own autograd."""

from __future__ import annotations

import pytest
import torch
from bdsgd.stages.model.gru import gru_sequence


def _case(dtype=torch.float64, batch=3, steps=7, size=(5, 4)):
    torch.manual_seed(0)
    gru = torch.nn.GRU(*size, batch_first=True).to(dtype)
    x = torch.randn(batch, steps, size[0], dtype=dtype, requires_grad=True)
    h0 = torch.randn(batch, size[1], dtype=dtype, requires_grad=True)
    return gru, x, h0


def _grads(out, gru, x, h0, weights):
    grads = torch.autograd.grad((out * weights).sum(), [x, h0, *gru.parameters()])
    return [g.detach() for g in grads]


def test_outputs_and_every_gradient_match_nn_gru():
    gru, x, h0 = _case()
    weights = torch.randn(3, 7, 4, dtype=torch.float64)  # a loss that weighs every output
    ours = gru_sequence(gru, x, h0)
    theirs = gru(x, h0.unsqueeze(0))[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    ours_g, theirs_g = _grads(ours, gru, x, h0, weights), _grads(theirs, gru, x, h0, weights)
    assert len(ours_g) == len(theirs_g) == 6
    for a, b in zip(ours_g, theirs_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_passes_torch_gradcheck():
    gru, x, h0 = _case(batch=2, steps=4, size=(3, 2))
    params = list(gru.parameters())
    assert torch.autograd.gradcheck(lambda *args: gru_sequence(gru, args[0], args[1]), (x, h0))
    assert all(p.requires_grad for p in params)


def test_float32_matches_to_rounding():
    gru, x, h0 = _case(torch.float32, batch=16, steps=48, size=(64, 64))
    weights = torch.randn(16, 48, 64)
    ours, theirs = gru_sequence(gru, x, h0), gru(x, h0.unsqueeze(0))[0]
    ours_g, theirs_g = _grads(ours, gru, x, h0, weights), _grads(theirs, gru, x, h0, weights)
    assert len(ours_g) == len(theirs_g) == 6
    for a, b in zip(ours_g, theirs_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # sums of 768 terms


def test_refuses_a_gru_it_does_not_cover():
    gru = torch.nn.GRU(3, 2, num_layers=2, batch_first=True)
    with pytest.raises(ValueError, match="one layer"):
        gru_sequence(gru, torch.zeros(1, 2, 3), torch.zeros(1, 2))


def test_a_second_derivative_is_refused_not_wrong():
    gru, x, h0 = _case(batch=2, steps=3, size=(3, 2))
    (g,) = torch.autograd.grad(gru_sequence(gru, x, h0).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        torch.autograd.grad(g.sum(), [x])
