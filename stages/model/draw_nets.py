"""The predictor's per-decision network passes, for a frozen model: the transition and the
emission's phi in numpy, the two (S, N) products and the softplus in torch.

A decision draws S states z_{t+1} and their emission parameters. The networks on z are tiny (8 to
64 units, S = 64 to 256 rows), where each torch call costs about 5 us of dispatch and a numpy
call about 1 us; the (S, N) parts are large, where torch's vectorised softplus is a tenth of
numpy's. The weights are copied once per predictor (the model does not change while it predicts),
and :class:`DrawNets` agrees with the modules it copies (``GatedTransition``, ``Emitter``) to
float32 rounding.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F


def _linear(layer: torch.nn.Linear) -> tuple[np.ndarray, np.ndarray]:
    """(in, out) weight and (out,) bias of a linear layer, float32 numpy copies."""
    weight = layer.weight.detach().float().numpy().T.copy()
    return weight, layer.bias.detach().float().numpy().copy()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 + 0.5 * np.tanh(0.5 * x)  # no overflow for large |x|


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x)  # (S, K) entries: one call beats logaddexp's nine


VECTOR_FROM = 512  # logaddexp: entries from which the vectorised form is the faster


def logaddexp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """log(e^a + e^b) elementwise, as ``np.logaddexp`` (within float rounding), as
    max + log1p(exp(-|a - b|)) by numpy's vectorised exp and log1p: ``np.logaddexp`` computes
    each entry by scalar calls, a tenth of the speed on float32 (0.19 against 0.018 ms for
    16 x 254 x 2 entries). Infinite entries as ``np.logaddexp``: both -inf gives -inf, and an
    inf gives inf. Below ``VECTOR_FROM`` entries its nine calls cost more than the scalar
    loop: ``np.logaddexp`` itself."""
    if a.size < VECTOR_FROM and b.size < VECTOR_FROM:
        return np.logaddexp(a, b)
    top = np.maximum(a, b)
    with np.errstate(invalid="ignore"):  # inf - inf: mended below
        gap = np.subtract(a, b)
    np.abs(gap, out=gap)
    np.negative(gap, out=gap)
    np.exp(gap, out=gap)
    np.log1p(gap, out=gap)
    gap += top
    odd = ~np.isfinite(top)  # -inf or inf on both sides, or one: gap is nan there
    if odd.any():
        np.copyto(gap, top, where=odd)
    return gap


class DrawNets:
    """Numpy copies of a model's transition and phi, and the workers' (F, N) loadings B, C."""

    def __init__(self, model, params) -> None:
        t = model.transition
        self.gate = (_linear(t.gate[0]), _linear(t.gate[2]))
        self.proposed = (_linear(t.proposed[0]), _linear(t.proposed[2]))
        self.to_loc, self.to_scale = _linear(t.z_to_loc), _linear(t.to_scale)
        self.phi = _linear(model.emitter.phi[0])
        self.b_t = params.B.detach().float().T.contiguous()
        self.c_t = params.C.detach().float().T.contiguous()

    @staticmethod
    def _mlp(z: np.ndarray, layers) -> np.ndarray:
        (w1, b1), (w2, b2) = layers
        return np.maximum(z @ w1 + b1, 0.0) @ w2 + b2

    def transition(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """loc, scale (S, K) of z_{t+1} given (S, K) states z_t: ``GatedTransition.forward``."""
        gate = _sigmoid(self._mlp(z, self.gate))
        proposed = self._mlp(z, self.proposed)
        loc = (1.0 - gate) * (z @ self.to_loc[0] + self.to_loc[1]) + gate * proposed
        w, b = self.to_scale
        return loc, _softplus(np.maximum(proposed, 0.0) @ w + b) + np.float32(1e-3)

    def emission(self, z: np.ndarray, base) -> tuple[torch.Tensor, torch.Tensor]:
        """loc, scale (S, N) of y given (S, K) states and no host jump: ``Emitter.forward``."""
        w, b = self.phi
        phi = torch.from_numpy(np.tanh(z @ w + b).astype(np.float32, copy=False))
        loc = torch.addmm(base.loc0, phi, self.b_t)
        scale = softplus(torch.addmm(base.pre0, phi, self.c_t)).mul_(base.scale0).add_(1e-3)
        return loc, scale


EXP_SAFE = 80.0  # float32's exp overflows above 88.7


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), as torch's softplus to float32 rounding: exp then log1p (torch's CPU
    softplus took 1.7x as long at 64 x 1,024), torch's own where some entry could overflow or
    a gradient is wanted (the log1p is taken in place)."""
    if not x.requires_grad and x.numel() and float(x.max()) < EXP_SAFE:
        return x.exp().log1p_()
    return F.softplus(x)
