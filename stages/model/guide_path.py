"""The guide's path z_{1:L}, drawn step by step, with a backward pass written out.

``Combiner.draw`` runs, for every step t in order,

    hid_t   = tanh(z_{t-1} W_in + b_in)                      (M, hidden)
    loc_t, s_t = split(hid_t W_out + a_t)                    (M, K) each; a_t: h_t's share
    scale_t = softplus(s_t) + 1e-3
    z_t     = loc_t + scale_t eps_t

Under autograd each step is about eight recorded operations, and the backward pass walks
all of them, one small node at a time. :func:`draw_path` runs the same steps unrecorded and
its backward pass walks back through time with seven operations a step, then takes the
weights' gradients as one product each over all steps. Tests check the values and every
gradient against the recorded loop in float64.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

SCALE_FLOOR = 1e-3


def draw_path(z0, from_h, noise, w_in, b_in, w_out):
    """(path, loc, scale), each (M, L, K): ``z0`` (M, K) the state before the first step,
    ``from_h`` (M, L, 2K) each step's share of (loc, s), ``noise`` (M, L, K), ``w_in`` (K,
    hidden), ``b_in`` (hidden,), ``w_out`` (hidden, 2K)."""
    return _DrawPath.apply(z0, from_h, noise, w_in, b_in, w_out)


class _DrawPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z0, from_h, noise, w_in, b_in, w_out):
        steps, k = noise.shape[1], noise.shape[2]
        a, eps = from_h.transpose(0, 1), noise.transpose(0, 1)  # time first
        path = noise.new_empty(steps + 1, *z0.shape)  # z_0 .. z_L
        path[0] = z0
        hid = noise.new_empty(steps, z0.shape[0], w_in.shape[1])
        pre = noise.new_empty(steps, z0.shape[0], 2 * k)
        for t in range(steps):
            torch.tanh(torch.addmm(b_in, path[t], w_in), out=hid[t])
            torch.addmm(a[t], hid[t], w_out, out=pre[t])
            loc, s = pre[t].split(k, -1)
            torch.addcmul(loc, F.softplus(s) + SCALE_FLOOR, eps[t], out=path[t + 1])
        loc, s = pre.split(k, -1)
        scale = F.softplus(s) + SCALE_FLOOR
        ctx.save_for_backward(path, hid, s, noise, w_in, w_out)
        return tuple(  # copies (never views of the saved buffers), batch first
            v.transpose(0, 1).clone(memory_format=torch.contiguous_format)
            for v in (path[1:], loc, scale)
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, d_path, d_loc, d_scale):
        path, hid, s, noise, w_in, w_out = ctx.saved_tensors
        steps, m, k = s.shape
        # (autograd hands zeros, not None, for an output nothing used: grads are materialised)
        d_loc = d_loc.transpose(0, 1)
        d_pre, d_tin, d_z0 = _back_through_time(
            d_path.transpose(0, 1), d_loc, d_scale.transpose(0, 1),
            noise.transpose(0, 1), torch.sigmoid(s), 1.0 - hid * hid, w_in, w_out,
        )  # fmt: skip
        d_pre_flat, d_tin_flat = d_pre.reshape(steps * m, -1), d_tin.reshape(steps * m, -1)
        d_noise = None
        if ctx.needs_input_grad[2]:  # z_t = loc_t + scale_t eps_t: dz_t scale_t
            d_z = d_pre[..., :k] - d_loc  # the loc part is d_loc + dz
            d_noise = (d_z * (F.softplus(s) + SCALE_FLOOR)).transpose(0, 1)
        return (
            d_z0,
            d_pre.transpose(0, 1),
            d_noise,
            path[:-1].reshape(steps * m, k).T @ d_tin_flat,
            d_tin_flat.sum(0),
            hid.reshape(steps * m, -1).T @ d_pre_flat,
        )


def _back_through_time(d_path, d_loc, d_scale, eps, sig_s, one_minus_hid2, w_in, w_out):
    """From the last step back: each step's gradients of (loc, s) pre-activations (L, M, 2K)
    and of the tanh's input (L, M, hidden), and the gradient of z_0."""
    steps, m, k = d_path.shape
    d_pre = d_path.new_empty(steps, m, 2 * k)
    d_tin = d_path.new_empty(steps, m, w_in.shape[1])
    w_in_t, w_out_t = w_in.T.contiguous(), w_out.T.contiguous()
    carry = torch.zeros_like(d_path[0])
    for t in range(steps - 1, -1, -1):
        dz = d_path[t] + carry  # z_t feeds the outputs and the next step
        torch.add(d_loc[t], dz, out=d_pre[t, :, :k])
        torch.mul(torch.addcmul(d_scale[t], dz, eps[t]), sig_s[t], out=d_pre[t, :, k:])
        torch.mul(d_pre[t] @ w_out_t, one_minus_hid2[t], out=d_tin[t])
        carry = d_tin[t] @ w_in_t
    return d_pre, d_tin, carry
