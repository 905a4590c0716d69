"""The predictor's numpy copies of the transition and the emission agree with the modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bdsgd.stages.model.draw_nets import EXP_SAFE, DrawNets, logaddexp, softplus
from bdsgd.stages.model.runtime_model import EmissionBase, ModelConfig, RuntimeModel


def _trained_looking(seed: int) -> RuntimeModel:
    """A model whose weights are not at their initial values (eye, zeros), so every term counts."""
    torch.manual_seed(seed)
    model = RuntimeModel(ModelConfig(num_workers=12, num_hosts=3)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def test_transition_matches_the_module_to_float32_rounding() -> None:
    model = _trained_looking(0)
    nets = DrawNets(model, model.head(torch.arange(1, 13), torch.arange(1, 13) % 3 + 1))
    z = 2.0 * torch.randn(64, model.cfg.z_dim)
    with torch.no_grad():
        loc, scale = model.transition(z)
    got_loc, got_scale = nets.transition(z.numpy())
    assert got_loc.dtype == np.float32 and got_scale.dtype == np.float32
    np.testing.assert_allclose(got_loc, loc.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_scale, scale.numpy(), rtol=1e-5, atol=1e-5)
    assert (got_scale > 0).all()


def test_emission_matches_the_module_to_float32_rounding() -> None:
    model = _trained_looking(1)
    with torch.no_grad():
        params = model.head(torch.arange(1, 13), torch.arange(1, 13) % 3 + 1)
        base = EmissionBase(
            loc0=torch.randn(12), pre0=torch.randn(12), scale0=torch.rand(12) + 0.1,
            jump_logit=torch.randn(12),
        )  # fmt: skip
        nets = DrawNets(model, params)
        z = 2.0 * torch.randn(32, model.cfg.z_dim)
        loc, scale = model.emitter(z, params, base)
        got_loc, got_scale = nets.emission(z.numpy(), base)
    assert got_loc.shape == loc.shape == (32, 12)
    torch.testing.assert_close(got_loc, loc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_scale, scale, rtol=1e-5, atol=1e-5)


def test_softplus_matches_torch_below_and_above_the_exp_limit() -> None:
    # exp then log1p where every entry is safe; torch's own once one could overflow
    x = torch.linspace(-60.0, 60.0, 4001).reshape(1, -1)
    torch.testing.assert_close(softplus(x), torch.nn.functional.softplus(x), rtol=2e-6, atol=1e-7)
    big = torch.cat([x, torch.tensor([[EXP_SAFE + 20.0]])], 1)
    out = softplus(big)
    assert torch.isfinite(out).all() and float(out[0, -1]) == EXP_SAFE + 20.0


def test_softplus_with_a_gradient_wanted_gives_torchs_gradient() -> None:
    x = torch.linspace(-5.0, 5.0, 11, requires_grad=True)
    (grad,) = torch.autograd.grad(softplus(x).sum(), [x])
    torch.testing.assert_close(grad, torch.sigmoid(x.detach()))


@pytest.mark.parametrize("size", [100, 2000])  # below and above VECTOR_FROM
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logaddexp_matches_numpys_including_infinities_and_nan(dtype, size) -> None:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((2, size)) * 60).astype(dtype)
    a[:6] = [-np.inf, -np.inf, np.inf, np.inf, 0.0, np.nan]
    b[:6] = [-np.inf, 3.0, -np.inf, np.inf, -np.inf, 1.0]
    with np.errstate(invalid="ignore"):
        want, got = np.logaddexp(a, b), logaddexp(a, b)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=2e-7 if dtype == np.float32 else 1e-15, atol=0)
    assert np.isneginf(got[0]) and np.isposinf(got[2:4]).all() and np.isnan(got[5])
