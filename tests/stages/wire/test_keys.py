"""Unit tests of the engine protocol: store keys, payload packing, flat buffers,
bounded store waits, the control store listening on the requested address alone."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest
import torch
from bdsgd.stages.errors import WorkerError
from bdsgd.stages.wire import keys as P
from torch.nn.utils import parameters_to_vector


def test_keys_are_distinct_per_iteration_and_ticket():
    keys = {
        P.go_key(3),
        P.go_key(4),
        P.ticket_key(3),
        P.arrival_key(3, 1),
        P.arrival_key(3, 2),
        P.arrival_key(4, 1),
        P.cut_key(3),
        P.closed_key(3),
        P.async_arrival_key(3),
    }
    assert len(keys) == 9


def test_pack_params_puts_iteration_and_cutoff_in_the_header():
    vector = torch.arange(5, dtype=torch.float32)
    packed = P.pack_params(vector, 7, 3)
    assert packed.numel() == P.PARAM_HEADER + 5
    assert int(packed[0]) == 7 and int(packed[1]) == 3
    assert torch.equal(packed[P.PARAM_HEADER :], vector)


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


def test_store_waits_end_at_their_timeout():
    store = P.open_store("127.0.0.1", 0, True, 0.2)
    store.set("a", "1")
    assert P.wait_keys(store, ["a"], 0.2)
    assert not P.wait_keys(store, ["a", "b"], 0.05)
    assert P.get_key(store, "a") == b"1"
    assert P.get_key(store, "b") is None  # the store's own timeout bounds a get


# -- where the control store listens ----------------------------------------------------------
def socket_inodes(pids: list[int]) -> set[str]:
    """Inodes of the sockets the processes ``pids`` hold open."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by ``pids`` (/proc/net/tcp[6])."""
    inodes, found = socket_inodes(pids), []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)  # little-endian 32-bit words
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def test_the_store_listens_on_loopback_alone():
    store = P.open_store("127.0.0.1", 0, is_server=True, timeout_s=5.0)
    assert (("127.0.0.1", store.port)) in listening_addresses([os.getpid()])
    ours = [a for a, port in listening_addresses([os.getpid()]) if port == store.port]
    assert ours == ["127.0.0.1"]  # not 0.0.0.0 nor ::, where torch's own socket would listen
    client = P.open_store("127.0.0.1", store.port, is_server=False, timeout_s=5.0)
    client.set("k", "v")
    assert store.get("k") == b"v"


def outward_address() -> str | None:
    """This machine's address on its default route (no packet is sent), None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # TEST-NET-3: routed, never reached
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_the_store_cannot_be_reached_on_another_address():
    store = P.open_store("127.0.0.1", 0, is_server=True, timeout_s=5.0)
    other = outward_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    with pytest.raises(ConnectionRefusedError), socket.create_connection((other, store.port), 5):
        pass


def test_a_store_on_an_address_this_machine_lacks_is_one_error():
    with pytest.raises(WorkerError, match="control store at 203.0.113.254"):
        P.open_store("203.0.113.254", 0, is_server=True, timeout_s=1.0)  # TEST-NET-3


def test_a_standing_c_moves_in_the_counter_and_a_c_of_every_rank_is_no_cut():
    import torch.distributed as dist

    store, standing = dist.HashStore(), P.StandingC(4)
    assert not standing.move(store, 0, 3)
    assert P.decode_ticket(store.add(P.ticket_key(0), 1)) == P.Ticket(1, 3, False)
    assert not standing.move(store, 0, 2) and not standing.move(store, 0, 2)  # (no second add)
    assert P.decode_ticket(store.add(P.ticket_key(0), 1)) == P.Ticket(2, 2, False)  # it cuts
    assert not standing.move(store, 0, 4)  # every rank: nothing stands
    assert P.decode_ticket(store.add(P.ticket_key(0), 0)).limit == 0
    assert standing.stood == {3, 2, 0}
    standing.begin()
    assert standing.c == 0 and not standing.stood


def test_a_holder_that_cut_is_seen_by_the_move_after_it_or_by_asking_again():
    import torch.distributed as dist

    store, standing = dist.HashStore(), P.StandingC(4)
    standing.move(store, 0, 2)
    for _ in range(2):
        ticket = P.decode_ticket(store.add(P.ticket_key(0), 1))
    assert ticket == P.Ticket(2, 2, False)
    assert not standing.held_cut(store, 0, 1, 2, 1.0)  # not closed yet
    P.cut_at_limit(store, 0, 2)
    assert not standing.held_cut(store, 0, 3, 3, 1.0)  # ticket 2 not among those read
    assert standing.held_cut(store, 0, 1, 2, 1.0)
    assert standing.move(store, 0, 3)  # raised after its holder cut: the counter is closed
