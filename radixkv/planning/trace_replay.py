"""Replaying agent traces (the kv-cache-tester format) through the core, to compare eviction policies.

A trace directory holds one gzip'd JSON session per file: requests with a time `t`, prompt tokens `in` and
the prompt's 64-token blocks as `runs` of consecutive hash ids (local to the session). The replay keeps the
top-level requests (a subagent's summary record is not a request), gives each session its own id range (so
sessions never share a prefix), and starts sessions at seeded uniform times over a span chosen so that on
average `concurrency` sessions are in flight. Each hash id is one token of a `KVCache` with 8-token blocks:
one block is one 512-token unit, and a unit hits when its whole prefix is cached. A request opens its full
units plus one token (`open` recomputes the last token), commits them, and releases with `cache`. The hit
ratio is hit units over prompt units (the prompt's whole 512-token units).

MIN (Belady) is the same replay under a policy that knows each unit's next use; the infinite cache never evicts.
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import numpy.typing as npt

from radixkv.memory.block_pool import BlockPool
from radixkv.sequences.admission import Allocator
from radixkv.sequences.retain import expire, retain
from radixkv.stats import Stats
from radixkv.tree.eviction import EvictionPolicy, KeyedPolicy, Retention, make_policy
from radixkv.tree.host_tier import HostTier
from radixkv.tree.radix_tree import DEFAULT_NAMESPACE, Node, RadixTree, TokenKey

UNIT_IDS = 8  # hash ids (64 tokens each) per 512-token unit: the replay's block size
TOKENS_PER_UNIT = 512
NEVER = float("inf")


@dataclasses.dataclass(slots=True)
class Request:
    session: int  # index into the sorted trace files
    t: float  # seconds since the session's start
    token_ids: npt.NDArray[np.int32]  # the prompt's whole units, in global ids (session offset added)

    @property
    def num_units(self) -> int:
        return len(self.token_ids) // UNIT_IDS


def _ids(runs: list[list[int]]) -> npt.NDArray[np.int64]:
    if not runs:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(first, first + n, dtype=np.int64) for first, n in runs])


def load_sessions(directory: str | Path) -> list[list[Request]]:
    """Every session of `directory` (files `*.json.gz`, by name), its requests in time order."""
    files = sorted(Path(directory).glob("*.json.gz"))
    if not files:
        raise ValueError(f"no *.json.gz traces in {directory}")
    sessions: list[list[Request]] = []
    offset = 0
    for index, path in enumerate(files):
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        requests, top = [], 0
        for r in data["requests"]:
            if "runs" not in r or "in" not in r:
                continue  # a subagent's summary record
            ids = _ids(r["runs"])
            ids = ids[: len(ids) // UNIT_IDS * UNIT_IDS]
            top = max(top, int(ids.max()) + 1 if len(ids) else 0)
            requests.append((float(r["t"]), ids))
        requests.sort(key=lambda x: x[0])
        sessions.append([Request(index, t, (ids + offset).astype(np.int32)) for t, ids in requests])
        offset += top + 1
        if offset >= 1 << 31:
            raise ValueError(f"{directory}: too many hash ids to keep the sessions apart in int32 tokens")
    return sessions


def schedule(sessions: list[list[Request]], concurrency: float, seed: int = 7) -> list[tuple[float, Request]]:
    """All requests in global time order: session i starts at a seeded uniform time in [0, span), with span the
    sessions' total duration over `concurrency` (so that many are in flight on average)."""
    durations = np.array([s[-1].t if s else 0.0 for s in sessions])
    span = max(float(durations.sum()) / concurrency, 1e-9)
    starts = np.random.default_rng(seed).uniform(0.0, span, len(sessions))
    events = [(starts[i] + r.t, i, j, r) for i, s in enumerate(sessions) for j, r in enumerate(s)]
    events.sort(key=lambda e: e[:3])
    return [(t, r) for t, _, _, r in events]


class _Clock:
    """The replay's time: the current request's."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def next_uses(events: list[tuple[float, Request]]) -> dict[int, list[int]]:
    """For each unit (its last hash id: ids are prefix hashes, so it names the whole prefix), the indices of
    the requests that hold it, ascending."""
    uses: dict[int, list[int]] = {}
    for index, (_, request) in enumerate(events):
        for unit in request.token_ids[UNIT_IDS - 1 :: UNIT_IDS].tolist():
            uses.setdefault(unit, []).append(index)
    return uses


def _min_policy(uses: dict[int, list[int]], position: list[int], clock: _Clock) -> EvictionPolicy:
    """Belady's MIN as a key: the leaf whose last unit is next used farthest ahead goes first."""

    def key(node: Node) -> tuple[float, int]:
        unit = int.from_bytes(node.token_bytes[-4:], "little", signed=True)
        times = uses.get(unit, ())
        k = bisect.bisect_right(times, position[0])
        return (-(times[k] if k < len(times) else NEVER), node.node_id)

    return KeyedPolicy("min", key, clock)


def replay(
    events: list[tuple[float, Request]],
    capacity_tokens: int | None,
    policy: str,
    *,
    ttl_s: float = 0.0,
    uses: dict[int, list[int]] | None = None,
) -> float:
    """The prompt-unit hit ratio of `events` through the core's tree, pool and allocator with `capacity_tokens`
    (None: never evicts) under `policy` (a `make_policy` name or "min"). With `ttl_s`, each request's prefix gets
    a TTL refreshed on use, and expired prefixes go before each request (the hosted APIs' meaning).

    Each request makes the calls `KVCache.open`, `commit` and `release` make for one prompt, in their order (so
    the tree sees the same locks, ticks and evictions), without the sequence bookkeeping a replay never reads:
    match, split and lock the cached prefix, allocate the rest plus the recomputed last token (evicting the
    shortfall), insert the new units below the lock, move the lock down, unlock, free the last token's block.
    """
    clock, position = _Clock(), [0]
    if policy == "min":
        tree_policy = _min_policy(uses if uses is not None else next_uses(events), position, clock)
    else:
        tree_policy = make_policy(policy, UNIT_IDS, clock, tokens_per_id=TOKENS_PER_UNIT // UNIT_IDS)
    total_units = sum(r.num_units for _, r in events)
    num_blocks = (total_units if capacity_tokens is None else capacity_tokens // TOKENS_PER_UNIT) + 2
    tree = RadixTree(UNIT_IDS, policy=tree_policy)
    pool = BlockPool(num_blocks)
    stats = Stats(num_blocks_total=num_blocks)
    blocks = Allocator(pool, tree, stats, host=HostTier(0, tree, stats))  # a tier of none: evictions drop
    root = tree.root(DEFAULT_NAMESPACE)
    retention = Retention(ttl_s=ttl_s) if ttl_s else None
    unit_bytes = UNIT_IDS * 4
    hits = 0
    for index, (t, request) in enumerate(events):
        clock.now, position[0] = t, index
        if retention is not None:
            expire(blocks)
        data, num_units = request.token_ids.tobytes(), request.num_units
        if num_units + 1 > num_blocks:  # larger than the whole cache: served uncached, as a server refuses
            hits += tree.match(root, data).num_blocks
            continue
        match = tree.match(root, data, num_units)
        num_hit = match.num_blocks
        hits += num_hit
        node = tree.split(match)
        tree.lock(node)
        new_blocks = blocks.allocate(num_units + 1 - num_hit)  # one more: open recomputes the last token
        if num_hit < num_units:
            leaf, num_taken = tree.insert(node, data[num_hit * unit_bytes :], new_blocks[:-1])
            assert num_taken == num_units - num_hit, "the locked prefix was all the tree held"
            tree.unlock(node)
            node = leaf
        tree.unlock(node)
        pool.decref(new_blocks[-1:])
        if retention is not None:
            retain(blocks, root, TokenKey.of(request.token_ids), retention)
    return hits / total_units if total_units else 0.0


def ttl_oracle(events: list[tuple[float, Request]], ttl_s: float) -> float:
    """The TTL rule without the core: a unit hits when its whole prefix was used within `ttl_s` (a refresh on
    every use), so the test of `replay(..., ttl_s=...)` compares two independent implementations."""
    last_use: dict[int, float] = {}
    hits = total = 0
    for t, request in events:
        units = request.token_ids[UNIT_IDS - 1 :: UNIT_IDS].tolist()
        total += len(units)
        for unit in units:
            used = last_use.get(unit)
            if used is None or used + ttl_s <= t:  # the core's expiry test, in the same float arithmetic
                break
            hits += 1
        for unit in units:
            last_use[unit] = t
    return hits / total if total else 0.0
