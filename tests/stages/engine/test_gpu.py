"""The GPU path: CUDA-event timing, device placement, the backend choice, and a collective run of
replicas sharing one GPU over gloo (and NCCL at world size 1). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from bdsgd.stages.engine.launch import run_engine
from bdsgd.stages.engine.protocol import agreed_backend, vote_backend
from bdsgd.stages.engine.worker import use_device
from bdsgd.stages.store import TraceStore
from bdsgd.stages.workloads import backend_for, load_workload, resolve_device

from tests.stages.engine.test_collective import collective_config
from tests.stages.engine.test_engine import RecordingStatic

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cpu_placement_and_gloo_without_a_gpu():
    assert resolve_device("cpu", 4) == torch.device("cpu")
    assert backend_for(torch.device("cpu"), 4) == "gloo"
    if not torch.cuda.is_available():
        assert resolve_device("auto", 4) == torch.device("cpu")


@pytest.mark.parametrize(
    "votes,agreed",
    [
        (["nccl", "nccl", "nccl"], "nccl"),
        (["nccl", "gloo", "nccl"], "gloo"),
        (["gloo"] * 3, "gloo"),
    ],
)
def test_the_replicas_use_nccl_only_if_every_one_can(votes, agreed):
    """Machines decide for their own workers (a machine whose workers share a GPU, or have
    none, says gloo): one such replica makes every replica's group gloo, never a mix."""
    store = dist.HashStore()
    for mine in votes:
        vote_backend(store, mine)
    assert [agreed_backend(store, mine) for mine in votes] == [agreed] * 3


def test_a_worker_on_gpu_k_makes_it_the_current_device(monkeypatch):
    """CUDA events record on the current device's stream: a worker on GPU 3 must make GPU 3
    current (a unit test of the call; the GPU itself is exercised by the tests below)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    use_device(torch.device("cuda", 3))
    use_device(torch.device("cpu"))
    assert calls == [torch.device("cuda", 3)]


def test_the_transformer_workload_learns_on_the_cpu():
    workload = load_workload("transformer", seed=0)
    opt = torch.optim.SGD(workload.model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(1)
    x, y = workload.eval_batch
    with torch.no_grad():
        before = float(workload.loss(workload.model(x), y))
    for _ in range(15):
        xb, yb = workload.batch(gen, 16)
        opt.zero_grad()
        workload.loss(workload.model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        assert float(workload.loss(workload.model(x), y)) < before


@cuda
def test_replicas_share_one_gpu_over_gloo_and_time_with_cuda_events(tmp_path):
    cfg = collective_config(device="cuda", iterations=8, workload="transformer", batch_size=8,
                            stragglers="synthetic:base_s=0.005")  # fmt: skip
    result = run_engine(cfg, RecordingStatic(3), tmp_path / "traces", lambda t, r: None)
    assert result.log["c"] == [3] * cfg.iterations
    assert result.extras["replicas_identical"] and result.extras["device"] == "cuda"
    rows = TraceStore(tmp_path / "traces").read()
    assert set(rows["device"].to_list()) == {"cuda"}


@cuda
def test_nccl_at_world_size_one(tmp_path):
    cfg = collective_config(device="cuda", workers=1, iterations=5, hosts=("h0",))
    assert backend_for(torch.device("cuda", 0), 1) == "nccl"
    result = run_engine(cfg, RecordingStatic(1), tmp_path / "traces", lambda t, r: None)
    assert result.log["iteration"] == list(range(5)) and result.extras["replicas_identical"]
