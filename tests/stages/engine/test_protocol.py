"""Pure unit tests of the engine protocol: store keys, payload packing, worker records."""

from __future__ import annotations

import torch

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
