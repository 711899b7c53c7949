"""The worker's side of the hand-off: a step's `StepArrays` (numpy, from the orchestrator) as tensors on its device.

One call gives exactly what the kernels take: int64 slots for `store_kv`, int64 `[n, 2]` pairs for
`copy_blocks`, int32 padded block tables and sequence lengths for `paged_decode_attention`.
"""

from __future__ import annotations

import dataclasses

import torch

from radixkv.sequences.handoff import StepArrays


@dataclasses.dataclass(frozen=True, slots=True)
class StepTensors:
    """`StepArrays` on a device; the same fields, the same dtypes."""

    seq_ids: torch.Tensor  # int64 [num_seqs]
    query_starts: torch.Tensor  # int32 [num_seqs + 1]
    slots: torch.Tensor  # int64 [num_new_tokens]
    copies: torch.Tensor  # int64 [num_copies, 2]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]


def step_tensors(arrays: StepArrays, device: str | torch.device) -> StepTensors:
    """Every array of `arrays` as a tensor on `device` (a host copy is shared, not duplicated, on CPU)."""
    return StepTensors(
        **{f.name: torch.from_numpy(getattr(arrays, f.name)).to(device) for f in dataclasses.fields(StepTensors)}
    )
