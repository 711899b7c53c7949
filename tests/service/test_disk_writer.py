"""The disk tier's writer and reader inside one server process's pool: the bytes a worker wrote reach the disk (also
when the device drops them before the writer comes), a failed write is kept and written by a later flush, and a
disk hit comes back into host-tier blocks bit for bit."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixkv.disk.block_io import DirectIO
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.rules.config import PoolConfig
from radixkv.server.rules.disk_tier import PoolDisk
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.tenants import Shares
from radixkv.tree.radix_tree import to_token_bytes

BS = 4
PROMPT = list(range(1, 15))  # 3 full blocks and 2 tokens


class FailingIO(DirectIO):
    failing = False

    def write_file(self, path: Path, parts: list[memoryview], durable: bool) -> None:
        if self.failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().write_file(path, parts, durable)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    config = PoolConfig(
        name="p",
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_size=BS,
        num_blocks=8,
        dtype="float32",
        host_num_blocks=8,
    )
    built = build_pool(config, 16)
    yield built
    built.close()


def disk_of(pool: Pool, path: Path) -> PoolDisk:
    """A started disk tier without its thread: the test flushes."""
    disk = PoolDisk(pool, directory=path, capacity_bytes=64 << 20, prefill_tokens_per_s=None, shares=Shares(0))
    disk.store.io = FailingIO()
    disk.store.open()
    pool.disk, pool.events.disk = disk, disk
    return disk


def cache_prompt(pool: Pool, seed: int) -> torch.Tensor:
    """Open, write K/V as a worker would, commit and release cached; returns the prompt's full blocks' K/V."""
    with pool.lock:
        opened = pool.cache.open(PROMPT)
        table = torch.tensor(opened.block_table[:3].tolist())
        kv = torch.randn(2, 2, 3, BS, 2, 8, generator=torch.Generator().manual_seed(seed))
        pool.storage.data[:, :, table] = kv
        pool.cache.commit([opened.seq_id], [len(PROMPT)])
        pool.cache.release(opened.seq_id)
    return kv


def test_a_failed_write_is_kept_and_a_block_dropped_before_the_writer_is_written(pool: Pool, tmp_path: Path) -> None:
    disk = disk_of(pool, tmp_path / "d")
    written = cache_prompt(pool, seed=1)
    assert disk.num_pending == 3
    with pool.lock:
        assert pool.cache.evict(3) == 3  # the device drops them before the writer came: copied now
        assert pool.cache.host.enabled
        pool.cache.host.take_offloads()
        pool.cache.host.evict(3)  # and the host tier too: the disk is the only copy left
    assert isinstance(disk.store.io, FailingIO)
    disk.store.io.failing = True
    assert disk.flush() == 0 and disk.store.num_write_errors == 1 and disk.num_pending == 3, "kept for a retry"
    disk.store.io.failing = False
    assert disk.flush() == 3 and disk.num_pending == 0
    assert disk.promote(to_token_bytes(PROMPT), "default") == 12  # takes the pool's lock itself
    with pool.lock:
        opened = pool.cache.open(PROMPT)
    assert opened.num_host_hit_tokens == 12
    host = pool.host_storage
    assert host is not None
    loaded = host.data[:, :, torch.tensor(opened.loads[:, 0].tolist())]
    assert torch.equal(loaded, written), "the disk's bytes land in the host blocks the open loads from"
    pool.cache.check_invariants()
    disk.store.close()


def test_a_writers_digest_waits_one_flush_reaches_the_disk_and_comes_back_with_a_disk_hit(
    pool: Pool, tmp_path: Path
) -> None:
    disk = disk_of(pool, tmp_path / "d")
    cache_prompt(pool, seed=2)
    assert disk.flush() == 0 and disk.num_pending == 3, "no digest recorded yet: the blocks wait one flush for it"
    with pool.lock:
        table = pool.cache.open(PROMPT).block_table[:3].tolist()
        digests = [bytes([i + 1]) * 32 for i in range(3)]
        pool.events.checksums.record(table[:2], digests[:2])  # the third block's writer never records one
    assert disk.flush() == 3, "two digests recorded, and the third block waited its flush"
    disk.store.close()

    restarted = build_pool(PoolConfig(name="p", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, num_blocks=8,
                                      dtype="float32", host_num_blocks=8), 16)  # fmt: skip
    try:
        again = disk_of(restarted, tmp_path / "d")  # the index and the digests rebuilt from the directory alone
        assert again.promote(to_token_bytes(PROMPT), "default") == 12
        with restarted.lock:
            opened = restarted.cache.open(PROMPT)
            got = restarted.events.checksums.get(opened.block_table[:3].tolist())
        assert opened.num_host_hit_tokens == 12 and got == [*digests[:2], b""], "each block's writer's digest, or none"
        again.store.close()
    finally:
        restarted.close()


class GatedIO(DirectIO):
    """Reads wait for `go`, once they said they are `inside`."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.go = threading.Event(), threading.Event()

    def read_into(self, path: Path, offset: int, dest: Any) -> int:
        self.inside.set()
        assert self.go.wait(300)
        return super().read_into(path, offset, dest)


def test_a_disk_read_holds_no_pool_lock_and_a_match_that_moved_meanwhile_wins(pool: Pool, tmp_path: Path) -> None:
    disk = disk_of(pool, tmp_path / "d")
    cache_prompt(pool, seed=3)
    assert disk.flush(everything=True) == 3
    with pool.lock:
        assert pool.cache.evict(3) == 3
        assert pool.cache.host.enabled
        pool.cache.host.take_offloads()
        pool.cache.host.evict(3)
        assert pool.cache.match_tiers(PROMPT) == (0, 0)
    gated = disk.store.io = GatedIO()
    promoted: list[int] = []
    reader = threading.Thread(target=lambda: promoted.append(disk.promote(to_token_bytes(PROMPT), "default")))
    reader.start()
    try:
        assert gated.inside.wait(300)
        assert pool.lock.acquire(blocking=False), "the disk is read without the pool's lock"
        pool.lock.release()
        cache_prompt(pool, seed=4)  # meanwhile the prompt is computed again: the device holds it
    finally:
        gated.go.set()
        reader.join()
    assert promoted == [0], "the match moved during the read: nothing installed"
    with pool.lock:
        assert pool.cache.match_tiers(PROMPT) == (12, 0)
        pool.cache.check_invariants()
    disk.store.close()
