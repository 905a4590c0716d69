"""bdsgd.Cutoff in a user's loop: real ranks over gloo on loopback (run_loop.py), each test's
processes reaped (launch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from bdsgd.stages.errors import CheckpointError, ConfigError
from bdsgd.stages.loop.config import LoopConfig, lr_factor, lr_rule
from bdsgd.stages.loop.rank import STATS, Cutoff, batch_size, load_state, split_batch
from bdsgd.stages.store import TraceStore

from tests.stages.loop.launch import SCRIPT, run_ranks

# rank 0 is persistently 1e5 times slower (over 100 s per micro-batch: only a cut ends its wait,
# however slow the machine makes the others), the others about 5 ms
# rank 0 waits 5 s of emulated device time a step, in equal parts after its micro-batches: a cut
# rank finishes the part it is in (as a real rank finishes its micro-batch), then stops
SLOW_RANK0 = "synthetic:base_s=0.005,slow_workers=1,slow_worker_factor=1000,sigma=0,spike_p=0"


def ranks_ok(results) -> None:
    for rc, out in results:
        assert rc == 0, out[-2000:]


def load(result: Path, rank: int) -> dict:
    return json.loads((result / f"rank{rank}.json").read_text())


def flat(params: list) -> np.ndarray:
    return np.concatenate([np.asarray(p) for p in params])


@pytest.mark.slow
def test_full_policy_is_the_whole_batch_step_of_one_process(tmp_path):
    """AdamW, warmup then cosine, clipping and bf16 autocast, micro-batches: two ranks under
    ``full`` take the step one process takes on both ranks' batches at once. The gradients are
    cleared in each of the three ways in turn: set to None and zeroed in place, the backward
    accumulates into the all-reduce buffer; set to the script's own tensors, they are copied."""
    ranks_ok(run_ranks(2, "--steps", "5", "--micro-batches", "2", "--result", str(tmp_path / "d"),
                       "--grad-modes", "none,keep,foreign"))  # fmt: skip
    subprocess.run([sys.executable, str(SCRIPT), "--single", "--steps", "5", "--result",
                    str(tmp_path / "s")], check=True, timeout=120)  # fmt: skip
    r0, r1, ref = load(tmp_path / "d", 0), load(tmp_path / "d", 1), load(tmp_path / "s", 0)
    assert r0["params"] == r1["params"]
    group_released(r0, r1)
    assert r0["world_size"] == 2 and r0["admitted"] == [2] * 5 and r0["samples"] == [32.0] * 5
    assert r0["in_buffer"] == r1["in_buffer"] == [True, True, True, False, True]
    np.testing.assert_allclose(flat(r0["params"]), flat(ref["params"]), rtol=0, atol=1e-3)
    moved = np.abs(flat(r0["params"]) - flat(load_initial())).max()
    assert moved > 20 * 1e-3  # the tolerance is small beside what five steps move


def group_released(*ranks) -> None:
    """cut.close() handed back the group that AdamW's import of torch.distributed.nn captured:
    destroy_process_group then ended gloo's threads (else they abort a rank at exit)."""
    for seen in ranks:
        assert seen["held_after_close"] == 0
        assert seen["gloo_threads_after_destroy"] in (0, None)


def load_initial() -> list:
    sys.path.insert(0, str(SCRIPT.parent))
    from tests.stages.loop.run_loop import setup

    model, _, _ = setup()
    return [p.detach().double().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("salvage,relay", [(False, False), (True, False), (True, True)])
def test_a_slow_rank_is_cut_every_iteration_and_censored_in_the_traces(tmp_path, salvage, relay):
    """static:2 of 3 with rank 0 (which also runs the coordinator) far slower: every iteration
    applies the two fast ranks' batches (with salvage also rank 0's finished micro-batches),
    rank 0's rows are censored, and the replicas stay identical. No rank is reserved. A fast
    rank cuts (static:2's c is announced to the ranks). With the
    cut relayed (one host here, so forced), every rank looks for the cut in the local store,
    and rank 0's relay passed the cuts on."""
    steps = 4
    args = ["--steps", str(steps), "--policy", "static:2", "--micro-batches", "4",
            "--stragglers", SLOW_RANK0, "--result", str(tmp_path / "r"),
            "--out", str(tmp_path / "run"), "--traces", str(tmp_path / "traces")]  # fmt: skip
    flags = (["--salvage"] if salvage else []) + (["--cut-relay"] if relay else [])
    ranks_ok(run_ranks(3, *args, *flags))
    seen = [load(tmp_path / "r", r) for r in range(3)]
    assert [s["local_view"] for s in seen] == [relay] * 3
    if relay:  # (a cut its rank's delay outran is skipped: at least one, at most every one)
        assert 1 <= seen[0]["relayed"] <= steps
    else:
        assert seen[0]["relayed"] is None
    assert seen[1]["relayed"] is None and seen[2]["relayed"] is None
    assert seen[0]["params"] == seen[1]["params"] == seen[2]["params"]
    group_released(*seen)
    assert seen[0]["world_size"] == 3
    assert seen[0]["cut"] == [True] * steps and seen[1]["cut"] == [False] * steps
    assert seen[0]["admitted"] == [2] * steps
    # c = 2 is announced in the ticket counter: the fast rank holding ticket 2 cuts (in every
    # iteration whose announcement came before that ticket), never the slow rank 0
    assert seen[0]["cuts_set"] == 0 and 1 <= seen[1]["cuts_set"] + seen[2]["cuts_set"] <= steps
    samples = seen[1]["samples"]
    if salvage:  # rank 0 finished at least one 4-sample micro-batch before its first delay
        assert all(32 < s < 48 and s % 4 == 0 for s in samples), samples
    else:
        assert samples == [32.0] * steps
    rows = TraceStore(tmp_path / "traces").read().sort("iteration", "worker")
    assert rows.height == 3 * steps
    assert rows.filter(rows["worker"] == 0)["censored"].to_list() == [True] * steps
    assert not any(rows.filter(rows["worker"] != 0)["censored"].to_list())
    assert set(rows["cutoff"].to_list()) == {2} and set(rows["world_size"].to_list()) == {3}
    log = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert log["iteration"] == list(range(steps)) and log["c"] == [2] * steps


@pytest.mark.slow
def test_an_online_policy_learns_to_cut_the_slow_rank_and_its_c_stands_for_the_fast_ones(tmp_path):
    """ewma:online of 3, rank 0 (the coordinator's) a second slower: the first iteration waits
    for it (no history), every later one cuts it at c = 2, which stands in the ticket counter, so
    a fast rank may set the cut; the replicas stay identical and rank 0's late rows are censored."""
    steps = 5
    slow = "synthetic:base_s=0.005,slow_workers=1,slow_worker_factor=200,sigma=0,spike_p=0"
    args = ["--steps", str(steps), "--policy", "ewma:online", "--micro-batches", "2",
            "--stragglers", slow, "--result", str(tmp_path / "r"),
            "--out", str(tmp_path / "run"), "--traces", str(tmp_path / "traces")]  # fmt: skip
    ranks_ok(run_ranks(3, *args))
    seen = [load(tmp_path / "r", r) for r in range(3)]
    assert seen[0]["params"] == seen[1]["params"] == seen[2]["params"]
    assert seen[0]["admitted"] == [3] + [2] * (steps - 1)
    assert seen[0]["cut"] == [False] + [True] * (steps - 1)
    # (a fast rank cuts in every iteration whose c stood before its ticket: rank 0 announces it
    # when it begins, as the fast ranks begin computing)
    assert seen[0]["cuts_set"] == 0 and 1 <= seen[1]["cuts_set"] + seen[2]["cuts_set"] <= steps - 1
    rows = TraceStore(tmp_path / "traces").read().sort("iteration", "worker")
    assert rows.filter(rows["worker"] == 0)["censored"].to_list() == [False] + [True] * (steps - 1)
    log = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert log["c"] == [3] + [2] * (steps - 1)


@pytest.mark.slow
def test_resumed_mid_run_reaches_the_state_of_an_uninterrupted_run(tmp_path):
    """AdamW moments and the scheduler are restored: 3 steps, save, a new job resumes to 6,
    and ends where 6 steps straight end; the traces hold each (iteration, rank) once."""
    common = ["--steps", "6", "--micro-batches", "2"]
    ranks_ok(run_ranks(2, *common, "--result", str(tmp_path / "straight")))
    run = ["--out", str(tmp_path / "run"), "--traces", str(tmp_path / "traces")]
    ranks_ok(run_ranks(2, *common, *run, "--stop-after", "3", "--result", str(tmp_path / "a")))
    ranks_ok(run_ranks(2, *common, *run, "--resume", "--result", str(tmp_path / "b")))
    straight, resumed = load(tmp_path / "straight", 0), load(tmp_path / "b", 0)
    assert resumed["start"] == 3
    assert resumed["params"] == straight["params"]
    rows = TraceStore(tmp_path / "traces").read()
    assert rows.height == 12 and rows["run_id"].n_unique() == 1
    assert sorted(rows["iteration"].unique().to_list()) == list(range(6))
    log = pq.read_table(tmp_path / "run" / "iterations.parquet").to_pydict()
    assert log["iteration"] == list(range(6))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("broadcast", [True, False])
def test_a_batchnorm_model_ends_with_the_same_state_on_every_rank(tmp_path, broadcast):
    """Each rank normalises its own batches; with broadcast_buffers (the default, as DDP's)
    every rank's parameters and running statistics are identical after training, without it
    the running statistics part."""
    flags = [] if broadcast else ["--no-broadcast-buffers"]
    ranks_ok(run_ranks(2, "--steps", "4", "--batchnorm", *flags, "--policy", "static:1",
                       "--result", str(tmp_path / "r")))  # fmt: skip
    a, b = load(tmp_path / "r", 0), load(tmp_path / "r", 1)
    assert a["params"] == b["params"]
    assert len(a["buffers"]) == 3  # running mean, running var, batches tracked
    assert (a["buffers"] == b["buffers"]) is broadcast


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_whose_parameters_part_end_with_the_same_line(tmp_path):
    """Rank 1 moves a parameter after step 1: the checksums compared at step 2 disagree and
    every rank ends with the same one line."""
    results = run_ranks(2, "--steps", "6", "--check-every", "2", "--diverge-at", "1",
                        "--result", str(tmp_path / "r"))  # fmt: skip
    lines = [out.strip().splitlines()[-1].split("]: ", 1)[-1] for _, out in results]
    assert all(rc != 0 for rc, _ in results)
    assert lines[0] == lines[1] and "parameters differ before iteration 2" in lines[0], lines


@pytest.mark.slow
def test_a_bad_policy_is_one_error_on_every_rank(tmp_path):
    results = run_ranks(2, "--policy", "nonsense", "--result", str(tmp_path / "r"))
    for rc, out in results:
        assert rc != 0 and "nonsense" in out


def test_the_rank_side_loads_no_coordinator_trace_store_or_dataframes():
    code = ("import sys, bdsgd, bdsgd.stages.loop.rank; bad = [m for m in ('polars', 'pyarrow', "
            "'rich', 'pyro', 'bdsgd.stages.store', 'bdsgd.stages.loop.coordinator', "
            "'bdsgd.stages.policies.registry') if m in sys.modules]; print(bad)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


# -- pieces -------------------------------------------------------------------------------------
def test_split_batch_cuts_every_tensor_alike_and_counts_samples():
    x, y = torch.arange(10).reshape(10, 1), torch.arange(10)
    parts = split_batch({"x": x, "y": y}, 3)
    assert [batch_size(p) for p in parts] == [3, 4, 3]
    assert torch.equal(torch.cat([p["y"] for p in parts]), y)
    assert [batch_size(p) for p in split_batch((x, y), 20)] == [1] * 10
    with pytest.raises(ConfigError, match="pass tensors"):
        split_batch("text", 2)


def test_lr_scaling_defaults_by_optimizer_family():
    assert lr_rule("auto", "AdamW") == "sqrt" and lr_rule("auto", "SGD") == "linear"
    assert lr_rule("none", "AdamW") == "none"
    assert lr_factor("linear", 0.25) == 0.25 and lr_factor("sqrt", 0.25) == 0.5
    assert lr_factor("none", 0.25) == 1.0 and lr_factor("linear", 1.5) == 1.0


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(micro_batches=0), "micro_batches"),
        (dict(lr_scaling="cubic"), "lr_scaling"),
        (dict(policy="k-async:2"), "asynchronous"),
        (dict(timeout_s=float("nan")), "timeout_s"),
        (dict(policy=123), "policy must be a string, got 123 [(]int[)]"),
        (dict(micro_batches="4"), "micro_batches must be an integer, got '4' [(]str[)]"),
        (dict(micro_batches=2.5), "micro_batches must be an integer, got 2.5"),
        (dict(micro_batches=True), "micro_batches must be an integer, got True"),
        (dict(timeout_s="300"), "timeout_s must be a number, got '300'"),
        (dict(salvage="no"), "salvage must be True or False, got 'no'"),
        (dict(cut_relay="off"), "cut_relay must be True, False or None, got 'off'"),
        (dict(target_loss="low"), "target_loss must be a number or None"),
        (dict(out=3), "out must be a path or None, got 3"),
    ],
)
def test_loop_config_refuses_bad_options_in_one_line(options, match):
    with pytest.raises(ConfigError, match=match) as raised:
        LoopConfig(**options)
    assert "\n" not in str(raised.value)


def test_loop_config_takes_ints_for_numbers_and_paths_for_directories(tmp_path):
    cfg = LoopConfig(timeout_s=60, time_scale=2, overhead_s=0, explore=0, target_loss=1,
                     micro_batches=np.int64(4), out=tmp_path, traces=str(tmp_path), cut_relay=False)  # fmt: skip
    assert cfg.micro_batches == 4 and cfg.out_path == tmp_path


def test_cutoff_without_a_process_group_says_what_to_call():
    import bdsgd

    with pytest.raises(ConfigError, match="init_process_group"):
        bdsgd.Cutoff(torch.nn.Linear(2, 2))


def test_cutoff_given_an_optimizer_or_a_policy_name_says_what_it_takes():
    import bdsgd

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="first argument must be the model .* got SGD"):
        bdsgd.Cutoff(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="config must be a bdsgd.LoopConfig or None, got str"):
        bdsgd.Cutoff(model, "static:3")
    with pytest.raises(ConfigError, match="optimizer must be a torch.optim.Optimizer"):
        bdsgd.Cutoff(model, optimizer="adamw")


def test_a_foreign_file_is_not_loaded_as_a_checkpoint(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="bdsgd loop checkpoint"):
        load_state(path)
    torch.save({"version": 99}, path)
    with pytest.raises(CheckpointError, match="version 1"):
        load_state(path)


def _buffer_of(params: list) -> types.SimpleNamespace:
    """What Cutoff's gradient views need of it: the parameters and the flat buffer."""
    numel = sum(p.numel() for p in params)
    return types.SimpleNamespace(params=params, flat=torch.zeros(numel + STATS))


def test_gradient_views_keep_each_parameters_layout_and_tile_the_buffer():
    """A channels_last conv weight and a transposed weight get views with their own strides
    (a fused optimizer needs a gradient laid out as its parameter), every view inside the
    buffer, the views together covering it once; a parameter that is not dense is copied."""
    torch.manual_seed(0)
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    params = [conv, torch.nn.Parameter(torch.randn(3, 5).t()), torch.nn.Parameter(torch.randn(6))]
    cut = _buffer_of(params)
    views = Cutoff._grad_views(cut)
    for p, view in zip(params, views, strict=True):
        assert view.shape == p.shape and view.stride() == p.stride()
    marks = cut.flat.clone()
    for i, view in enumerate(views):
        view.fill_(i + 1)  # each view writes only its own places
    counts = torch.bincount(cut.flat[:-STATS].long(), minlength=4)
    assert counts.tolist() == [0, conv.numel(), 15, 6] and not marks.any()
    overlapping = torch.nn.Parameter(torch.randn(3).expand(2, 3).clone()[:, ::2].t())
    assert not Cutoff._fits(_buffer_of([overlapping]), overlapping)
    assert all(Cutoff._fits(cut, p) for p in params)


def test_a_fused_step_on_gradient_views_is_the_step_on_its_own_gradients():
    torch.manual_seed(0)
    conv = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    weights = [conv, torch.randn(3, 5).t(), torch.randn(6)]
    grads = [torch.randn_like(w) for w in weights]
    stepped = []
    for as_views in (False, True):
        params = [torch.nn.Parameter(w.clone(memory_format=torch.preserve_format)) for w in weights]
        cut = _buffer_of(params)
        views = Cutoff._grad_views(cut)
        for p, view, g in zip(params, views, grads, strict=True):
            if as_views:
                view.copy_(g)
                p.grad = view
            else:
                p.grad = g.clone(memory_format=torch.preserve_format)
        opt = torch.optim.AdamW(params, lr=0.1, fused=True)
        opt.step()
        stepped.append([p.detach().clone() for p in params])
    for a, b in zip(*stepped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
