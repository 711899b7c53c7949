"""Request sizes, checked before anything is converted or locked, so that every response fits its message.

A call whose response would exceed `max_message_bytes` must be refused before it applies: gRPC
would drop the response after the server had applied the call, and the client would see
RESOURCE_EXHAUSTED for a change that happened (an open whose sequence id never arrived). So the
response's size is bounded from the request's counts alone (a varint's widest encoding for each
slot and block id) and refused up front, naming `max_message_bytes`. The token limit is checked
the same way, from the count, before a token list is converted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixkv.errors import LimitExceeded

if TYPE_CHECKING:
    from radixkv.server.pools import Pool

_PER_SEQUENCE_BYTES = 48  # a response's fixed fields per sequence (ids, counts, a copy), with their tags
_ENVELOPE_BYTES = 64
_TRANSFER_BYTES = 14  # one BlockTransfer at its widest: tag, length, two tagged uint32 varints


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _token_bytes(pool: Pool) -> int:
    """Response bytes per token at most: its slot, plus one block id (a token starts at most one block)."""
    layout = pool.layout
    return _varint_bytes(layout.num_blocks * layout.block_size) + _varint_bytes(layout.num_blocks)


def _transfers_bytes(pool: Pool, num_blocks: int) -> int:
    """With a host tier, every block a response hands out may bring an offload and a load."""
    return 2 * _TRANSFER_BYTES * num_blocks if pool.host_storage is not None else 0


def open_response_bytes(pool: Pool, counts: Sequence[int]) -> int:
    """The most an OpenSequences response for prompts of these token counts can take."""
    num_blocks = sum(-(-n // pool.layout.block_size) for n in counts)
    return (
        _ENVELOPE_BYTES + sum(counts) * _token_bytes(pool) + len(counts) * _PER_SEQUENCE_BYTES
        + _transfers_bytes(pool, num_blocks)
    )  # fmt: skip


def append_response_bytes(pool: Pool, num_sequences: int, num_tokens: int) -> int:
    """The most an AppendTokens response for this batch can take (each sequence may add a block and a copy)."""
    per_sequence = _PER_SEQUENCE_BYTES + _varint_bytes(pool.layout.num_blocks)
    num_blocks = num_tokens // pool.layout.block_size + 2 * num_sequences  # new blocks and copies
    return (
        _ENVELOPE_BYTES + num_tokens * _token_bytes(pool) + num_sequences * per_sequence
        + _transfers_bytes(pool, num_blocks)
    )  # fmt: skip


def check_request_size(
    pool: Pool, num_tokens: int, response_bytes: int = 0, max_message_bytes: int | None = None
) -> None:
    """Raises LimitExceeded naming `max_tokens_per_request` or `max_message_bytes` (None or 0: no limit)."""
    allowed = pool.cache.limits.max_tokens_per_request
    if num_tokens > allowed:
        raise LimitExceeded("max_tokens_per_request", num_tokens, allowed)
    if max_message_bytes and response_bytes > max_message_bytes:
        raise LimitExceeded("max_message_bytes", response_bytes, max_message_bytes)


def message_bytes_needed(max_tokens_per_request: int, max_sequences_per_session: int, host_tier: bool = False) -> int:
    """A default `max_message_bytes`: room for the largest request and response these limits allow, with any layout
    (and, with a host tier, an offload and a load for every block, at one token per block)."""
    per_token = 10 + 5  # an int64 slot and a uint32 block id, each at its widest
    per_block = 2 * _TRANSFER_BYTES if host_tier else 0
    return (
        _ENVELOPE_BYTES
        + max_tokens_per_request * (per_token + per_block)
        + max_sequences_per_session * (_PER_SEQUENCE_BYTES + 5 + 2 * per_block)
        + (1 << 16)
    )
