"""The KV transfer's message on a TCP connection: one message of blocks, one ack. Pure Python (sockets).

A sender connects, writes a header (magic, format version, the KV-layout fingerprint, the number of blocks, the bytes
of one block), the blocks' hashes (8 bytes each) and their payloads back to back, and waits for the ack (magic, the
number of blocks the receiver stored). The receiver stores the blocks before it acks, so a sender that has its ack
knows the blocks are there for the next request. Anything else (a short read, a wrong magic, a block larger than the
receiver's whole buffer) closes the connection without an ack, which the sender counts as a failed send.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

MAGIC = b"FOLIOKVT"
ACK_MAGIC = b"FOLIOACK"
VERSION = 1
HEADER = struct.Struct("<8sH32sIQ")  # magic, version, fingerprint (sha256), number of blocks, bytes per block
ACK = struct.Struct("<8sI")  # magic, blocks stored
MAX_BLOCKS = 1 << 20  # per message: a header claiming more is refused before anything is allocated


class WireError(ConnectionError):
    """A message that breaks the format, or a connection that ended early."""


def send_blocks(
    host: str, port: int, fingerprint: bytes, block_hashes: Sequence[int], payloads: memoryview, timeout_s: float
) -> int:
    """Send one message and wait for its ack; returns the number of blocks the receiver stored. ``payloads``: the
    blocks' bytes back to back, in the order of ``block_hashes``. Raises OSError (WireError included) when the
    consumer cannot be reached or does not ack."""
    num_blocks = len(block_hashes)
    if num_blocks == 0 or len(payloads) % num_blocks:
        raise ValueError(f"{len(payloads)} bytes of payload for {num_blocks} blocks")
    header = HEADER.pack(MAGIC, VERSION, fingerprint, num_blocks, len(payloads) // num_blocks)
    hashes = struct.pack(f"<{num_blocks}Q", *block_hashes)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(header + hashes)
            sock.sendall(payloads)
            magic, num_stored = ACK.unpack(recv_exactly(sock, ACK.size))
        except (BrokenPipeError, ConnectionResetError) as exc:  # the receiver refused the message and closed
            raise WireError(f"the consumer at {host}:{port} closed the connection without an ack: {exc}") from exc
    if magic != ACK_MAGIC:
        raise WireError(f"the consumer at {host}:{port} answered with an unknown ack")
    return int(num_stored)


def recv_exactly(sock: socket.socket, num_bytes: int) -> bytearray:
    buffer = bytearray(num_bytes)
    recv_into_exactly(sock, memoryview(buffer))
    return buffer


def recv_into_exactly(sock: socket.socket, view: memoryview) -> None:
    received = 0
    while received < len(view):
        n = sock.recv_into(view[received:])
        if n == 0:
            raise WireError(f"connection closed after {received} of {len(view)} bytes")
        received += n


def read_header(sock: socket.socket, max_block_bytes: int) -> tuple[bytes, int, int]:
    """(fingerprint, number of blocks, bytes per block) of an incoming message; WireError if it breaks the format
    or its blocks are larger than ``max_block_bytes``."""
    magic, version, fingerprint, num_blocks, block_bytes = HEADER.unpack(recv_exactly(sock, HEADER.size))
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not a KV transfer message of version {VERSION}")
    if num_blocks > MAX_BLOCKS or block_bytes > max_block_bytes:
        raise WireError(f"{num_blocks} blocks of {block_bytes} bytes: more than this receiver takes")
    return bytes(fingerprint), int(num_blocks), int(block_bytes)


def read_blocks(sock: socket.socket, num_blocks: int, block_bytes: int) -> list[tuple[int, bytearray]]:
    """(hash, payload) of every block of the message whose header was read."""
    hashes = struct.unpack(f"<{num_blocks}Q", recv_exactly(sock, 8 * num_blocks))
    return [(int(block_hash), recv_exactly(sock, block_bytes)) for block_hash in hashes]


def send_ack(sock: socket.socket, num_stored: int) -> None:
    sock.sendall(ACK.pack(ACK_MAGIC, num_stored))
