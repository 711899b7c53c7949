"""Kernel test set-up: the device the Triton kernels run on here, and a builder of random paged batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixkv.kernels import quantize_fp8
from radixkv.kernels.backend import INTERPRETED

FP8 = torch.float8_e4m3fn
# Per-layer (k_scale, v_scale) of the fp8 test caches: neither 1, so a scale left out or swapped shows.
FP8_SCALES = (0.02, 0.005)

# Per-dtype (atol, rtol) of a kernel against its fp32 torch reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture
def device() -> str:
    """CUDA when there is one (the compiled kernels), else CPU through Triton's interpreter."""
    if torch.cuda.is_available():
        return "cuda"
    if not INTERPRETED:
        pytest.skip("neither CUDA nor TRITON_INTERPRET=1: the Triton kernels cannot run")
    return "cpu"


@dataclasses.dataclass
class PagedBatch:
    q: torch.Tensor  # [num_seqs, num_q_heads, head_dim]
    kv_layer: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    scale: float
    kv_scales: torch.Tensor | None = None  # fp32 [2] with an fp8 kv_layer
    original_kv: torch.Tensor | None = None  # fp8 only: the fp32 K/V before quantizing, [2, num_blocks, ...]

    def args(self) -> tuple:
        return (self.q, self.kv_layer, self.block_tables, self.seq_lens, self.scale)


def build_paged_batch(
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    table: str = "shuffled",
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Random q and caches, and block tables whose ids are shuffled over the pool.

    `kv_dtype` fp8 quantizes the caches with torch (`FP8_SCALES`); q and the output keep `dtype`.

    `table`: "shuffled" (contiguous table), "sliced" (a column slice of a wider table, so its rows are
    strided) or "shared" (every sequence starts with sequence 0's blocks, as after a fork). Entries past
    a sequence's last block hold an out-of-range id: reading one would read outside the pool.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    max_blocks = max([1, *blocks_needed])
    num_blocks = sum(blocks_needed) + 3  # spare blocks of random data that no sequence owns
    perm = torch.randperm(num_blocks, generator=gen)
    wide = torch.full((len(seq_lens), max_blocks + 3), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_needed):
        wide[i, 2 : 2 + n] = perm[used : used + n].int()
        used += n
    if table == "shared":
        shared = min(blocks_needed) if blocks_needed else 0
        wide[1:, 2 : 2 + shared] = wide[0, 2 : 2 + shared]
    block_tables = wide.to(device)[:, 2 : 2 + max_blocks]  # sliced on the device: .to() would compact it
    if table != "sliced":
        block_tables = block_tables.contiguous()
    kv = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen)  # [2, num_blocks, ...]
    q = torch.randn((len(seq_lens), num_q_heads, head_dim), generator=gen).to(dtype)
    batch = PagedBatch(
        q=q.to(device),
        kv_layer=kv.to(dtype).to(device),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )
    if kv_dtype == FP8:
        scales = torch.tensor(FP8_SCALES)
        kv = kv * scales[:, None, None, None, None] * 3  # stored values ~ N(0, 3): e4m3's normal range, unsaturated
        batch.kv_layer = torch.stack([quantize_fp8(kv[i], scales[i]) for i in range(2)]).to(device)
        batch.kv_scales, batch.original_kv = scales.to(device), kv.to(device)
    return batch


@pytest.fixture
def paged_batch():
    """The builder, as a fixture (test modules under importlib mode cannot import each other)."""
    return build_paged_batch


@pytest.fixture
def tolerances():
    return TOLERANCES
