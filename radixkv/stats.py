"""Counters and gauges of one cache, as one plain record (the server exports them as metrics)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True, kw_only=True)
class Stats:
    """Gauges (`num_blocks_*`, `num_live_sequences`) are read at snapshot time; `num_*` counters only grow."""

    num_blocks_total: int
    num_blocks_free: int = 0
    num_blocks_cached: int = 0  # held by the tree (some may also be held by sequences)
    num_blocks_evictable: int = 0  # held by the tree alone, unlocked: reclaimable on demand
    num_blocks_pinned: int = 0
    num_blocks_in_use: int = 0  # neither free nor evictable
    num_live_sequences: int = 0
    num_namespaces: int = 0
    num_requested_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_blocks: int = 0
    num_allocation_failures: int = 0
    num_cow_copies: int = 0
    num_opened_sequences: int = 0
    num_forked_sequences: int = 0
    num_released_sequences: int = 0
    # The host tier (all 0 without one). Gauges: its blocks, free ones, ones caching prefixes (host-only or
    # copies of device blocks), ones holding swapped sequences. Counters: blocks offloaded and loaded, host
    # blocks evicted, and tokens opens loaded back instead of computing (also counted in num_hit_tokens).
    num_host_blocks_total: int = 0
    num_host_blocks_free: int = 0
    num_host_blocks_cached: int = 0
    num_host_blocks_swapped: int = 0
    num_offloaded_blocks: int = 0
    num_loaded_blocks: int = 0
    num_host_evicted_blocks: int = 0
    num_host_hit_tokens: int = 0
    num_swapped_sequences: int = 0  # preempted by swap: their private blocks on the host tier
    num_blocks_reserved: int = 0  # admission's reserved growth not yet appended into
    num_preempted_sequences: int = 0
    num_admission_refusals: int = 0  # NotAdmitted
    num_preemptions_swap: int = 0  # sequences preempted, by mode
    num_preemptions_recompute: int = 0
    num_resumed_sequences: int = 0
    num_recomputed_tokens: int = 0  # tokens resumes after recompute handed back to prefill (not cached any more)

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_requested_tokens if self.num_requested_tokens else 0.0

    @property
    def usage_ratio(self) -> float:
        return self.num_blocks_in_use / self.num_blocks_total

    @property
    def memory_pressure(self) -> float:
        """(used + reserved) / total: what admission and operators watch."""
        return (self.num_blocks_in_use + self.num_blocks_reserved) / self.num_blocks_total

    @property
    def pressure_band(self) -> str:
        """ "normal" below 0.7, "high" up to 0.9 (throttle admissions), "danger" above (preemption is near)."""
        return pressure_band(self.memory_pressure)


PRESSURE_BANDS = ("normal", "high", "danger")


def pressure_band(memory_pressure: float) -> str:
    """The operators' bands of KV memory pressure: < 0.7 normal, 0.7-0.9 high, > 0.9 danger."""
    return "normal" if memory_pressure < 0.7 else "high" if memory_pressure <= 0.9 else "danger"
