"""A one-layer GRU over a whole window whose backward pass is taken in batches.

``nn.GRU`` on the CPU runs its forward pass as one fused operation, but under autograd it
records every step's cell (about twenty small operations a step), and the backward pass walks
that graph: 5.3 of the 6.6-6.7 ms of a fit's GRU (16 windows x 48 iterations, 64 units, one
thread). :func:`gru_sequence` runs the same fused forward pass without recording, and its
backward pass:

- recomputes every step's gates at once from the outputs (one product for the input side and
  one for the recurrent side, over all steps),
- walks back through time with what depends on the step before (:func:`_back_through_time`:
  an add, one product into five gradients and one ``addmm`` a step),
- takes the weights' gradients as one product each over all steps.

A whole fit's GRU forward and backward went from 6.7 to 4.4 ms (docs/benchmarks.md).

PyTorch's GRU (``torch.nn.GRU``)::

    r = sigmoid(W_ir x + b_ir + W_hr h + b_hr)
    z = sigmoid(W_iz x + b_iz + W_hz h + b_hz)
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn))
    h' = (1 - z) * n + z * h

Tests check values and gradients against ``nn.GRU``'s autograd in float64.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable


def gru_sequence(gru: nn.GRU, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """The outputs (B, L, H) of ``gru`` (one layer, batch first, with biases) over ``x``
    (B, L, I) from ``h0`` (B, H), as ``gru(x, h0[None])[0]``, with the batched backward."""
    if gru.num_layers != 1 or gru.bidirectional or not gru.batch_first or not gru.bias:
        raise ValueError("gru_sequence: one layer, one direction, batch first, with biases")
    params = (gru.weight_ih_l0, gru.weight_hh_l0, gru.bias_ih_l0, gru.bias_hh_l0)
    return _GruSequence.apply(x, h0, *params, gru)


class _GruSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h0, w_ih, w_hh, b_ih, b_hh, gru):  # noqa: ARG004 (gru holds them)
        out = gru(x, h0.unsqueeze(0).contiguous())[0]  # the fused pass, nothing recorded
        ctx.save_for_backward(x, h0, out, w_ih, w_hh, b_ih, b_hh)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, h0, out, w_ih, w_hh, b_ih, b_hh = ctx.saved_tensors
        batch, steps, hidden = out.shape
        x_tf = x.transpose(0, 1).reshape(steps * batch, -1)  # time first: (L B, I)
        out_tf = out.transpose(0, 1)
        h_prev = torch.cat([h0.unsqueeze(0), out_tf[:-1]], 0).reshape(steps * batch, hidden)
        factors = _factors(x_tf, h_prev, w_ih, w_hh, b_ih, b_hh).view(steps, batch, 5, hidden)
        d, d_h0 = _back_through_time(grad_out.transpose(0, 1), factors, w_hh)
        d = d.view(steps * batch, 5 * hidden)
        # the recurrent side's pre-activations: (da_r, da_z, da_n r); the input side's:
        # (da_r, da_z, da_n)
        d_gh, d_rz, d_n = d[:, : 3 * hidden], d[:, : 2 * hidden], d[:, 3 * hidden : 4 * hidden]
        d_x = None
        if ctx.needs_input_grad[0]:
            d_x = torch.addmm(d_rz @ w_ih[: 2 * hidden], d_n, w_ih[2 * hidden :])
            d_x = d_x.view(steps, batch, -1).transpose(0, 1)
        d_w_ih = torch.cat([d_rz.T @ x_tf, d_n.T @ x_tf])
        d_b_ih = torch.cat([d_rz.sum(0), d_n.sum(0)])
        return d_x, d_h0, d_w_ih, d_gh.T @ h_prev, d_b_ih, d_gh.sum(0), None


def _factors(x, h_prev, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    """(L B, 5, H): what each step's gradient of h' is multiplied by to give, in turn, the
    gradients of a_r, a_z (the two gates' pre-activations), of W_hn h + b_hn, of a_n (the new
    gate's pre-activation), and of h (the direct path), recomputed from the inputs and the
    outputs of every step at once."""
    hidden = h_prev.shape[-1]
    gi = torch.addmm(b_ih, x, w_ih.T)
    gh = torch.addmm(b_hh, h_prev, w_hh.T)
    rz = torch.sigmoid(gi[:, : 2 * hidden] + gh[:, : 2 * hidden])
    r, z, gh_n = rz[:, :hidden], rz[:, hidden:], gh[:, 2 * hidden :]
    n = torch.tanh(gi[:, 2 * hidden :] + r * gh_n)
    a_n = (1.0 - z) * (1.0 - n * n)  # dh' -> da_n: through n = tanh(a_n), h' = (1 - z) n + z h
    out = h_prev.new_empty(h_prev.shape[0], 5, hidden)
    torch.mul(a_n * gh_n, r * (1.0 - r), out=out[:, 0])  # a_r: via r in r * (W_hn h + b_hn)
    torch.mul((h_prev - n) * z, 1.0 - z, out=out[:, 1])  # a_z: via z in h'
    torch.mul(a_n, r, out=out[:, 2])
    out[:, 3] = a_n
    out[:, 4] = z
    return out


def _back_through_time(grad, factors, w_hh):
    """Walk back from the last step with ``grad`` (L, B, H) the outputs' gradients: every
    step's five gradients (L, B, 5, H) as in :func:`_factors`, and the gradient of h0. A step
    is three operations: its h's gradient, the five products, and the next one's h."""
    steps, batch, _, hidden = factors.shape
    d = torch.empty_like(factors)
    carry = factors.new_zeros(batch, hidden)
    for t in range(steps - 1, -1, -1):
        step = torch.mul((grad[t] + carry).unsqueeze(1), factors[t], out=d[t])
        flat = step.view(batch, 5 * hidden)
        carry = torch.addmm(step[:, 4], flat[:, : 3 * hidden], w_hh)
    return d, carry
