"""When a disk hit is worth loading: only when reading its blocks is faster than computing its tokens.

A hit of `n` blocks costs `latency + n * bytes_per_block / read_bandwidth` to read, and
`n * block_size / prefill_tokens_per_s` to recompute. The read bandwidth is measured: each load's bytes over
its seconds, smoothed (`observe`, an exponential average weighting the last load by `SMOOTHING`), seeded at
start by reading one object back (`DiskStore.probe`). The prefill rate is the caller's: the pool key
`disk_prefill_tokens_per_s` (what the model computes per second on this hardware; a scheduler knows it). Without
one, or before the first measurement, a hit is loaded: there is nothing to weigh it against, and the first load
measures the disk.

A disk judged too slow is never read for a load again by this rule alone, so the writer re-probes it (one
object, off the request path) at most every `reprobe_s`: a disk that recovers is used again.
"""

from __future__ import annotations

import time

SMOOTHING = 0.3
READ_LATENCY_S = 200e-6  # per load: an NVMe or a virtual disk's request latency, before the bytes flow


class LoadCost:
    """Weighs a disk load against recomputing it (see the module docstring)."""

    def __init__(self, bytes_per_block: int, block_size: int, prefill_tokens_per_s: float | None) -> None:
        self.bytes_per_block, self.block_size = bytes_per_block, block_size
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.read_bytes_per_s: float | None = None
        self.last_observed = 0.0
        self.num_skipped_loads = 0  # hits left to recompute because reading them would be slower

    def observe(self, num_bytes: int, seconds: float) -> None:
        """A read of `num_bytes` took `seconds`: move the bandwidth estimate towards it."""
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        old = self.read_bytes_per_s
        self.read_bytes_per_s = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        self.last_observed = time.monotonic()

    def read_seconds(self, num_blocks: int) -> float | None:
        if self.read_bytes_per_s is None:
            return None
        return READ_LATENCY_S + num_blocks * self.bytes_per_block / self.read_bytes_per_s

    def compute_seconds(self, num_blocks: int) -> float | None:
        if not self.prefill_tokens_per_s:
            return None
        return num_blocks * self.block_size / self.prefill_tokens_per_s

    def cheaper(self, num_blocks: int) -> bool:
        """Whether loading `num_blocks` from disk beats recomputing them, by the estimate (changes nothing)."""
        read, compute = self.read_seconds(num_blocks), self.compute_seconds(num_blocks)
        return read is None or compute is None or read < compute

    def worth_loading(self, num_blocks: int) -> bool:
        """`cheaper`, counting the hits it leaves to recompute."""
        if self.cheaper(num_blocks):
            return True
        self.num_skipped_loads += 1
        return False
