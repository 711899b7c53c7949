"""Every KVCache RPC through `RadixKVClient` against a real server process, checked against the server's
own invariants."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from radixkv.client import KVEventKind, RadixKVClient
from radixkv.memory.layout import PoolLayout
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

BLOCK_SIZE = 4  # the test pools' block size (conftest.POOL_FLAGS)
_namespaces = itertools.count()


@pytest.fixture
def client(server) -> Iterator[RadixKVClient]:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as c:
        yield c


@pytest.fixture
def ns() -> str:
    """A namespace no other test uses, so shared pools do not couple tests through the cache."""
    return f"rpcs-{next(_namespaces)}"


def expected_slots(table: list[int], start: int, stop: int) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, stop)]


def test_open_append_fork_cache_release_track_the_block_table(client: RadixKVClient, debug, ns: str) -> None:  # type: ignore[no-untyped-def]
    opened = client.open(list(range(10)), ns)
    assert opened.num_cached_tokens == 0
    assert len(opened.block_table) == 3
    assert np.asarray(opened.slots).tolist() == expected_slots(opened.block_table, 0, 10)
    assert client.block_table(opened.seq_id) == opened.block_table.tolist()

    appended = client.append(opened.seq_id, [1, 2, 3])  # positions 10..12: fills block 2, opens block 3
    assert (appended.num_tokens, appended.table_offset, len(appended.block_ids), appended.copies) == (13, 3, 1, [])
    table = client.block_table(opened.seq_id)
    assert table == opened.block_table.tolist() + appended.block_ids
    assert np.asarray(appended.slots).tolist() == expected_slots(table, 10, 13)

    client.commit([opened.seq_id], [13])  # the worker wrote all 13 tokens' K/V: only written blocks are cached
    children = client.fork(opened.seq_id, 2)
    assert len(children) == 2 and all(client.block_table(c) == table for c in children)
    # The child writes into the partial last block it shares with its parent and sibling: copy-on-write.
    written = client.append(children[0], [7])
    assert written.table_offset == 3 and len(written.copies) == 1
    src, dst = written.copies[0]
    assert src == table[3] and written.block_ids == [dst]
    assert client.block_table(children[0]) == table[:3] + [dst]
    assert client.block_table(opened.seq_id) == table  # the parent keeps its block
    debug.check()

    assert client.cache(opened.seq_id) == 12
    prompt = list(range(10)) + [1, 2, 3]
    assert client.match(prompt[:12] + [999], ns) == 12
    assert client.match(prompt, "rpcs-elsewhere") == 0

    client.release_many([opened.seq_id, *children])
    with pytest.raises(Exception, match="unknown sequence"):
        client.block_table(opened.seq_id)
    again = client.open(prompt + [5], ns)
    assert again.num_cached_tokens == 12
    assert again.block_table[:3].tolist() == table[:3]
    client.release(again.seq_id, cache=False)
    debug.check()


def test_append_many_is_one_columnar_step(client: RadixKVClient, debug, ns: str) -> None:  # type: ignore[no-untyped-def]
    prompts = [[1000 * i + t for t in range(3 + i)] for i in range(6)]
    opened = client.open_many([(p, ns) for p in prompts])
    assert [o.num_cached_tokens for o in opened] == [0] * 6
    steps = [[1], [2, 3], [4, 5, 6, 7, 8], [9], [], [10, 11]]
    items = [(o.seq_id, s) for o, s in zip(opened, steps, strict=True) if s]
    results = client.append_many(items)
    assert [r.seq_id for r in results] == [seq_id for seq_id, _ in items]
    for result, (_, tokens), prompt in zip(
        results, items, [p for p, s in zip(prompts, steps, strict=True) if s], strict=True
    ):
        assert result.num_tokens == len(prompt) + len(tokens)
        table = client.block_table(result.seq_id)
        assert table[result.table_offset :] == result.block_ids
        assert np.asarray(result.slots).tolist() == expected_slots(table, len(prompt), result.num_tokens)
    # Token ids may also come as numpy arrays or packed int32 bytes.
    a = client.append(opened[0].seq_id, np.array([5, 6], dtype=np.int64))
    b = client.append(opened[1].seq_id, np.array([5, 6], dtype="<i4").tobytes())
    assert a.num_tokens == 3 + 1 + 2 and b.num_tokens == 4 + 2 + 2
    client.release_many([o.seq_id for o in opened], cache=False)
    debug.check()


def test_pin_keeps_a_prefix_until_unpin_or_session_end(server, client: RadixKVClient, debug, ns: str) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(50, 66))  # 4 full blocks
    seq_id = client.open(prompt, ns).seq_id
    client.commit([seq_id], [16])
    client.release(seq_id)
    assert client.pin(prompt, ns) == 16
    assert client.stats().num_blocks_pinned == 4
    client.unpin(prompt, ns)
    assert client.stats().num_blocks_pinned == 0
    with RadixKVClient(server.address) as other:
        assert other.pin(prompt, ns) > 0
        assert other.stats().num_blocks_pinned > 0
    assert client.stats().num_blocks_pinned == 0  # the pin went with the session
    debug.check()


def test_stats_and_get_pool_describe_the_pool(client: RadixKVClient) -> None:
    stats = client.stats()
    assert stats.num_blocks_total == 256
    assert stats.num_blocks_free + stats.num_blocks_evictable + stats.num_blocks_in_use == 256
    info = client.get_pool()
    assert info.name == "default" and info.device == "cpu"
    assert info.layout == PoolLayout(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=256, dtype="float32"
    )
    assert info.handle.WhichOneof("memory") == "shared_memory"
    assert info.handle.shared_memory.name.startswith("radixkv-")


def test_get_pool_fills_the_deprecated_json_handle_with_the_same_segment(server) -> None:  # type: ignore[no-untyped-def]
    """v0.1 clients read `handle_json`: it names the segment the typed `handle` names."""
    with grpc.insecure_channel(server.address) as channel:
        response = kvcache_pb2_grpc.KVCacheStub(channel).GetPool(pb.GetPoolRequest(pool="default"), timeout=patient(10))
    legacy = json.loads(response.handle_json)
    assert legacy["kind"] == "shm" and legacy["num_blocks"] == response.layout.num_blocks == 256
    assert legacy["name"] == response.handle.shared_memory.name != ""


def test_watch_events_reports_stored_and_evicted_blocks(server, debug) -> None:  # type: ignore[no-untyped-def]
    ns = f"events-{next(_namespaces)}"
    with RadixKVClient(server.address, pool="tiny") as client, client.watch_events([ns]) as stream:
        events = iter(stream)
        prompt = list(range(200, 216))  # 4 full blocks of the 8-block tiny pool
        opened = client.open(prompt, ns)
        client.commit([opened.seq_id], [16])
        client.release(opened.seq_id)
        stored = next(events)
        assert (stored.kind, stored.namespace, stored.sequence_number, stored.snapshot) == (
            KVEventKind.BLOCKS_STORED,
            ns,
            1,
            False,
        )
        assert stored.block_ids == opened.block_table.tolist()
        assert stored.token_ids == prompt and stored.parent_block_id is None
        # Opening 8 blocks elsewhere must evict all four.
        big = client.open(list(range(300, 332)), f"{ns}-other")
        removed = next(events)
        assert (removed.kind, removed.sequence_number) == (KVEventKind.BLOCKS_REMOVED, 2)
        assert sorted(removed.block_ids) == sorted(opened.block_table)
        client.release(big.seq_id, cache=False)
    debug.check("tiny")


def test_watch_events_snapshot_starts_where_the_numbers_are(server, client: RadixKVClient) -> None:  # type: ignore[no-untyped-def]
    ns = f"snap-{next(_namespaces)}"
    first = client.open(list(range(8)), ns)  # 2 full blocks
    client.commit([first.seq_id], [8])
    client.release(first.seq_id)
    second = client.open(list(range(8)) + [40, 41, 42, 43, 44], ns)  # hits both blocks, caches one more
    client.commit([second.seq_id], [13])
    client.release(second.seq_id)
    with client.watch_events([ns], include_snapshot=True) as stream:
        events = iter(stream)
        snapshot = [next(events) for _ in range(2)]
        assert all(e.snapshot and e.kind == KVEventKind.BLOCKS_STORED for e in snapshot)
        assert {e.sequence_number for e in snapshot} == {2}
        stored = {b for e in snapshot for b in e.block_ids}
        assert set(first.block_table) <= stored
        assert len(stored) == 3
        # Parents before children: the second run hangs off the first prompt's second block.
        assert snapshot[1].parent_block_id in snapshot[0].block_ids
        third = client.open(list(range(100, 104)) + [1], ns)
        client.commit([third.seq_id], [5])
        client.release(third.seq_id)
        live = next(events)
        assert (live.snapshot, live.sequence_number, live.token_ids) == (False, 3, [100, 101, 102, 103])
