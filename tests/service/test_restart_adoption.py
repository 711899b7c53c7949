"""A pool's snapshot adopted in-process by a second pool over the same memory (as the keeper keeps it), or refused.

The real-process upgrade, with a keeper, is tests/reliability/test_upgrade.py; here the two "servers" are
two `Pool`s over one shared-memory segment, so each refusal can be produced exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from radixkv.errors import ServerRestarting
from radixkv.kv_cache import Limits
from radixkv.memory.storage import KVStorage
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.rules.config import PoolConfig, ServerConfig
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.restart import adopt_snapshot, restore_sessions, snapshot_path, write_snapshot
from radixkv.server.rules.service import KVService
from radixkv.server.rules.tenants import ANONYMOUS
from radixkv.server.wire.reads import KVReads

CONFIG = PoolConfig(name="default", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, num_blocks=64)
SERVER = ServerConfig(pools=(CONFIG,))
PROMPTS = [list(range(100 + i, 120 + i)) for i in range(0, 40, 10)]


@dataclasses.dataclass(frozen=True)
class Memory:
    """The keeper's word on a pool's memory (`KeeperAttachment`'s fields that adoption reads)."""

    snapshot_dir: Path
    fresh: bool = False
    incarnation: str = "a" * 32
    generation: int = 1


def _pool(storage: KVStorage, name: str = "default") -> Pool:
    return Pool(name, storage, Limits(), watch_queue_size=100)


@pytest.fixture
def memory(tmp_path):
    storage = KVStorage.create(_layout(), "cpu")
    yield storage
    storage.close()
    storage.unlink()


def _layout():
    from radixkv.memory.layout import PoolLayout

    return PoolLayout(
        num_layers=CONFIG.num_layers,
        num_kv_heads=CONFIG.num_kv_heads,
        head_dim=CONFIG.head_dim,
        block_size=CONFIG.block_size,
        num_blocks=CONFIG.num_blocks,
    )


def _step(service: KVService, session_id: str, step: Step) -> StepResult:
    """A unary call, as the servicer makes it."""
    return service.step(ANONYMOUS, session_id, "default", step)


def _serve_some(pool: Pool) -> tuple[KVService, str, int]:
    """Cached prompts with written K/V, a live sequence mid-decode and a pin, through the service as RPCs do."""
    service = KVService(SERVER, {"default": pool})
    session = service.open_session(ANONYMOUS, 30.0)
    gen = torch.Generator().manual_seed(0)
    for prompt in PROMPTS:
        (opened,) = _step(service, session.session_id, Step(opens=[(prompt, "")])).opened
        for b in opened.block_table:  # the worker writes the prompt's K/V
            pool.storage.data[:, :, b] = torch.randn(pool.storage.data[:, :, b].shape, generator=gen).half()
        _step(service, session.session_id, Step(commit=Commit([opened.seq_id], [len(prompt)])))
        _step(service, session.session_id, Step(releases=[([opened.seq_id], True)]))
    (live,) = _step(service, session.session_id, Step(opens=[(PROMPTS[0] + [7, 7, 7], "")])).opened
    (parked,) = _step(service, session.session_id, Step(opens=[(PROMPTS[2] + [8, 8], "")])).opened
    service.preempt(ANONYMOUS, session.session_id, "default", [parked.seq_id], "recompute")
    service.pin(ANONYMOUS, session.session_id, "default", PROMPTS[1], "")
    return service, session.session_id, live.seq_id, parked.seq_id


def _state(pool: Pool) -> dict[str, object]:
    return {
        "hits": [pool.cache.match(p, "default") for p in PROMPTS],
        "digests": dict(pool.events.digests),
        "tables": {s: pool.cache.block_table(s) for s in pool.cache.sequence_ids()},
        "free": pool.cache.pool.free_block_ids(),
    }


def test_a_second_pool_over_the_kept_memory_adopts_the_index_sessions_and_sequences(tmp_path, memory) -> None:
    first = _pool(memory)
    service, session_id, seq_id, parked_id = _serve_some(first)
    before = _state(first)
    kv_before = memory.data.clone()
    written = write_snapshot(first, Memory(tmp_path), service.sessions.live())
    assert written.path == snapshot_path("default", Memory(tmp_path)) and written.num_cached_blocks == 20
    with pytest.raises(ServerRestarting):  # frozen: nothing changes after the snapshot
        _step(service, session_id, Step(opens=[([1, 2, 3, 4, 5], "")]))

    second = _pool(KVStorage.open(memory.export_handle()))
    adopted = adopt_snapshot(second, Memory(tmp_path, generation=2), Limits())
    assert adopted is not None and not written.path.exists(), "an adopted snapshot is consumed"
    service2 = KVService(SERVER, {"default": second})
    assert restore_sessions(second, adopted.extras, service2.sessions, {"": ANONYMOUS}) == 0
    assert _state(second) == before and torch.equal(second.storage.data, kv_before)
    KVReads(service2).check_invariants(second)
    # The session goes on with the same sequence id, and its pin is still its own.
    result = _step(service2, session_id, Step(append=Append([seq_id], [1], [9]))).appended
    assert result is not None
    assert result.num_tokens == [len(PROMPTS[0]) + 4]
    service2.unpin(ANONYMOUS, session_id, "default", PROMPTS[1], "")
    # A sequence preempted before the restart resumes under its id, its cached prefix hit again.
    resumed = service2.resume(ANONYMOUS, session_id, "default", parked_id)
    assert len(resumed.block_table) == len(PROMPTS[2] + [8, 8]) // 4 + 1
    KVReads(service2).check_invariants(second)


def _refusal(tmp_path, memory, adopter_memory: Memory, tamper=None, pool_name="default", layout=None) -> Pool:
    first = _pool(memory)
    service, *_ = _serve_some(first)
    written = write_snapshot(first, Memory(tmp_path), service.sessions.live())
    if tamper is not None:
        tamper(written.path, memory)
    if pool_name != "default":
        written.path.rename(snapshot_path(pool_name, Memory(tmp_path)))
    if layout is not None:
        storage = KVStorage.create(layout, "cpu")
    else:
        storage = KVStorage.open(memory.export_handle())
    second = _pool(storage, pool_name)
    try:
        assert adopt_snapshot(second, adopter_memory, Limits()) is None
        path = snapshot_path(pool_name, adopter_memory)
        assert not path.exists() and path.with_name(path.name + ".refused").exists()
        assert second.cache.tree.num_cached_blocks == 0 and second.events.digests == {}, "nothing adopted"
        second.cache.check_invariants()
        return second
    finally:
        if layout is not None:
            storage.close()
            storage.unlink()


def _flip_a_byte(path: Path, _memory: KVStorage) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _truncate(path: Path, _memory: KVStorage) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _overwrite_a_cached_block(_path: Path, memory: KVStorage) -> None:
    memory.data[1, 1, 0, 0, 0, 0] += 1  # block 0 holds the first prompt's first block


@pytest.mark.parametrize(
    ("tamper", "adopter", "why"),
    [
        (None, {"fresh": True, "generation": 1}, "MEMORY"),  # the keeper restarted: zeros, whatever the file says
        (None, {"generation": 3}, "MEMORY"),  # a server ran on this memory in between (and crashed)
        (None, {"incarnation": "b" * 32, "generation": 2}, "MEMORY"),  # another keeper's memory
        (_flip_a_byte, {"generation": 2}, "CORRUPTED"),
        (_truncate, {"generation": 2}, "TRUNCATED"),
        (_overwrite_a_cached_block, {"generation": 2}, "KV_CHECKSUM"),
    ],
)
def test_a_snapshot_that_does_not_describe_the_memory_is_refused_and_the_pool_starts_cold(
    tmp_path, memory, tamper, adopter, why
) -> None:
    pool = _refusal(tmp_path, memory, Memory(tmp_path, **adopter), tamper)
    assert pool.snapshot_refusals == {why: 1}


def test_a_snapshot_of_another_pool_or_layout_is_refused(tmp_path, memory) -> None:
    assert _refusal(tmp_path, memory, Memory(tmp_path, generation=2), pool_name="other").snapshot_refusals == {
        "OTHER_POOL": 1
    }


def test_a_snapshot_of_another_layout_is_refused(tmp_path, memory) -> None:
    wider = dataclasses.replace(_layout(), head_dim=16)
    assert _refusal(tmp_path, memory, Memory(tmp_path, generation=2), layout=wider).snapshot_refusals == {"LAYOUT": 1}


def test_an_adopted_snapshot_keeps_evicting_by_the_pool_policy(tmp_path, memory) -> None:
    first = Pool("default", memory, Limits(), watch_queue_size=100, eviction_policy="agent")
    service, *_ = _serve_some(first)
    before = _state(first)
    write_snapshot(first, Memory(tmp_path), service.sessions.live())
    second = Pool(
        "default", KVStorage.open(memory.export_handle()), Limits(), watch_queue_size=100, eviction_policy="agent"
    )
    assert adopt_snapshot(second, Memory(tmp_path, generation=2), Limits()) is not None
    assert second.cache.tree.policy.name == "agent" and _state(second)["hits"] == before["hits"]
    second.cache.check_invariants()
