"""Hash chain over FULL KV blocks, the key of the prefix cache.

Block i's hash covers its own token ids AND (through ``parent_hash``) every token before it, so two requests share
block i's hash only if their first (i + 1) * block_size tokens are equal: a hit on block i is a hit on the whole
prefix. Partial blocks are never hashed: their K/V would change as tokens are appended.

sha256 (not Python's ``hash``) keeps hashes stable across processes and runs (``PYTHONHASHSEED``), and makes
accidental collisions, which would silently serve the wrong K/V, practically impossible.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence

from folio.request import Request

ExtraKeys = tuple[Hashable, ...]
# Bump when hash_block_tokens changes: the disk tier's files are named by these hashes (worker/kv_disk.py puts the
# version in its fingerprint), and files named under another scheme must never be found.
BLOCK_HASH_VERSION = 1


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
    """Hash of one full block: sha256 over (parent hash, token ids, extra keys), the first 64 bits as an int.

    The encoding is fixed-width and prefixed with a marker byte per field, so different inputs cannot encode to
    the same bytes: parent ``None`` -> b"N", an int -> b"P" + 8 bytes; tokens -> count + int64 each; extra keys
    (e.g. a LoRA name or image hashes that change the K/V of the same token ids) -> their ``repr``.
    """
    hasher = hashlib.sha256()
    if parent_hash is None:
        hasher.update(b"N")
    else:
        hasher.update(b"P" + struct.pack("<Q", parent_hash))
    hasher.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    if extra_keys is not None:
        hasher.update(b"X" + repr(extra_keys).encode())
    return int.from_bytes(hasher.digest()[:8], "little")


def extend_block_hashes(
    block_hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys | None = None,
) -> int:
    """Append the hashes of the full blocks of ``token_ids`` that ``block_hashes`` does not cover yet.

    Incremental: blocks already hashed are not re-hashed, so calling this after every appended token costs one
    hash per block_size tokens. Returns the number of hashes appended.
    Example (block_size 4): 10 tokens, 1 hash so far -> hashes block 1 (tokens 4..7); tokens 8, 9 wait.
    """
    num_full_blocks = len(token_ids) // block_size
    num_before = len(block_hashes)
    for block_index in range(num_before, num_full_blocks):
        parent = block_hashes[block_index - 1] if block_index > 0 else None
        start = block_index * block_size
        block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys))
    return num_full_blocks - num_before


def update_request_block_hashes(request: Request, block_size: int, extra_keys: ExtraKeys | None = None) -> int:
    """Extend ``request.block_hashes`` to cover every full block of its prompt + output tokens.

    Called when a request is added and after tokens are appended to it. Skips building prompt + output (a copy
    of the whole sequence) unless a block became full, which is once every block_size tokens.
    """
    if request.num_tokens // block_size <= len(request.block_hashes):
        return 0
    return extend_block_hashes(request.block_hashes, request.all_token_ids, block_size, extra_keys)
