"""bench_core's decode-heavy workload: radixkv's decode step against a minimal allocator (the floor).

64 prompts of ~760 tokens, each opened, its K/V written, forked into 4 parallel samples: 256 sequences.
Each of `steps` steps, every live sequence appends one token (the step's slots and copy-on-write pairs are
read, as a worker needs them); then, with beams, each of 8 beam groups forks its best sequence once and
releases its worst (a discarded hypothesis, not cached), so every group keeps 4. Without beams, the same
256 sequences only append. Engine time is the steps' (append, fork, release), token conversion included.

The floor is what a scheduler could write in an afternoon (`Floor`, ~60 lines): a free list, a Python list
of blocks per sequence, ref counts, copy-on-write of a shared partial block, a hash-chain prefix cache of
full blocks. It lacks what radixkv keeps: radix sharing with LRU eviction of cached prefixes, namespaces,
reservations, all-or-none batches with checked arguments, invariants that can be recounted.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from radixkv import KVCache

NUM_PROMPTS, SAMPLES, BEAM_GROUPS = 64, 4, 8


class Floor:
    """The minimal allocator: blocks, ref counts, tables, copy-on-write, a hash-chain prefix cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.cached: dict[int, int] = {}  # chain hash of a full block -> block
        self.hash_of: dict[int, int] = {}  # block -> its chain hash
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.chains: dict[int, list[int]] = {}  # each full block's chain hash, per sequence
        self.next_id = 0

    def _take(self) -> int:
        block = self.free.pop()
        self.ref[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.ref[block] -= 1
        if not self.ref[block]:
            self.free.append(block)
            h = self.hash_of.pop(block, None)
            if h is not None and self.cached.get(h) == block:
                del self.cached[h]

    def _seal(self, seq: int, block: int) -> None:
        """The sequence's last block just filled: chain its hash, and cache it (the first one wins)."""
        chain, bs = self.chains[seq], self.bs
        h = hash((chain[-1] if chain else 0, tuple(self.tokens[seq][-bs:])))
        chain.append(h)
        if h not in self.cached:
            self.cached[h], self.hash_of[block] = block, h

    def open(self, prompt: list[int]) -> int:
        seq, bs, table = self.next_id, self.bs, []
        self.next_id += 1
        self.tables[seq], self.tokens[seq], self.chains[seq] = table, [], []
        for start in range(0, len(prompt), bs):
            chunk = prompt[start : start + bs]
            h = hash((self.chains[seq][-1] if self.chains[seq] else 0, tuple(chunk)))
            hit = self.cached.get(h) if len(chunk) == bs else None
            if hit is not None:
                self.ref[hit] += 1
                table.append(hit)
            else:
                table.append(self._take())
            self.tokens[seq] += chunk
            if len(chunk) == bs:
                self.chains[seq].append(h)
                if hit is None:
                    self.cached[h], self.hash_of[table[-1]] = table[-1], h
        return seq

    def fork(self, seq: int) -> int:
        child = self.next_id
        self.next_id += 1
        table = self.tables[child] = list(self.tables[seq])
        for block in table:
            self.ref[block] += 1
        self.tokens[child], self.chains[child] = list(self.tokens[seq]), list(self.chains[seq])
        return child

    def release(self, seq: int) -> None:
        for block in self.tables.pop(seq):
            self._drop(block)
        del self.tokens[seq], self.chains[seq]

    def decode_step(self, seqs: list[int], token_ids: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """One token each: the slots they go to, and the (src, dst) copies to make before writing."""
        bs, slots, copies = self.bs, [], []
        for seq, token in zip(seqs, token_ids, strict=True):
            table, tokens = self.tables[seq], self.tokens[seq]
            within = len(tokens) % bs
            if not within:
                table.append(self._take())
            elif self.ref[table[-1]] > 1:  # a shared partial block: copy it first
                src, dst = table[-1], self._take()
                self._drop(src)
                table[-1] = dst
                copies.append((src, dst))
            tokens.append(token)
            slots.append(table[-1] * bs + within)
            if within == bs - 1:
                self._seal(seq, table[-1])
        return slots, copies


def _workload(steps: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 32000, int(n), dtype=np.int32) for n in rng.integers(700, 821, NUM_PROMPTS)]
    tokens = rng.integers(0, 32000, (steps, NUM_PROMPTS * SAMPLES), dtype=np.int32)  # the sampler's output
    picks = rng.integers(0, SAMPLES, (steps, BEAM_GROUPS, 2))  # each beam group's best and worst, by position
    picks[..., 1] = (picks[..., 0] + 1 + picks[..., 1] % (SAMPLES - 1)) % SAMPLES  # worst != best
    return prompts, tokens, picks


def _num_blocks(prompts: list[np.ndarray], steps: int, block_size: int) -> int:
    tokens = sum(len(p) for p in prompts) * SAMPLES + NUM_PROMPTS * SAMPLES * (steps + 2 * block_size)
    return int(tokens * 1.5) // block_size + 1024


def run_radixkv(steps: int, block_size: int, beams: bool) -> dict:
    prompts, tokens, picks = _workload(steps)
    cache = KVCache(_num_blocks(prompts, steps, block_size), block_size)
    groups = []
    for prompt in prompts:
        seq_id = cache.open(prompt).seq_id
        cache.commit([seq_id], [len(prompt)])
        groups.append([seq_id, *cache.fork(seq_id, SAMPLES - 1)])
    ones = [1] * (NUM_PROMPTS * SAMPLES)
    clock, cpu_clock = time.perf_counter, time.thread_time
    gc.collect()
    t0, c0 = clock(), cpu_clock()
    for step in range(steps):
        batch = cache.append_batch([s for g in groups for s in g], ones, tokens[step])
        batch.slots, batch.copies  # noqa: B018 -- what the worker reads
        if beams:
            for g, (best, worst) in zip(groups[:BEAM_GROUPS], picks[step].tolist(), strict=True):
                child = cache.fork(g[best], 1)[0]
                cache.release(g[worst], cache=False)
                g[worst] = child
    wall, cpu = clock() - t0, cpu_clock() - c0
    cache.check_invariants()
    return {"wall_s": wall, "cpu_s": cpu}


def run_floor(steps: int, block_size: int, beams: bool) -> dict:
    prompts, tokens, picks = _workload(steps)
    floor = Floor(_num_blocks(prompts, steps, block_size), block_size)
    groups = []
    for prompt in prompts:
        seq = floor.open(prompt.tolist())
        groups.append([seq, *(floor.fork(seq) for _ in range(SAMPLES - 1))])
    clock, cpu_clock = time.perf_counter, time.thread_time
    gc.collect()
    t0, c0 = clock(), cpu_clock()
    for step in range(steps):
        floor.decode_step([s for g in groups for s in g], tokens[step].tolist())
        if beams:
            for g, (best, worst) in zip(groups[:BEAM_GROUPS], picks[step].tolist(), strict=True):
                child = floor.fork(g[best])
                floor.release(g[worst])
                g[worst] = child
    return {"wall_s": clock() - t0, "cpu_s": cpu_clock() - c0}


def bench_decode(steps: int, rounds: int) -> dict:
    """radixkv and the floor at block 16 and 1, with and without beams; engines alternated round by round,
    each one's best round (wall and on-CPU), and the ratio floor / radixkv (> 1: radixkv is faster)."""
    out: dict = {"steps": steps, "sequences": NUM_PROMPTS * SAMPLES, "beam_groups": BEAM_GROUPS, "rounds": rounds}
    for block_size in (16, 1):
        for beams in (False, True):
            engines = {"radixkv": run_radixkv, "floor": run_floor}
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            for r in range(rounds):
                for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                    runs[name].append(engines[name](steps, block_size, beams))
            row = {name: {c: min(x[c] for x in results) for c in ("wall_s", "cpu_s")} for name, results in runs.items()}
            for c in ("wall", "cpu"):
                row[f"ratio_{c}"] = row["floor"][f"{c}_s"] / row["radixkv"][f"{c}_s"]
            out[f"{block_size}{'_beams' if beams else ''}"] = row
    return out


def rows(results: dict) -> list[tuple[str, str]]:
    out = [("decode-heavy: us per step radixkv / floor",
            f"{results['sequences']} sequences x {results['steps']} steps, best of {results['rounds']}; "
            "ratio floor/radixkv (target >= 1)")]  # fmt: skip
    for key, row in results.items():
        if not isinstance(row, dict):
            continue
        block_size, _, beams = key.partition("_")
        label = f"  block {block_size}, {'8 beam groups' if beams else 'no beams'}"
        us = {c: (row["radixkv"][f"{c}_s"] * 1e6 / results["steps"], row["floor"][f"{c}_s"] * 1e6 / results["steps"])
              for c in ("wall", "cpu")}  # fmt: skip
        out.append((label, f"wall {us['wall'][0]:.0f} / {us['wall'][1]:.0f} = {row['ratio_wall']:.2f}x; "
                           f"cpu {us['cpu'][0]:.0f} / {us['cpu'][1]:.0f} = {row['ratio_cpu']:.2f}x"))  # fmt: skip
    return out
