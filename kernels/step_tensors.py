"""The worker's side of the hand-off: host index arrays (numpy, from the orchestrator) as tensors on its device.

One call gives exactly what the kernels take: int64 slots for `store_kv`, int64 `[n, 2]` pairs for
`copy_blocks`, int32 padded block tables and sequence lengths for `paged_decode_attention`.

To a CUDA device the arrays travel together: packed into one pinned host buffer, then one non-blocking
copy, so a step costs one DMA the host never waits for (a copy from pageable memory, even one marked
non-blocking, makes the host wait while the driver stages it). The buffer comes from torch's caching
host allocator, which hands a pinned block out again only once the copies that read it have finished,
so the next step can pack while this one's copy is still in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

_ALIGN = 16  # bytes: each array starts 16-byte aligned, as Triton's fast (divisible-by-16) specialization wants


class HostStep(Protocol):
    """What `step_tensors` reads: the core's `radixkv.sequences.handoff.StepArrays`, or anything with its six arrays."""

    @property
    def seq_ids(self) -> np.ndarray: ...  # int64 [num_seqs]

    @property
    def query_starts(self) -> np.ndarray: ...  # int32 [num_seqs + 1]

    @property
    def slots(self) -> np.ndarray: ...  # int64 [num_new_tokens]

    @property
    def copies(self) -> np.ndarray: ...  # int64 [num_copies, 2]

    @property
    def block_tables(self) -> np.ndarray: ...  # int32 [num_seqs, max_blocks_per_seq]

    @property
    def seq_lens(self) -> np.ndarray: ...  # int32 [num_seqs]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepTensors:
    """A step's arrays on a device; the same fields, the same dtypes."""

    seq_ids: torch.Tensor  # int64 [num_seqs]
    query_starts: torch.Tensor  # int32 [num_seqs + 1]
    slots: torch.Tensor  # int64 [num_new_tokens]
    copies: torch.Tensor  # int64 [num_copies, 2]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]


def step_tensors(arrays: HostStep, device: str | torch.device) -> StepTensors:
    """Every array of `arrays` as a tensor on `device`: on CPU the arrays' own memory, elsewhere one staged copy."""
    names = [f.name for f in dataclasses.fields(StepTensors)]
    tensors = host_to_device([getattr(arrays, name) for name in names], device)
    return StepTensors(**dict(zip(names, tensors, strict=True)))


def host_to_device(arrays: Sequence[np.ndarray], device: str | torch.device) -> list[torch.Tensor]:
    """`arrays` as tensors on `device`, same dtypes and shapes, with no host wait.

    CPU: `torch.from_numpy` of each (shared memory, no copy). Another device: one pinned staging buffer
    (pinned on CUDA), one `non_blocking` copy, and a view of the device buffer per array. The tensors are
    ready for kernels queued after this call on the current stream.
    """
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")  # [total] bytes
    packed = staging.numpy()
    for a, start in zip(arrays, offsets, strict=True):
        packed[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = staging.to(device, non_blocking=True)  # [total] bytes: the step's one host-to-device copy
    return [
        on_device[start : start + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
        for a, start in zip(arrays, offsets, strict=True)
    ]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype
