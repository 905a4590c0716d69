"""The fitted model as a per-iteration predictor for policies and for evaluation.

The filter keeps P particles ``z_t^(p) ~ q(z_t | z_{t-1}^(p), x_{<=t})`` (the guide run forward),
the encoder's GRU state ``h_t`` and the workers' history features. ``observe`` advances all of
them by one iteration (O(N + P), no loop over workers); ``sample(S)`` draws
``z_{t+1} ~ p(z_{t+1} | z_t^(p))`` and then all N run-times jointly from the emission in a
few batched tensor operations; ``remaining`` conditions that iteration's draws on the arrivals so
far (:class:`Arrivals`). Per-worker emission parameters are computed once, at construction.

A checkpoint whose fit anchored each run at its own level (``bdsgd.stages.model.data``) is used
the same way: the first iteration ``observe`` is given sets the run's anchor, before anything is
normalised, so everything after is predicted relative to the level the run showed. The draws of
that first iteration carry the run's unknown level: one shared shift per draw, ``level_sd``
times a Student's t with ``level_dof`` degrees of freedom (:mod:`bdsgd.stages.model.data`).
Its x_(c) does not move the online spread (it measures the fitted runs' levels, not the spread
the predictor will draw with once anchored).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from bdsgd.stages.errors import ConfigError
from bdsgd.stages.model.checkpoint import Checkpoint, load_checkpoint
from bdsgd.stages.model.data import HistoryFilter, Normaliser, host_groups, run_anchor
from bdsgd.stages.model.draw_nets import DrawNets, logaddexp
from bdsgd.stages.model.online import OnlineSpread
from bdsgd.stages.model.runtime_model import HostIndex, RuntimeModel
from scipy.special import expit, log_ndtr, ndtri_exp

DEFAULT_PARTICLES = 64
LEVEL_T_CLIP = 8.0  # a run's unknown level: at most 8 level_sd from the fitted median
CONSTANTS = ("shift", "jump", "widen", "log_pi", "log_1m_pi")  # WorkerParams fields Arrivals uses


class RuntimePredictor:
    """Joint predictive of the next iteration's run-times; satisfies ``policies.base.Predictor``."""

    def __init__(
        self,
        model: RuntimeModel,
        norm: Normaliser,
        worker_idx: torch.Tensor,
        host_idx: torch.Tensor,
        hosts: list[str],
        particles: int = DEFAULT_PARTICLES,
        seed: int | None = None,
        common: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0),
        online: bool = True,
    ):
        self.model = model.eval()
        # the recalibration (bdsgd.stages.model.recalibrate): a shared log-slowdown (shift, sd) per
        # draw, a factor on the workers' own spreads and one on the spread of the draws' levels
        self.common = (*common, 1.0)[:4]
        self.online = OnlineSpread() if online else None  # x_(c)'s spread, adjusted as it goes
        self.norm = norm
        self.hosts = tuple(hosts)
        self.num_workers = len(hosts)
        self.gen = torch.Generator().manual_seed(seed if seed is not None else 0)
        self.host_index = HostIndex.of(host_groups(hosts))
        self.present = torch.ones(self.num_workers, dtype=torch.bool)
        self._anchor_seen = False
        self._drawn: tuple[torch.Tensor, torch.Tensor] | None = None
        self._arrivals: Arrivals | None = None
        self._constants: dict[str, np.ndarray] | None = None
        self.rng = np.random.default_rng(seed if seed is not None else 0)
        self.hist = HistoryFilter(self.host_index.groups, model.cfg.num_features)
        with torch.inference_mode():
            self.params = model.head(worker_idx, host_idx)
            self.nets = DrawNets(model, self.params)
            self.emb_proj = model.encoder.embed(self.params.emb)
            self.h = model.encoder.h0.reshape(1, 1, -1).clone()
            self.z_chain = model.z_q_init.expand(particles, -1).clone()
            self.z_now = model.z_init.expand(particles, -1).clone()
        self._refresh()

    @torch.inference_mode()
    def _refresh(self) -> None:
        """Cache the z-free emission terms for the next iteration from the history features."""
        self.ewma, sd, feats, known = self.hist.features()
        emitter = self.model.emitter
        self.base = emitter.base(
            self.params, self.ewma, sd, feats, self.present, self.host_index, known
        )
        self.rare_p = emitter.rare_probabilities(self.params, self.base, self.host_index)

    def _normalise(self, runtimes, censored) -> tuple[torch.Tensor, ...]:
        """(y, censored, present) tensors of one iteration's (N,) run-times and flags."""
        x = torch.as_tensor(np.asarray(runtimes, dtype=np.float64))
        if x.shape != (self.num_workers,) or np.shape(censored) != (self.num_workers,):
            raise ConfigError(
                f"predictor for {self.num_workers} workers got run-times of shape "
                f"{tuple(x.shape)} and censoring flags of shape {np.shape(censored)}"
            )
        present = torch.isfinite(x) & (x > 0)
        y = ((torch.where(present, x, 1.0).log() - self.norm.loc) / self.norm.scale).float()
        cens = torch.as_tensor(np.asarray(censored, dtype=bool)) & present
        return y * present, cens, present

    def _anchor(self, runtimes: np.ndarray) -> bool:
        """Anchor the run at the first iteration with a present entry; True if this one did."""
        if not self.norm.anchored or self._anchor_seen:
            return False
        x = np.asarray(runtimes, dtype=np.float64)
        anchor = run_anchor(x, np.isfinite(x) & (x > 0), self.norm.anchor_q)
        if anchor is None:
            return False
        self.norm, self._anchor_seen = self.norm.at(anchor), True
        return True

    @torch.inference_mode()
    def observe(self, runtimes: np.ndarray, censored: np.ndarray) -> None:
        """Advance the filter by one iteration: (N,) seconds and (N,) censoring flags; a
        non-finite or non-positive run-time marks a missing entry. The first one anchors the
        run (see the module docstring)."""
        anchoring = self._anchor(runtimes)
        y, cens, present = self._normalise(runtimes, censored)
        if self.online is not None and not anchoring:
            self.online.update(np.asarray(runtimes, dtype=np.float64), cens.numpy())
        elif self.online is not None:
            self.online.draws = None
        enc = self.model.encoder
        g = enc.pooled(y, cens, present, self.ewma, self.emb_proj)
        _, self.h = enc.gru(g.reshape(1, 1, -1), self.h)
        loc, scale = self.model.combiner(self.z_chain, self.h[0])
        self.z_chain = loc + scale * torch.randn(loc.shape, generator=self.gen)
        self.z_now = self.z_chain
        self.hist.update(y, cens, present)
        self.present = present
        self._refresh()

    def _next_y_params(self, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """loc, scale (S, N) of y_{t+1} given S draws of z_{t+1} ~ p(. | z_t^(p))."""
        z = self.z_now.numpy()
        if num_samples != z.shape[0]:
            z = z[np.arange(num_samples) % z.shape[0]]
        loc, scale = self.nets.transition(z)
        z_next = loc + scale * self.rng.standard_normal(loc.shape, dtype=np.float32)
        loc, scale = self.nets.emission(z_next, self.base)
        level = self._level(num_samples)
        if level is not None:
            loc = loc.add_(torch.from_numpy(level))
        widen = self.common[2]
        return loc, scale if widen == 1.0 else scale.mul_(widen)

    def _level(self, num_samples: int) -> np.ndarray | None:
        """(S, 1) float32 shared log-slowdown of each draw, or None for none: the
        recalibration's N(shift, sd^2) and, before the run's anchor, its unknown level
        (``level_sd`` times a t with ``level_dof`` degrees of freedom clipped at
        +-:data:`LEVEL_T_CLIP`, or, for a checkpoint without ``level_dof``, a normal)."""
        shift, sd, _, _ = self.common
        norm, size = self.norm, (num_samples, 1)
        if not norm.level_dof:
            sd = math.hypot(sd, norm.level_sd)
        if not (shift or sd or norm.level_dof):
            return None
        level = shift + sd * self.rng.standard_normal(size, dtype=np.float32)
        if norm.level_dof:
            t = np.clip(self.rng.standard_t(norm.level_dof, size), -LEVEL_T_CLIP, LEVEL_T_CLIP)
            level = (level + norm.level_sd * t).astype(np.float32)
        return level

    @torch.inference_mode()
    def sample(self, num_samples: int) -> torch.Tensor:
        """(S, N) joint samples of the next iteration's run-times, seconds (float32). The result
        is an inference tensor: read or copy it, do not modify it in place.

        Each draw's shared level (the mean over workers of its normalised log run-times) is
        stretched about the draws' median level by the recalibrated factor times the online one,
        then moved by the online shift (:mod:`bdsgd.stages.model.online`): every worker of a draw
        moves by the same amount, so the spread of x_(c) scales with it. :meth:`remaining`
        conditions the unstretched, unshifted draws."""
        loc, scale = self._next_y_params(num_samples)
        self._drawn, self._arrivals = (loc, scale), None
        emitter, hosts = self.model.emitter, self.host_index
        y = emitter.sample(
            loc, scale, self.params, self.base, hosts, self.gen, self.rng, self.rare_p
        )
        factor = self.common[3] * (self.online.factor if self.online is not None else 1.0)
        norm = self.norm
        offset = norm.loc + (self.online.log_shift if self.online is not None else 0.0)
        if factor != 1.0:  # each draw's shift, (S, 1), folded into the normaliser's offset
            level = y.mean(dim=1, keepdim=True)  # a median over N costs ~1 ms at N = 1024
            offset = (level - level.median()).mul_((factor - 1.0) * norm.scale).add_(offset)
        x = y.mul_(norm.scale).add_(offset).exp_()
        if self.online is not None:
            self.online.drawn(x.numpy())
        return x

    def worker_constants(self) -> dict[str, np.ndarray]:
        """The per-worker emission constants :class:`Arrivals` uses, float32 numpy, converted
        once for the predictor's worker set: each worker's four components (bulk and tail
        without its host's jump, then with it) as offsets of the mean ``offsets`` (N, 4),
        factors of the sd ``sd_factors`` (N, 4) and log weights ``log_weights`` (N, 4); the
        workers ordered by host ``by_host`` and their hosts ``groups_by_host``; each worker's
        host ``groups``; whether ``by_host`` is the workers' own order ``in_worker_order``."""
        if self._constants is None:
            p, hosts = self.params, self.host_index
            shift, jump, widen, log_pi, log_1m_pi = (
                getattr(p, k).detach().float().numpy() for k in CONSTANTS
            )
            zero, one, by_host = np.zeros_like(shift), np.ones_like(shift), hosts.by_host.numpy()
            self._constants = {
                "offsets": np.stack([zero, shift, jump, jump + shift], -1),
                "sd_factors": np.stack([one, widen, one, widen], -1),
                "log_weights": np.stack([log_1m_pi, log_pi] * 2, -1),
                "by_host": by_host,
                "groups_by_host": hosts.groups.numpy()[by_host],
                "groups": hosts.groups.numpy(),
                "in_worker_order": bool(np.all(by_host[1:] > by_host[:-1])),
            }
        return self._constants

    def prepare(self) -> None:
        """Set up the conditional of the iteration last sampled (what :meth:`remaining` would set
        up at its first call), so that a policy can do it before the iteration begins."""
        if self._drawn is not None and self._arrivals is None:
            self._arrivals = Arrivals(self, *self._drawn)

    def remaining(
        self, now_s: float, runtimes: np.ndarray, arrived: np.ndarray, waiting: np.ndarray
    ) -> np.ndarray:
        """Joint samples, in seconds (float32), of the run-times of the ``waiting`` workers of the
        iteration the last :meth:`sample` call predicted, given that the ``arrived`` workers
        took ``runtimes`` and the waiting ones are still running ``now_s`` seconds in: (S,
        n_waiting), S as in that call. Workers in neither mask (dead) are left out. Meant for
        deciding, at each arrival, whether the gradients still out are worth waiting for (see
        :class:`Arrivals`). The draws are moved by the online shift as :meth:`sample`'s are,
        and the arrivals are read at that level: a run-time as predicted by the shifted draws
        is an ordinary one to the conditional too."""
        if self._drawn is None:
            raise RuntimeError("predictor: remaining() needs a sample() of the iteration first")
        if self._arrivals is None:
            self._arrivals = Arrivals(self, *self._drawn)
        scale = self.norm.scale
        loc = self.norm.loc + (self.online.log_shift if self.online is not None else 0.0)
        x = np.where(arrived, np.asarray(runtimes, dtype=np.float64), 1.0)
        y = (np.log(np.maximum(x, 1e-12)) - loc) / scale
        y_now = (math.log(max(now_s, 1e-12)) - loc) / scale
        draws = self._arrivals.sample(y, np.asarray(arrived), np.asarray(waiting), y_now)
        draws *= np.float32(scale)
        draws += np.float32(loc)
        # float32 (7 digits of a run-time; sorting them costs 60% of float64's); above the
        # present by construction, but for float32's rounding far out in the tail
        return np.maximum(np.exp(draws, out=draws), float32_at_least(now_s), out=draws)

    @torch.inference_mode()
    def log_predictive(self, runtimes, censored, num_samples: int = 256) -> tuple[float, int]:
        """Monte Carlo joint one-step-ahead log-likelihood of the next iteration, in nats of
        seconds, and the number of scored entries:

            log p(x_{t+1} | x_{<=t}) ~ logsumexp_s sum_w log p(x_w | z^(s)) - log S,

        with log p(x) = log p(y) - log s - log x for uncensored entries (the Jacobian)."""
        y, cens, present = self._normalise(runtimes, censored)
        loc, scale = self._next_y_params(num_samples)
        emitter = self.model.emitter
        ll = emitter.joint_log_lik(
            y, cens, present, loc, scale, self.params, self.base, self.host_index
        )
        joint = float(torch.logsumexp(ll.double(), 0)) - math.log(num_samples)
        exact = present & ~cens
        log_x = y * self.norm.scale + self.norm.loc
        jacobian = float(((log_x + math.log(self.norm.scale)) * exact).sum())
        return joint - jacobian, int(present.sum())


class Arrivals:
    """The coming iteration's predictive, conditioned on arrivals as they happen.

    At an arrival the server knows which workers' gradients are in (their run-times exactly) and
    that every other one is still running. Given the emission terms of P draws of z (the first P
    of the S drawn by :meth:`RuntimePredictor.sample`), the model's likelihood of that weighs the
    draws and gives each host's posterior jump probability (several of a host's workers late make
    a slow spell of the whole host likely; its workers still out are then predicted slow) and each
    waiting worker's posterior mixture component; each of S samples picks a draw by weight, the
    hosts' jumps and the components from those posteriors, and the waiting workers' y from the
    chosen normal truncated below at the present moment. Numpy on float32, the normal's log
    survival and quantiles by torch's vectorised erfc and erfinv (:func:`log_ndtr32`,
    :func:`ndtri_exp32`); the per-host sums of the arrived workers are kept in float64.
    """

    PARTICLES = 32
    """Draws of z weighed, up to N = 128; then 4096 / N, at least 16: the work is P x N."""

    def __init__(self, pred: RuntimePredictor, loc: torch.Tensor, scale: torch.Tensor):
        self.num_samples = loc.shape[0]
        particles = min(self.PARTICLES, max(16, 4096 // max(loc.shape[-1], 1)))
        self.loc = loc[:particles].float().numpy()
        self.scale = scale[:particles].float().numpy()
        for name, value in pred.worker_constants().items():  # the same every iteration
            setattr(self, name, value)
        log_states = pred.base.host_log_probs(pred.host_index.first, torch.float64)
        self.log_states = log_states.numpy()  # (K, G): calm, jumped, with recovery dropped
        self.num_states, self.num_hosts = self.log_states.shape
        self.rng = pred.rng
        self.added: np.ndarray | None = None  # the arrivals already summed into seen_arrived
        self.seen_arrived = np.zeros(0)
        self.mixed = self.mixed_sum = np.zeros(0)  # see arrived_terms
        # every worker's components once per iteration, (P, N, 2K): a revision gathers its
        # workers' rows instead of adding and multiplying them out again
        offsets, sd_factors = self.offsets, self.sd_factors
        if pred.base.drop is not None:  # bulk and tail with the host dropped: this iteration's R
            drop = pred.base.drop.detach().float().numpy()[:, None]
            offsets = np.concatenate([offsets, offsets[:, :2] - drop], -1)
            sd_factors = np.concatenate([sd_factors, sd_factors[:, :2]], -1)
            self.log_weights = np.concatenate([self.log_weights, self.log_weights[:, :2]], -1)
        self.means = self.loc[:, :, None] + offsets
        self.sds = self.scale[:, :, None] * sd_factors

    def components(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Means, sds (P, n, 2K) and log weights (n, 2K) of workers w's components: bulk and
        tail with their host calm, then jumped, then (with recovery) dropped."""
        return self.means.take(w, axis=1), self.sds.take(w, axis=1), self.log_weights[w]

    def grouped(self, mask: np.ndarray) -> tuple[np.ndarray, ...]:
        """The workers in ``mask`` grouped by host (by worker id within a host), and the hosts
        among them, where each host's run starts, and each worker's host as a position in
        those hosts."""
        picked = mask[self.by_host]
        w, groups = self.by_host[picked], self.groups_by_host[picked]
        first = np.empty(w.size, dtype=bool)
        first[:1] = True
        np.not_equal(groups[1:], groups[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        return w, groups[starts], starts, np.cumsum(first) - 1

    def arrived_terms(self, y: np.ndarray, arrived: np.ndarray) -> np.ndarray:
        """(P, K, G) per host: log p(what its arrived workers showed | draw p, state k). Arrivals
        only grow within an iteration, so the sums are kept and only new arrivals are added (the
        revision that ends an iteration costs what its last arrival costs, not all N). Kept with
        them: ``mixed`` (P, G), each host's term with its state summed out, and ``mixed_sum``
        (P,), their sum over hosts, so that a revision weighs the draws by updating only the
        hosts it waits on (a host with no arrival yet has mixed 0: log(1 - rho + rho))."""
        if self.added is None or (self.added & ~arrived).any():  # first call, or not a superset
            self.added = np.zeros(arrived.shape, dtype=bool)
            self.seen_arrived = np.zeros((self.loc.shape[0], self.num_states, self.num_hosts))
            self.mixed = np.zeros((self.loc.shape[0], self.num_hosts))
            self.mixed_sum = np.zeros(self.loc.shape[0])
        fresh = arrived & ~self.added
        new = np.flatnonzero(fresh)
        if new.size == 1:  # the usual: one arrival since the last revision, no grouping
            hosts, starts = self.groups[new], np.zeros(1, dtype=np.intp)
        elif new.size:
            new, hosts, starts, _ = self.grouped(fresh)
        if new.size:
            means, sds, logw = self.components(new)
            dens = -0.5 * ((y[new, None] - means) / sds) ** 2 - np.log(sds) + logw
            terms = logaddexp(dens[..., 0::2], dens[..., 1::2])  # (P, n_new, K)
            summed = np.add.reduceat(terms, starts, axis=1).transpose(0, 2, 1)
            seen = self.seen_arrived[:, :, hosts] + summed
            self.seen_arrived[:, :, hosts] = seen
            mixed = summed_states(seen + self.log_states[:, hosts])
            self.mixed_sum += (mixed - self.mixed[:, hosts]).sum(-1)
            self.mixed[:, hosts] = mixed
            if not np.isfinite(self.mixed_sum).all():  # a term at -inf: (-inf) - (-inf)
                self.mixed_sum = self.mixed.sum(-1)
            self.added[new] = True
        return self.seen_arrived

    def sample(self, y, arrived, waiting, y_now) -> np.ndarray:
        """(S, n_waiting) draws of the waiting workers' y (see the class docstring). The work
        grows with the waiting workers and their hosts, not with N."""
        waiting = np.asarray(waiting, dtype=bool)
        w, hosts, starts, inverse = self.grouped(waiting)  # grouped by host; undone at the end
        if w.size == 0:
            return np.zeros((self.num_samples, 0))
        means, sds, logw = self.components(w)
        log_surv = log_ndtr32((means - np.float32(y_now)) / sds)
        weighted = log_surv + logw
        out = logaddexp(weighted[..., 0::2], weighted[..., 1::2])  # log P(still out | p, j)
        pick, state = self.draw_hosts(y, arrived, hosts, starts, out)
        # flat indices into the (P, n, K) arrays of each sample's draw, worker and host state
        # (the host mates of a sample share its state), then into the (P, n, 2K) ones of its
        # component
        cell = pick[:, None] * np.int32(w.size) + np.arange(w.size, dtype=np.int32)
        cell *= self.num_states
        cell += state[:, inverse]
        tail_share = np.exp(weighted[..., 1::2] - out).reshape(-1)
        idx = cell + cell
        idx += self.rng.random(cell.shape, dtype=np.float32) < tail_share.take(cell)
        mean, sd = means.reshape(-1).take(idx), sds.reshape(-1).take(idx)
        # y > y_now drawn by inverting P(y > v) = U P(y > y_now), in logs (no underflow far out)
        log_p = np.log1p(-self.rng.random(idx.shape, dtype=np.float32))  # log U, U in (0, 1]
        log_p += log_surv.reshape(-1).take(idx)
        mean -= sd * ndtri_exp32(log_p)
        if self.in_worker_order:  # grouped by host is by worker id too
            return mean
        draws = np.empty_like(mean)
        draws[:, np.cumsum(waiting)[w] - 1] = mean  # each worker's column: by worker id
        return draws

    def draw_hosts(self, y, arrived, hosts, starts, out) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's draw of z (S,) int32, weighed by what arrived and what is still out
        (``out``: log P(still out | draw, state), (P, n, K), the waiting workers grouped by host
        from ``starts``), and each waited-on host's state in it (S, hosts): whether it jumped
        (bool), or with recovery 0 calm, 1 jumped, 2 dropped (int32)."""
        seen = self.arrived_terms(y, arrived)[:, :, hosts]  # (P, K, hosts waited on)
        seen += np.add.reduceat(out, starts, axis=1).transpose(0, 2, 1)
        seen += self.log_states[:, hosts]
        # every other host's term is as the arrivals left it (mixed_sum)
        with np.errstate(invalid="ignore"):
            others = self.mixed_sum - self.mixed[:, hosts].sum(-1)
        if not np.isfinite(others).all():  # a term at -inf: sum the other hosts afresh
            rest = np.ones(self.num_hosts, dtype=bool)
            rest[hosts] = False
            others = self.mixed[:, rest].sum(-1)
        mixed = summed_states(seen)  # (P, hosts waited on)
        joint = others + mixed.sum(-1)
        pick = self.pick_draws(joint).astype(np.int32)
        u = self.rng.random((pick.size, hosts.size))  # one per host
        if self.num_states == 2:
            p_jump = expit(seen[:, 1] - seen[:, 0])  # (P, hosts waited on); no overflow
            return pick, u < p_jump[pick]
        calm = np.exp(seen[:, 0] - mixed)  # (P, hosts): P(calm), then P(calm or jumped)
        calm_or_jumped = np.exp(seen[:, 1] - mixed)
        calm_or_jumped += calm  # per draw (P rows), then picked (S rows)
        state = (u >= calm[pick]).astype(np.int32)
        state += u >= calm_or_jumped[pick]
        return pick, state

    def pick_draws(self, joint: np.ndarray) -> np.ndarray:
        """(S,) draws of z picked in proportion to exp(``joint``), their (P,) log weights."""
        weight = np.cumsum(np.exp(joint - joint.max()))
        pick = np.searchsorted(weight, self.rng.random(self.num_samples) * weight[-1])
        return np.minimum(pick, weight.size - 1)


def summed_states(terms: np.ndarray) -> np.ndarray:
    """(P, K, h) -> (P, h): log sum over the K host states (K = 2 or 3)."""
    mixed = logaddexp(terms[:, 0], terms[:, 1])
    return mixed if terms.shape[1] == 2 else logaddexp(mixed, terms[:, 2])


SQRT_HALF = np.float32(math.sqrt(0.5))
LOG_HALF = np.float32(math.log(0.5))
FAR_Z = -10.0  # log_ndtr32: below, float64 (erfc in float32 nears its smallest numbers)
FAR_LOG_P = (math.log(1e-3), math.log1p(-1e-3))  # ndtri_exp32: float64 outside (2p - 1 near -1 or 1
# in float32 loses p)


def float32_at_least(value: float) -> np.float32:
    """The least float32 not below ``value``."""
    out = np.float32(value)  # compared in float64: numpy compares a float32 with a Python
    return out if float(out) >= value else np.nextafter(out, np.float32(np.inf))  # float in 32


def log_ndtr32(z: np.ndarray) -> np.ndarray:
    """log Phi(z) of float32 ``z``, in float32: log(erfc(-z / sqrt 2) / 2) by torch's vectorised
    erfc (a tenth of scipy's float64 log_ndtr; within 1e-5), scipy's where z < ``FAR_Z``."""
    out = torch.special.erfc(torch.from_numpy(z * -SQRT_HALF)).log_().add_(LOG_HALF).numpy()
    far = z < FAR_Z
    if far.any():
        out[far] = log_ndtr(z[far].astype(np.float64))
    return out


def ndtri_exp32(log_p: np.ndarray) -> np.ndarray:
    """Phi^-1(exp(log_p)) of float32 ``log_p``, in float32: sqrt 2 erfinv(2 p - 1) by torch's
    vectorised erfinv (a fifth of scipy's ndtri_exp; within 1e-5 for 1e-3 <= p <= 1 - 1e-3),
    scipy's float64 ndtri_exp outside."""
    p = torch.from_numpy(np.exp(log_p))
    out = torch.erfinv(p.mul_(2.0).sub_(1.0)).mul_(math.sqrt(2.0)).numpy()
    far = (log_p < FAR_LOG_P[0]) | (log_p > FAR_LOG_P[1])
    if far.any():
        out[far] = ndtri_exp(log_p[far].astype(np.float64))
    return out


def load_predictor(
    path: str | os.PathLike,
    workers: list[int] | None = None,
    hosts: list[str] | None = None,
    *,
    particles: int = DEFAULT_PARTICLES,
    seed: int | None = None,
) -> RuntimePredictor:
    """A predictor for the given worker ids (default: the latest fitted run's 0..N-1) on the given
    hosts (default: where each id last ran, else "unknown"). Unknown ids and hosts use the
    learned "unknown" embedding."""
    return predictor_from(load_checkpoint(path), workers, hosts, particles=particles, seed=seed)


def predictor_from(
    ckpt: Checkpoint,
    workers: list[int] | None = None,
    hosts: list[str] | None = None,
    *,
    particles: int = DEFAULT_PARTICLES,
    seed: int | None = None,
) -> RuntimePredictor:
    """:func:`load_predictor` for a checkpoint already in memory."""
    if workers is None:
        workers = list(range(len(hosts) if hosts is not None else len(ckpt.default_hosts)))
    if hosts is None:
        hosts = [ckpt.vocab.worker_hosts.get(int(w), "unknown") for w in workers]
    if len(hosts) != len(workers) or not workers:
        raise ConfigError(
            f"predictor needs one host per worker and at least one worker "
            f"(got {len(workers)} workers, {len(hosts)} hosts)"
        )
    widx = ckpt.vocab.worker_index(list(workers))
    hidx = ckpt.vocab.host_index(list(hosts))
    return RuntimePredictor(
        ckpt.model, ckpt.norm, widx, hidx, list(hosts), particles, seed, ckpt.common
    )
