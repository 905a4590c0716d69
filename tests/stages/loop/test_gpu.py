"""bdsgd.Cutoff on a GPU: NCCL at world size 1 (one GPU per rank), and two ranks sharing one GPU
over gloo with CUDA tensors, a slow one cut; compute timed with CUDA events. Skipped without a
GPU (``make gpu-check`` runs them where there is one)."""

from __future__ import annotations

import pytest
import torch
from bdsgd.stages.store import TraceStore

from tests.stages.loop.launch import run_ranks
from tests.stages.loop.test_rank import SLOW_RANK0, load, ranks_ok

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_nccl_at_world_size_one_writes_cuda_rows(tmp_path):
    args = ["--steps", "4", "--device", "cuda", "--backend", "nccl", "--result",
            str(tmp_path / "r"), "--traces", str(tmp_path / "traces")]  # fmt: skip
    ranks_ok(run_ranks(1, *args))
    assert load(tmp_path / "r", 0)["admitted"] == [1] * 4
    rows = TraceStore(tmp_path / "traces").read()
    assert set(rows["device"].to_list()) == {"cuda"} and rows.height == 4
    assert all(r > 0 for r in rows["runtime_s"].to_list())


@cuda
def test_two_ranks_share_a_gpu_over_gloo_and_the_slow_one_is_cut(tmp_path):
    args = ["--steps", "3", "--device", "cuda", "--policy", "static:1", "--micro-batches", "4",
            "--stragglers", SLOW_RANK0, "--result", str(tmp_path / "r")]  # fmt: skip
    ranks_ok(run_ranks(2, *args))
    r0, r1 = load(tmp_path / "r", 0), load(tmp_path / "r", 1)
    assert r0["params"] == r1["params"]
    assert r0["cut"] == [True] * 3 and r1["admitted"] == [1] * 3


@cuda
@pytest.mark.timeout(600)
def test_train_engine_loop_on_the_gpu_in_bf16_with_the_workloads_adamw(tmp_path):
    """``bdsgd train --engine loop --device cuda``: two ranks share the GPU over gloo, the
    workload's AdamW, schedule, clipping and bf16 autocast on CUDA tensors."""
    from tests.stages.test_loop_runs import checkpoint, train

    rc, _, err = train(tmp_path, "--iterations", "10", "--device", "cuda")
    assert rc == 0, err
    rows = TraceStore(tmp_path / "traces").read()
    assert set(rows["device"].to_list()) == {"cuda"} and rows.height == 20
    assert checkpoint(tmp_path / "run")["next_iteration"] == 10
