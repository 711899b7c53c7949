"""The connector in vLLM's worker: radixkv's pool mapped with `PoolView`, blocks copied between it and vLLM's.

A step's loads run before its forward, after the host tier's transfers of the step's opens (device -> host
offloads, host -> device loads: a host or disk hit joins radixkv's pool there), in groups of `GROUP_BLOCKS`
blocks pipelined over threads: each group is
copied out of the pool into a private staging tensor (`PoolRows.gather`, one whole-row copy per layer and K|V),
its blocks' BLAKE3 digests are computed over that copy on a hashing thread (BLAKE3 releases the GIL) while the
next group is copied, and only the blocks whose digest equals the one their saver recorded on the server are
converted into vLLM's KV tensors (one transposing copy per layer and run of consecutive vLLM blocks). The others,
and the blocks the scheduler already knew it could not load, are reported by `take_load_errors`; vLLM recomputes
them. So vLLM
never reads a byte that is not exactly what a saver wrote and vouched for, whatever happened to the pool
meanwhile (a cryptographic digest kept by the server: a writer of pool memory can neither meet nor rewrite it).
Saves run after the forward (`save`): vLLM's blocks are read from every layer into a staging tensor, written
into the sequence's own radixkv blocks with one row copy, and digested; the scheduler commits what is reported.
"""

from __future__ import annotations

import collections
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from radixkv.client import PoolView
from radixkv.kernels import swap_blocks
from radixkv.vllm.layouts import CpuLayout, PoolRows, TokenMajorLayout, block_digests
from radixkv.vllm.plan import Copies, StepPlan

log = logging.getLogger("radixkv.vllm")
GROUP_BLOCKS = 8  # blocks per pipelined group: ~12 MB at SmolLM2-135M's 1.5 MB blocks, cache-sized
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))


class WorkerSide:
    def __init__(
        self, pool: PoolView, kv_caches: list[torch.Tensor], layout: type[CpuLayout] | type[TokenMajorLayout]
    ) -> None:
        self.pool = pool
        self.rows = PoolRows(pool.data)
        self.kv_caches = kv_caches  # vLLM's per-layer views, in model layer order
        self.layout = layout
        self.device = kv_caches[0].device
        self._errors: set[int] = set()
        self.failed_reqs: set[str] = set()  # this step's requests with a failed load: none of their saves is valid
        self._hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="radixkv-digest")

    def load(self, plan: StepPlan) -> None:
        """Apply radixkv's transfers, then copy the step's verified blocks into vLLM's tensors; the rest become load
        errors."""
        for offloads, host_loads in plan.transfers:  # each open's, in order (radixkv.tree.host_tier says why)
            if len(offloads):
                swap_blocks(self.pool.data, self.pool.host_data, offloads)
            if len(host_loads):
                swap_blocks(self.pool.host_data, self.pool.data, host_loads)
        self._errors.update(plan.failed)
        self.failed_reqs = set()
        loads = plan.loads
        pending: collections.deque[tuple[int, torch.Tensor, Future[list[bytes]]]] = collections.deque()
        num_bad = 0
        for start in range(0, len(loads), GROUP_BLOCKS):
            staged = self.rows.gather(loads.src[start : start + GROUP_BLOCKS])  # private: the pool may change
            pending.append((start, staged, self._hashers.submit(block_digests, staged)))
            if len(pending) > HASH_THREADS:  # the oldest group's digests are ready (or nearly): place it
                num_bad += self._place(loads, *pending.popleft())
        while pending:
            num_bad += self._place(loads, *pending.popleft())
        if num_bad:
            log.warning("radixkv: %d of %d blocks failed their digest; vLLM recomputes them", num_bad, len(loads))

    def _place(self, loads: Copies, start: int, staged: torch.Tensor, pending: Future[list[bytes]]) -> int:
        """Write the group's blocks whose digest is their saver's into every layer; returns how many were not."""
        digests = pending.result()
        keep, dst = [], []
        for j, got in enumerate(digests):
            i = start + j
            if got == loads.checksums[i]:
                keep.append(j)
                dst.append(loads.dst[i])
            else:
                self._errors.add(loads.dst[i])
                self.failed_reqs.add(loads.req_ids[i])
        if keep:
            if len(keep) < len(digests):
                staged = staged[torch.tensor(keep, device=staged.device)]
            staged = staged.to(self.device, non_blocking=True)
            for layer, kv in enumerate(self.kv_caches):
                self.layout.write(kv, dst, staged[:, layer])
        return len(digests) - len(keep)

    def save(self, plan: StepPlan) -> dict[str, dict[int, bytes]]:
        """Copy the step's computed blocks out; returns what was saved: request -> block index -> digest."""
        rows = [i for i, r in enumerate(plan.saves.req_ids) if r not in self.failed_reqs]
        if not rows:
            return {}
        src = torch.tensor([plan.saves.src[i] for i in rows], dtype=torch.int64, device=self.device)
        staged = torch.empty((len(rows), self.rows.num_layers, 2, *self.rows.block_shape), dtype=self.pool.data.dtype)
        staged = staged.to(self.pool.data.device)
        for layer, kv in enumerate(self.kv_caches):
            staged[:, layer] = self.layout.read(kv, src)
        self.rows.scatter([plan.saves.dst[i] for i in rows], staged)
        saved: dict[str, dict[int, bytes]] = {}
        for i, digest in zip(rows, block_digests(staged), strict=True):
            saved.setdefault(plan.saves.req_ids[i], {})[plan.saves.indices[i]] = digest
        return saved

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._hashers.shutdown(wait=False)
        self.pool.close()
