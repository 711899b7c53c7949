"""The connector in vLLM's worker: radixkv's pool mapped with `PoolView`, blocks copied between it and vLLM's.

A step's loads run before its forward, all layers at once: the pool's blocks are gathered into one staging tensor
(a private copy), each block's checksum over that copy is compared with the one its saver recorded, and only the
blocks that match are written into vLLM's KV tensors, converted to the backend's layout. The others, and the
blocks the scheduler already knew it could not load, are reported by `take_load_errors`; vLLM recomputes them.
So vLLM never reads a byte that is not exactly what a saver wrote and vouched for, whatever happened to the pool
or the server meanwhile. Saves run after the forward (`save`): vLLM's blocks are gathered from every layer,
converted, checksummed and written into the sequence's own radixkv blocks; the scheduler commits what is reported.
"""

from __future__ import annotations

import logging

import torch

from radixkv.client import PoolView
from radixkv.vllm.layouts import CpuLayout, TokenMajorLayout, block_checksums
from radixkv.vllm.plan import StepPlan

log = logging.getLogger("radixkv.vllm")


class WorkerSide:
    def __init__(
        self, pool: PoolView, kv_caches: list[torch.Tensor], layout: type[CpuLayout] | type[TokenMajorLayout]
    ) -> None:
        self.pool = pool
        self.kv_caches = kv_caches  # vLLM's per-layer views, in model layer order
        self.layout = layout
        self.device = kv_caches[0].device
        self._errors: set[int] = set()
        self.failed_reqs: set[str] = set()  # this step's requests with a failed load: none of their saves is valid

    def load(self, plan: StepPlan) -> None:
        """Copy the step's verified blocks into vLLM's tensors; the rest become load errors."""
        self._errors.update(plan.failed)
        self.failed_reqs = set()
        if not plan.loads:
            return
        pool_blocks = torch.tensor(plan.loads.src, dtype=torch.int64, device=self.pool.data.device)
        staged = self.pool.data.index_select(2, pool_blocks)  # [L, 2, n, N, H, D]: a private copy
        good = [got == want for got, want in zip(block_checksums(staged), plan.loads.checksums, strict=True)]
        for ok, req_id, vllm_block in zip(good, plan.loads.req_ids, plan.loads.dst, strict=True):
            if not ok:
                self._errors.add(vllm_block)
                self.failed_reqs.add(req_id)
        if not all(good):
            log.warning(
                "radixkv: %d of %d blocks failed their checksum; vLLM recomputes them", good.count(False), len(good)
            )
        keep = torch.tensor([i for i, ok in enumerate(good) if ok], dtype=torch.int64, device=staged.device)
        if not len(keep):
            return
        dst = torch.tensor([b for b, ok in zip(plan.loads.dst, good, strict=True) if ok], dtype=torch.int64)
        dst = dst.to(self.device)
        staged = staged.index_select(2, keep).to(self.device)
        for layer, kv in enumerate(self.kv_caches):
            self.layout.write(kv, dst, staged[layer])

    def save(self, plan: StepPlan) -> dict[str, dict[int, int]]:
        """Copy the step's computed blocks out; returns what was saved: request -> block index -> checksum."""
        rows = [i for i, r in enumerate(plan.saves.req_ids) if r not in self.failed_reqs]
        if not rows:
            return {}
        src = torch.tensor([plan.saves.src[i] for i in rows], dtype=torch.int64, device=self.device)
        staged = torch.stack([self.layout.read(kv, src) for kv in self.kv_caches])  # [L, 2, n, N, H, D]
        staged = staged.to(self.pool.data.device, self.pool.data.dtype)
        checksums = block_checksums(staged)
        dst = torch.tensor([plan.saves.dst[i] for i in rows], dtype=torch.int64, device=self.pool.data.device)
        self.pool.data.index_copy_(2, dst, staged)
        saved: dict[str, dict[int, int]] = {}
        for i, checksum in zip(rows, checksums, strict=True):
            saved.setdefault(plan.saves.req_ids[i], {})[plan.saves.indices[i]] = checksum
        return saved

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
