"""Concurrency: eight threads of batched open/append/fork/release at once lose no update and share no writable block.

The server serialises each pool behind one lock (see `radixkv.server.rules.service`); if any update
escaped it, a counter would drift from what clients were told, or two live sequences would be handed
the same fresh block. Both are checked exactly: every counter's change equals the sum of what the
clients saw, and a shared registry of the blocks each live sequence was given to write fails the
moment one is handed out twice.
"""

from __future__ import annotations

import random
import threading

from radixkv.client import RadixKVClient

NUM_THREADS = 8
ROUNDS = 20
BLOCK_SIZE = 4  # the hardened pools' block size
PREFIX = list(range(7000, 7016))  # shared by every prompt: 4 full blocks that hit once cached
COUNTERS = ("num_requested_tokens", "num_hit_tokens", "num_opened_sequences", "num_forked_sequences",
            "num_released_sequences", "num_cow_copies")  # fmt: skip


class Writable:
    """Which live sequence was handed each block to write; a block handed out twice is a lost update."""

    def __init__(self) -> None:
        self._owner: dict[int, int] = {}
        self._lock = threading.Lock()
        self.clashes: list[tuple[int, int, int]] = []

    def take(self, seq_id: int, block_ids: list[int]) -> None:
        with self._lock:
            for block_id in block_ids:
                holder = self._owner.setdefault(block_id, seq_id)
                if holder != seq_id:
                    self.clashes.append((block_id, holder, seq_id))

    def give_back(self, seq_ids: set[int]) -> None:
        """Before the release is sent: until the server has it, no one else can be given these blocks."""
        with self._lock:
            self._owner = {b: s for b, s in self._owner.items() if s not in seq_ids}


def _client_thread(
    address: str, worker: int, writable: Writable, seen: dict[str, int], failures: list[BaseException]
) -> None:
    rng = random.Random(worker)
    told = dict.fromkeys(COUNTERS, 0)
    try:
        with RadixKVClient(address, pool="big") as client:
            for round_ in range(ROUNDS):
                prompts = [PREFIX + [worker, round_, i] + [rng.randrange(100)] * rng.randrange(0, 6) for i in range(8)]
                opened = client.open_many([(p, "counts") for p in prompts])
                told["num_opened_sequences"] += len(opened)
                told["num_requested_tokens"] += sum(map(len, prompts))
                told["num_hit_tokens"] += sum(o.num_cached_tokens for o in opened)
                for o in opened:  # blocks past the cached prefix were allocated for this sequence alone
                    writable.take(o.seq_id, o.block_table[o.num_cached_tokens // BLOCK_SIZE :])
                live = [o.seq_id for o in opened]
                children = client.fork(live[0], 2)
                told["num_forked_sequences"] += len(children)
                live += children
                for _ in range(2):  # decode steps: the family's shared partial block is copied on write
                    for r in client.append_many([(s, [rng.randrange(100)]) for s in live]):
                        told["num_cow_copies"] += len(r.copies)
                        writable.take(r.seq_id, list(r.block_ids))
                writable.give_back(set(live))
                client.release_many(live, cache=rng.random() < 0.5)
                told["num_released_sequences"] += len(live)
    except BaseException as e:  # noqa: BLE001 -- reported to the main thread
        failures.append(e)
    finally:
        for name, n in told.items():
            seen[f"{worker}:{name}"] = n  # a key per thread: no two threads write the same entry


def test_parallel_batched_calls_lose_no_update(hardened, hardened_debug) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(hardened.address, pool="big") as observer:
        before = observer.stats()
        writable, seen, failures = Writable(), {}, []  # type: ignore[var-annotated]
        threads = [
            threading.Thread(target=_client_thread, args=(hardened.address, i, writable, seen, failures))
            for i in range(NUM_THREADS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        if failures:
            raise failures[0]
        after = observer.stats()

    assert writable.clashes == [], "a block was handed to two live sequences at once"
    for name in COUNTERS:
        told = sum(n for key, n in seen.items() if key.endswith(f":{name}"))
        assert getattr(after, name) - getattr(before, name) == told, name
    assert after.num_opened_sequences - before.num_opened_sequences == NUM_THREADS * ROUNDS * 8
    assert after.num_hit_tokens > before.num_hit_tokens  # the shared prefix was hit, concurrently
    assert after.num_cow_copies > before.num_cow_copies
    # Every block is accounted for: nothing held, all free or cached, and the server's recount agrees.
    assert (after.num_live_sequences, after.num_blocks_in_use) == (0, 0)
    assert after.num_blocks_free + after.num_blocks_evictable == after.num_blocks_total
    assert hardened_debug.check("big").num_live_sequences == 0
