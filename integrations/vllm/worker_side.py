"""The connector in vLLM's worker: radixkv's pool mapped with `PoolView`, blocks copied between it and vLLM's.

A step's loads run before its forward, after the host tier's transfers of the step's opens (device -> host
offloads, host -> device loads: a host or disk hit joins radixkv's pool there), in groups of about `GROUP_BYTES`:
each group is copied out of the pool into a private staging tensor (`PoolRows.gather`, one copy per run of
consecutive pool blocks), and while a hashing thread computes its blocks' BLAKE3 digests over that copy (BLAKE3
releases the GIL), this thread converts the same copy into vLLM's KV tensors (one transposing copy per layer and
run of consecutive vLLM blocks). Before `load` returns every digest is compared with the one the block's saver
recorded on the server: a block that differs is wiped (zeros in every layer) and reported by `take_load_errors`
with the blocks the scheduler already knew it could not load; vLLM recomputes them. So vLLM's forward never reads
a byte that is not exactly what a saver wrote and vouched for, whatever happened to the pool meanwhile (a
cryptographic digest kept by the server: a writer of pool memory can neither meet nor rewrite it), and hashing
costs no time of its own beside the copies.
Saves run after the forward (`save`): vLLM's blocks are read from every layer into a staging tensor, written
into the sequence's own radixkv blocks (one copy per run of consecutive blocks) while they are digested; the
scheduler commits what is reported.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from radixkv.client import PoolView
from radixkv.kernels import swap_blocks
from radixkv.vllm.layouts import CpuLayout, PoolRows, TokenMajorLayout, block_digests
from radixkv.vllm.plan import Copies, StepPlan

log = logging.getLogger("radixkv.vllm")
GROUP_BYTES = 32 << 20  # per pipelined group: fewer groups cost less Python per layer, more cost more staging memory
HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))


def unpinned() -> None:
    """Let the calling thread run on every CPU the process may use (the kernel keeps it within its cpuset). vLLM's
    CPU worker pins its thread to one core and a new thread inherits that: hashing there would only take turns with
    the copies it is meant to run beside."""
    with contextlib.suppress(AttributeError, OSError):  # no sched_setaffinity outside Linux
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


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
        self._hashers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="radixkv-digest", initializer=unpinned)
        self.group_blocks = max(1, GROUP_BYTES // (pool.data[:, :, 0].numel() * pool.data.element_size()))
        self._staging = [self.rows.staging(self.group_blocks) for _ in range(HASH_THREADS + 1)]  # groups in flight

    def load(self, plan: StepPlan) -> None:
        """Apply radixkv's transfers, then copy the step's blocks into vLLM's tensors, verified before this returns;
        the rest become load errors."""
        for offloads, host_loads in plan.transfers:  # each open's, in order (radixkv.tree.host_tier says why)
            if len(offloads):
                swap_blocks(self.pool.data, self.pool.host_data, offloads)
            if len(host_loads):
                swap_blocks(self.pool.host_data, self.pool.data, host_loads)
        self._errors.update(plan.failed)
        self.failed_reqs = set()
        loads = plan.loads
        pending: collections.deque[tuple[int, Future[list[bytes]]]] = collections.deque()
        bad: list[int] = []
        size = self.group_blocks
        for group, start in enumerate(range(0, len(loads), size)):
            # Private (the pool may change); its buffer's last group is hashed and converted (see the bound below).
            into = self._staging[group % len(self._staging)]
            staged = self.rows.gather(loads.src[start : start + size], into)
            pending.append((start, self._hashers.submit(block_digests, staged)))
            staged = staged.to(self.device, non_blocking=True)
            dst = loads.dst[start : start + size]
            for layer, kv in enumerate(self.kv_caches):  # converted while hashed: vLLM reads none before we return
                self.layout.write(kv, dst, staged[:, layer])
            if len(pending) > HASH_THREADS:  # bounds the staged groups held
                bad += self._check(loads, *pending.popleft())
        while pending:
            bad += self._check(loads, *pending.popleft())
        if bad:
            wipe = torch.tensor(bad, dtype=torch.int64, device=self.device)
            for kv in self.kv_caches:  # not one byte of a refused block stays for the forward to read
                kv.index_fill_(0, wipe, 0)
            log.warning("radixkv: %d of %d blocks failed their digest; vLLM recomputes them", len(bad), len(loads))

    def _check(self, loads: Copies, start: int, pending: Future[list[bytes]]) -> list[int]:
        """The group's vLLM blocks whose digest is not their saver's: load errors, to be wiped."""
        bad = []
        for j, got in enumerate(pending.result()):
            i = start + j
            if got != loads.checksums[i]:
                bad.append(loads.dst[i])
                self._errors.add(loads.dst[i])
                self.failed_reqs.add(loads.req_ids[i])
        return bad

    def save(self, plan: StepPlan) -> dict[str, dict[int, bytes]]:
        """Copy the step's computed blocks out; returns what was saved: request -> block index -> digest.

        In groups, as loads: read out of vLLM's tensors into a staging buffer, written into the pool while hashed."""
        saves = plan.saves
        rows = [i for i, r in enumerate(saves.req_ids) if r not in self.failed_reqs]
        pending: collections.deque[tuple[list[int], Future[list[bytes]]]] = collections.deque()
        saved: dict[str, dict[int, bytes]] = {}
        size = self.group_blocks
        for group, start in enumerate(range(0, len(rows), size)):
            part = rows[start : start + size]
            staged = self._staging[group % len(self._staging)][: len(part)]
            staged = staged.view(len(part), self.rows.num_layers, 2, *self.rows.block_shape)
            src = [saves.src[i] for i in part]
            for layer, kv in enumerate(self.kv_caches):
                self.layout.read(kv, src, staged[:, layer])
            pending.append((part, self._hashers.submit(block_digests, staged)))
            self.rows.scatter([saves.dst[i] for i in part], staged)
            while pending and (len(pending) > HASH_THREADS or start + size >= len(rows)):
                done, digests = pending.popleft()
                for i, digest in zip(done, digests.result(), strict=True):
                    saved.setdefault(saves.req_ids[i], {})[saves.indices[i]] = digest
        return saved

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._hashers.shutdown(wait=False)
        self.pool.close()
