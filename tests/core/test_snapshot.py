"""Snapshots of the core: a restored cache is the cache that was dumped, and a bad snapshot is refused whole."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import hypothesis.strategies as st
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, rule

from radixkv import KVCache, PoolLayout
from radixkv.errors import SnapshotRefused
from radixkv.kv_cache import Limits
from radixkv.state.cache_state import capture
from radixkv.state.snapshot import MAGIC, PoolIdentity, dump, load, read_header, write_atomically
from tests.core.test_state_machine import BASES, BLOCK_SIZE, NAMESPACES, NUM_BLOCKS, CacheMachine
from tests.examples import examples

LIMITS = Limits(max_pinned_fraction=0.25)


def identity(num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE, memory_id: str = "mem-1") -> PoolIdentity:
    return PoolIdentity(
        pool="default",
        layout=PoolLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=block_size, num_blocks=num_blocks),
        memory_id=memory_id,
    )


def fingerprint(cache: KVCache) -> dict[str, object]:
    """Everything observable about a cache, by content (node ids differ across processes; their order must not)."""

    def path(node) -> tuple[str, bytes]:
        runs = []
        while node.parent is not None:
            runs.append(bytes(node.token_bytes))
            node = node.parent
        return node.namespace, b"".join(reversed(runs))

    tree = cache.tree
    return {
        "nodes": sorted(
            (path(n), list(map(int, n.block_ids)), n.lock_ref, n.pin_ref, n.last_access) for _, n in tree.nodes()
        ),
        "roots": {name: root.lock_ref for name, root in tree.roots.items()},
        "lru": [path(n) for n in tree.evictable_leaves()],
        "ref_counts": cache.pool.ref_counts.tolist(),
        "free": cache.pool.free_block_ids(),
        "sequences": {
            s.seq_id: (cache.block_table(s.seq_id), s.num_tokens, s.num_computed_tokens, s.priority, s.reserve_until)
            for s in cache._sequences
        },
        "preempted": {p.seq_id: dataclasses.astuple(p) for p in cache._sequences.preempted.values()},
        "budget": cache.budget,
        "stats": dataclasses.asdict(cache.stats()),
        "next_seq_id": cache._sequences.next_seq_id,
        "pins": {k: [path(node) for node in nodes] for k, nodes in cache._pins._pins.items()},
        "clock": tree._clock,
        "families": sorted({tuple(sorted(s.family)) for s in cache._sequences if s.family}),
    }


class RestartingCacheMachine(CacheMachine):
    """The state machine of test_state_machine, plus pins held across steps and restarts through a snapshot:
    after each restart the model goes on against the restored cache, so any difference shows in later steps."""

    @initialize()
    def setup(self):
        super().setup()
        self.held_pins: list[tuple[list[int], str]] = []
        self.num_restarts = 0

    @rule(base=st.sampled_from(BASES), cut=st.integers(2, 10), namespace=st.sampled_from(NAMESPACES))
    def pin_and_hold(self, base, cut, namespace):
        try:
            self.cache.pin(base[:cut], namespace)
        except Exception as e:  # noqa: BLE001 - any refusal must be one of ours
            assert getattr(e, "reason", None) in ("FAILED_PRECONDITION", "LIMIT_EXCEEDED", "OUT_OF_BLOCKS"), repr(e)
            return
        self.held_pins.append((base[:cut], namespace))

    @rule()
    def restart(self):
        before = fingerprint(self.cache)
        data = dump(self.cache, identity(), {"note": "extras travel"})
        adopted = load(data, identity(), LIMITS)
        assert adopted.extras == {"note": "extras travel"}
        assert fingerprint(adopted.cache) == before
        adopted.cache.check_invariants()
        self.cache = adopted.cache
        self.num_restarts += 1

    def teardown(self):
        if hasattr(self, "cache"):
            for tokens, namespace in self.held_pins:
                self.cache.unpin(tokens, namespace)
        super().teardown()


RestartingCacheMachine.TestCase.settings = settings(
    max_examples=examples(120), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_restart_state_machine = RestartingCacheMachine.TestCase


def busy_cache() -> KVCache:
    """Cached prefixes in two namespaces, a live sequence locking one, a pin, some evictions."""
    cache = KVCache(NUM_BLOCKS, BLOCK_SIZE, LIMITS)
    for i, namespace in enumerate(["a", "b", "a"]):
        opened = cache.open([1, 2, 3, 4, 5, 6, 7 + i], namespace)
        cache.commit([opened.seq_id], [7])
        cache.release(opened.seq_id)
    cache.pin([1, 2, 3, 4], "a")
    live = cache.open([1, 2, 3, 4, 5, 6, 9, 9, 9], "a")
    cache.append(live.seq_id, [10, 11])
    cache.evict(1)
    return cache


def test_a_restored_cache_hits_and_allocates_exactly_as_the_original() -> None:
    original = busy_cache()
    restored = load(dump(original, identity()), identity(), LIMITS).cache
    for cache in (original, restored):
        cache.open([1, 2, 3, 4, 5, 6, 7, 8], "a")
        cache.open([50, 51, 52, 53, 54], "b")  # takes blocks off the free stack, then evicts LRU
    assert fingerprint(restored) == fingerprint(original)


def test_the_snapshot_names_its_pool_memory_and_contract() -> None:
    header = read_header(dump(busy_cache(), identity(memory_id="m-7")))
    assert header["pool"] == "default" and header["memory_id"] == "m-7"
    assert header["layout"]["num_blocks"] == NUM_BLOCKS and header["hash_contract"]["block_size"] == BLOCK_SIZE
    assert header["num_cached_blocks"] > 0


def _refused(data: bytes, expected: PoolIdentity | None = None) -> str:
    with pytest.raises(SnapshotRefused) as e:
        load(data, expected or identity(), LIMITS)
    assert e.value.reason == "SNAPSHOT_REFUSED" and e.value.metadata["why"] == e.value.why
    return e.value.why


@pytest.mark.parametrize("keep", [0, 10, 24, 100, -33, -1])
def test_a_truncated_snapshot_is_refused(keep: int) -> None:
    data = dump(busy_cache(), identity())
    assert _refused(data[:keep]) == "TRUNCATED"


def test_every_flipped_byte_is_refused() -> None:
    data = dump(busy_cache(), identity())
    seen = set()
    for i in range(0, len(data), 7):
        broken = bytearray(data)
        broken[i] ^= 0x40
        seen.add(_refused(bytes(broken)))
    assert seen <= {"NOT_A_SNAPSHOT", "VERSION", "TRUNCATED", "CORRUPTED"}
    assert "CORRUPTED" in seen


def test_another_format_version_and_a_foreign_file_are_refused() -> None:
    data = dump(busy_cache(), identity())
    assert _refused(data[:8] + struct.pack("<I", 99) + data[12:]) == "VERSION"
    assert _refused(b"PK\x03\x04" + data[4:]) == "NOT_A_SNAPSHOT"
    assert data.startswith(MAGIC)


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (PoolIdentity(pool="other-pool", layout=identity().layout, memory_id="mem-1"), "OTHER_POOL"),
        (
            PoolIdentity(
                pool="default",
                layout=PoolLayout(
                    num_layers=2, num_kv_heads=1, head_dim=8, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS
                ),
                memory_id="mem-1",
            ),
            "LAYOUT",
        ),
        (
            PoolIdentity(
                pool="default",
                layout=PoolLayout(
                    num_layers=2,
                    num_kv_heads=1,
                    head_dim=4,
                    block_size=BLOCK_SIZE,
                    num_blocks=NUM_BLOCKS,
                    dtype="bfloat16",
                ),
                memory_id="mem-1",
            ),
            "LAYOUT",
        ),
        (identity(memory_id="mem-2"), "MEMORY"),
    ],
)
def test_a_snapshot_of_another_pool_layout_or_memory_is_refused(other: PoolIdentity, why: str) -> None:
    assert _refused(dump(busy_cache(), identity()), other) == why


def _resealed(data: bytes, change) -> bytes:
    """`data` with its body changed by `change` and a valid checksum again: a bug, not a bit flip."""
    import hashlib

    magic, version, header_len, body_len = struct.unpack_from("<8sIIQ", data)
    start = 24
    header = data[start : start + header_len]
    body = msgpack.unpackb(data[start + header_len : -32], raw=False, strict_map_key=False)
    change(body["cache"])
    body_bytes = msgpack.packb(body, use_bin_type=True)
    framed = struct.pack("<8sIIQ", magic, version, header_len, len(body_bytes)) + header + body_bytes
    return framed + hashlib.sha256(framed).digest()


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(ref_counts=b"\x00" * len(s["ref_counts"])),  # holders without counts
        lambda s: s.update(free=s["free"][:-4]),  # a block lost from the free stack
        lambda s: s["nodes"].update(parent=b"\x05\x00\x00\x00" * (len(s["nodes"]["parent"]) // 4)),  # bad links
        lambda s: s["nodes"].update(blocks=s["nodes"]["blocks"][:-4]),  # blocks and tokens disagree
        lambda s: s["sequences"][0].__setitem__(4, 10_000),  # a sequence locking a node that is not there
        lambda s: s["nodes"].update(lock_ref=b"\x00" * len(s["nodes"]["lock_ref"])),  # locks forgotten
        lambda s: s.pop("free"),
        lambda s: s.update(families=[[10_000, 10_001]]),  # a family of sequences that are not there
    ],
)
def test_a_sealed_but_inconsistent_snapshot_is_refused(change) -> None:
    assert _refused(_resealed(dump(busy_cache(), identity()), change)) == "INCONSISTENT"


def test_write_atomically_leaves_the_whole_file_and_no_temporary(tmp_path) -> None:
    target = tmp_path / "default.snapshot"
    target.write_bytes(b"old")
    write_atomically(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["default.snapshot"]


def forked_on_a_split_path() -> KVCache:
    """Two sequences (a fork) locking a deep node, and a third locking the node above it."""
    cache = KVCache(NUM_BLOCKS, 4, LIMITS)
    deep = cache.open(list(range(16)) + [99])
    cache.commit([deep.seq_id], [17])
    cache.cache(deep.seq_id)
    cache.fork(deep.seq_id)
    cache.open(list(range(8)) + [50])
    return cache


def test_stored_locks_count_the_holders_through_each_node_and_families_come_back() -> None:
    """The snapshot keeps the form earlier releases wrote and read (holders whose path runs through a node), not
    the tree's own (holders plus locked children), so snapshots cross an upgrade either way."""
    cache = forked_on_a_split_path()
    state = capture(cache)
    nodes = [node for _, node in cache.tree.nodes()]  # parents first
    stored = dict(zip([n.node_id for n in nodes], np.frombuffer(state["nodes"]["lock_ref"], "<i4"), strict=True))
    upper = nodes[0]
    assert upper.lock_ref == 2 and stored[upper.node_id] == 3, "the upper node: one holder and one locked child"
    deep, twin, _ = cache._sequences.ids()
    assert state["families"] == [[deep, twin]]
    restored = load(dump(cache, identity(block_size=4)), identity(block_size=4), LIMITS).cache
    assert fingerprint(restored) == fingerprint(cache)


def test_a_snapshot_from_before_families_restores_without_them() -> None:
    cache = forked_on_a_split_path()
    data = _resealed(dump(cache, identity(block_size=4)), lambda s: s.pop("families"))
    restored = load(data, identity(block_size=4), LIMITS).cache
    restored.check_invariants()
    assert all(seq.family is None for seq in restored._sequences)
    assert fingerprint(restored)["nodes"] == fingerprint(cache)["nodes"]


def test_a_snapshot_from_the_release_before_families_restores_and_goes_on() -> None:
    """Written by b049e0d (locks stored per holder through each node, no families): a fork family of three on a
    deep node, a sequence and a pin on the node above. An upgrade restores it as it was and carries on."""
    data = (Path(__file__).parent / "data" / "snapshot_before_families.bin").read_bytes()
    ident = PoolIdentity(
        pool="default",
        layout=PoolLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=64),
        memory_id="mem-1",
    )
    cache = load(data, ident, Limits()).cache
    cache.check_invariants()
    tables = {s.seq_id: cache.block_table(s.seq_id) for s in cache._sequences}
    assert tables == {1: [0, 1, 2, 3, 5], 2: [0, 1, 2, 3, 6], 3: [0, 1, 2, 3, 4], 4: [0, 1, 7]}
    deep, upper = cache._sequences.get(1).lock_node, cache._sequences.get(4).lock_node
    assert deep.parent is upper and (deep.lock_ref, upper.lock_ref) == (3, 3), "3 holders; 1 + a pin + locked child"
    for seq_id in tables:
        cache.append(seq_id, [1, 2, 3, 4, 5])
    cache.release_many(list(tables))
    cache.check_invariants()
    assert cache.match(list(range(16))) == 16
