"""The TCP transfer on 127.0.0.1: a real receiver thread and real sockets (folio/kv_transfer/wire.py, receiver.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from folio.core.remote_kv import RemoteKVStore
from folio.kv_transfer import wire
from folio.kv_transfer.receiver import KVReceiver

FP = bytes(range(32))


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    store = RemoteKVStore(capacity_bytes=2 * 16)  # two blocks of 16 bytes
    receiver = KVReceiver("127.0.0.1", 0, store)
    yield receiver
    receiver.close()


def _store(receiver: KVReceiver) -> RemoteKVStore:
    return receiver._server.store


def _send(receiver: KVReceiver, hashes: list[int], payload: bytes) -> int:
    host, port = receiver.address
    return wire.send_blocks(host, port, FP, hashes, memoryview(payload), timeout_s=10)


def test_blocks_are_stored_before_the_ack_and_the_head_of_the_chain_stays(receiver: KVReceiver) -> None:
    payload = bytes(range(16)) + bytes(range(16, 32)) + bytes(range(32, 48))
    assert _send(receiver, [0xA, 0xB, 0xC], payload) == 3  # all stored in turn, tail first: C went out again
    store = _store(receiver)
    assert store.hashes() == [0xB, 0xA] and store.num_evicted_blocks_total == 1
    block = store.get(0xA)
    assert block is not None and bytes(block.payload) == bytes(range(16)) and block.fingerprint == FP


def test_a_broken_message_gets_no_ack(receiver: KVReceiver) -> None:
    host, port = receiver.address
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"NOTAKVMESSAGE" * 8)
        assert sock.recv(16) == b""  # closed without an ack
    for block_bytes in (33, 8 << 20):  # refused at the header; the large one is refused while still being sent
        with pytest.raises(wire.WireError):
            _send(receiver, [1], bytes(block_bytes))
    assert len(_store(receiver)) == 0
    assert _send(receiver, [2], bytes(16)) == 1  # the receiver goes on serving


def test_no_consumer_is_an_os_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: the connection is refused
        with pytest.raises(OSError):
            wire.send_blocks("127.0.0.1", port, FP, [1], memoryview(bytes(16)), timeout_s=10)


def test_a_port_in_use_names_the_field() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=f"kv_transfer_config.kv_port {port}: cannot listen on 127.0.0.1:{port}"):
            KVReceiver("127.0.0.1", port, RemoteKVStore(16))
