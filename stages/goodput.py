"""Goodput: what c gradients are worth, from the gradient noise scale (McCandlish et al. 2018,
"An Empirical Model of Large-Batch Training", appendix A; Pollux, OSDI'21; AdaScale, ICML'20).

One worker's gradient g_i is the mean of b per-sample gradients. With G the true gradient and
Sigma the per-sample covariance, E|g_i|^2 = |G|^2 + tr(Sigma)/b, and the mean Gbar of n such
gradients has E|Gbar|^2 = |G|^2 + tr(Sigma)/(n b). Given sum_i |g_i|^2 and |Gbar|^2, two unbiased
estimates follow (n >= 2):

    tr(Sigma) ~ n b / (n - 1) * (mean_i |g_i|^2 - |Gbar|^2)       (>= 0 always)
    |G|^2     ~ (n |Gbar|^2 - mean_i |g_i|^2) / (n - 1)          (may be negative: noise)

:class:`NoiseScale` smooths each over iterations (bias-corrected exponential moving averages,
kept apart), and its ratio is the noise scale B = tr(Sigma) / |G|^2 (``B_simple``), in samples:
the batch size at which noise and signal weigh the same. With one gradient (n = 1) an iteration
says nothing about the variance and the estimate holds.

The gain of c gradients over one (sigma^2 = tr(Sigma)/b, the variance of one worker's gradient):

    gain(c) = (sigma^2 + |G|^2) / (sigma^2 / c + |G|^2) = c (phi + 1) / (phi + c),  phi = B / b

is how many one-worker steps a step on c gradients is worth (with the learning rate scaled by it,
AdaScale). 1 <= gain(c) <= c: close to c while noise dominates (phi >> c), close to 1 when the
gradients agree (phi << 1). An unknown noise scale (None) counts every gradient fully: gain = c.

The engine calls, once per iteration, ``noise.update(n, b, sum_sq_norms, sq_norm_of_mean)`` (or
``noise.observe_gradients(grads, b)``), logs ``noise.value`` as the iteration's ``noise_scale``,
pushes it to the policy (``policy.set_noise_scale(noise.value, b)``) and, for
``--lr-scaling adascale``, scales the learning rate by ``noise.lr_factor(c, live)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from bdsgd.stages.errors import ConfigError

DEFAULT_ALPHA = 0.02  # EMA weight of one iteration: about the last 100 iterations count


def gain(c, noise_scale: float | None, batch_size: int):
    """gain(c) of c gradients of per-worker batch ``batch_size`` over one, for a scalar or an
    array of c: c (phi + 1) / (phi + c) with phi = noise_scale / batch_size. ``noise_scale``
    None or NaN (unknown) or inf: c; 0: 1."""
    c = np.asarray(c, dtype=float)
    if noise_scale is None or not math.isfinite(noise_scale):
        out = c
    else:
        phi = max(float(noise_scale), 0.0) / batch_size
        out = c * (phi + 1.0) / (phi + c)
    return float(out) if out.ndim == 0 else out


def adascale_factor(c: int, reference: int, noise_scale: float | None, batch_size: int) -> float:
    """AdaScale's learning-rate factor for a step on c gradients when ``lr`` is the rate of a
    step on ``reference`` (the live workers): gain(c) / gain(reference). Unknown noise: c /
    reference (linear scaling)."""
    return gain(c, noise_scale, batch_size) / gain(max(reference, 1), noise_scale, batch_size)


def gradient_stats(grads: Sequence[torch.Tensor]) -> tuple[int, float, float]:
    """(n, sum_i |g_i|^2, |mean_i g_i|^2) of n gradients (any shape, each one worker's mean over
    its batch, all at the same parameters): what :meth:`NoiseScale.update` takes. In float64, one
    running sum: the difference of the two is small when the gradients agree."""
    total, sum_sq = None, 0.0
    for g in grads:
        g = g.detach().flatten().to(torch.float64)
        sum_sq += float(torch.dot(g, g))
        total = g.clone() if total is None else total.add_(g)
    if total is None:
        return 0, 0.0, 0.0
    mean = total / len(grads)
    return len(grads), sum_sq, float(torch.dot(mean, mean))


def unbiased_estimates(
    n: int,
    batch_size: int,
    sum_sq_norms: float,
    sq_norm_of_mean: float,
    mean_samples: int | None = None,
) -> tuple[float, float]:
    """One iteration's unbiased (|G|^2, tr(Sigma)) from n >= 2 gradients (module docstring).

    ``mean_samples``: the samples behind the mean when it holds more than the n gradients' n b
    (an engine that also salvages the partial gradients of cut-off workers). With M of them,
    E|Gbar|^2 = |G|^2 + tr(Sigma)/M, so tr(Sigma) ~ (mean_i |g_i|^2 - |Gbar|^2) / (1/b - 1/M) and
    |G|^2 ~ |Gbar|^2 - tr(Sigma)/M; M = n b gives the formulas above."""
    big = n * batch_size if mean_samples is None else mean_samples
    trace = (sum_sq_norms / n - sq_norm_of_mean) / (1 / batch_size - 1 / big)
    return sq_norm_of_mean - trace / big, trace


class NoiseScale:
    """The gradient noise scale B = tr(Sigma) / |G|^2, estimated online.

    ``alpha`` is the weight of one iteration in the two exponential moving averages (bias
    corrected, so the first iterations count fully). :attr:`value` is None until an iteration
    with two or more gradients, and inf while the smoothed |G|^2 is not positive (noise drowns
    the signal: every gradient counts).
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.batch_size = 1  # per-worker batch of the last iteration used
        self.updates = 0  # iterations that carried variance information
        self._grad_sq = 0.0  # biased EMAs and the weight (1 - (1 - alpha)^updates) they carry
        self._trace = 0.0
        self._weight = 0.0

    def update(
        self,
        n: int,
        batch_size: int,
        sum_sq_norms: float,
        sq_norm_of_mean: float,
        mean_samples: int | None = None,
    ) -> bool:
        """Add one iteration: n gradients of per-worker batch ``batch_size``, the sum of their
        squared norms and the squared norm of their mean (``mean_samples``: of the mean over
        that many samples, when it also holds partial gradients; see
        :func:`unbiased_estimates`). Returns whether it was used (n < 2, a mean over no more
        than b samples or a non-finite value holds the estimate)."""
        big = n * batch_size if mean_samples is None else mean_samples
        if n < 2 or batch_size < 1 or big <= batch_size:
            return False
        if not math.isfinite(sum_sq_norms + sq_norm_of_mean):
            return False
        grad_sq, trace = unbiased_estimates(n, batch_size, sum_sq_norms, sq_norm_of_mean, big)
        a = self.alpha
        self._grad_sq = (1 - a) * self._grad_sq + a * grad_sq
        self._trace = (1 - a) * self._trace + a * trace
        self._weight = (1 - a) * self._weight + a
        self.batch_size, self.updates = batch_size, self.updates + 1
        return True

    def observe_gradients(self, grads: Sequence[torch.Tensor], batch_size: int) -> bool:
        """:meth:`update` from the iteration's flat gradients themselves."""
        n, sum_sq_norms, sq_norm_of_mean = gradient_stats(grads)
        return self.update(n, batch_size, sum_sq_norms, sq_norm_of_mean)

    @property
    def grad_sq(self) -> float | None:
        """Smoothed estimate of |G|^2 (None before any update)."""
        return self._grad_sq / self._weight if self._weight > 0 else None

    @property
    def trace(self) -> float | None:
        """Smoothed estimate of tr(Sigma), the per-sample gradient variance (None before any)."""
        return self._trace / self._weight if self._weight > 0 else None

    @property
    def value(self) -> float | None:
        """B_simple = tr(Sigma) / |G|^2 in samples; None before any update, inf when the
        smoothed |G|^2 is not positive."""
        if self._weight <= 0:
            return None
        return max(self._trace, 0.0) / self._grad_sq if self._grad_sq > 0 else math.inf

    def gain(self, c):
        """gain(c) over one gradient of the last per-worker batch (see :func:`gain`)."""
        return gain(c, self.value, self.batch_size)

    def lr_factor(self, c: int, reference: int) -> float:
        """``--lr-scaling adascale``: lr x gain(c) / gain(reference) (:func:`adascale_factor`)."""
        return adascale_factor(c, reference, self.value, self.batch_size)

    def state_dict(self) -> dict:
        """Plain floats and ints, for the server checkpoint of a resumable run."""
        return {
            "alpha": self.alpha,
            "batch_size": self.batch_size,
            "updates": self.updates,
            "grad_sq": self._grad_sq,
            "trace": self._trace,
            "weight": self._weight,
        }

    def load_state_dict(self, state: dict) -> None:
        self.alpha, self.batch_size = float(state["alpha"]), int(state["batch_size"])
        self.updates = int(state["updates"])
        self._grad_sq, self._trace = float(state["grad_sq"]), float(state["trace"])
        self._weight = float(state["weight"])


DEFAULT_BATCH_SIZE = 32  # ``bdsgd train --batch-size``'s default


class NoiseSchedule:
    """The noise scale by iteration that ``bdsgd simulate --noise-scale`` feeds the policies
    (simulate cannot see gradients): a constant, or the ``noise_scale`` column of a train run's
    ``iterations.parquet``, forward-filled (before its first value: the first value; after its
    last iteration: the last value). ``batch_size`` is the per-worker batch it refers to."""

    def __init__(self, values: np.ndarray, batch_size: int) -> None:
        self.values = np.asarray(values, dtype=float)
        self.batch_size = batch_size

    def __call__(self, iteration: int) -> float:
        return float(self.values[min(max(iteration, 0), self.values.size - 1)])

    def gain(self, iteration: int, c: int) -> float:
        """gain(c) at ``iteration``'s noise scale."""
        return gain(c, self(iteration), self.batch_size)

    @classmethod
    def from_spec(cls, spec: str, batch_size: int | None = None) -> NoiseSchedule:
        """``spec`` is a number of samples (>= 0, or inf) or the path of an iterations.parquet
        (or of the run directory holding it). ``batch_size`` None: the run directory's
        ``config.json`` says, else :data:`DEFAULT_BATCH_SIZE`. A one-line ConfigError on bad
        input."""
        try:
            value = float(spec)
        except ValueError:
            values, path = read_noise_column(spec)
            return cls(values, batch_size or run_batch_size(path) or DEFAULT_BATCH_SIZE)
        if not value >= 0:
            raise ConfigError(f"--noise-scale must be >= 0 samples, got {spec}")
        return cls(np.array([value]), batch_size or DEFAULT_BATCH_SIZE)


def read_noise_column(spec: str) -> tuple[np.ndarray, Path]:
    """The dense, filled noise scale by iteration from an iterations.parquet (the first policy's
    rows when it holds several) and the file's path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(spec)
    path = path / "iterations.parquet" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--noise-scale: {spec} is neither a number nor an iterations.parquet")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--noise-scale: {path} is unreadable ({reason})") from None
    if "noise_scale" not in table.column_names or "iteration" not in table.column_names:
        raise ConfigError(f"--noise-scale: {path} has no noise_scale column (not a train run?)")
    rows = table.to_pydict()
    policies = rows.get("policy") or [None] * table.num_rows
    known: dict[int, float] = {}
    for t, b, p in zip(rows["iteration"], rows["noise_scale"], policies, strict=True):
        if p == policies[0] and b is not None and not math.isnan(b):
            known[int(t)] = float(b)
    if not known:
        raise ConfigError(f"--noise-scale: {path} has no noise_scale values")
    dense = np.full(max(known) + 1, np.nan)
    dense[list(known)] = list(known.values())
    filled = dense[np.maximum.accumulate(np.where(np.isnan(dense), 0, np.arange(dense.size)))]
    return np.where(np.isnan(filled), known[min(known)], filled), path


def run_batch_size(iterations_path: Path) -> int | None:
    """``batch_size`` from the config.json beside a train run's iterations.parquet, if any."""
    try:
        return int(json.loads((iterations_path.parent / "config.json").read_text())["batch_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
