"""The noise-scale estimator against a problem whose noise scale is known, and the gain."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from bdsgd.stages.goodput import (
    NoiseScale,
    adascale_factor,
    gain,
    gradient_stats,
    unbiased_estimates,
)
from torch.func import grad, vmap

DIM = 10


def regression_gradients(
    delta_sq: float, noise_sd: float, workers: int, batch: int, iterations: int, seed: int = 0
) -> tuple[torch.Tensor, float]:
    """(iterations, workers, DIM) real autograd gradients of least squares, 0.5 (x.w - y)^2
    averaged over each worker's ``batch`` fresh samples, x ~ N(0, I), y = x.w* + N(0, noise_sd^2),
    at a point w with |w - w*|^2 = ``delta_sq``; and the true noise scale there.

    With delta = w - w*, a sample's gradient x (x.delta - eps) has mean delta and covariance
    (|delta|^2 + s^2) I + delta delta^T (Isserlis), so B = (d (|delta|^2 + s^2) + |delta|^2) /
    |delta|^2."""
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(DIM, generator=gen, dtype=torch.float64)
    delta = torch.randn(DIM, generator=gen, dtype=torch.float64)
    w = w_star + delta * math.sqrt(delta_sq) / delta.norm()
    x = torch.randn(iterations * workers, batch, DIM, generator=gen, dtype=torch.float64)
    noise = torch.randn(iterations * workers, batch, generator=gen, dtype=torch.float64)
    y = x @ w_star + noise_sd * noise

    def loss(w, x, y):
        return 0.5 * ((x @ w - y) ** 2).mean()

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(w, x, y)
    truth = (DIM * (delta_sq + noise_sd**2) + delta_sq) / delta_sq
    return grads.reshape(iterations, workers, DIM), truth


@pytest.mark.parametrize(
    ("delta_sq", "noise_sd", "batch", "iterations"),
    [
        (1.0, 0.0, 16, 2000),  # B = 11: gradients agree (B below one worker's batch)
        (0.1, 1.0, 16, 2000),  # B = 111: about the 8 workers' batch
        (0.01, 1.0, 64, 3000),  # B = 1011: noise dominates
    ],
)
def test_noise_scale_within_ten_percent_of_the_truth(delta_sq, noise_sd, batch, iterations):
    grads, truth = regression_gradients(delta_sq, noise_sd, 8, batch, iterations)
    noise = NoiseScale(alpha=1 / iterations)
    for g in grads:
        assert noise.observe_gradients(list(g), batch)
    assert noise.value == pytest.approx(truth, rel=0.10)
    assert noise.updates == iterations


def test_noise_scale_with_a_varying_number_of_gradients():
    # a cutoff policy applies c = 2..8 gradients: each iteration's estimate stays unbiased
    grads, truth = regression_gradients(0.1, 1.0, 8, 16, 3000, seed=1)
    counts = np.random.default_rng(0).integers(2, 9, size=grads.shape[0])
    noise = NoiseScale(alpha=1 / grads.shape[0])
    for g, c in zip(grads, counts, strict=True):
        noise.observe_gradients(list(g[:c]), 16)
    assert noise.value == pytest.approx(truth, rel=0.10)


def test_noise_scale_follows_a_change():
    # the default smoothing forgets: the noise scale rises 10x and the estimate goes with it
    low, b_low = regression_gradients(1.0, 0.0, 8, 16, 300, seed=2)
    high, b_high = regression_gradients(0.1, 1.0, 8, 16, 300, seed=3)
    noise = NoiseScale()
    for g in low:
        noise.observe_gradients(list(g), 16)
    before = noise.value
    for g in high:
        noise.observe_gradients(list(g), 16)
    assert before == pytest.approx(b_low, rel=0.25)
    assert noise.value == pytest.approx(b_high, rel=0.25)


def test_one_gradient_holds_the_estimate():
    noise = NoiseScale()
    assert noise.value is None and noise.gain(4) == 4.0  # unknown: every gradient counts
    assert not noise.update(1, 32, 5.0, 5.0)
    assert noise.value is None
    assert noise.update(2, 32, 2.0, 0.5)  # |g1|^2 + |g2|^2 = 2, |mean|^2 = 0.5
    held = noise.value
    assert not noise.update(1, 32, 9.0, 9.0)
    assert not noise.update(4, 32, float("nan"), 1.0)
    assert noise.value == held and noise.updates == 1


def test_unbiased_estimates_on_exact_expectations():
    # feed the expectations themselves: E sum|g_i|^2 = n (|G|^2 + S/b), E|mean|^2 = |G|^2 + S/(nb)
    n, b, g2, trace = 5, 8, 3.0, 40.0
    est_g2, est_trace = unbiased_estimates(n, b, n * (g2 + trace / b), g2 + trace / (n * b))
    assert est_g2 == pytest.approx(g2) and est_trace == pytest.approx(trace)


def test_negative_signal_estimate_means_every_gradient_counts():
    noise = NoiseScale()
    noise.update(2, 16, 2.0, 0.1)  # the mean's norm is below what noise alone gives
    assert noise.grad_sq < 0 and noise.value == math.inf
    assert noise.gain(8) == 8.0 and noise.lr_factor(4, 8) == 0.5


def test_gradient_stats_matches_the_definition():
    grads = [torch.tensor([[1.0], [2.0]]), torch.tensor([3.0, 0.0])]  # shapes do not matter
    n, sum_sq, sq_mean = gradient_stats(grads)
    assert (n, sum_sq, sq_mean) == (2, 14.0, pytest.approx(5.0))  # mean (2, 1)
    assert grads[0].tolist() == [[1.0], [2.0]]  # untouched
    assert gradient_stats([]) == (0, 0.0, 0.0)


def test_gain_bounds_and_limits():
    c = np.arange(1, 33)
    for b_noise in (0.0, 3.0, 32.0, 1e3, 1e9):
        g = gain(c, b_noise, 32)
        assert g[0] == pytest.approx(1.0)
        assert np.all(g <= c + 1e-9) and np.all(g >= 1 - 1e-12) and np.all(np.diff(g) >= 0)
    assert gain(8, 1e9, 32) == pytest.approx(8.0, rel=1e-6)  # high noise: every gradient counts
    assert gain(8, 0.0, 32) == 1.0  # no noise: one gradient is as good as eight
    assert gain(8, None, 32) == 8.0 and gain(8, float("nan"), 32) == 8.0  # unknown
    # sigma^2 = B |G|^2 / b: (sigma^2 + |G|^2) / (sigma^2 / c + |G|^2) with |G|^2 = 1
    sigma_sq = 64 / 16
    assert gain(4, 64.0, 16) == pytest.approx((sigma_sq + 1) / (sigma_sq / 4 + 1))


def test_adascale_factor_is_relative_to_the_live_workers():
    assert adascale_factor(8, 8, 50.0, 32) == pytest.approx(1.0)
    assert adascale_factor(4, 8, None, 32) == pytest.approx(0.5)  # unknown: linear
    low = adascale_factor(4, 8, 1.0, 32)  # little noise: 4 gradients are almost as good as 8
    assert 0.9 < low < 1.0


def test_state_round_trip():
    noise = NoiseScale(alpha=0.1)
    noise.update(4, 16, 10.0, 1.0)
    again = NoiseScale()
    again.load_state_dict(noise.state_dict())
    assert again.value == noise.value and again.alpha == 0.1 and again.batch_size == 16


def test_a_mean_that_also_holds_salvaged_partial_gradients():
    # 6 workers finish their 16 samples; 2 are cut after 8, and their partial sums join the mean
    # (112 samples): the squared norms are the 6 finished gradients' only
    halves, truth = regression_gradients(0.1, 1.0, 16, 8, 3000, seed=4)  # 8-sample halves
    full = (halves[:, 0:12:2] + halves[:, 1:12:2]) / 2  # (T, 6, DIM) finished gradients
    mean = halves[:, :14].mean(dim=1)  # equal weights: every half holds 8 samples
    noise, naive = NoiseScale(alpha=1 / 3000), NoiseScale(alpha=1 / 3000)
    for g, m in zip(full, mean, strict=True):
        sum_sq, sq_mean = float((g**2).sum()), float(m @ m)
        assert noise.update(6, 16, sum_sq, sq_mean, mean_samples=112)
        naive.update(6, 16, sum_sq, sq_mean)  # as if the mean were over 96 samples
    assert noise.value == pytest.approx(truth, rel=0.10)
    assert abs(naive.value / truth - 1) > abs(noise.value / truth - 1)
    assert not noise.update(2, 16, 1.0, 0.5, mean_samples=16)  # a mean over one batch: nothing
