"""``run_fit``: config checks, errors, reproducibility, continuing from a checkpoint."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pyro
import pytest
import torch
from bdsgd.stages import fit
from bdsgd.stages.errors import CheckpointError, ConfigError, TraceError
from bdsgd.stages.fit import FitConfig, policy_censored, run_fit
from bdsgd.stages.model.checkpoint import load_checkpoint
from bdsgd.stages.model.clipped_adam import FusedClippedAdam
from bdsgd.stages.model.data import Normaliser, sample_windows, to_tensors
from bdsgd.stages.model.predictor import load_predictor
from bdsgd.stages.model.runtime_model import ModelConfig, RuntimeModel
from bdsgd.stages.store import RunMatrix, TraceStore, matrix_rows
from bdsgd.stages.stragglers import SyntheticCluster
from pyro.infer import SVI, TraceMeanField_ELBO

from tests.stages.model.clusters import drifting_cluster, write_run


def _store(
    path: Path, workers: int = 5, iterations: int = 60, seed: int = 0, hosts: int = 2
) -> TraceStore:
    cluster = SyntheticCluster(seed=seed, hosts=hosts, p_slow=0.05)
    store = TraceStore(path)
    x = cluster.delays(iterations, workers)
    write_run(store, f"run-{seed}", x, np.zeros_like(x, dtype=bool), cluster.host_of(workers))
    return store


def _config(tmp_path: Path, **kwargs) -> FitConfig:
    defaults = dict(
        traces=tmp_path / "traces",
        checkpoint=tmp_path / "m.pt",
        steps=8,
        window=16,
        batch=4,
        hidden=16,
        eval_samples=16,
        progress=False,
    )
    return FitConfig(**{**defaults, **kwargs})


@pytest.mark.parametrize(
    "field, value",
    [("steps", 0), ("window", 1), ("batch", 0), ("lr", 0.0), ("holdout", 0.95), ("unknown_p", 1.0),
     ("threads", 0), ("threads", 100_000)],
)  # fmt: skip
def test_bad_config_values_are_config_errors(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        _config(tmp_path, **{field: value})


def test_fit_writes_a_checkpoint_with_its_summary(tmp_path):
    _store(tmp_path / "traces")
    result = run_fit(_config(tmp_path))
    assert len(result.losses) == 8 and np.isfinite(result.losses).all()
    assert set(result.baseline_nll) == {"window", "ewma"} and np.isfinite(result.val_nll)
    summary = load_checkpoint(result.checkpoint).summary
    assert summary["val_nll"] == result.val_nll and summary["workers"] == 5
    assert load_predictor(result.checkpoint).sample(4).shape == (4, 5)


def test_unknown_workers_and_hosts_follow_their_own_observations(tmp_path):
    _store(tmp_path / "traces")
    result = run_fit(_config(tmp_path))
    pred = load_predictor(result.checkpoint, workers=[0, 42], hosts=["host0", "new-host"], seed=0)
    for _ in range(10):
        pred.observe(np.array([0.02, 0.2]), np.zeros(2, dtype=bool))
    median = pred.sample(256).median(0).values.numpy()
    assert 0.01 < median[0] < 0.04 and 0.1 < median[1] < 0.4


def test_same_seed_same_fit(tmp_path):
    _store(tmp_path / "traces")
    a = run_fit(_config(tmp_path, checkpoint=tmp_path / "a.pt", seed=3))
    b = run_fit(_config(tmp_path, checkpoint=tmp_path / "b.pt", seed=3))
    assert a.losses == b.losses and a.val_nll == b.val_nll
    sa = load_checkpoint(a.checkpoint).model.state_dict()
    sb = load_checkpoint(b.checkpoint).model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_init_continues_and_grows_to_new_workers(tmp_path):
    _store(tmp_path / "traces")
    first = run_fit(_config(tmp_path, checkpoint=tmp_path / "a.pt"))
    _store(tmp_path / "traces", workers=7, seed=1)
    second = run_fit(_config(tmp_path, checkpoint=tmp_path / "b.pt", init=first.checkpoint))
    old, new = load_checkpoint(first.checkpoint), load_checkpoint(second.checkpoint)
    assert new.norm == old.norm and new.vocab.worker_ids[:5] == old.vocab.worker_ids
    assert len(new.vocab.worker_ids) == 7 and new.model.cfg.hidden == 16


def test_holdout_zero_trains_on_everything_without_val_nll(tmp_path):
    _store(tmp_path / "traces")
    result = run_fit(_config(tmp_path, holdout=0.0))
    assert result.val_nll is None and result.baseline_nll is None


def test_empty_or_missing_store_is_a_trace_error(tmp_path):
    (tmp_path / "traces").mkdir()
    with pytest.raises(TraceError):
        run_fit(_config(tmp_path))
    with pytest.raises(TraceError):
        run_fit(_config(tmp_path, traces=tmp_path / "nowhere"))


def test_bad_init_fails_before_training(tmp_path):
    _store(tmp_path / "traces")
    (tmp_path / "bad.pt").write_text("nope")
    with pytest.raises(CheckpointError):
        run_fit(_config(tmp_path, init=tmp_path / "bad.pt"))
    assert not (tmp_path / "m.pt").exists()


def test_policy_censored_copy_cuts_each_iteration_at_its_cth_arrival():
    x = SyntheticCluster(seed=1, hosts=2, p_slow=0.2).delays(50, 6)
    present = np.ones_like(x, dtype=bool)
    present[3, 2] = False
    run = RunMatrix("r", x, np.zeros_like(present), present, ("a", "b") * 3)
    cut = policy_censored(run, np.random.default_rng(0))
    assert np.all(cut.runtimes <= x) and np.array_equal(cut.present, present)
    for t in range(50):
        arrived = present[t] & ~cut.censored[t]
        late = present[t] & cut.censored[t]
        assert arrived.sum() >= 1
        np.testing.assert_array_equal(cut.runtimes[t, arrived], x[t, arrived])
        if late.any():
            assert np.all(cut.runtimes[t, late] == x[t, arrived].max())
            assert x[t, late].min() >= x[t, arrived].max()
    assert cut.censored.any() and not cut.censored.all()


def test_asynchronous_runs_are_skipped_with_a_note(tmp_path, capsys):
    store = _store(tmp_path / "traces")
    x = SyntheticCluster(seed=1, hosts=2).delays(40, 5)
    run = RunMatrix(
        "train-async", x, np.zeros_like(x, dtype=bool), np.ones_like(x, bool), ("h",) * 5
    )
    store.append(matrix_rows(run, policy="k-async:3", source="train"))
    result = run_fit(_config(tmp_path))
    assert "skipping 1 asynchronous run(s) (train-async)" in capsys.readouterr().err
    assert load_checkpoint(result.checkpoint).summary["runs"] == 1


def test_a_store_of_asynchronous_runs_only_is_a_trace_error(tmp_path):
    x = SyntheticCluster(seed=1, hosts=2).delays(40, 5)
    run = RunMatrix(
        "train-async", x, np.zeros_like(x, dtype=bool), np.ones_like(x, bool), ("h",) * 5
    )
    TraceStore(tmp_path / "traces").append(matrix_rows(run, policy="adasync", source="train"))
    with pytest.raises(TraceError, match="no synchronous run"):
        run_fit(_config(tmp_path))


def test_an_existing_file_that_is_not_a_checkpoint_is_refused_and_kept(tmp_path):
    _store(tmp_path / "traces")
    precious = tmp_path / "precious.txt"
    precious.write_text("my notes")
    with pytest.raises(CheckpointError, match="not a bdsgd checkpoint"):
        run_fit(_config(tmp_path, checkpoint=precious))
    assert precious.read_text() == "my notes"


def test_a_checkpoint_inside_the_trace_store_is_refused_and_the_store_kept(tmp_path):
    store = _store(tmp_path / "traces")
    part = sorted(store.path.glob("*.parquet"))[0]
    before = part.read_bytes()
    for target in (part, store.path / "m.pt", store.path / "sub" / "m.pt"):
        with pytest.raises(ConfigError, match="inside the trace store"):
            run_fit(_config(tmp_path, checkpoint=target))
    assert part.read_bytes() == before
    assert all(p.suffix == ".parquet" for p in store.path.iterdir())  # nothing added either


def test_fitting_again_replaces_the_earlier_checkpoint(tmp_path):
    _store(tmp_path / "traces")
    first = run_fit(_config(tmp_path, seed=1))
    second = run_fit(_config(tmp_path, seed=2))
    assert first.checkpoint == second.checkpoint
    assert load_checkpoint(second.checkpoint).fit_config["seed"] == 2


def test_a_failed_fit_leaves_no_new_folder(tmp_path, monkeypatch):
    _store(tmp_path / "traces")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("bdsgd.stages.fit.train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_fit(_config(tmp_path, checkpoint=tmp_path / "new" / "sub" / "m.pt"))
    assert not (tmp_path / "new").exists()


def test_a_crafted_init_checkpoint_is_refused_before_the_traces_are_read(tmp_path):
    _store(tmp_path / "traces")
    good = run_fit(_config(tmp_path, checkpoint=tmp_path / "a.pt")).checkpoint
    payload = torch.load(good, weights_only=True)
    payload["norm"]["scale"] = 0.0
    torch.save(payload, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="malformed checkpoint .*norm scale 0.0"):
        run_fit(_config(tmp_path, init=tmp_path / "bad.pt", traces=tmp_path / "nowhere"))
    assert not (tmp_path / "m.pt").exists()


def test_train_takes_the_steps_pyros_svi_takes(tmp_path):
    """``train`` writes SVI.step out (its loss ``RuntimeModel.negative_elbo``, not Pyro's
    traces), and the model and guide no longer register their parameters with ``pyro.module``:
    the same losses and the same weights as Pyro's SVI with that registration, step for step."""
    x, cens, hosts = drifting_cluster(60, 6, 2, seed=1, cutoff=5)
    run = RunMatrix("r", x, cens, np.ones_like(cens), tuple(hosts))
    data = [to_tensors(run, Normaliser.fit([run]), torch.arange(1, 7),
                       torch.tensor([1 + w % 2 for w in range(6)]))]  # fmt: skip
    config = _config(tmp_path, steps=6, window=10, batch=3, progress=False)
    torch.manual_seed(0)
    ours = RuntimeModel(ModelConfig(num_workers=8, num_hosts=3, z_dim=4, hidden=16))
    theirs = copy.deepcopy(ours)
    pyro.set_rng_seed(0)
    losses = fit.train(ours, data, config)

    def model(batch):
        pyro.module("runtime_model", theirs)
        theirs.model(batch)

    def guide(batch):
        pyro.module("runtime_model", theirs)
        theirs.guide(batch)

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    optim = FusedClippedAdam(lr=config.lr, lrd=0.1 ** (1.0 / config.steps), clip_norm=10.0)
    svi, rng, expected = (
        SVI(model, guide, optim, loss=TraceMeanField_ELBO()),
        np.random.default_rng(config.seed),
        [],
    )
    with pyro.validation_enabled(False):
        for _ in range(config.steps):
            batch = fit._mask_unknown(
                sample_windows(data, config.window, config.batch, rng), config.unknown_p, rng
            )
            expected.append(svi.step(batch) / max(int(batch.present.sum()), 1))
    assert losses == expected and len(set(losses)) == config.steps  # the weights moved
    for mine, pyros in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(mine, pyros, rtol=0, atol=0)


def test_a_fit_on_a_subsample_of_hosts_weighs_the_likelihood_up(tmp_path, monkeypatch):
    """--step-workers: each step sees whole hosts drawn at random and weighs their likelihood
    by all hosts / the hosts seen; the fit completes and is scored on every worker."""
    _store(tmp_path / "traces", workers=6)
    weights, hosts_seen = [], []
    real = RuntimeModel.emission_log_lik

    def spy(self, z, data, params):
        weights.append(data.weight)
        hosts_seen.append(int(data.groups.max()) + 1)
        return real(self, z, data, params)

    monkeypatch.setattr(RuntimeModel, "emission_log_lik", spy)
    result = run_fit(_config(tmp_path, step_workers=3))
    assert weights == [2.0] * 8 and hosts_seen == [1] * 8  # 1 of the 2 hosts, every step
    assert result.val_nll is not None and np.isfinite(result.val_nll)
    with pytest.raises(ConfigError, match="step_workers"):
        _config(tmp_path, step_workers=-1)


def _slow_start_runs(runs: int, iterations: int, workers: int, seed: int) -> list[RunMatrix]:
    """Runs at random levels whose iteration 1 (the second) is twice as slow as the others."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(runs):
        level = np.log(0.05) + rng.uniform(-0.5, 0.5)
        x = np.exp(level + 0.1 * rng.standard_normal((iterations, workers)))
        x[1] *= 2.0
        full = np.ones(x.shape, dtype=bool)
        hosts = tuple(f"h{w % 2}" for w in range(workers))
        out.append(RunMatrix(f"run{r}", x, ~full, full, hosts))
    return out


def test_a_fit_learns_a_slow_start_from_the_run_position(tmp_path):
    """Every fitted run's second iteration is twice as slow: a new run's predictive for its
    second iteration is slower than for its later ones (without the position features, the
    history looks the same there as anywhere, and the ratio came out 1.00)."""
    store = TraceStore(tmp_path / "t")
    for run in _slow_start_runs(6, 20, 8, seed=0):
        store.append(matrix_rows(run))
    config = _config(tmp_path, traces=tmp_path / "t", steps=400, window=20, batch=4, holdout=0.0)
    run_fit(config)
    new = _slow_start_runs(1, 8, 8, seed=9)[0]
    predictor = load_predictor(config.checkpoint, list(range(8)), list(new.hosts), seed=0)
    medians = []
    for t in range(8):
        medians.append(float(np.median(predictor.sample(256).numpy())))
        predictor.observe(new.runtimes[t], new.censored[t])
    assert medians[1] > 1.3 * max(medians[2:])


def _wide(workers: int, hosts: int) -> RunMatrix:
    x = np.ones((3, workers))
    full = np.ones_like(x, dtype=bool)
    return RunMatrix("r", x, ~full, full, tuple(f"h{w % hosts}" for w in range(workers)))


@pytest.mark.parametrize(
    "workers, hosts, expected",
    [
        (1024, 1024, 64),  # one worker a host: 64 a step
        (1024, 128, 64),  # 8 a host: 64 is 8 hosts
        (1024, 64, 64),  # 16 a host: 4 hosts
        (1024, 32, 128),  # 32 a host: 4 hosts' worth, 128
        (1024, 8, 0),  # 4 hosts would be half the workers: every worker
        (512, 512, 64),
        (512, 16, 128),  # 4 hosts of 32: a quarter
        (256, 256, 0),  # under 512 workers: every worker
        (32, 8, 0),
    ],
)
def test_the_default_step_subsample_keeps_four_hosts_and_at_most_a_quarter(
    workers, hosts, expected
):
    assert fit.auto_step_workers([_wide(16, 4), _wide(workers, hosts)]) == expected


@pytest.mark.parametrize(
    "runs, expected",
    [
        ([(1024, 128), (256, 32)], 0),  # the 256-worker run would be subsampled: none is
        ([(1024, 1024), (600, 6)], 0),  # 64 of 600 would be 1 of its 6 hosts
        ([(1024, 1024), (1024, 32)], 128),  # each run's own step; 128 is 4 of its 32 hosts
        ([(1024, 1024), (512, 512), (64, 64)], 64),  # 64 workers: never subsampled
        ([(2048, 2048), (500, 500)], 0),  # a run under 512 workers is left whole
        ([(2048, 2048), (600, 600)], 64),
    ],
)
def test_the_default_subsamples_a_store_only_where_every_run_it_cuts_qualifies(runs, expected):
    assert fit.auto_step_workers([_wide(n, h) for n, h in runs]) == expected


def test_a_fit_of_512_workers_subsamples_by_default_and_records_it(tmp_path, monkeypatch):
    _store(tmp_path / "traces", workers=512, iterations=24, hosts=32)
    seen = []
    real = RuntimeModel.emission_log_lik

    def spy(self, z, data, params):
        seen.append((data.y.shape[-1], data.weight))
        return real(self, z, data, params)

    monkeypatch.setattr(RuntimeModel, "emission_log_lik", spy)
    assert run_fit(_config(tmp_path, steps=2, window=8, batch=2, eval_samples=4)).step_workers == 64
    assert seen == [(64, 8.0)] * 2  # 4 of the 32 hosts of 16 workers, weighed by 8
    assert load_checkpoint(tmp_path / "m.pt").summary["step_workers"] == 64
    run_fit(_config(tmp_path, steps=2, window=8, batch=2, eval_samples=4, step_workers=0))
    assert seen[2:] == [(512, 1.0)] * 2
    assert load_checkpoint(tmp_path / "m.pt").summary["step_workers"] == 0


def test_a_fit_with_host_drops_learns_that_a_slow_host_drops_back(tmp_path):
    """Hosts switch in and out of 4x slow spells: with --host-drops the fitted model gives a
    host in a slow spell a far higher chance of dropping back next iteration than a calm one;
    without it there is no drop, and --init cannot add one."""
    cluster = SyntheticCluster(seed=4, hosts=4, p_slow=0.05, p_recover=0.25, slow_factor=4.0)
    x = cluster.delays(600, 8)
    store = TraceStore(tmp_path / "traces")
    write_run(store, "run-0", x, np.zeros_like(x, dtype=bool), cluster.host_of(8))
    config = _config(tmp_path, steps=400, window=24, holdout=0.0, host_drops=True)
    assert load_checkpoint(run_fit(config).checkpoint).model.cfg.recovery
    predictor = load_predictor(config.checkpoint, seed=0)
    calm = np.full(8, float(np.median(x)))
    for t in range(12):  # host0 (workers 0 and 4) slow from iteration 4 on
        predictor.observe(np.where(np.arange(8) % 4 == 0, 4.0, 1.0) * calm if t >= 4 else calm,
                          np.zeros(8, dtype=bool))  # fmt: skip
    drop = torch.sigmoid(predictor.base.drop_logit).numpy()
    assert drop[0] == drop[4] and drop[0] > 5 * drop[[1, 2, 3]].max()
    plain = run_fit(_config(tmp_path, checkpoint=tmp_path / "plain.pt", holdout=0.0))
    assert not load_checkpoint(plain.checkpoint).model.cfg.recovery
    with pytest.raises(ConfigError, match="fitted without host drops"):
        run_fit(_config(tmp_path, checkpoint=tmp_path / "c.pt", init=plain.checkpoint,
                        host_drops=True))  # fmt: skip


def test_host_regime_is_opt_in_and_every_fit_is_anchored_at_the_quartile(tmp_path):
    """A default fit keeps the 12 features; --host-regime fits the 14, with the host regime
    filtered; both anchor runs of 5 workers at their first iteration's lower quartile (version
    8); --init from that keeps them."""
    _store(tmp_path / "traces")
    plain = run_fit(_config(tmp_path, checkpoint=tmp_path / "a.pt"))
    regime = run_fit(_config(tmp_path, checkpoint=tmp_path / "b.pt", host_regime=True))
    assert load_checkpoint(plain.checkpoint).model.cfg.num_features == 12
    assert load_checkpoint(regime.checkpoint).model.cfg.num_features == 14
    for result in (plain, regime):
        assert torch.load(result.checkpoint, weights_only=True)["version"] == 8
        assert load_checkpoint(result.checkpoint).norm.anchor_q == 0.25
    again = run_fit(_config(tmp_path, checkpoint=tmp_path / "c.pt", init=regime.checkpoint))
    assert load_checkpoint(again.checkpoint).model.cfg.num_features == 14


def _scored(ks: float | None, iterations: int) -> fit.FitResult:
    """A fit's result whose held-out calibration scored ``iterations`` with run-time KS ``ks``."""
    calibration = {"runtime": {"ks": ks}, "order_stat": {"count": iterations}}
    return fit.FitResult(8, 0.0, None, Path("m.pt"), 0.0, [], calibration)


@pytest.mark.parametrize(
    ("ks", "iterations", "chosen", "expected"),
    [(0.06, 200, {}, True), (0.04, 200, {}, False), (0.06, 99, {}, False),
     (None, 200, {}, False), (0.06, 200, {"host_drops": True}, False),
     (0.06, 200, {"host_regime": True}, False), (0.06, 200, {"auto_host_ks": 1.0}, False)],
)  # fmt: skip
def test_a_fit_is_redone_only_when_its_run_times_are_off_over_enough_iterations(
    tmp_path, ks, iterations, chosen, expected
):
    """--auto-host-ks: above the bound (0.05), over at least 100 scored iterations, and only
    where the user chose neither option."""
    config = _config(tmp_path, **chosen)
    assert fit.wants_refit(config, None, _scored(ks, iterations)) is expected


def test_an_init_checkpoint_keeps_its_choice_however_the_fit_scores(tmp_path):
    _store(tmp_path / "traces")
    prior = load_checkpoint(run_fit(_config(tmp_path, auto_host_ks=1.0)).checkpoint)
    assert not fit.wants_refit(_config(tmp_path), prior, _scored(0.5, 1000))


def test_an_off_fit_is_fitted_again_with_both_options_and_the_better_one_kept(tmp_path, capsys):
    """Bound 0 (every KS is above it) on 1,000 iterations (100 scored): the fit runs twice, says
    so, keeps the fit whose held-out run-time KS is lower and records both KS in its result and
    checkpoint; the saved model has the options exactly when the second fit was kept."""
    _store(tmp_path / "traces", workers=4, iterations=1000)
    result = run_fit(_config(tmp_path, auto_host_ks=0.0, eval_samples=8))
    info = result.auto_host
    assert info["ks"] > 0 and info["kept"] == (info["refit_ks"] < info["ks"])
    assert result.calibration["runtime"]["ks"] == (info["refit_ks"] if info["kept"] else info["ks"])
    ckpt = load_checkpoint(result.checkpoint)
    assert ckpt.summary["auto_host"] == info
    assert ckpt.model.cfg.recovery == info["kept"] == result.host_drops
    assert (ckpt.model.cfg.num_features == 14) == info["kept"] == result.host_regime
    assert result.to_json()["model"] == {"host_drops": info["kept"], "host_regime": info["kept"]}
    said = " ".join(capsys.readouterr().err.split())  # (rich folds long lines)
    assert "fitting again with --host-drops --host-regime" in said
    assert f"kept the {'second' if info['kept'] else 'first'} fit" in said


def test_bad_auto_host_ks_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="auto_host_ks"):
        _config(tmp_path, auto_host_ks=1.5)


def _second_fit(monkeypatch, outcome):
    """Make ``fit._fit``'s second call (the refit) do ``outcome(config, runs, prior)``."""
    real, calls = fit._fit, []

    def counted(config, runs, prior, bar=None):
        calls.append(config)
        return real(config, runs, prior, bar) if len(calls) == 1 else outcome(config, runs, prior)

    monkeypatch.setattr(fit, "_fit", counted)
    return real, calls


def test_a_kept_second_fit_is_the_model_saved(tmp_path, monkeypatch):
    """The refit's model scores better (KS made 0.01 for a model with the options, 0.2
    without): it is the one saved, with both options, and the result says so."""
    _store(tmp_path / "traces", workers=4, iterations=1000)
    monkeypatch.setattr(fit, "runtime_ks", lambda r: 0.01 if r.host_drops else 0.2)
    result = run_fit(_config(tmp_path, eval_samples=8))
    assert result.auto_host == {"ks": 0.2, "refit_ks": 0.01, "kept": True}
    ckpt = load_checkpoint(result.checkpoint)
    assert ckpt.model.cfg.recovery and ckpt.model.cfg.num_features == 14
    assert ckpt.summary["auto_host"]["kept"] and ckpt.fit_config["host_regime"]
    assert result.to_json()["model"] == {"host_drops": True, "host_regime": True}


def test_a_failed_refit_keeps_the_first_fit(tmp_path, monkeypatch, capsys):
    _store(tmp_path / "traces", workers=4, iterations=1000)

    def fails(config, runs, prior):
        raise RuntimeError("out of memory")

    _, calls = _second_fit(monkeypatch, fails)
    result = run_fit(_config(tmp_path, auto_host_ks=0.0, eval_samples=8))
    assert len(calls) == 2 and calls[1].host_drops and calls[1].host_regime
    assert result.auto_host == {"ks": result.auto_host["ks"], "refit_ks": None, "kept": False}
    assert not load_checkpoint(result.checkpoint).model.cfg.recovery
    assert "the second fit failed (out of memory); kept the first" in " ".join(
        capsys.readouterr().err.split()
    )


def test_a_refit_stopped_by_ctrl_c_leaves_the_first_fit_saved(tmp_path, monkeypatch):
    _store(tmp_path / "traces", workers=4, iterations=1000)

    def interrupted(config, runs, prior):
        raise KeyboardInterrupt

    _second_fit(monkeypatch, interrupted)
    config = _config(tmp_path, auto_host_ks=0.0, eval_samples=8)
    with pytest.raises(KeyboardInterrupt):
        run_fit(config)
    saved = load_checkpoint(config.checkpoint)
    assert not saved.model.cfg.recovery and saved.summary["val_nll"] is not None


def _job_store(path: Path, iterations: int, workers: int, seed: int = 0) -> TraceStore:
    """A profile of a small job: one rank 2.5x slower, 0.6 s spells (p 0.08) on every rank."""
    from benchmarks.bench_fit import straggling_job

    x, hosts = straggling_job(seed, iterations, workers)
    store = TraceStore(path)
    write_run(store, "profile", x, np.zeros_like(x, dtype=bool), hosts)
    return store


def test_a_profile_too_short_to_score_is_refused_in_one_line(tmp_path):
    _job_store(tmp_path / "traces", iterations=fit.MIN_ITERATIONS - 1, workers=3)
    with pytest.raises(ConfigError, match="too few to fit") as err:
        run_fit(_config(tmp_path))
    assert "\n" not in str(err.value) and "--policy ecdf" in str(err.value)
    assert not (tmp_path / "m.pt").exists()


def test_a_30_iteration_3_worker_profile_is_refused_or_marked_unusable(tmp_path, capsys):
    """The profile a user takes of a short job: fit either refuses it or writes a checkpoint
    that says, in its plain metadata, that no policy should lean on it, and prints one line."""
    _job_store(tmp_path / "traces", iterations=30, workers=3)
    try:
        result = run_fit(_config(tmp_path, steps=None))
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert not result.usable and "profile longer" in result.unusable_reason
    assert not result.probation  # too few held-out iterations to tell: the model never decides
    payload = torch.load(result.checkpoint, weights_only=True)
    assert payload["summary"]["usable"] is False
    assert payload["summary"]["unusable_reason"] == result.unusable_reason
    assert "\n" not in result.unusable_reason
    ckpt = load_checkpoint(result.checkpoint)
    assert not ckpt.usable and ckpt.unusable_reason == result.unusable_reason
    said = capsys.readouterr().err
    assert len([line for line in said.splitlines() if "unusable" in line]) <= 1
    assert "marked unusable" in " ".join(said.split())


def _result(val_nll=-1.0, window=-0.5, ks=0.05, count=6400, order_ks=0.05, order_count=200):
    calibration = {
        "runtime": {"ks": ks, "count": count},
        "order_stat": {"ks": order_ks, "count": order_count},
    }
    return fit.FitResult(steps=1, val_nll=val_nll, baseline_nll={"window": window, "ewma": 0.0},
                         checkpoint=Path("m.pt"), fit_s=0.0, losses=[],
                         calibration=calibration)  # fmt: skip


def test_assess_marks_a_model_worse_than_the_window_or_off_beyond_its_noise():
    runs = [RunMatrix("r", np.ones((120, 4)), np.zeros((120, 4), bool), np.ones((120, 4), bool),
                      ("h",) * 4)]  # fmt: skip

    def why(result, among=runs) -> str | None:
        verdict = fit.assess(result, among)
        return None if verdict is None else verdict[0]

    assert why(_result()) is None
    assert "worse than the pooled window" in why(_result(val_nll=834.7))
    assert "worse than the pooled window" in why(_result(val_nll=float("nan")))
    # the bar is scaled to the values scored: 0.2 is noise over 48 values, not over 6,400
    assert why(_result(ks=0.2, count=48)) is None
    reason = why(_result(ks=0.2, count=6400))
    assert "run-times 0.200" in reason and "at least 240 iterations" in reason
    assert "x_(c)" in why(_result(order_ks=0.4, order_count=200))
    assert fit.ks_bar(48) > fit.ks_bar(480) >= fit.ks_bar(6400) == fit.USABLE_KS
    no_holdout = dataclasses.replace(_result(), val_nll=None, calibration=None)
    assert fit.assess(no_holdout, runs) is None
    # a held-out part too short to judge: 30 iterations score 3
    short = _runs(3, 30)
    assert fit.scored_iterations(short, 0.2) == 3 and fit.scored_iterations(runs, 0.2) == 12
    assert "scored 3 held-out iterations, too few" in why(_result(), short)
    assert fit.scored_iterations(_runs(4, 100), 0.2) == fit.MIN_SCORED_ITERATIONS


def _runs(workers: int, iterations: int) -> list[RunMatrix]:
    shape = (iterations, workers)
    return [RunMatrix("r", np.ones(shape), np.zeros(shape, bool), np.ones(shape, bool),
                      ("h",) * workers)]  # fmt: skip


def test_auto_steps_grow_with_the_data_within_bounds():
    sizes = [(3, 24), (4, 96), (8, 400), (16, 800), (32, 1600), (256, 800)]
    steps = [fit.auto_steps(_runs(n, t)) for n, t in sizes]
    assert steps == sorted(steps) and steps[0] < steps[-1]
    assert steps[0] == steps[1] == fit.AUTO_MIN_STEPS  # a few hundred run-times
    assert steps[2] > fit.AUTO_MIN_STEPS and steps[3] > steps[2]
    assert steps[4] == steps[5] == fit.AUTO_MAX_STEPS  # 32 x 1,600 and more
    # missing entries are not data
    sparse = _runs(32, 1600)[0]
    sparse = dataclasses.replace(sparse, present=np.zeros((1600, 32), bool))
    assert fit.auto_steps([sparse]) == fit.AUTO_MIN_STEPS


def test_a_default_fit_plans_its_steps_from_the_data(tmp_path):
    _store(tmp_path / "traces", workers=5, iterations=60)
    result = run_fit(_config(tmp_path, steps=None, early_stop=False))
    assert result.planned_steps == result.steps == fit.AUTO_MIN_STEPS
    assert load_checkpoint(result.checkpoint).summary["planned_steps"] == fit.AUTO_MIN_STEPS


def test_early_stop_stops_when_the_score_stops_improving_and_keeps_the_best_weights(
    tmp_path, monkeypatch
):
    """Scores improve until the third check, then worsen: the fit stops STOP_PATIENCE checks
    after the last improvement and puts back the weights of the best check."""
    _store(tmp_path / "traces", workers=5, iterations=60)
    scores = iter([1.0, 0.5, 0.2] + [0.3 + 0.01 * k for k in range(100)])
    kept = {}

    def score(self, model):
        value = next(scores)
        if value == 0.2:
            kept.update({k: v.clone() for k, v in model.state_dict().items()})
        return value

    monkeypatch.setattr(fit.EarlyStop, "score", score)
    monkeypatch.setattr(fit, "STOP_MIN_ENTRIES", 0)  # (the store's span holds 30 run-times)
    result = run_fit(_config(tmp_path, steps=1000))
    every = max(fit.STOP_MIN_EVERY, 1000 // fit.STOP_CHECKS)
    assert result.planned_steps == 1000
    assert result.steps == (3 + fit.STOP_PATIENCE) * every
    saved = load_checkpoint(result.checkpoint).model.state_dict()
    for name, value in kept.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)


def test_early_stop_scores_only_the_held_out_span_with_a_fixed_draw(tmp_path):
    """The stopping windows score the first half of the held-out part, nothing trained on;
    the score is the same twice for the same weights (the guide's draw is seeded)."""
    runs = [
        TraceStore(_store(tmp_path / "traces", workers=4, iterations=100).path).run_matrices()[0]
    ]
    config = _config(tmp_path, window=16)
    tensors = fit.stopping_windows(runs, config, lambda r: to_tensors(
        r, Normaliser.fit([r]), torch.arange(1, 5), torch.tensor([1, 2, 1, 2])))  # fmt: skip
    ((batch, mask),) = tensors
    assert batch.y.shape[1] == 16 and mask.sum() == 10  # iterations 80..89 of 100
    torch.manual_seed(0)
    model = RuntimeModel(ModelConfig(num_workers=4, num_hosts=2, z_dim=4, hidden=16))
    stop = fit.EarlyStop(tensors, every=1)
    before = torch.random.get_rng_state()
    assert stop.score(model) == stop.score(model)
    assert torch.equal(before, torch.random.get_rng_state())  # training's stream untouched
    # with --step-workers, the hosts a training step would see (drawn once)
    sub = dataclasses.replace(config, step_workers=2)
    ((batch, _),) = fit.stopping_windows(runs, sub, lambda r: to_tensors(
        r, Normaliser.fit([r]), torch.arange(1, 5), torch.tensor([1, 2, 1, 2])))  # fmt: skip
    assert batch.y.shape[2] == 2 and batch.weight == 2.0


def test_a_small_profile_runs_its_planned_steps(tmp_path, monkeypatch):
    """A stopping span of fewer than STOP_MIN_ENTRIES run-times is too noisy to stop on: a
    score that never improves does not stop the fit."""
    _store(tmp_path / "traces", workers=5, iterations=60)
    monkeypatch.setattr(fit.EarlyStop, "score", lambda self, model: 1.0)
    result = run_fit(_config(tmp_path, steps=100))
    assert result.steps == result.planned_steps == 100


def test_fit_and_refit_share_one_progress_bar(tmp_path, monkeypatch):
    """The refit's steps are added to the bar the first fit began (one bar for the whole fit):
    both ``_fit`` calls get the same bar, whose total is the steps of both."""
    _store(tmp_path / "traces", workers=4, iterations=1000)
    real, bars = fit._fit, []

    def spied(config, runs, prior, bar=None):
        bars.append(bar)
        return real(config, runs, prior, bar)

    monkeypatch.setattr(fit, "_fit", spied)
    result = run_fit(_config(tmp_path, auto_host_ks=0.0, eval_samples=8))
    assert result.auto_host is not None and len(bars) == 2
    assert bars[0] is bars[1] and isinstance(bars[0], fit.FitBar)
    task = bars[0].progress.tasks[0]
    assert task.total == task.completed == 2 * 8


def test_the_bar_counts_the_steps_planned_less_those_an_early_stop_left():
    with fit.FitBar(enabled=False) as bar:
        bar.plan(100)
        for _ in range(40):
            bar.step(-1.0)
        bar.unplan(60)
        bar.plan(200)
        task = bar.progress.tasks[0]
        assert (task.total, task.completed) == (240, 40)


def test_a_model_only_uncalibrated_goes_on_probation_and_a_worse_one_is_unusable():
    runs = _runs(4, 200)
    reason, probation = fit.assess(_result(ks=0.3), runs)
    assert probation and "marked uncalibrated" in reason and "--policy ecdf" in reason
    reason, probation = fit.assess(_result(val_nll=0.0, ks=0.3), runs)
    assert not probation and "marked unusable" in reason and "worse than the pooled" in reason
    reason, probation = fit.assess(_result(ks=0.3), _runs(3, 30))  # too few to tell
    assert not probation and "marked unusable" in reason


def test_a_few_ranks_are_anchored_at_the_quartile_and_a_cluster_at_the_median():
    assert fit.anchor_quantile(_runs(4, 50)) == 0.25
    assert fit.anchor_quantile(_runs(16, 50)) == 0.25
    assert fit.anchor_quantile(_runs(32, 50)) == 0.5
    assert fit.anchor_quantile(_runs(4, 50) + _runs(32, 50)) == 0.5
