"""The audit's copy of a pool (`radixkv.server.process.audit_image`) taken over many lock holds while the pool changes
between them: it always recounts clean (no false alarm), and still catches a count corrupted mid-copy.

Each test interleaves one copy slice of (almost) zero budget, so one node per slice, with one random
operation on the pool, as RPCs would run between the audit's slices: opens that share prefixes, appends
across block boundaries, commits, forks, releases with and without caching, pins, and evictions from a pool
small enough that allocations evict.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from radixkv.errors import RadixKVError
from radixkv.server.process.audit import PoolAuditor
from radixkv.server.process.audit_image import PoolImage
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.rules.config import PoolConfig
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.sessions import Session
from radixkv.server.rules.tenants import Tenant

BLOCK_SIZE = 4


@pytest.fixture
def pool():  # type: ignore[no-untyped-def]
    pool = build_pool(
        PoolConfig(name="p", num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, num_blocks=96), 16
    )
    yield pool
    pool.close()


class _Load:
    """Random operations through the core and the ledger, as the servicer makes them (under the pool's lock)."""

    def __init__(self, pool: Pool, seed: int) -> None:
        self.pool, self.rng = pool, random.Random(seed)
        self.session = Session(
            session_id="s",
            tenant=Tenant(name="t", namespaces=frozenset({"a", "b"}), max_blocks=None, map_pools=False),
            ttl=60.0,
            deadline=float("inf"),
        )
        self.live: list[int] = []
        self.pins: list[tuple[list[int], str]] = []

    def _prompt(self) -> tuple[list[int], str]:
        rng = self.rng
        stem = [rng.randrange(3)] * BLOCK_SIZE * rng.randrange(1, 4)  # few stems: prefixes are shared and split
        return stem + [rng.randrange(100) for _ in range(rng.randrange(1, 3 * BLOCK_SIZE))], rng.choice("ab")

    def step(self) -> None:
        cache, ledger, rng = self.pool.cache, self.pool.ledger, self.rng
        op = rng.choice(["open", "open", "append", "commit", "fork", "release", "release", "pin", "unpin", "evict"])
        try:
            if op == "open" or not self.live and op in ("append", "commit", "fork", "release"):
                opened = cache.open(*self._prompt())
                ledger.adopt(self.session, cache, opened.seq_id)
                self.live.append(opened.seq_id)
            elif op == "append":
                seq_id = rng.choice(self.live)
                tokens = [rng.randrange(100) for _ in range(rng.randrange(1, 2 * BLOCK_SIZE))]
                ledger.follow_append(self.session, cache.append_batch([seq_id], [len(tokens)], tokens))
            elif op == "commit":
                seq_id = rng.choice(self.live)
                cache.commit([seq_id], [cache.num_tokens(seq_id)])
            elif op == "fork":
                seq_id = rng.choice(self.live)
                for child in cache.fork(seq_id, rng.randrange(1, 3)):
                    ledger.adopt(self.session, cache, child)
                    self.live.append(child)
            elif op == "release":
                seq_id = self.live.pop(rng.randrange(len(self.live)))
                cache.release(seq_id, cache=rng.random() < 0.8)
                ledger.forget(seq_id)
            elif op == "pin":
                prompt = self._prompt()
                cache.pin(*prompt)
                self.pins.append(prompt)
            elif op == "unpin" and self.pins:
                cache.unpin(*self.pins.pop(rng.randrange(len(self.pins))))
            elif op == "evict":
                cache.evict(rng.randrange(1, 8))
        except RadixKVError:
            pass  # out of blocks, nothing to pin: refused, and nothing changed


def _copy_under_load(pool: Pool, load: _Load, num_ops_between: int = 1, num_ops: int = 60) -> PoolImage:
    """Copy one node per slice with `num_ops_between` operations after each slice, `num_ops` in all (then the copy
    catches up: with writes after every one-node slice forever, it never would)."""
    image = PoolImage(pool)
    while not image.step(0.0):
        for _ in range(min(num_ops_between, num_ops)):
            load.step()
        num_ops = max(0, num_ops - num_ops_between)
    return image


@pytest.mark.parametrize("seed", range(8))
def test_a_copy_taken_while_the_pool_changes_between_slices_recounts_clean(pool: Pool, seed: int) -> None:
    load = _Load(pool, seed)
    num_holds = []
    for _ in range(25):
        for _ in range(10):
            load.step()
        pool.cache.check_invariants()
        image = _copy_under_load(pool, load, num_ops_between=1 + seed % 3)
        assert pool.cache.tree.touched is None  # a finished copy stops collecting writes
        image.check()  # the pool changed under the copy, and still: no false alarm
        num_holds.append(image.num_holds)
    assert max(num_holds) > 5  # the copies really spanned many holds, with writes between them
    assert pool.cache.stats().num_blocks_cached > 0


def test_a_ref_count_corrupted_while_the_copy_runs_is_caught(pool: Pool) -> None:
    load = _Load(pool, 1)
    while len(list(pool.cache.tree.nodes())) < 3 or not load.live:
        load.step()
    image = PoolImage(pool)
    assert not image.step(0.0)
    held = pool.cache.block_table(load.live[0])[0] if load.live else pool.cache.tree.tree_block_ids()[0]
    pool.cache.pool.ref_counts[held] += 1  # as the Debug service's CorruptRefCount does
    while not image.step(0.0):
        pass
    with pytest.raises(AssertionError, match=f"block {held}: ref_count"):
        image.check()


def test_a_digest_drift_and_a_ledger_drift_are_caught_in_the_copy(pool: Pool) -> None:
    load = _Load(pool, 2)
    for _ in range(60):
        load.step()
    namespace = next(iter(pool.events.digests))
    pool.events.digests[namespace] ^= 1
    image = _copy_under_load(pool, _Load(pool, 3))
    with pytest.raises(AssertionError, match=f"namespace {namespace!r}: event hub digest"):
        image.check()
    pool.events.digests[namespace] ^= 1
    pool.ledger.forget(load.live[0])  # a sequence the core holds, forgotten by the ledger alone
    image = _copy_under_load(pool, load)
    with pytest.raises(AssertionError, match="ledger: owned sequences"):
        image.check()


def test_an_abandoned_copy_stops_collecting_writes_and_the_auditor_counts_its_runs(pool: Pool) -> None:
    load = _Load(pool, 4)
    while len(list(pool.cache.tree.nodes())) < 3:
        load.step()
    image = PoolImage(pool)
    image.step(0.0)
    assert pool.cache.tree.touched is not None
    image.abort()
    assert pool.cache.tree.touched is None
    registry = CollectorRegistry()
    auditor = PoolAuditor({"p": pool}, interval=1.0, registry=registry, slice_seconds=1e-9)  # one node per hold
    assert auditor.audit(pool) is True
    assert registry.get_sample_value("radixkv_audit_runs_total", {"pool": "p"}) == 1
    assert registry.get_sample_value("radixkv_audit_slice_seconds_count", {"pool": "p"}) > 1  # several holds
    assert not pool.lock.locked() and pool.cache.tree.touched is None
