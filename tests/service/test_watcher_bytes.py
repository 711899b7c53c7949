"""A WatchEvents queue is bounded in bytes as well as in events: a stored prompt's event carries its tokens, so a
watcher that stops reading must not keep 10,000 of them alive (issue 42, "every per-connection structure")."""

from __future__ import annotations

from radixkv.server.events.hub import EVENT_BYTES, BlockEvent, EventKind, Watcher, event_bytes


def _stored(n: int, num_blocks: int, block_size: int = 16) -> BlockEvent:
    tokens = bytes(4 * num_blocks * block_size)
    return BlockEvent(
        sequence_number=n,
        namespace="t/chat",
        kind=EventKind.BLOCKS_STORED,
        block_ids=tuple(range(num_blocks)),
        token_bytes=tokens,
        block_hashes=tuple(range(num_blocks)),
        digest_delta=1,
    )


def test_a_watcher_that_stops_reading_keeps_at_most_its_bytes_and_the_gap_shows() -> None:
    big = _stored(0, 4096)  # a 64k-token prompt: ~590 KiB
    watcher = Watcher(lambda ns: True, max_events=10_000, max_bytes=8 * event_bytes(big))
    for n in range(100):
        watcher.push(_stored(n, 4096))
    assert watcher.num_bytes == 8 * event_bytes(big)
    events, digest = watcher.take(0)
    assert [e.sequence_number for e in events] == list(range(8)), "the first ones kept, the rest dropped"
    assert watcher.digest == 100 and digest == 8, "the digest counts every event; the queue's, what it holds"
    assert watcher.num_bytes == 0
    watcher.push(_stored(100, 1))
    assert [e.sequence_number for e in watcher.take(0)[0]] == [100], "room again once read"


def test_small_events_are_bounded_by_count_as_before() -> None:
    watcher = Watcher(lambda ns: True, max_events=5)
    for n in range(9):
        watcher.push(_stored(n, 1))
    assert len(watcher.take(0)[0]) == 5
    assert event_bytes(_stored(0, 1)) == EVENT_BYTES + 64 + 2 * 40
