"""free_port: ports for the servers that tests and `folio bench serve` start, drawn where clients never draw."""

from __future__ import annotations

import socket

from folio.bench.server_proc import _ephemeral_range_start, free_port


def test_free_ports_lie_between_rays_worker_ports_and_the_ephemeral_range_and_are_free() -> None:
    low = _ephemeral_range_start()
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), (ports, low)  # Ray's workers take 10002-19999
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
