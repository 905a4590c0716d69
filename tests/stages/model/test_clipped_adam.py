"""FusedClippedAdam makes pyro.optim.ClippedAdam's update, all tensors at once."""

from __future__ import annotations

import pyro
import torch
from bdsgd.stages.model.clipped_adam import FusedClippedAdam
from pyro.optim import ClippedAdam


def test_the_fused_update_is_clipped_adams_with_its_learning_rate_decay():
    torch.manual_seed(0)
    shapes = [(3, 4), (4,), (2, 2, 2)]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    fused = FusedClippedAdam(lr=0.05, lrd=0.99, clip_norm=1.0)
    reference = ClippedAdam({"lr": 0.05, "lrd": 0.99, "clip_norm": 1.0})
    for step in range(6):
        grads = [3 * torch.randn(s) for s in shapes]  # beyond clip_norm: clamped
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 2:  # a tensor without a gradient: no update, its learning rate decays
            ours[1].grad = theirs[1].grad = None
        fused(ours)
        reference(theirs)
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_svi_accepts_it():
    pyro.clear_param_store()

    def model():
        pyro.sample(
            "x",
            pyro.distributions.Normal(pyro.param("m", torch.tensor(0.0)), 1.0),
            obs=torch.tensor(2.0),
        )

    svi = pyro.infer.SVI(model, lambda: None, FusedClippedAdam(lr=0.1), pyro.infer.Trace_ELBO())
    for _ in range(5):
        svi.step()
    assert 0.0 < float(pyro.param("m").detach()) < 2.0
