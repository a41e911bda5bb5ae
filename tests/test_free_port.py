"""free_port: the port a test or benchmark hands to a child process cannot be taken before the child binds it."""

from __future__ import annotations

import socket

import pytest

from serving_common import processes
from serving_common.processes import PORT_SLICE_SIZE, ephemeral_low, free_port


def test_ports_come_from_below_the_range_the_kernel_hands_out_by_itself() -> None:
    """An ephemeral port, released and then bound by the child, may meanwhile be given to any outgoing
    connection on the box (a gateway once failed to start with 'Address already in use' so)."""
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= p < ephemeral_low() for p in ports), ports
    assert len(set(ports)) == len(ports)


def test_two_test_workers_never_pick_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    picked = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setattr(processes, "_picked", {})
        picked[worker] = {free_port() for _ in range(PORT_SLICE_SIZE // 4)}
    assert not picked["gw0"] & picked["gw1"]


def test_a_port_someone_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    start = dict(processes._picked)
    first = free_port()
    monkeypatch.setattr(processes, "_picked", start)  # the same turn again, with the first port now held
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        assert free_port() != first


def test_without_room_below_the_kernels_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "ephemeral_low", lambda: 2048)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
