"""How large a call's response can be, from its request's counts alone: bounded before anything applies.

A call whose response would exceed the message limit must be refused before it applies: gRPC would
drop the response after the server had applied the call, and the client would see
RESOURCE_EXHAUSTED for a change that happened (an open whose sequence id never arrived). So each
response's size is bounded from the request's counts (a varint's widest encoding for each slot and
block id of a unary response; 8 bytes a slot and 4 a block id where the Session stream packs them)
and checked up front (`checks.Checks.check_size`). A Session frame's steps answer in one message:
each step is bounded against what the steps before it left (`session_stream`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Protocol

from radixkv.memory.layout import PoolLayout
from radixkv.sequences.step import Step
from radixkv.tree.radix_tree import TOKEN_BYTES, TokenIds


class Pool(Protocol):
    """What a response's bound reads of a pool (`pools.Pool`): its layout, and whether it has a host tier."""

    @property
    def layout(self) -> PoolLayout: ...

    @property
    def host_storage(self) -> object | None: ...


DEFAULT_MAX_STEPS_PER_FRAME = (
    256  # a Session frame's steps: four times the clients' (client/session/pipeline.py MAX_FRAME_STEPS)
)
_PER_SEQUENCE_BYTES = 48  # a response's fixed fields per sequence (ids, counts, a copy), with their tags
_ENVELOPE_BYTES = 64
_STEP_ENVELOPE_BYTES = 128  # a step's request id and session id, and the tags of its result fields
_EXPLANATION_BYTES = 32 + 256  # an explained open's miss fields, and the other namespace it names
_ID_BYTES = 11  # a uint64 varint at its widest, with its tag
_TRANSFER_BYTES = 14  # one BlockTransfer at its widest: tag, length, two tagged uint32 varints
_PACKED_SLOT_BYTES, _PACKED_ID_BYTES = 8, 4  # the stream's int64 slots and uint32 columns


def num_tokens(token_ids: TokenIds) -> int:
    """How many tokens a request's token list holds, without converting it."""
    return len(token_ids) // TOKEN_BYTES if isinstance(token_ids, bytes) else len(token_ids)


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


@functools.cache
def _widths(num_blocks: int, block_size: int, packed: bool) -> tuple[int, int]:
    """(response bytes per token, per appended sequence) at most, for a pool of this shape: a token's slot plus one
    block id (a token starts at most one block); a sequence's fixed fields plus its table offset."""
    if packed:
        per_token = _PACKED_SLOT_BYTES + max(_PACKED_ID_BYTES, _varint_bytes(num_blocks))
    else:
        per_token = _varint_bytes(num_blocks * block_size) + _varint_bytes(num_blocks)
    return per_token, _PER_SEQUENCE_BYTES + _varint_bytes(num_blocks)


def _transfers_bytes(pool: Pool, num_blocks: int) -> int:
    """With a host tier, every block a response hands out may bring an offload and a load."""
    return 2 * _TRANSFER_BYTES * num_blocks if pool.host_storage is not None else 0


def open_response_bytes(pool: Pool, counts: Sequence[int], packed: bool = False) -> int:
    """The most the opens of prompts of these token counts can answer (an OpenSequences response, or a step's
    `opened`); a Resume's answer is one such open."""
    layout = pool.layout
    per_token, _ = _widths(layout.num_blocks, layout.block_size, packed)
    num_blocks = sum(-(-n // layout.block_size) for n in counts)
    return (
        _ENVELOPE_BYTES + sum(counts) * per_token + len(counts) * _PER_SEQUENCE_BYTES
        + _transfers_bytes(pool, num_blocks)
    )  # fmt: skip


def append_response_bytes(pool: Pool, num_sequences: int, num_tokens: int, packed: bool = False) -> int:
    """The most an append of this batch can answer (each sequence may add a block and a copy)."""
    layout = pool.layout
    per_token, per_sequence = _widths(layout.num_blocks, layout.block_size, packed)
    total = _ENVELOPE_BYTES + num_tokens * per_token + num_sequences * per_sequence
    if pool.host_storage is None:
        return total
    return total + _transfers_bytes(pool, num_tokens // layout.block_size + 2 * num_sequences)  # new blocks, copies


def preempt_response_bytes(pool: Pool, num_sequences: int, num_blocks: int) -> int:
    """The most a preemption of sequences holding `num_blocks` blocks can answer (an offload per block)."""
    return _ENVELOPE_BYTES + num_sequences * _ID_BYTES + _transfers_bytes(pool, num_blocks)


def step_sizes(pool: Pool, step: Step, max_children: int, packed: bool) -> Iterator[tuple[str, int, int]]:
    """Item by item: (the item, its tokens, the most the step's response takes up to and with that item, if the step
    applies). A fork that applies makes at most `max_children` children (more are refused by the sequence limits);
    forks, caches and releases answer ids and counts."""
    total = _STEP_ENVELOPE_BYTES
    if step.opens:
        counts = [num_tokens(t) for t, _ in step.opens]
        total += open_response_bytes(pool, counts, packed) + _EXPLANATION_BYTES * sum(map(bool, step.explain))
        yield "opens", sum(counts), total
    if step.append is not None:
        a = step.append
        count = num_tokens(a.token_ids)
        total += append_response_bytes(pool, len(a.seq_ids), count, packed)
        yield "append", count, total
    for i, (_, num_children) in enumerate(step.forks):
        total += _ID_BYTES * (1 + min(max(num_children, 0), max_children))
        yield f"forks[{i}]", 0, total
    if step.caches or step.releases:
        total += _ID_BYTES * (len(step.caches) + 1)  # each cache's count, and the count of released sequences
        yield ("caches[0]" if step.caches else "releases[0]"), 0, total


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
