"""The KV-event path's byte bounds in-process: split and coalesce keep what a consumer learns, the ring and a
WatchEvents queue stay within their bytes (issue 42; the real-server attacks are tests/reliability/
test_kv_events_bounds.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.server.events.hub import BlockEvent, EventKind, Watcher, event_bytes
from radixkv.server.events.kv_events_wire import (
    BATCH_OVERHEAD,
    ENCODER,
    BlockRemoved,
    BlockStored,
    Event,
    batch_payload,
    coalesce,
    min_batch_bytes,
    split,
)
from radixkv.server.events.kv_replay import ReplayBuffer
from tests.examples import examples

BLOCK_SIZE = 4


def _stored(hashes: list[int], parent: int | None, salt: str | None = None) -> BlockStored:
    tokens = [h % 2**31 for h in hashes for _ in range(BLOCK_SIZE)]
    extra = [(salt,)] + [None] * (len(hashes) - 1) if salt is not None and parent is None else None
    return BlockStored(hashes, parent, tokens, BLOCK_SIZE, None, "GPU", None, extra)


def _apply(events: list[Event]) -> dict[int, tuple[int | None, list[int]]]:
    """A consumer's index: hash -> (parent, tokens), each parent known when its child is stored."""
    index: dict[int, tuple[int | None, list[int]]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                assert parent is None or parent in index, "a parent is announced before its children"
                index[h] = (parent, event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                index.pop(h, None)
    return index


@settings(max_examples=examples(200), deadline=None)
@given(
    num_blocks=st.integers(1, 300),
    max_bytes=st.integers(min_batch_bytes(BLOCK_SIZE) + 16, 8192),  # + the salt's 16 bytes below
    salted=st.booleans(),
)
def test_a_split_event_announces_the_same_chain_in_batches_within_the_bound(
    num_blocks: int, max_bytes: int, salted: bool
) -> None:
    event = _stored([2**63 + i for i in range(num_blocks)], None, "acme%2Fchat" if salted else None)
    pieces = split(event, max_bytes - BATCH_OVERHEAD)
    assert pieces, "any block, and its salt, fits the bound"
    for piece in pieces:
        assert len(batch_payload(1.0, [piece], 2**31 - 1)) <= max_bytes
    assert _apply(pieces) == _apply([event])
    removed = BlockRemoved([2**63 + i for i in range(num_blocks)], "GPU")
    removed_pieces = split(removed, max_bytes - BATCH_OVERHEAD)
    assert [h for p in removed_pieces for h in p.block_hashes] == removed.block_hashes  # type: ignore[attr-defined]
    assert all(len(batch_payload(1.0, [p], 0)) <= max_bytes for p in removed_pieces)


def test_a_block_no_batch_can_hold_is_refused_not_sent() -> None:
    event = _stored([1], None, "x" * 10_000)
    assert split(event, 4096) == []


@settings(max_examples=examples(300), deadline=None)
@given(st.data())
def test_coalescing_a_unit_changes_nothing_a_consumer_ends_up_knowing(data: st.DataObject) -> None:
    """A random unit of tree-like events (runs stored under cached blocks, chains removed from a leaf up): the
    coalesced unit leaves a consumer with the same index, and never more blocks on the wire."""
    start: list[Event] = [_stored([1, 2], None)]
    parent_of: dict[int, int | None] = {1: None, 2: 1}  # what is cached, and under what (None: a root)
    events: list[Event] = []
    next_hash = 100
    for _ in range(data.draw(st.integers(1, 12))):
        leaves = sorted(h for h in parent_of if h not in set(parent_of.values()))
        if data.draw(st.booleans()) and leaves:
            gone = [data.draw(st.sampled_from(leaves))]
            while data.draw(st.booleans()):  # up the chain while the next one up is a leaf once these go
                up = parent_of[gone[-1]]
                if up is None or any(p == up and h not in gone for h, p in parent_of.items()):
                    break
                gone.append(up)
            for h in gone:
                del parent_of[h]
            events.append(BlockRemoved(list(reversed(gone)), "GPU"))
        else:
            parent = data.draw(st.sampled_from(sorted(parent_of))) if parent_of else None
            hashes = list(range(next_hash, next_hash + data.draw(st.integers(1, 5))))
            next_hash += len(hashes)
            for p, h in zip([parent, *hashes], hashes, strict=False):
                parent_of[h] = p
            events.append(_stored(hashes, parent))
    kept = coalesce(events)
    assert _apply(start + kept) == _apply(start + events)
    # type: ignore[attr-defined]
    assert sum(len(e.block_hashes) for e in kept) <= sum(len(e.block_hashes) for e in events)


def test_stored_then_removed_in_one_unit_publishes_nothing() -> None:
    stored, removed = _stored([10, 11, 12], 2), BlockRemoved([11, 12], "GPU")
    assert coalesce([stored, removed]) == [_stored([10], 2)]
    assert coalesce([stored, BlockRemoved([12, 11, 10], "GPU")]) == []
    middle = BlockRemoved([11], "GPU")  # not a tail: left as it is
    assert coalesce([stored, middle]) == [stored, middle]


def test_the_ring_keeps_its_bytes_and_drops_the_oldest() -> None:
    ring = ReplayBuffer(1000, max_bytes=100)
    for seq in range(50):
        ring.append(seq, bytes(30))
        ring.check_invariants()
        assert ring.num_bytes <= 100
    assert ring.window() == (47, 50) and ring.get(46) is None and ring.get(49) == bytes(30)


def test_a_watch_queue_drops_past_its_bytes() -> None:
    watcher = Watcher(lambda namespace: True, max_events=10_000, max_bytes=64 << 10)
    event = BlockEvent(
        sequence_number=1,
        namespace="default",
        kind=EventKind.BLOCKS_STORED,
        block_ids=tuple(range(256)),
        token_bytes=bytes(4 * 4 * 256),
    )
    for _ in range(100):
        watcher.push(event)
    fits = (64 << 10) // event_bytes(event)  # 4 of 100: the rest dropped (a gap the stream's numbers show)
    assert watcher.num_bytes == fits * event_bytes(event) <= 64 << 10
    events, _ = watcher.take(0)
    assert len(events) == fits and watcher.num_bytes == 0


def test_encoder_sizes_are_upper_bounds() -> None:
    event = _stored([2**64 - 1] * 3, 2**64 - 1)
    assert len(ENCODER.encode(event)) <= len(batch_payload(0.0, [event], 0))
