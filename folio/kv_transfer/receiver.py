"""The consumer's TCP receiver: a thread in the engine core's process that puts received blocks into the store.

One thread accepts, one thread per connection reads its message (folio/kv_transfer/wire.py), stores the blocks
(tail first: if they do not all fit the store, the head of the chain stays) and acks. Bytes only, no torch: the
engine core's scheduler finds the blocks by hash (core/remote_kv.py) and the worker copies them into the cache.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading

from folio.core.remote_kv import RemoteBlock, RemoteKVStore
from folio.kv_transfer import wire

logger = logging.getLogger("folio")

_READ_TIMEOUT_S = 60.0  # a sender that stalls mid-message longer than this is dropped


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    store: RemoteKVStore


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        server: _Server = self.server  # type: ignore[assignment]
        sock.settimeout(_READ_TIMEOUT_S)
        try:
            fingerprint, num_blocks, block_bytes = wire.read_header(sock, server.store.capacity_bytes)
            blocks = wire.read_blocks(sock, num_blocks, block_bytes)
            stored = server.store.put([RemoteBlock(h, fingerprint, payload) for h, payload in reversed(blocks)])
            wire.send_ack(sock, stored)
        except OSError as e:  # WireError included: no ack, the sender counts a failed send
            logger.warning("KV transfer: a message from %s was dropped: %s", self.client_address, e)


class KVReceiver:
    """Listens on host:port until ``close``. ValueError naming kv_transfer_config.kv_port when it cannot bind."""

    def __init__(self, host: str, port: int, store: RemoteKVStore) -> None:
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as e:
            raise ValueError(f"kv_transfer_config.kv_port {port}: cannot listen on {host}:{port}: {e}") from e
        self._server.store = store
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="folio-kv-receiver", daemon=True)
        self._thread.start()
        logger.info("KV transfer: receiving blocks on %s:%d (buffer %d bytes)", host, port, store.capacity_bytes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
