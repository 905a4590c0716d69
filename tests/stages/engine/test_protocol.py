"""Unit tests of the engine protocol: store keys, payload packing, worker records, flat buffers,
bounded store waits."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from stages.engine import protocol as P


def test_keys_are_distinct_per_iteration_and_ticket():
    keys = {
        P.go_key(3),
        P.go_key(4),
        P.ticket_key(3),
        P.arrival_key(3, 1),
        P.arrival_key(3, 2),
        P.arrival_key(4, 1),
        P.cut_key(3),
        P.record_key(0, 0),
        P.record_key(1, 0),
        P.record_key(0, 1),
        P.members_key(0),
        P.members_key(1),
    }
    assert len(keys) == 12


def test_pack_params_puts_iteration_and_cutoff_in_the_header():
    vector = torch.arange(5, dtype=torch.float32)
    packed = P.pack_params(vector, 7, 3)
    assert packed.numel() == P.PARAM_HEADER + 5
    assert int(packed[0]) == 7 and int(packed[1]) == 3
    assert torch.equal(packed[P.PARAM_HEADER :], vector)


def test_pack_grad_puts_runtime_loss_worker_in_the_header():
    grad = torch.tensor([1.0, -2.0])
    packed = P.pack_grad(grad, 0.25, 1.5, 3)
    runtime, loss, worker = packed[: P.GRAD_HEADER].tolist()
    assert (runtime, loss, int(worker)) == (0.25, 1.5, 3)
    assert torch.equal(packed[P.GRAD_HEADER :], grad)


def test_record_round_trips_through_an_appended_blob():
    records = [
        P.Record(0, 0.001, 0.0125, False, 0.01),
        P.Record(1, 0.02, 0.5, True, 0.75),
    ]
    blob = "".join(r.encode() for r in records).encode()
    assert P.Record.decode_all(blob) == records


def test_record_decode_of_an_empty_blob_is_empty():
    assert P.Record.decode_all(b"") == []


def test_members_round_trip():
    assert P.decode_members(P.encode_members([0, 1, 3]).encode()) == [0, 1, 3]


def test_covers_finds_an_iteration_without_decoding():
    blob = (
        P.Record(3, 0.0, 0.1, False, 0.0).encode() + P.Record(13, 0.0, 0.1, True, 0.0).encode()
    ).encode()
    assert P.Record.covers(blob, 3) and P.Record.covers(blob, 13)
    assert not P.Record.covers(blob, 1) and not P.Record.covers(blob, 23)


def test_bind_flat_receives_into_the_model_and_accumulates_gradients_in_place():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before = parameters_to_vector(model.parameters()).detach().clone()
    data, grads = torch.zeros(before.numel()), torch.zeros(before.numel())
    P.bind_flat(model.parameters(), data, grads)
    assert torch.equal(data, before)  # the values moved into the buffer
    data.add_(1.0)  # writing the buffer (a received payload) writes the model
    assert torch.equal(parameters_to_vector(model.parameters()), before + 1.0)
    x = torch.randn(5, 3)
    for _ in range(2):  # two micro-batches accumulate into the same buffer
        model(x).sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(grads, expected) and grads.abs().sum() > 0
    model.zero_grad(set_to_none=False)
    assert not grads.any()


def test_pack_params_of_matches_pack_params():
    model = torch.nn.Linear(3, 2)
    vector = parameters_to_vector(model.parameters()).detach()
    assert torch.equal(P.pack_params_of(model.parameters(), 4, 2), P.pack_params(vector, 4, 2))


def test_store_waits_end_at_their_timeout():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=0.2)
    )
    store.set("a", "1")
    assert P.wait_keys(store, ["a"], 0.2)
    assert not P.wait_keys(store, ["a", "b"], 0.05)
    assert P.get_key(store, "a") == b"1"
    assert P.get_key(store, "b") is None  # the store's own timeout bounds a get
