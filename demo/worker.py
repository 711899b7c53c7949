"""The worker: runs the model over the pool's memory, as the orchestrator's step tells it to.

It knows nothing of sequences, prefixes or the radix tree: a step says which blocks to move to and
from the host tier (swap) and to copy (copy-on-write), all applied before any write, which prompt
tails to prefill and which tokens to decode, each with the slots its K/V go to and the block table it
reads. It returns log-probabilities, nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from radixkv.demo.model import LlamaForCausalLM
from radixkv.demo.paged_attention import PagedDecode, PagedPrefill, PoolMemory, PrefillSeq
from radixkv.kernels import copy_blocks, host_to_device, swap_blocks


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PrefillInput:
    """The uncached tail of one prompt: `token_ids` sit at positions `num_cached_tokens` on."""

    token_ids: list[int]
    num_cached_tokens: int
    slots: npt.NDArray[np.int64]  # [len(token_ids)]
    block_table: list[int]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DecodeInput:
    """One sequence's newest token, at `position` (so it attends to `position + 1` tokens)."""

    token_id: int
    position: int
    slot: int
    block_table: list[int]


Pairs = list[tuple[int, int]]


def as_pairs(pairs: Iterable[Sequence[int]]) -> Pairs:
    """The core's block pairs (a list, or an int64 `[n, 2]` array) as plain `(src_block, dst_block)` tuples."""
    return [(int(src), int(dst)) for src, dst in pairs]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStep:
    """Applied in the order the core's results were handed out, each result's offloads before its copies and
    its loads: the last step's appends and preemptions (`offloads`, then `copies`), then this step's resumes
    and opens (`transfers`, one `(offloads, loads)` per result), then the model."""

    copies: Pairs  # (src_block, dst_block): copy-on-write from the last appends
    prefills: list[PrefillInput]
    decodes: list[DecodeInput]
    offloads: Pairs = dataclasses.field(default_factory=list)  # (device_block, host_block)
    transfers: list[tuple[Pairs, Pairs]] = dataclasses.field(default_factory=list)  # loads: (host_block, device_block)

    @property
    def num_offloaded_blocks(self) -> int:
        return len(self.offloads) + sum(len(offloads) for offloads, _ in self.transfers)

    @property
    def num_loaded_blocks(self) -> int:
        return sum(len(loads) for _, loads in self.transfers)


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutput:
    prefill_logprobs: torch.Tensor  # fp32 [num_prefills, vocab_size], after each prompt's last token
    decode_logprobs: torch.Tensor  # fp32 [num_decodes, vocab_size]


class Worker:
    """Runs `model` with every K/V read from and written to `pool` (a `PoolView` of the server's pool).

    Every tensor a step needs is made on the pool's device: the step's host lists go there in one staged copy
    (`host_to_device`), and block pairs go to the kernels as the lists they are (they stage them the same way).

    Args:
        backend: the kernels' backend ("torch" or "triton"); None lets them pick for the device.
        host_data: the pool's host tier (`PoolView.host_data`: the pool's layout, its own num_blocks), where
            swapped-out and evicted blocks go; None without one.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: PoolMemory,
        *,
        backend: str | None = None,
        host_data: torch.Tensor | None = None,
    ) -> None:
        c = model.config
        num_layers, _, _, _, num_kv_heads, head_dim = pool.data.shape
        if (num_layers, num_kv_heads, head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"pool: layout (layers, kv heads, head_dim) = {(num_layers, num_kv_heads, head_dim)} does not fit the "
                "model's "
                f"{(c.num_layers, c.num_kv_heads, c.head_dim)}"
            )
        self.device = pool.data.device
        model_device = model.lm_head.weight.device
        if model_device != self.device:
            raise ValueError(f"model: on {model_device}, the pool on {self.device}: the worker runs both on one device")
        self.model, self.pool, self.backend, self.host_data = model, pool, backend, host_data
        self.scale = c.head_dim**-0.5

    def execute(self, step: WorkerStep) -> StepOutput:
        """Block moves in the order of `WorkerStep`, then prefill and decode: a block leaves the device before its
        block id is reused, and a copied or loaded block is whole before anyone reads or writes it."""
        self._offload(step.offloads)
        if step.copies:
            copy_blocks(self.pool.data, step.copies, backend=self.backend)
        for offloads, loads in step.transfers:
            self._offload(offloads)
            if loads:
                self._swap(self._host(), self.pool.data, loads)
        vocab_size = self.model.config.vocab_size
        empty = torch.empty(0, vocab_size, device=self.device)
        return StepOutput(
            self._prefill(step.prefills) if step.prefills else empty,
            self._decode(step.decodes) if step.decodes else empty,
        )

    def _host(self) -> torch.Tensor:
        if self.host_data is None:
            raise ValueError("the step moves blocks to or from a host tier, and this worker has none")
        return self.host_data

    def _offload(self, offloads: Pairs) -> None:
        if offloads:
            self._swap(self.pool.data, self._host(), offloads)

    def _swap(self, src: torch.Tensor, dst: torch.Tensor, pairs: Pairs) -> None:
        # src, dst: whole pools [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        done = swap_blocks(src, dst, pairs, backend=self.backend)
        if done is not None:  # CUDA: the copies ran on a side stream; this step's kernels wait for them
            done.wait()

    def _prefill(self, prefills: list[PrefillInput]) -> torch.Tensor:
        token_ids, positions, slots, last_rows = host_to_device(
            [
                np.array([t for p in prefills for t in p.token_ids], dtype=np.int64),  # [num_tokens]
                np.concatenate(
                    [np.arange(p.num_cached_tokens, p.num_cached_tokens + len(p.token_ids)) for p in prefills]
                ).astype(np.int64),  # [num_tokens] positions
                np.concatenate([p.slots for p in prefills]).astype(np.int64),  # [num_tokens]
                np.cumsum([len(p.token_ids) for p in prefills]).astype(np.int64) - 1,  # [num_prefills] last rows
            ],
            self.device,
        )
        seqs = [PrefillSeq(p.block_table, p.num_cached_tokens, len(p.token_ids)) for p in prefills]
        attention = PagedPrefill(
            self.pool,
            seqs=seqs,
            slots=slots,
            scale=self.scale,
            sliding_window=self.model.config.sliding_window,
            backend=self.backend,
        )
        return self.model(token_ids, positions, attention, last_rows)  # [num_prefills, vocab_size]

    def _decode(self, decodes: list[DecodeInput]) -> torch.Tensor:
        num_seqs = len(decodes)
        max_blocks = max(len(d.block_table) for d in decodes)
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)  # [num_seqs, max_blocks]
        for i, d in enumerate(decodes):
            tables[i, : len(d.block_table)] = d.block_table
        host_lens = [d.position + 1 for d in decodes]  # the decode plan is made from them, no device read
        block_tables, token_ids, positions, slots, seq_lens = host_to_device(
            [
                tables,
                np.array([d.token_id for d in decodes], dtype=np.int64),  # [num_seqs]
                np.array([d.position for d in decodes], dtype=np.int64),  # [num_seqs]
                np.array([d.slot for d in decodes], dtype=np.int64),  # [num_seqs]
                np.array(host_lens, dtype=np.int32),  # [num_seqs]
            ],
            self.device,
        )
        c = self.model.config
        attention = PagedDecode(
            self.pool,
            slots=slots,
            block_tables=block_tables,
            seq_lens=seq_lens,
            host_seq_lens=host_lens,
            scale=self.scale,
            sliding_window=c.sliding_window,
            backend=self.backend,
            num_q_heads=c.num_q_heads,
            model_dtype=self.model.dtype,
        )
        rows = torch.arange(num_seqs, device=self.device)  # [num_seqs]
        return self.model(token_ids, positions, attention, rows)  # [num_seqs, vocab_size]
