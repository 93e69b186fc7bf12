"""Block hash chain: deterministic, prefix-sensitive, incremental over full blocks only."""

from folio.core.block_hash import extend_block_hashes, hash_block_tokens, update_request_block_hashes
from tests.helpers import make_request


def test_hash_is_deterministic_64_bit_and_sensitive_to_every_input() -> None:
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert 0 <= h < 2**64
    assert h != hash_block_tokens(None, [1, 2, 3, 5])
    assert h != hash_block_tokens(0, [1, 2, 3, 4])  # parent None differs from parent 0
    assert h != hash_block_tokens(None, [1, 2, 3, 4], ("lora-a",))
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora-a",)) != hash_block_tokens(None, [1, 2, 3, 4], ("lora-b",))
    # Any sequence type hashes alike: the scheduler passes list slices, others may pass tuples.
    assert h == hash_block_tokens(None, (1, 2, 3, 4))


def test_hash_values_are_pinned() -> None:
    """The exact values of the sha256 encoding, computed once and written here.

    Prefix-cache hits compare hashes made by different processes and runs (the engine core, a restarted server,
    a KV tier that outlives one run), so the value must not depend on PYTHONHASHSEED, the platform or the
    Python version, and must not change silently: a change to the encoding (marker bytes, widths, byte order,
    the extra-key repr) fails here and has to be made on purpose.
    """
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == 0x70F93561024E2578
    assert hash_block_tokens(root, [5, 6, 7, 8], ("lora-a",)) == 0x180D31E726A0E945


def test_chain_makes_equal_blocks_with_different_prefixes_differ() -> None:
    hashes_a: list[int] = []
    hashes_b: list[int] = []
    assert extend_block_hashes(hashes_a, [1, 2, 9, 9], block_size=2) == 2
    assert extend_block_hashes(hashes_b, [3, 4, 9, 9], block_size=2) == 2
    assert hashes_a[1] != hashes_b[1]  # same tokens [9, 9], different prefix
    assert hashes_a[1] == hash_block_tokens(hashes_a[0], [9, 9])


def test_incremental_extension_hashes_only_new_full_blocks() -> None:
    request = make_request("r", prompt=[1, 2, 3, 4, 5, 6], max_tokens=8)
    assert update_request_block_hashes(request, block_size=4) == 1  # tokens 4, 5 are a partial block
    first = list(request.block_hashes)
    request.output_token_ids.append(7)
    assert update_request_block_hashes(request, block_size=4) == 0
    request.output_token_ids.append(8)
    assert update_request_block_hashes(request, block_size=4) == 1
    assert request.block_hashes[0] == first[0]
    full: list[int] = []
    extend_block_hashes(full, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert request.block_hashes == full
