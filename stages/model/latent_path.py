"""A window's latent path ``z_{1:L}`` as one Pyro sample site: batch (B,), event (L, K).

``MarkovPath`` is the prior, ``FilteredPath`` the guide::

    p(z_{1:L})     = prod_t N(z_t; mu(z_{t-1}), sigma(z_{t-1})^2)          z_0 = z_init
    q(z_{1:L} | x) = prod_t N(z_t; loc(z_{t-1}, h_t), scale(z_{t-1}, h_t)^2)   z_0 = z_q_init

Drawing a path is sequential (step t's mean depends on the draw at t - 1); scoring a given path
is not: every step's conditional is one batched call on ``z_{0:L-1}``. So the model scores the
guide's path in one call, and the only loop left is the guide's draw, in plain torch, without
Pyro's per-site work (tracing, log-probabilities, KL terms) at every step.

KL: ``TraceMeanField_ELBO`` takes ``KL(q || p)`` from the registry. The one registered here is
the per-step analytic KL at the guide's latest draw,
``sum_t KL(q(z_t | z_{t-1}) || p(z_t | z_{t-1}))`` with ``z_{0:L-1}`` from that draw: an unbiased
estimate of the paths' KL, the one ``TraceMeanField_ELBO`` computes when every step is its own
site. A ``FilteredPath`` that has not drawn has no such estimate (the ELBO then falls back to
``log p(z) - log q(z)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from pyro.distributions import Normal, TorchDistribution, constraints
from torch.distributions import kl_divergence, register_kl

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Combiner(Protocol):
    """q's step: ``combiner(z_{t-1}, h_t) -> (loc, scale)`` of z_t, and ``combiner.draw(z0, h,
    noise) -> (path, loc, scale)`` the whole path drawn in order, h (M, L, H), noise (M, L, K)."""

    def __call__(self, z: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def draw(
        self, z0: torch.Tensor, h: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _previous(z0: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """``z_{0:L-1}`` of a path ``z_{1:L}`` (..., L, K)."""
    start = z0.expand(*path.shape[:-2], 1, path.shape[-1])
    return torch.cat([start, path[..., :-1, :]], dim=-2)


class _Path(TorchDistribution):
    """A path of L steps of K: batch (B,), event (L, K); a subclass gives ``conditionals``."""

    arg_constraints = {}
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def conditionals(self, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def log_prob(self, path: torch.Tensor) -> torch.Tensor:
        loc, scale = self.conditionals(path)
        return Normal(loc, scale).log_prob(path).sum((-2, -1))

    def expand(self, batch_shape, _instance=None):
        """Itself where the shape is already ``batch_shape`` (as a plate asks): a wrapped path
        would hide its type from the KL registry."""
        if torch.Size(batch_shape) == self.batch_shape:
            return self
        return super().expand(batch_shape, _instance)


class MarkovPath(_Path):
    """p(z_{1:L}): ``transition(z_{t-1}) -> (loc, scale)`` of z_t, from ``z0`` (K,)."""

    def __init__(self, transition: Step, z0: torch.Tensor, batch: int, length: int):
        self.transition, self.z0 = transition, z0
        super().__init__(
            torch.Size([batch]), torch.Size([length, z0.shape[-1]]), validate_args=False
        )

    def conditionals(self, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """loc, scale (..., L, K) of every z_t given z_{t-1} on ``path``, in one call."""
        return self.transition(_previous(self.z0, path))

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        z = self.z0.expand(*sample_shape, *self.batch_shape, -1)
        steps = []
        for _ in range(self.event_shape[0]):
            loc, scale = self.transition(z)
            z = loc + scale * torch.randn_like(loc)
            steps.append(z)
        return torch.stack(steps, dim=-2)


class FilteredPath(_Path):
    """q(z_{1:L} | x): ``combiner(z_{t-1}, h_t) -> (loc, scale)`` of z_t, from ``z0`` (K,),
    with ``h`` (B, L, H) the encoder's filtered states (:class:`Combiner`)."""

    def __init__(self, combiner: Combiner, z0: torch.Tensor, h: torch.Tensor):
        self.combiner, self.z0, self.h = combiner, z0, h
        self.drawn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """(path, loc, scale) of the latest ``rsample``: what the registered KL is taken at."""
        super().__init__(h.shape[:-2], torch.Size([h.shape[-2], z0.shape[-1]]), validate_args=False)

    def conditionals(self, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """loc, scale (..., L, K) of every z_t given z_{t-1} on ``path`` and h_t, in one call."""
        return self.combiner(_previous(self.z0, path), self.h)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """z_t = loc_t + scale_t eps_t, t = 1..L in order (``combiner.draw``); keeps
        (path, loc, scale). The noise is drawn step by step (t outermost), as L sites would."""
        length, k = self.event_shape
        shape = (*sample_shape, *self.batch_shape)
        noise = torch.randn(length, *shape, k).movedim(0, -2).reshape(-1, length, k)
        h = self.h.expand(*shape, -1, -1).reshape(noise.shape[0], length, -1)
        drawn = self.combiner.draw(self.z0, h, noise)
        self.drawn = tuple(v.reshape(*shape, length, k) for v in drawn)
        return self.drawn[0]


@register_kl(FilteredPath, MarkovPath)
def kl_at_draw(q: FilteredPath, p: MarkovPath) -> torch.Tensor:
    """sum_t KL(q(z_t | z_{t-1}) || p(z_t | z_{t-1})) at q's latest draw (the module docstring)."""
    if q.drawn is None:
        raise NotImplementedError("FilteredPath has not drawn a path")
    path, loc, scale = q.drawn
    p_loc, p_scale = p.conditionals(path)
    return kl_divergence(Normal(loc, scale), Normal(p_loc, p_scale)).sum((-2, -1))
