"""The Pyro model and guide: shapes, variable worker counts, the censored likelihood."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from bdsgd.stages.estimators import lognormal_logpdf_or_logsf
from bdsgd.stages.model.data import (
    BASE_FEATURES,
    DEFAULT_FEATURES,
    NUM_FEATURES,
    Normaliser,
    sample_windows,
    to_tensors,
)
from bdsgd.stages.model.latent_path import FilteredPath, MarkovPath
from bdsgd.stages.model.runtime_model import (
    CENSORED_WEIGHT,
    POSITION_RATE,
    HostIndex,
    ModelConfig,
    RuntimeModel,
    censored_normal_log_lik,
    rare_cells,
    split_moves,
)
from bdsgd.stages.store import RunMatrix
from pyro import poutine

from tests.stages.model.clusters import drifting_cluster


def _window(workers: int, length: int = 10, batch: int = 3):
    x, cens, hosts = drifting_cluster(40, workers, 2, seed=workers, cutoff=workers - 1)
    run = RunMatrix("r", x, cens, np.ones_like(cens), tuple(hosts))
    idx = torch.arange(1, workers + 1)
    data = to_tensors(
        run, Normaliser.fit([run]), idx, torch.tensor([1 + w % 2 for w in range(workers)])
    )
    return sample_windows([data], length, batch, np.random.default_rng(0))


@pytest.mark.parametrize("workers", [3, 7])
def test_model_and_guide_shapes_for_any_worker_count(workers):
    model = RuntimeModel(ModelConfig(num_workers=8, num_hosts=2, z_dim=4, hidden=16))
    batch = _window(workers)
    guide = poutine.trace(model.guide).get_trace(batch)
    replayed = poutine.trace(poutine.replay(model.model, trace=guide)).get_trace(batch)
    assert guide.nodes["z"]["value"].shape == (3, 10, 4)
    assert replayed.nodes["y"]["fn"].batch_shape == (3,)
    assert torch.isfinite(replayed.log_prob_sum())


def test_elbo_step_is_finite_with_censoring_and_missing_entries():
    pyro.set_rng_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16))
    batch = _window(4)
    present = batch.present.clone()
    present[:, 2, 1] = False
    batch = type(batch)(**{**batch.__dict__, "present": present})
    loss = pyro.infer.TraceMeanField_ELBO().differentiable_loss(model.model, model.guide, batch)
    loss.backward()
    assert torch.isfinite(loss)


def test_negative_elbo_is_pyros_loss_to_the_bit_with_its_gradients():
    # written out without Pyro's traces, with censored and missing entries: the same value and
    # the same gradient on every weight, from the same random draws
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16))
    batch = _window(4)
    present = batch.present.clone()
    present[:, 2, 1] = False
    batch = type(batch)(**{**batch.__dict__, "present": present})
    found = []
    for loss_of in (
        lambda: pyro.infer.TraceMeanField_ELBO().differentiable_loss(
            model.model, model.guide, batch
        ),
        lambda: model.negative_elbo(batch),
    ):
        pyro.set_rng_seed(5)
        loss = loss_of()
        loss.backward()
        found.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (pyros, pyro_grads), (ours, our_grads) = found
    assert batch.censored.any() and torch.isfinite(ours)
    torch.testing.assert_close(ours, pyros, rtol=0, atol=0)
    for mine, theirs in zip(our_grads, pyro_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert any(g.abs().sum() > 0 for g in our_grads)


def test_step_elbo_sums_to_the_negative_elbo_at_the_same_draw():
    """``step_elbo`` splits the ELBO by iteration (what fit's early stop scores the held-out
    span by): its terms sum to ``-negative_elbo`` from the same random draw."""
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16))
    batch = _window(4)
    with torch.no_grad():
        pyro.set_rng_seed(3)
        total = model.negative_elbo(batch)
        pyro.set_rng_seed(3)
        terms = model.step_elbo(batch)
    assert terms.shape == (3, 10) and torch.isfinite(terms).all()
    torch.testing.assert_close(terms.sum(), -total, rtol=1e-5, atol=1e-3)


def _per_step_elbo(model: RuntimeModel, batch, path: torch.Tensor) -> torch.Tensor:
    """The ELBO at the guide's ``path`` written one step at a time: the emission's
    log-likelihood minus sum_t KL(q(z_t | z_{t-1}, h_t) || p(z_t | z_{t-1}))."""
    params = model.head(batch.worker_idx, batch.host_idx)
    h = model.encoder(batch, params.emb)
    z_q = model.z_q_init.expand(path.shape[0], -1)
    z_p = model.z_init.expand(path.shape[0], -1)
    kl = torch.zeros(())
    for t in range(path.shape[1]):
        q, p = dist.Normal(*model.combiner(z_q, h[:, t])), dist.Normal(*model.transition(z_p))
        kl = kl + torch.distributions.kl_divergence(q, p).sum()
        z_q = z_p = path[:, t]
    return model.emission_log_lik(path, batch, params).sum() - kl


def test_the_elbo_is_the_per_step_kl_at_the_guides_draw():
    # the path is one sample site; its registered KL is the per-step analytic KL at the draw,
    # the estimator that one site per step gives: the same value, not log p(z) - log q(z)
    model = RuntimeModel(ModelConfig(num_workers=8, num_hosts=2, z_dim=4, hidden=16))
    batch = _window(5)
    pyro.set_rng_seed(3)
    loss = pyro.infer.TraceMeanField_ELBO().differentiable_loss(model.model, model.guide, batch)
    pyro.set_rng_seed(3)
    path = poutine.trace(model.guide).get_trace(batch).nodes["z"]["value"]
    torch.testing.assert_close(-loss, _per_step_elbo(model, batch, path), rtol=1e-5, atol=1e-4)


def test_the_guides_path_follows_the_combiner_and_scores_in_one_call():
    model = RuntimeModel(ModelConfig(num_workers=8, num_hosts=2, z_dim=4, hidden=16))
    h = torch.randn(3, 6, 16)
    q = FilteredPath(model.combiner, model.z_q_init, h)
    path = q.rsample()
    z = model.z_q_init.expand(3, -1)
    expected = torch.zeros(3)
    for t in range(6):
        loc, scale = model.combiner(z, h[:, t])
        expected = expected + dist.Normal(loc, scale).log_prob(path[:, t]).sum(-1)
        z = path[:, t]
    torch.testing.assert_close(q.log_prob(path), expected, rtol=1e-5, atol=1e-4)
    p = MarkovPath(model.transition, model.z_init, 3, 6)
    assert p.rsample().shape == path.shape and q.rsample(torch.Size([2])).shape == (2, 3, 6, 4)


def test_censored_entry_scores_the_analytic_log_survival():
    y = torch.tensor([0.3, 1.5, -2.0, 4.0])
    loc, scale = torch.tensor(0.1), torch.tensor(0.7)
    ll = censored_normal_log_lik(y, torch.ones(4, dtype=torch.bool), loc, scale)
    expected = [math.log(0.5 * math.erfc((v - 0.1) / (0.7 * math.sqrt(2)))) for v in y.tolist()]
    torch.testing.assert_close(ll, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_uncensored_entry_is_the_log_normal_density_after_the_jacobian():
    norm = Normaliser(loc=math.log(0.05), scale=0.4)
    x = np.array([0.03, 0.05, 0.2])
    cens = np.array([False, False, True])
    y = torch.as_tensor(norm.normalise(x), dtype=torch.float64)
    loc, scale = torch.tensor(0.2, dtype=torch.float64), torch.tensor(0.8, dtype=torch.float64)
    ll = censored_normal_log_lik(y, torch.as_tensor(cens), loc, scale).numpy()
    ll = ll - np.where(cens, 0.0, np.log(x) + math.log(norm.scale))
    mu, sigma = norm.loc + norm.scale * 0.2, norm.scale * 0.8
    np.testing.assert_allclose(ll, lognormal_logpdf_or_logsf(x, cens, mu, sigma), rtol=1e-9)


def test_mixture_emission_mixes_densities_and_survivals_analytically():
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=2, num_hosts=1, z_dim=4, hidden=16))
    params = model.head(torch.tensor([1, 2]), torch.tensor([1, 1]))
    y, loc, scale = torch.tensor([0.4, 2.5]), torch.tensor([0.1, 0.2]), torch.tensor([0.5, 0.6])
    pi, shift, widen = params.log_pi.exp(), params.shift, params.widen

    def normal(v, m, s, censored):
        if censored:
            return 0.5 * torch.erfc((v - m) / (s * math.sqrt(2)))
        return torch.exp(-0.5 * ((v - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))

    for censored in (False, True):
        cens = torch.full((2,), censored)
        got = model.emitter.log_lik(y, cens, loc, scale, params)
        mix = (1 - pi) * normal(y, loc, scale, censored) + pi * normal(
            y, loc + shift, scale * widen, censored
        )
        torch.testing.assert_close(got, mix.log(), rtol=1e-5, atol=1e-5)
    assert torch.all(shift > 0) and torch.all(widen > 1) and torch.all(pi < 0.05)


def _emission_parts(groups: torch.Tensor, recovery: bool = True):
    torch.manual_seed(0)
    cfg = ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16, recovery=recovery)
    model = RuntimeModel(cfg)
    params = model.head(torch.arange(1, 5), torch.tensor([1, 2, 1, 2]))
    hosts = HostIndex.of(groups)
    n = groups.numel()
    feats = torch.randn(n, DEFAULT_FEATURES)
    base = model.emitter.base(
        params,
        torch.zeros(n),
        torch.full((n,), 0.5),
        feats,
        torch.ones(n, dtype=torch.bool),
        hosts,
        torch.ones(n, dtype=torch.bool),
    )
    return model, params, hosts, base


def test_a_hosts_jump_risk_is_read_off_the_workers_seen_exactly():
    groups = torch.tensor([0, 0, 1, 1])
    model, params, hosts, _ = _emission_parts(groups)
    params = dataclasses.replace(params, jump_w=torch.eye(4, DEFAULT_FEATURES))
    feats = torch.zeros(4, DEFAULT_FEATURES)
    feats[0, 0] = feats[2, 2] = 3.0  # workers 0 and 2 look risky; 0's host mate was seen
    known = torch.tensor([False, True, False, False])  # host 1: both cut off
    present = torch.ones(4, dtype=torch.bool)
    base = model.emitter.base(params, torch.zeros(4), torch.ones(4), feats, present, hosts, known)
    bias, w = params.jump_bias, CENSORED_WEIGHT
    weighted = (w * (bias[0] + 3.0) + (1 + w) * bias[1]) / (1 + 2 * w)
    torch.testing.assert_close(base.jump_logit[0], weighted)  # the cut-off worker counts less
    assert base.jump_logit[0] < (bias[0] + 3.0 + bias[1]) / 2
    torch.testing.assert_close(base.jump_logit[2], (bias[2:].sum() + 3.0) / 2)  # none seen: mean


@pytest.mark.parametrize("recovery", [False, True])
def test_host_jumps_are_summed_out_exactly_per_host(recovery):
    groups = torch.tensor([0, 1, 0, 1])
    model, params, hosts, base = _emission_parts(groups, recovery)
    if recovery:  # a drop likely enough to weigh: logits 0, jump, drop as a softmax
        base = dataclasses.replace(base, drop_logit=torch.tensor([-1.0, -2.0, -1.0, -2.0]))
    y = torch.tensor([0.4, 2.5, 1.9, -0.3])
    cens = torch.tensor([False, False, True, False])
    present = torch.tensor([True, True, True, False])
    loc, scale = torch.tensor([0.1, 0.2, 0.0, 0.3]), torch.tensor([0.5, 0.6, 0.4, 0.5])
    got = model.emitter.joint_log_lik(y, cens, present, loc, scale, params, base, hosts)
    per = model.emitter.log_lik
    calm, jumped = per(y, cens, loc, scale, params), per(y, cens, loc + params.jump, scale, params)
    dropped = per(y, cens, loc - base.drop, scale, params) if recovery else calm
    expected = 0.0
    for host in (0, 1):
        rows = (groups == host) & present
        jump = base.jump_logit[groups == host][0].exp()
        drop = base.drop_logit[groups == host][0].exp() if recovery else torch.tensor(0.0)
        total = 1 + jump + drop
        mix = (calm[rows].sum().exp() + jump * jumped[rows].sum().exp()
               + drop * dropped[rows].sum().exp()) / total  # fmt: skip
        expected = expected + mix.log()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(base.jump_logit[groups == 0] == base.jump_logit[0])


def test_a_host_jump_moves_every_worker_of_that_host_together():
    groups = torch.tensor([0, 1, 0, 1])
    model, params, hosts, base = _emission_parts(groups)
    sure = torch.where(groups == 0, 50.0, -50.0)
    base = dataclasses.replace(base, jump_logit=sure, drop_logit=torch.full((4,), -50.0))
    never_tail = dataclasses.replace(params, log_pi=torch.full((4,), -1e9))
    loc, scale = torch.zeros(64, 4), torch.full((64, 4), 1e-6)
    y = model.emitter.sample(loc, scale, never_tail, base, hosts, torch.Generator().manual_seed(0))
    torch.testing.assert_close(y, torch.where(groups == 0, params.jump, 0.0).expand(64, 4))


@pytest.mark.parametrize("top", [0.01, 0.15, 0.5])
def test_rare_cells_come_up_with_each_columns_probability(top):
    p = np.array([top, top / 2, top / 10, 0.0])
    rows, cols = rare_cells(20_000, p, np.random.default_rng(1))
    counts = np.bincount(cols, minlength=4)
    expected = 20_000 * p
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected * (1 - p)) + 1)
    assert counts[3] == 0
    assert rows.min() >= 0 and rows.max() < 20_000
    cells = rows * 4 + cols
    assert np.all(cells[1:] > cells[:-1])  # distinct, row-major


def test_rare_cells_of_nothing_likely_are_none():
    rows, cols = rare_cells(64, np.zeros(8), np.random.default_rng(0))
    assert rows.size == cols.size == 0


def test_with_drops_a_host_moves_at_jump_plus_drop_and_a_move_is_a_jump_by_its_share():
    """The rates of the hosts' rare cells with drops: P(jump) + P(drop), then P(jump) / (that)
    for splitting each move; a share of 0 makes every move a drop, of 1 a jump."""
    groups = torch.tensor([0, 1, 0, 1])
    model, params, hosts, base = _emission_parts(groups)
    p = model.emitter.rare_probabilities(params, base, hosts)
    _, jump, drop = base.host_log_probs(hosts.first).exp().detach()
    assert p.shape == (4 + 2 * 2,)
    np.testing.assert_allclose(p[4:6], (jump + drop).numpy(), rtol=1e-6)
    np.testing.assert_allclose(p[6:], (jump / (jump + drop)).numpy(), rtol=1e-6)
    out = np.zeros((3, 4), dtype=np.float32)
    rows, cols = np.array([0, 1, 2]), np.array([0, 1, 0])
    jumped = split_moves(out, rows, cols, np.array([0.0, 1.0]), base.drop, hosts,
                         np.random.default_rng(0))  # fmt: skip
    assert jumped[0].tolist() == [1] and jumped[1].tolist() == [1]  # host 1's move: a jump
    R = base.drop.detach().numpy()
    np.testing.assert_allclose(out[[0, 2]][:, [0, 2]], -np.stack([R[[0, 2]]] * 2))  # dropped
    assert not out[:, [1, 3]].any() and not out[1].any()


@torch.no_grad()
def _dense_emission_sample(loc, scale, params, base, hosts, gen):
    """The emission's draw with one uniform per entry and per host (what Emitter.sample
    draws sparsely): the reference its distribution is checked against."""
    host_u = torch.rand((loc.shape[0], hosts.first.numel()), generator=gen)
    _, jump, drop = base.host_log_probs(hosts.first).exp()  # (the calm state: the rest)
    jumps = (host_u < jump)[:, hosts.groups]
    drops = ((host_u >= jump) & (host_u < jump + drop))[:, hosts.groups]
    is_tail = torch.rand(loc.shape, generator=gen).log_() < params.log_pi
    noise = torch.randn(loc.shape, generator=gen)
    widen = torch.where(is_tail, params.widen, 1.0)
    moves = jumps * params.jump - drops * base.drop
    return loc + is_tail * params.shift + moves + noise * scale * widen


def test_emission_draws_match_a_draw_of_every_entry_by_moments_and_quantiles():
    groups = torch.tensor([0, 1, 0, 1])
    model, params, hosts, base = _emission_parts(groups)
    # frequent tails and jumps, so that 200,000 draws per worker pin their shares down
    params = dataclasses.replace(params, log_pi=torch.tensor([-1.5, -2.5, -4.0, -2.0]))
    base = dataclasses.replace(
        base,
        jump_logit=torch.tensor([-2.0, -3.0, -2.0, -3.0]),
        drop_logit=torch.tensor([-2.5, -1.5, -2.5, -1.5]),  # as likely as the jumps, or more
        drop=torch.tensor([0.8, 1.2, 0.6, 1.0]),
    )
    loc = torch.tensor([0.0, 0.5, -0.5, 1.0]).expand(200_000, 4).contiguous()
    scale = torch.tensor([0.3, 0.5, 0.2, 0.4]).expand(200_000, 4).contiguous()
    got = model.emitter.sample(loc, scale, params, base, hosts, torch.Generator().manual_seed(0))
    ref = _dense_emission_sample(loc, scale, params, base, hosts, torch.Generator().manual_seed(1))
    q = torch.tensor([0.01, 0.1, 0.5, 0.9, 0.99, 0.999])
    torch.testing.assert_close(got.mean(0), ref.mean(0), atol=0.01, rtol=0)
    torch.testing.assert_close(got.std(0), ref.std(0), atol=0.01, rtol=0)
    share = (got < ref.quantile(q, dim=0)[:, None]).double().mean(1)  # (q, workers)
    sd = (q * (1 - q) / 200_000).sqrt().double()[:, None]
    assert torch.all((share - q.double()[:, None]).abs() < 5 * 2**0.5 * sd)
    # host mates move together: their correlation is the jumps'
    corr = lambda y: torch.corrcoef(y[:, [0, 2]].T)[0, 1]  # noqa: E731
    assert abs(float(corr(got) - corr(ref))) < 0.01


@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_the_encoders_pool_in_float64_matches_float32(lead):
    # the pool's batched products take one dtype: the masks follow the inputs'
    torch.manual_seed(0)
    enc = RuntimeModel(ModelConfig(num_workers=5, num_hosts=2)).encoder
    y, ewma = torch.randn(*lead, 5), torch.randn(*lead, 5)
    censored, present = torch.rand(*lead, 5) < 0.3, torch.rand(*lead, 5) < 0.8
    emb = torch.randn(5, enc.embed.out_features)
    single = enc.pooled(y, censored, present, ewma, emb)
    double = enc.double().pooled(y.double(), censored, present, ewma.double(), emb.double())
    assert single.shape == (*lead, enc.embed.out_features) and double.dtype == torch.float64
    torch.testing.assert_close(double.float(), single, rtol=1e-5, atol=1e-6)


def test_the_emission_likelihood_counts_a_subsample_of_hosts_by_its_weight():
    # fit --step-workers: a step on g of G hosts weighs their likelihood by G / g
    model = RuntimeModel(ModelConfig(num_workers=8, num_hosts=2, z_dim=4, hidden=16))
    batch = _window(6)
    z = poutine.trace(model.guide).get_trace(batch).nodes["z"]["value"]
    params = model.head(batch.worker_idx, batch.host_idx)
    whole = model.emission_log_lik(z, batch, params)
    weighed = model.emission_log_lik(z, dataclasses.replace(batch, weight=2.5), params)
    torch.testing.assert_close(weighed, 2.5 * whole)
    assert torch.all(whole != 0)


def test_the_run_position_weights_are_every_workers_and_start_at_zero():
    """g, h and j carry the position features' weights after the history features': one set,
    the same for every worker (known or not), zero at initialisation (a fresh model starts as
    one without them), and a gradient reaches them."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_workers=6, num_hosts=2, z_dim=4, hidden=16, num_features=NUM_FEATURES)
    model = RuntimeModel(cfg)
    params = model.head(torch.arange(7), torch.tensor([0, 1, 2, 1, 2, 1, 2]))
    for weights in (params.g, params.h, params.jump_w):
        assert weights.shape == (7, NUM_FEATURES)
        assert not weights[:, BASE_FEATURES:].any()
        assert weights[:, :BASE_FEATURES].std(dim=0).min() > 0  # the history weights: per worker
    k = NUM_FEATURES - BASE_FEATURES  # the run position's and the host regime's
    with torch.no_grad():
        model.head.position_w.copy_(torch.arange(3.0 * k).reshape(3, k))
    params = model.head(torch.arange(7), torch.tensor([0, 1, 2, 1, 2, 1, 2]))
    shared = [p[:, BASE_FEATURES:] for p in (params.g, params.h, params.jump_w)]
    for i, weights in enumerate(shared):
        assert torch.equal(
            weights, (POSITION_RATE * torch.arange(float(k)) + k * i * POSITION_RATE).expand(7, k)
        )
    sum(w.sum() for w in shared).backward()
    assert model.head.position_w.grad is not None and model.head.position_w.grad.abs().min() > 0


@pytest.mark.parametrize("count", [0, 4, 10, 12.0, True])
def test_a_model_takes_8_or_12_features_only(count):
    with pytest.raises(ValueError, match="num_features"):
        ModelConfig(num_workers=2, num_hosts=1, num_features=count)
