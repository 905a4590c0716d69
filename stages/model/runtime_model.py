"""The deep generative run-time model (Pyro) and its amortized filtering guide.

Notation: ``y_{t,w} = (log x_{t,w} - m) / s`` is worker w's normalised log run-time at iteration
t; ``e, sd, f`` are its history features from ``y_{<t}`` (see :mod:`bdsgd.stages.model.data`);
``z_t in R^K`` is the latent cluster state.

Generative model (one window of L iterations, N workers on hosts h(w))::

    z_t | z_{t-1} ~ N(mu(z_{t-1}), diag sigma(z_{t-1})^2)              GatedTransition
    j_{t,h} | f_t ~ Bernoulli(rho_{t,h}),  logit rho_{t,h} = mean_{w on h} (u_w + j_w . f_{t,w}),
                    the mean weighted 4:1 towards workers whose last value was seen exactly
                    (with ``ModelConfig.recovery``: j_{t,h} in {0, +1, -1}, P proportional to
                    1, exp(logit rho), exp(logit delta), delta's logit the host mean of
                    v_w + k_w . f_{t,w}; a drop moves m by -R_{t,w} = -softplus(r_w + m_w . f))
    y_{t,w} | z_t, j_t ~ (1 - pi_w) N(m, scale^2) + pi_w N(m + d_w, (k_w scale)^2),
                    m = loc + j_{t,h(w)} J_w, independent over workers given z_t, j_t  Emitter
        loc   = e_{t,w} + a_w + g_w . f_{t,w} + phi(z_t) . B_w
        scale = sd_{t,w}^(1 + b_w) * softplus(c_w + h_w . f_{t,w} + phi(z_t) . C_w)
        (a, g, B, c, h, C, pi, d, k, b, J, u, j)_w = MLP(worker_emb[w] + host_emb[host(w)]),
            except the weights of f's run-position and host-regime features in g, h and j:
            every worker's

So ``x = exp(m + s y)`` is log-normal given ``z_t``, plus a rare slower, wider log-normal
component (heavy-tailed spikes: d_w > 0, k_w > 1, pi_w starts near 2%) that keeps the bulk sharp.
A host jump ``j_{t,h}`` slows every worker of host h at once by J_w (a host entering a slow
spell: the next iteration's risk that a policy's c-th gradient comes from a host that has just
slowed down); it is summed out exactly per host in the likelihood, and drawn per host when
sampling. A fit with ``--host-drops`` adds the way out of a slow spell: a host can also drop by
R as a whole, with a chance and a size read off its history (its EWMAs above the run's anchor),
where without it only the wide tail component could stand for a recovery, for every worker
(docs/benchmarks.md, "Host drops"). Sharing ``z_t``, the host jumps and host features make the
workers' run-times jointly dependent. The emission is linear in ``phi(z)`` and nonlinear in the embeddings, so the
per-worker MLP runs once per worker set and sampling is one matmul. The history features give
every worker the ``ewma`` baseline as a starting point (``loc = e``, ``scale = sd`` when the
learned terms are zero); the exponent ``b_w`` lets the model discount the EWMA spread (inflated
for a while after every regime switch); the latent state and the last-step and host features add
what is shared across workers and regime changes.

Censoring: an entry known only as ``y >= u`` contributes ``log P(y >= u)``, for each component
``log Phi((loc - u) / scale)``, mixed by log-sum-exp; a missing entry (present = False)
contributes nothing.

Guide (filtering, past only)::

    g_t = mean_w  tanh(W [y_{t,w}, y_{t,w} - e_{t,w}, censored, emb_w])   over present workers
    h_t = GRU(g_t, h_{t-1})
    q(z_t | z_{t-1}, x_{<=t}) = N(Combiner(z_{t-1}, h_t))

Embedding index 0 is the learned "unknown" worker / host, used for ids not seen in training.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pyro
import torch
from bdsgd.stages.model.data import (
    BASE_FEATURES,
    DEFAULT_FEATURES,
    RunTensors,
    check_num_features,
)
from bdsgd.stages.model.gru import gru_sequence
from bdsgd.stages.model.guide_path import draw_path
from bdsgd.stages.model.latent_path import FilteredPath, MarkovPath, kl_at_draw
from torch import nn
from torch.nn import functional as F

SOFTPLUS_ONE = 0.5413248546129181  # softplus(SOFTPLUS_ONE) == 1
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
POSITION_RATE = 4.0
"""The shared run-position weights act as this times their parameters: Adam moves a parameter by
about the learning rate a step whatever its gradient, and these few weights need to reach 1-2
normalised units (a first iteration 25% slower, where a run's spread is 0.18 in log) within a
fit's steps; at 1 they stopped at a third of that."""
CENSORED_WEIGHT = 0.25  # weight of a cut-off worker's jump logit next to one seen exactly


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the networks (stored in the checkpoint as a plain dict)."""

    num_workers: int
    """Known worker ids (embedding rows beyond the unknown row 0)."""
    num_hosts: int
    """Known host names."""
    z_dim: int = 8
    """Latent state size K."""
    hidden: int = 64
    """Width of the MLPs and of the encoder's GRU."""
    emb_dim: int = 16
    """Worker and host embedding size."""
    phi_dim: int = 16
    """Size of phi(z), the latent features the emission is linear in."""
    num_features: int = DEFAULT_FEATURES
    """History features per worker (:mod:`bdsgd.stages.model.data`): a fit's
    :data:`~bdsgd.stages.model.data.DEFAULT_FEATURES`, or with the host regime (``bdsgd fit
    --host-regime``) :data:`~bdsgd.stages.model.data.NUM_FEATURES`; a checkpoint written before
    the run-position features has :data:`~bdsgd.stages.model.data.BASE_FEATURES` (one of
    :data:`~bdsgd.stages.model.data.FEATURE_SETS`)."""
    recovery: bool = False
    """Whether a host can also drop by R (a slow spell ending: :meth:`Emitter.recovery`;
    ``bdsgd fit --host-drops``); a checkpoint written before it (version 5 and older) has
    none."""

    def __post_init__(self) -> None:
        check_num_features(self.num_features)

    def to_dict(self) -> dict:
        return asdict(self)


class GatedTransition(nn.Module):
    """p(z_t | z_{t-1}) = N(mu, sigma^2): mu = (1 - g) * W z + g * MLP(z), g = sigmoid(MLP(z)),
    sigma = softplus(V relu(MLP(z))), as in Pyro's Deep Markov Model."""

    def __init__(self, z_dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Sequential(nn.Linear(z_dim, hidden), nn.ReLU(), nn.Linear(hidden, z_dim))
        self.proposed = nn.Sequential(nn.Linear(z_dim, hidden), nn.ReLU(), nn.Linear(hidden, z_dim))
        self.z_to_loc = nn.Linear(z_dim, z_dim)
        self.to_scale = nn.Linear(z_dim, z_dim)
        nn.init.eye_(self.z_to_loc.weight)
        nn.init.zeros_(self.z_to_loc.bias)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = torch.sigmoid(self.gate(z))
        proposed = self.proposed(z)
        loc = (1 - gate) * self.z_to_loc(z) + gate * proposed
        scale = F.softplus(self.to_scale(F.relu(proposed))) + 1e-3
        return loc, scale


class Combiner(nn.Module):
    """q(z_t | z_{t-1}, h_t) = N(loc, scale^2) with c = (tanh(W z_{t-1}) + h_t) / 2,
    loc = U c, scale = softplus(V c)."""

    def __init__(self, z_dim: int, hidden: int):
        super().__init__()
        self.z_to_hidden = nn.Linear(z_dim, hidden)
        self.to_loc = nn.Linear(hidden, z_dim)
        self.to_scale = nn.Linear(hidden, z_dim)

    def forward(self, z: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = 0.5 * (torch.tanh(self.z_to_hidden(z)) + h)
        return self.to_loc(c), F.softplus(self.to_scale(c)) + 1e-3

    def draw(
        self, z0: torch.Tensor, h: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A path z_{1:L} drawn with ``noise`` (M, L, K), h (M, L, hidden): z_t = loc_t +
        scale_t noise_t in order, loc_t, scale_t = forward(z_{t-1}, h_t); returns the path,
        loc and scale (M, L, K).

        The same maths as :meth:`forward`: h's share of loc and scale, (U h_t) / 2 + b, is
        taken for every t at once, loc and scale come from one product, and the steps run
        unrecorded, with a backward pass written out (:mod:`bdsgd.stages.model.guide_path`)."""
        out = torch.cat([self.to_loc.weight, self.to_scale.weight])  # (2K, hidden)
        from_h = F.linear(0.5 * h, out, torch.cat([self.to_loc.bias, self.to_scale.bias]))
        z0 = z0.expand(noise.shape[0], -1)
        w_in, b_in = self.z_to_hidden.weight.T, self.z_to_hidden.bias
        return draw_path(z0, from_h, noise, w_in, b_in, 0.5 * out.T)


@dataclass(frozen=True)
class WorkerParams:
    """Per-worker emission parameters, computed once per worker set: a, c (N,); g, h (N, F);
    B, C (N, phi_dim); the tail component's log pi, log(1 - pi), shift d and widening k (N,);
    the spread exponent 1 + b (N,); the host jump's size J, logit bias u (N,) and feature
    weights j (N, F); emb (N, emb_dim) for the encoder."""

    a: torch.Tensor
    g: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    h: torch.Tensor
    C: torch.Tensor
    log_pi: torch.Tensor
    log_1m_pi: torch.Tensor
    shift: torch.Tensor
    widen: torch.Tensor
    sd_power: torch.Tensor
    jump: torch.Tensor
    jump_bias: torch.Tensor
    jump_w: torch.Tensor
    emb: torch.Tensor
    recovery: torch.Tensor | None = None
    """(N, 2 + 2F), with ``ModelConfig.recovery``: the drop's logit bias v and feature weights
    k, the drop's size bias r and feature weights m (see :meth:`Emitter.recovery`)."""


class WorkerHead(nn.Module):
    """(a, g, B, c, h, C, pi, d, k, b, J, u, j)_w = MLP(worker_emb[w] + host_emb[host(w)]);
    index 0 is the unknown worker/host. At initialisation pi ~ 0.018, d = 1, k = 2, b = 0,
    J = 1 and a host jumps with probability ~ 0.007. The weights of the run-position features in
    g, h and j are shared by every worker (``position_w`` times :data:`POSITION_RATE`, zero at
    initialisation): a slow or fast start is the job's, and a few fitted runs show it a few
    times each, too few to learn it per worker (per worker, the held-out NLL of the level
    clusters came out 0.02-0.03 worse). So are the host-regime features' (the last columns of
    ``position_w``): what a host's slow spell means for its workers' location is the same for
    every worker."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.worker_emb = nn.Embedding(cfg.num_workers + 1, cfg.emb_dim)
        self.host_emb = nn.Embedding(cfg.num_hosts + 1, cfg.emb_dim)
        nn.init.normal_(self.worker_emb.weight, std=0.1)
        nn.init.normal_(self.host_emb.weight, std=0.1)
        f, p = BASE_FEATURES, cfg.phi_dim
        self.sizes = [1, f, p, 1, f, p, 6, f]
        self.mlp = nn.Sequential(
            nn.Linear(cfg.emb_dim, cfg.hidden), nn.Tanh(), nn.Linear(cfg.hidden, sum(self.sizes))
        )
        nn.init.normal_(self.mlp[2].weight, std=0.01)
        nn.init.zeros_(self.mlp[2].bias)
        self.recovery = None  # with cfg.recovery: the drop's terms (Emitter.recovery)
        if cfg.recovery:  # zero at initialisation: a drop has probability ~ 0.007, size 1
            self.recovery = nn.Linear(cfg.emb_dim, 2 + 2 * cfg.num_features)
            nn.init.zeros_(self.recovery.weight)
            nn.init.zeros_(self.recovery.bias)
        self.num_position = cfg.num_features - BASE_FEATURES
        if self.num_position:  # the run position's weights in g, h and j: every worker's
            self.position_w = nn.Parameter(torch.zeros(3, self.num_position))

    def forward(self, worker_idx: torch.Tensor, host_idx: torch.Tensor) -> WorkerParams:
        emb = self.worker_emb(worker_idx) + self.host_emb(host_idx)
        a, g, B, c, h, C, tail, j = self.mlp(emb).split(self.sizes, dim=-1)
        if self.num_position:
            g, h, j = (
                torch.cat([w, s.expand(*w.shape[:-1], -1)], dim=-1)
                for w, s in zip((g, h, j), POSITION_RATE * self.position_w, strict=True)
            )
        logit = tail[..., 0] - 4.0
        return WorkerParams(
            a=a[..., 0],
            g=g,
            B=B,
            c=c[..., 0],
            h=h,
            C=C,
            log_pi=F.logsigmoid(logit),
            log_1m_pi=F.logsigmoid(-logit),
            shift=F.softplus(tail[..., 1] + SOFTPLUS_ONE),
            widen=1.0 + F.softplus(tail[..., 2] + SOFTPLUS_ONE),
            sd_power=1.0 + tail[..., 3],
            jump=F.softplus(tail[..., 4] + SOFTPLUS_ONE),
            jump_bias=tail[..., 5] - 5.0,
            jump_w=j,
            emb=emb,
            recovery=None if self.recovery is None else self.recovery(emb),
        )


@dataclass(frozen=True)
class EmissionBase:
    """The z-free parts of the emission at one or more iterations, (..., N): loc0 = e + a + g.f,
    the scale's pre-activation c + h.f, its factor sd^(1 + b), and each host's jump logit
    (mean over the host's present workers of u + j.f), repeated for every worker of the host."""

    loc0: torch.Tensor
    pre0: torch.Tensor
    scale0: torch.Tensor
    jump_logit: torch.Tensor
    drop_logit: torch.Tensor | None = None
    """With recovery: each host's drop logit (as ``jump_logit``), repeated per worker."""
    drop: torch.Tensor | None = None
    """With recovery: each worker's drop R when its host drops (> 0)."""

    def host_log_probs(self, first: torch.Tensor, dtype: torch.dtype | None = None):
        """(K, ..., G) log probabilities of each host's states: calm, jumped and, with recovery,
        dropped (a softmax of 0 and the logits); K = 2 without. ``dtype``: computed in it."""
        jump = self.jump_logit[..., first].to(dtype)
        if self.drop_logit is None:
            return torch.stack([F.logsigmoid(-jump), F.logsigmoid(jump)])
        logits = torch.stack([torch.zeros_like(jump), jump, self.drop_logit[..., first].to(dtype)])
        return torch.log_softmax(logits, 0)


@dataclass(frozen=True)
class HostIndex:
    """Which workers share a host: ``groups`` (N,) host of each worker, ``member`` (N, G) one-hot,
    ``first`` (G,) one worker of each host (where a per-host value repeated per worker is read),
    ``by_host`` (N,) the workers ordered by host, host g's from ``starts[g]``, ``sizes[g]`` of
    them."""

    groups: torch.Tensor
    member: torch.Tensor
    first: torch.Tensor
    by_host: torch.Tensor
    starts: torch.Tensor
    sizes: torch.Tensor

    @staticmethod
    def of(groups: torch.Tensor) -> HostIndex:
        member = F.one_hot(groups, int(groups.max()) + 1 if groups.numel() else 0).float()
        sizes = member.sum(0).long()
        starts = sizes.cumsum(0) - sizes
        by_host = torch.argsort(groups, stable=True)
        return HostIndex(groups, member, member.argmax(0), by_host, starts, sizes)

    def workers_of(self, hosts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k,) hosts -> the workers on them, and for each the position in ``hosts`` of its
        host (numpy)."""
        sizes = self.sizes.numpy()[hosts]
        which = np.repeat(np.arange(hosts.size), sizes)
        offset = np.arange(which.size) - (np.cumsum(sizes) - sizes)[which]
        return self.by_host.numpy()[self.starts.numpy()[hosts][which] + offset], which


class Emitter(nn.Module):
    """p(y_t | z_t): per-worker two-component normal mixtures, independent given z_t and the
    hosts' jump indicators, which are summed out exactly (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(cfg.z_dim, cfg.phi_dim), nn.Tanh())

    @staticmethod
    def base(
        params: WorkerParams, ewma, sd, feats, present, hosts: HostIndex, known
    ) -> EmissionBase:
        """The z-free emission terms from the history features. A host's jump logit is the mean
        of its workers' logits weighted towards those whose last value was seen exactly
        (``known``): a worker cut off says little about its host when its host mates arrived."""
        member = hosts.member
        worker_logit = params.jump_bias + (feats * params.jump_w).sum(-1)
        shown = present.float() * (known.float() + CENSORED_WEIGHT)
        count = (shown @ member).clamp(min=1e-6)
        host_logit = ((worker_logit * shown) @ member) / count
        drop = {}
        if params.recovery is not None:
            drop = Emitter.recovery(params.recovery, feats, shown, member, count)
        return EmissionBase(
            loc0=ewma + params.a + (feats * params.g).sum(-1),
            pre0=params.c + (feats * params.h).sum(-1) + SOFTPLUS_ONE,
            scale0=torch.exp(sd.log() * params.sd_power),
            jump_logit=host_logit @ member.T,
            **drop,
        )

    @staticmethod
    def recovery(rec: torch.Tensor, feats, shown, member, count) -> dict[str, torch.Tensor]:
        """A host's drop: logit the host mean of v_w + k_w . f (weighted as the jump's), size
        R = softplus(r_w + m_w . f) per worker: both read the host's history (its slow EWMA
        above the run's anchor says it is in a slow spell that can end)."""
        f = feats.shape[-1]
        worker_logit = rec[..., 0] - 5.0 + (feats * rec[..., 1 : 1 + f]).sum(-1)
        host_logit = ((worker_logit * shown) @ member) / count
        size = F.softplus(rec[..., 1 + f] + SOFTPLUS_ONE + (feats * rec[..., 2 + f :]).sum(-1))
        return {"drop_logit": host_logit @ member.T, "drop": size}

    def forward(self, z: torch.Tensor, params: WorkerParams, base: EmissionBase):
        """loc, scale of y given z and no host jump: z (..., K) -> (..., N)."""
        phi = self.phi(z)
        loc = base.loc0 + phi @ params.B.T
        scale = base.scale0 * F.softplus(base.pre0 + phi @ params.C.T) + 1e-3
        return loc, scale

    @staticmethod
    def log_lik(y, censored, loc, scale, params: WorkerParams) -> torch.Tensor:
        """Per-entry mixture log-likelihood (log density, or log survival where censored); the
        two components in one call."""
        loc, scale = torch.broadcast_tensors(loc, scale)
        locs, scales = (
            torch.stack([loc, loc + params.shift]),
            torch.stack([scale, scale * params.widen]),
        )
        bulk, tail = censored_normal_log_lik(y, censored, locs, scales).unbind(0)
        return torch.logaddexp(bulk + params.log_1m_pi, tail + params.log_pi)

    @classmethod
    def joint_log_lik(cls, y, censored, present, loc, scale, params, base, hosts: HostIndex):
        """sum over present entries of log p(y_w | z), each host's state summed out:
        sum_h log sum_s P(s_h) prod_w p(y_w | s_h), s calm, jumped (+J) and with recovery dropped
        (-R), (..., N) -> (...)."""
        shown = present.float()
        locs = [loc, loc + params.jump] + ([] if base.drop is None else [loc - base.drop])
        both = cls.log_lik(y, censored, torch.stack(locs), scale, params)
        states = (both * shown) @ hosts.member
        log_p = base.host_log_probs(hosts.first)
        log_p = log_p.reshape(log_p.shape[0], *[1] * (states.dim() - log_p.dim()), *log_p.shape[1:])
        if log_p.shape[0] == 2:  # two states: as before the drop, to the bit
            return torch.logaddexp(states[0] + log_p[0], states[1] + log_p[1]).sum(-1)
        return torch.logsumexp(states + log_p, 0).sum(-1)

    @staticmethod
    @torch.no_grad()
    def sample(
        loc,
        scale,
        params: WorkerParams,
        base: EmissionBase,
        hosts: HostIndex,
        gen=None,
        rng=None,
        p: np.ndarray | None = None,
    ):
        """(S, N) draws of y, ``loc`` and ``scale`` (S, N), ``base`` of one iteration (N,): each
        host jumps with its probability, each worker takes the tail component with probability
        pi. Both are rare, so every entry is first drawn from the bulk (``gen``), and the tails
        and the jumps are drawn (numpy ``rng``, default: seeded from ``gen``) and applied only
        where they occur (:func:`rare_cells`): a tail entry becomes loc + d + k (y - loc), a
        jumped host's workers move by J; with recovery a host moves with probability
        P(jump) + P(drop), and a move is a jump with probability P(jump) / (P(jump) + P(drop)),
        else a drop of its workers by -R (:func:`split_moves`). ``p`` (N + G, or N + 2G with
        recovery): the workers' pi, the hosts' jump (or move) probabilities and the jumps'
        shares of the moves, if the caller has them (:meth:`rare_probabilities`)."""
        y = torch.randn(loc.shape, generator=gen).mul_(scale).add_(loc)
        if rng is None:
            rng = np.random.default_rng(int(torch.randint(2**62, (), generator=gen)))
        n = y.shape[1]  # one grid for both: columns < n are the workers' tails, then the hosts
        if p is None:
            p = Emitter.rare_probabilities(params, base, hosts)
        moves = n + hosts.first.numel()  # (with recovery the jumps' shares follow)
        rows, cols = rare_cells(y.shape[0], p[:moves], rng)
        out, tail = y.numpy(), cols < n
        at = rows[tail], cols[tail]
        widen = _np(params.widen)[at[1]]
        out[at] = out[at] * widen + _np(params.shift)[at[1]] - _np(loc)[at] * (widen - 1)
        host_rows, host_cols = rows[~tail], cols[~tail] - n
        if base.drop is not None:
            host_rows, host_cols = split_moves(out, host_rows, host_cols, p[moves:], base.drop,
                                               hosts, rng)  # fmt: skip
        workers, pair = hosts.workers_of(host_cols)
        out[host_rows[pair], workers] += _np(params.jump)[workers]
        return y

    @staticmethod
    def rare_probabilities(params: WorkerParams, base: EmissionBase, hosts: HostIndex):
        """float32 numpy: each worker's tail probability pi, then each host's jump probability,
        the Bernoulli rates :meth:`sample` draws its rare cells at (N + G,); with recovery each
        host's move probability P(jump) + P(drop) instead, then the share of the jumps in its
        moves (N + 2G,)."""
        if base.drop_logit is None:
            p = torch.cat([params.log_pi.exp(), torch.sigmoid(base.jump_logit[hosts.first])])
            return _np(p)
        _, jump, drop = base.host_log_probs(hosts.first).exp()
        move = jump + drop
        share = torch.where(move > 0, jump / move.clamp(min=1e-30), torch.ones_like(move))
        return _np(torch.cat([params.log_pi.exp(), move.clamp(max=1.0), share]).float())


def split_moves(out, rows, cols, jump_share, drop, hosts: HostIndex, rng) -> tuple:
    """The hosts' moves (``rows``, ``cols``: (draw, host) cells drawn at P(jump) + P(drop)), each
    a jump with probability ``jump_share[host]``, else a drop: the dropped hosts' workers move by
    -R in ``out``; the jumps' cells are returned. A categorical draw of the three states: a
    cell jumps with P(jump), drops with P(drop)."""
    dropped = rng.random(cols.size) >= jump_share[cols]
    workers, pair = hosts.workers_of(cols[dropped])
    out[rows[dropped][pair], workers] -= _np(drop)[workers]
    return rows[~dropped], cols[~dropped]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


DENSE_ABOVE = 0.2  # rare_cells: above this probability one uniform per cell is cheaper


def rare_cells(rows: int, p: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) indices of the cells of a (rows, M) grid that come up in independent
    Bernoulli(p[column]) trials, row-major. The cost follows the cells that come up, not the
    grid: a Bernoulli(max p) process over the flattened grid (:func:`bernoulli_process`), each
    of whose cells is kept with probability p[column] / max p (thinning). Exact, for any p."""
    cells, top = rows * p.size, float(p.max()) if p.size else 0.0
    if cells == 0 or top <= 0.0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if top > DENSE_ABOVE:
        return np.nonzero(rng.random((rows, p.size)) < p)
    flat = bernoulli_process(cells, top, rng)
    cols = flat % p.size
    keep = rng.random(flat.size) * top < p[cols]
    return flat[keep] // p.size, cols[keep]


def bernoulli_process(cells: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """The positions in 0..cells-1 where a Bernoulli(p) process comes up, in order, drawn by the
    geometric gaps between them (failures before a success: floor(log U / log(1 - p)))."""
    found, last = [], -1.0  # the positions drawn so far; the last one
    while last < cells:
        expected = (cells - last) * p
        u = rng.random(int(expected + 4 * expected**0.5 + 16))
        at = last + np.cumsum(np.floor(np.log1p(-u) / math.log1p(-p)) + 1.0)
        found.append(at)
        last = float(at[-1])
    at = np.concatenate(found) if len(found) > 1 else found[0]
    return at[at < cells].astype(np.int64)


def censored_normal_log_lik(
    y: torch.Tensor, censored: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Per-entry log N(y; loc, scale) or, where censored, log P(Y >= y) = log Phi((loc - y)/scale)."""
    z = (y - loc) / scale
    log_pdf = -0.5 * z**2 - scale.log() - LOG_SQRT_2PI
    censored = censored.expand(z.shape)
    if not censored.any():
        return log_pdf
    # log_ndtr costs tens of times a density: take it at the censored entries only
    return log_pdf.masked_scatter(censored, torch.special.log_ndtr(-z[censored]))


class Encoder(nn.Module):
    """h_t = GRU(mean_w tanh(W [y, y - e, censored, emb_w]), h_{t-1}), over present workers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inputs = nn.Linear(3, cfg.hidden)
        self.embed = nn.Linear(cfg.emb_dim, cfg.hidden, bias=False)
        self.gru = nn.GRU(cfg.hidden, cfg.hidden, batch_first=True)
        self.h0 = nn.Parameter(torch.zeros(cfg.hidden))

    def pooled(self, y, censored, present, ewma, emb_proj) -> torch.Tensor:
        """(..., N) inputs -> (..., hidden) masked mean over workers.

        Its (..., N, hidden) tensors are the largest of a fit, so every pass over them counts:
        tanh(a) = 2 sigmoid(2a) - 1 (torch's CPU tanh took 6x as long as sigmoid on this
        project's machines, torch 2.13), with the factors 2 taken on the small tensors (the
        weights, and the mean: sum_w p_w (2 s_w - 1) = 2 sum_w p_w s_w - sum_w p_w); the
        inputs' product and the workers' terms in one ``baddbmm`` (a product then a broadcast
        add took 0.9 ms more, forward and backward, at 16 x 48 x 32 x 64), and the weighted
        mean as a batched product (weights (1, N) x (N, hidden)) rather than a product and a
        sum over a (..., N, hidden) tensor."""
        shown = present.to(y.dtype)
        x = torch.stack([y, (y - ewma) * shown, censored.to(y.dtype)], dim=-1)
        lead, n, hidden = x.shape[:-2], x.shape[-2], emb_proj.shape[-1]
        x = x.reshape(-1, n, 3)
        terms = (2 * (emb_proj + self.inputs.bias)).expand(*lead, n, hidden).reshape(-1, n, hidden)
        weight_in = 2 * self.inputs.weight.T.contiguous()  # (3, hidden)
        half = torch.sigmoid(torch.baddbmm(terms, x, weight_in.expand(x.shape[0], 3, hidden)))
        weight = shown / shown.sum(-1, keepdim=True).clamp(min=1)
        mean = (weight.reshape(-1, 1, n) @ half).view(*lead, hidden)
        return 2 * mean - weight.sum(-1, keepdim=True)

    def forward(self, data: RunTensors, emb: torch.Tensor) -> torch.Tensor:
        """(B, L, N) window -> (B, L, hidden) filtered GRU states."""
        g = self.pooled(data.y, data.censored, data.present, data.ewma, self.embed(emb))
        return gru_sequence(self.gru, g, self.h0.expand(g.shape[0], -1))


class RuntimeModel(nn.Module):
    """Deep Markov model of joint run-times with censoring; ``model``/``guide`` for Pyro SVI."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.head = WorkerHead(cfg)
        self.transition = GatedTransition(cfg.z_dim, cfg.hidden)
        self.emitter = Emitter(cfg)
        self.encoder = Encoder(cfg)
        self.combiner = Combiner(cfg.z_dim, cfg.hidden)
        self.z_init = nn.Parameter(torch.zeros(cfg.z_dim))
        self.z_q_init = nn.Parameter(torch.zeros(cfg.z_dim))

    def emission_log_lik(self, z: torch.Tensor, data: RunTensors, params: WorkerParams):
        """sum over present entries of log p(y_{t,w} | z_t), host jumps summed out:
        z (B, L, K) -> (B,)."""
        hosts = HostIndex.of(data.groups)
        base = self.emitter.base(
            params, data.ewma, data.sd, data.feats, data.present, hosts, data.known
        )
        loc, scale = self.emitter(z, params, base)
        ll = self.emitter.joint_log_lik(
            data.y, data.censored, data.present, loc, scale, params, base, hosts
        ).sum(-1)
        return ll * data.weight  # (x 1.0 is exact: a whole fit is unchanged)

    def model(self, data: RunTensors) -> None:
        """p(z_{1:L}) p(y_{1:L} | z_{1:L}) for a batch of windows (B, L, N); the path z_{1:L}
        is one sample site (:class:`MarkovPath`)."""
        batch, length = data.y.shape[:2]
        params = self.head(data.worker_idx, data.host_idx)
        with pyro.plate("windows", batch):
            z = pyro.sample("z", MarkovPath(self.transition, self.z_init, batch, length))
            pyro.factor("y", self.emission_log_lik(z, data, params))

    def negative_elbo(self, data: RunTensors) -> torch.Tensor:
        """``TraceMeanField_ELBO().differentiable_loss(self.model, self.guide, data)`` computed
        directly, to the same bits and with the same random draws: the guide's path drawn first
        (the head, the encoder, :meth:`FilteredPath.rsample`), then the model's terms at it, the
        registered per-step KL and the emission's log-likelihood, summed over windows in Pyro's
        order (``-((0 - KL) + log p(y | z))``). Without Pyro's tracing, its two sites' messengers
        and the replay of the model: about 2 of the 23 ms of a fit's step at 32 workers
        (docs/benchmarks.md, issue 32)."""
        batch, length = data.y.shape[:2]
        q = FilteredPath(self.combiner, self.z_q_init, self.encoder(data, self._emb(data)))
        z = q.rsample()
        params = self.head(data.worker_idx, data.host_idx)  # the model's own call, as in Pyro
        kl = kl_at_draw(q, MarkovPath(self.transition, self.z_init, batch, length))
        return -((0.0 - kl.sum()) + self.emission_log_lik(z, data, params).sum())

    def step_elbo(self, data: RunTensors) -> torch.Tensor:
        """The ELBO's terms of each iteration of a batch of windows at one draw of the guide's
        path: log p(y_t | z_t) - KL(q(z_t | z_{t-1}, x_{<=t}) || p(z_t | z_{t-1})), (B, L).
        Their sum over t is :meth:`negative_elbo`'s negative; the guide filters (past only), so
        the terms of a window's last iterations score them given its earlier ones."""
        batch, length = data.y.shape[:2]
        params = self.head(data.worker_idx, data.host_idx)
        q = FilteredPath(self.combiner, self.z_q_init, self.encoder(data, params.emb))
        z = q.rsample()
        path, loc, scale = q.drawn
        p_loc, p_scale = MarkovPath(self.transition, self.z_init, batch, length).conditionals(path)
        kl = torch.distributions.kl_divergence(
            torch.distributions.Normal(loc, scale), torch.distributions.Normal(p_loc, p_scale)
        ).sum(-1)
        hosts = HostIndex.of(data.groups)
        base = self.emitter.base(
            params, data.ewma, data.sd, data.feats, data.present, hosts, data.known
        )
        z_loc, z_scale = self.emitter(z, params, base)
        ll = self.emitter.joint_log_lik(
            data.y, data.censored, data.present, z_loc, z_scale, params, base, hosts
        )
        return ll - kl

    def _emb(self, data: RunTensors) -> torch.Tensor:
        """The guide's call of the head, for the encoder's embeddings."""
        return self.head(data.worker_idx, data.host_idx).emb

    def guide(self, data: RunTensors) -> None:
        """q(z_{1:L} | y_{1:L}) = prod_t q(z_t | z_{t-1}, h_t), h_t from the past only
        (:class:`FilteredPath`)."""
        params = self.head(data.worker_idx, data.host_idx)
        h = self.encoder(data, params.emb)
        with pyro.plate("windows", data.y.shape[0]):
            pyro.sample("z", FilteredPath(self.combiner, self.z_q_init, h))
