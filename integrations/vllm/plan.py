"""The scheduler side's bookkeeping per request, in plain Python (no vLLM): what to load, what to save, what to commit.

Per vLLM request the connector holds one radixkv sequence, opened on the prompt when vLLM first allocates the
request's blocks: the open locks the prefix radixkv holds (nobody evicts or rewrites it while the request lives)
and allocates radixkv blocks for the rest of the prompt. Then, per step:
- loads: the blocks promised to vLLM beyond its local hit, radixkv block -> vLLM block, each with the digest its
  saver recorded; a promised block the open did not lock, or that has no digest, is a failed load at once;
- saves: the prompt's full blocks radixkv lacks, vLLM block -> radixkv block, once vLLM holds their K/V (its
  local hit at once, computed ones after the step that computes them: every chunk of a chunked prefill);
- commits: what the worker reports saved, in order from the radixkv prefix (the computed watermark has no gaps);
  a block reported missing is planned again, after vLLM recomputes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(slots=True, kw_only=True)
class Copies:
    """Block copies of one step in columns: request ids, block indices in the request, sources, destinations."""

    req_ids: list[str] = dataclasses.field(default_factory=list)
    indices: list[int] = dataclasses.field(default_factory=list)
    src: list[int] = dataclasses.field(default_factory=list)
    dst: list[int] = dataclasses.field(default_factory=list)
    checksums: list[bytes] = dataclasses.field(default_factory=list)  # loads: each block's saver's digest

    def add(self, req_id: str, index: int, src: int, dst: int, checksum: bytes = b"") -> None:
        self.req_ids.append(req_id)
        self.indices.append(index)
        self.src.append(src)
        self.dst.append(dst)
        self.checksums.append(checksum)

    def __len__(self) -> int:
        return len(self.src)


@dataclasses.dataclass(slots=True, kw_only=True)
class StepPlan:
    """The worker's step: radixkv's own transfers (per open with a host tier, in order: its offloads device -> host,
    then its loads host -> device, int64 [n, 2] pairs each: `OpenResult`), then loads (radixkv -> vLLM), saves
    (vLLM -> radixkv), vLLM blocks that failed already."""

    loads: Copies = dataclasses.field(default_factory=Copies)
    saves: Copies = dataclasses.field(default_factory=Copies)
    failed: list[int] = dataclasses.field(default_factory=list)
    transfers: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True, kw_only=True)
class Tracked:
    """One vLLM request and its radixkv sequence (None: the open failed; nothing is loaded or saved)."""

    req_id: str
    seq_id: int | None
    table: list[int]  # the sequence's radixkv block table
    num_prompt_tokens: int
    num_committed_blocks: int  # leading blocks below the sequence's watermark: the prefix the open locked, then ours
    next_save: int  # the first prompt block not planned for saving yet
    block_size: int
    saved: dict[int, bytes] = dataclasses.field(default_factory=dict)  # reported saved, not committed: index -> digest
    in_flight: set[int] = dataclasses.field(default_factory=set)  # planned saves not reported yet
    failed_from: int | None = None  # this step's first failed load: nothing at or past it is saved this step
    finished: bool = False  # vLLM finished it: released once no save is in flight

    @property
    def num_prompt_blocks(self) -> int:
        return self.num_prompt_tokens // self.block_size

    def plan_loads(self, plan: StepPlan, first: int, last: int, vllm_blocks: list[int], checksums: list[bytes]) -> None:
        """Blocks [first, last) promised: loads of those the sequence holds (its locked prefix and what it committed
        since) with a digest (`checksums` from `first`), failures of the rest."""
        for i in range(first, last):
            checksum = checksums[i - first] if i - first < len(checksums) else b""
            if i < self.num_committed_blocks and checksum and self.seq_id is not None:
                plan.loads.add(self.req_id, i, self.table[i], vllm_blocks[i], checksum)
            else:
                plan.failed.append(vllm_blocks[i])
                self.failed_from = i if self.failed_from is None else min(self.failed_from, i)

    def plan_saves(self, plan: StepPlan, num_computed_tokens: int, vllm_blocks: list[int]) -> None:
        """Save the prompt's full blocks vLLM holds after this step (it computes up to `num_computed_tokens`)."""
        if self.seq_id is None or self.finished:
            return
        end = min(num_computed_tokens, self.num_prompt_tokens) // self.block_size
        if self.failed_from is not None:  # computed this step over a failed load: recomputed later, saved then
            end = min(end, self.failed_from)
        for i in range(self.next_save, min(end, len(vllm_blocks))):
            plan.saves.add(self.req_id, i, vllm_blocks[i], self.table[i])
            self.in_flight.add(i)
        self.next_save = max(self.next_save, min(end, len(vllm_blocks)))
        self.failed_from = None

    def take_saved(self, saved: dict[int, bytes], planned: set[int]) -> tuple[int, list[bytes]]:
        """The worker saved `saved` (index -> digest) of `planned`: (first block, digests) newly committable.

        A planned block it did not save (its step's load failed, the copy failed) is planned again from there.
        """
        self.in_flight -= planned
        self.saved.update(saved)
        missing = [i for i in planned if i not in saved]
        if missing:
            self.next_save = min(self.next_save, min(missing))
        first, checksums = self.num_committed_blocks, list[bytes]()
        while first + len(checksums) in self.saved:
            checksums.append(self.saved.pop(first + len(checksums)))
        self.num_committed_blocks += len(checksums)
        return first, checksums
