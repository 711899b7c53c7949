"""The decode step's launch plan: tile configs per head_dim and cache dtype, and the split of long sequences.

Made on the host from host-side lengths, once per step, and shared by every layer's
`paged_decode_attention` call: no device read. Splits have one length for the whole batch
(`DecodePlan.split_len`, a whole number of tiles), sized from the batch's lengths so that the longest
sequence alone is cut into enough programs to fill the device; a short sequence's splits past its end
do nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence

import torch
import triton

MAX_SPLITS = 64  # the merge kernel holds [splits, head_dim] partials of one head in registers
# Tokens per split below which splitting costs more (scratch, a second launch, a pipeline prologue) than it recovers.
MIN_TOKENS_PER_SPLIT = 256
# Programs per SM the split sizing aims for: two keep an SM busy while one waits on memory.
PROGRAMS_PER_SM = 2


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeConfig:
    """How one split-kernel program walks its tokens: `tile_n` tokens per K/V tile, `num_stages` software-pipeline
    stages (the loop's loads run that many tiles ahead), `num_warps` per program."""

    tile_n: int
    num_warps: int
    num_stages: int


# By (head_dim padded to 64/128/256, cache element bytes). The 16-bit rows: each K or V tile is 16 KiB, so
# one stage of both is 32 KiB; the block-id load and the K load that depends on it each take a stage, so 5
# stages double-buffer K and V (3 would leave them one buffer each). fp8 takes fp16's tiles of tokens at
# head_dim 128 and 256 (half the bytes per tile): its V tile passes shared memory twice (fp8 as copied, 16-bit
# as the dot reads it), and the 128-token tile it had needed 209 registers at head_dim 128, two programs per
# SM. Compiled for sm_90 (`benchmarks/kernel_resources.py` prints the table), head_dim 128: fp16 108
# registers, 71 KiB of shared memory, 3 programs per SM (shared memory binds); fp8 118-128 registers, 55 KiB,
# 4 programs (registers bind, at 128 exactly). Not yet timed on a GPU: `bench_paged_decode_attention.py
# --configs` times each neighbour.
DECODE_CONFIGS: dict[tuple[int, int], DecodeConfig] = {
    (64, 4): DecodeConfig(tile_n=64, num_warps=4, num_stages=4),
    (64, 2): DecodeConfig(tile_n=128, num_warps=4, num_stages=5),
    (64, 1): DecodeConfig(tile_n=128, num_warps=4, num_stages=5),
    (128, 4): DecodeConfig(tile_n=32, num_warps=4, num_stages=4),
    (128, 2): DecodeConfig(tile_n=64, num_warps=4, num_stages=5),
    (128, 1): DecodeConfig(tile_n=64, num_warps=4, num_stages=5),
    (256, 4): DecodeConfig(tile_n=16, num_warps=4, num_stages=4),
    (256, 2): DecodeConfig(tile_n=32, num_warps=8, num_stages=5),
    (256, 1): DecodeConfig(tile_n=32, num_warps=8, num_stages=5),
}


def decode_config(head_dim: int, cache_dtype: torch.dtype) -> DecodeConfig:
    """The table's config for this head_dim and cache dtype."""
    return DECODE_CONFIGS[(max(64, triton.next_power_of_2(head_dim)), cache_dtype.itemsize)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodePlan:
    """One decode step's launch decisions and scratch, made on the host once and shared by every layer's call.

    `num_splits * split_len` need not cover the longest sequence (the last split runs to the end), so a
    plan made from stale or assumed lengths costs speed, never correctness. Every call reuses the scratch:
    calls sharing a plan run in order on one stream, as a model's layers do.
    """

    num_seqs: int
    num_q_heads: int
    head_dim: int
    split_len: int  # tokens per split, a multiple of config.tile_n
    num_splits: int  # grid axis 2: the longest sequence's splits
    config: DecodeConfig
    part_ml: torch.Tensor | None  # fp32 [2, num_seqs, num_q_heads, num_splits]; None with one split
    part_acc: torch.Tensor | None  # fp32 [num_seqs, num_q_heads, num_splits, head_dim]; None with one split


def plan_decode(
    seq_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    device: str | torch.device,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    num_sms: int | None = None,
    config: DecodeConfig | None = None,
) -> DecodePlan:
    """The plan for a batch whose lengths the caller knows on the host (the scheduler does): no device read.

    Args:
        seq_lens: each sequence's length, as `seq_lens` will hold it on the device.
        num_splits: at most this many splits of the longest sequence (tests, benchmarks); None sizes them. A
            split is a whole number of tiles, so the plan's `split_len` is the fewest tiles holding
            `ceil(longest / num_splits)` tokens and its `num_splits` is `ceil(longest / split_len)`: fewer than
            asked when the tiles do not divide evenly (2,560 tokens in 64-token tiles asked for 64 splits
            run as 40 splits of one tile; asked for 30, as 20 of two tiles). The plan says what runs.
        num_sms: the device's SM count (default: read once from the device; tests pass a small one).
        config: tile/warps/stages (default: `DECODE_CONFIGS` for head_dim and cache_dtype).

    Raises:
        ValueError: num_splits outside [1, MAX_SPLITS].
    """
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: expected None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    device = torch.device(device)
    config = config or decode_config(head_dim, cache_dtype)
    lens = [min(n, sliding_window) if sliding_window else n for n in seq_lens]
    longest = max(lens, default=0)
    if num_splits is None:
        split_len = choose_split_len(lens, num_kv_heads, num_sms or _num_sms(device), config.tile_n)
    else:
        split_len = _round_up(max(1, math.ceil(longest / num_splits)), config.tile_n)
    num_splits = max(1, math.ceil(longest / split_len))
    split = num_splits > 1 and len(lens) > 0
    num_seqs = len(lens)
    part_ml = part_acc = None
    if split:
        part_ml = torch.empty((2, num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=device)
        part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    return DecodePlan(
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        head_dim=head_dim,
        split_len=split_len,
        num_splits=num_splits,
        config=config,
        part_ml=part_ml,
        part_acc=part_acc,
    )


def choose_split_len(seq_lens: Sequence[int], num_kv_heads: int, num_sms: int, tile_n: int) -> int:
    """Tokens per split: the batch's (token, KV head) work cut into about PROGRAMS_PER_SM x num_sms equal runs.

    Sized from the total, not the batch size, so the longest sequence of a ragged batch (one 128k among
    short ones) alone gets enough programs to fill the device, while a batch of many long sequences that
    fills it already runs one split each. At least MIN_TOKENS_PER_SPLIT, and at most MAX_SPLITS splits.
    """
    longest = max(seq_lens, default=0)
    if longest < 2 * MIN_TOKENS_PER_SPLIT:
        return _round_up(max(1, longest), tile_n)  # too short to cut in two worthwhile splits
    work = sum(seq_lens) * num_kv_heads
    even_share = math.ceil(work / (PROGRAMS_PER_SM * num_sms))
    split_len = max(even_share, MIN_TOKENS_PER_SPLIT, math.ceil(longest / MAX_SPLITS))
    return _round_up(split_len, tile_n)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1  # the interpreter runs programs on the CPU, one after another
