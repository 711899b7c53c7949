"""vLLM's per-layer KV tensors against radixkv's pool layout, converted explicitly per attention backend.

vLLM 0.32 hands a connector one view per layer, logically `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`
(`[B, H, N, C]`); what the C bytes of a (block, head) mean is the attention backend's:
- `CPU_ATTN` (ISAs `vec`, `vec16`): each (block, head) run of `block_size * 2 * head_dim` elements is K transposed,
  `[head_dim, block_size]`, then V, `[block_size, head_dim]` (its `cpu_attn_reshape_and_cache` writes them so; the
  tests check a round trip against that op and the backend's attention);
- token-major CUDA backends (`FLASH_ATTN`, `TRITON_ATTN`): per (block, head, token) K's `head_dim` then V's
  (`kv_cache.transpose(1, 2).split(head_size, dim=-1)` in those backends).
radixkv's pool is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (K at 0, V at 1), the layout
orchestrators, the demo and the kernels read; blocks move between the two as `[2, n, block_size, H, D]`.

A block's checksum is over its bytes in radixkv's layout, every layer, K and V: the saver computes it over what it
writes into the pool, the loader over what it copied out, before vLLM sees a byte of it.
"""

from __future__ import annotations

import torch

CPU_ISAS = ("vec", "vec16")  # the CPU backend's ISAs whose block layout is checked (the AMX one packs tiles)
TOKEN_MAJOR_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


class CpuLayout:
    """`CPU_ATTN`: per (block, head), K transposed `[D, N]` then V `[N, D]`."""

    name = "CPU_ATTN"

    @staticmethod
    def read(kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """kv: [B, H, N, 2D] (vLLM's view); blocks: int64 [n] -> [2, n, N, H, D]."""
        n, (_, num_heads, block_size, width) = len(blocks), kv.shape
        head_dim = width // 2
        x = kv.index_select(0, blocks).reshape(n, num_heads, 2, block_size * head_dim)  # [n, H, 2, N*D]
        k = x[:, :, 0].reshape(n, num_heads, head_dim, block_size).permute(0, 3, 1, 2)  # [n, N, H, D]
        v = x[:, :, 1].reshape(n, num_heads, block_size, head_dim).permute(0, 2, 1, 3)  # [n, N, H, D]
        return torch.stack((k, v))

    @staticmethod
    def write(kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        """data: [2, n, N, H, D] into kv [B, H, N, 2D] at `blocks`."""
        n, (_, num_heads, block_size, width) = len(blocks), kv.shape
        kt = data[0].permute(0, 2, 3, 1).reshape(n, num_heads, -1)  # [n, H, D*N]: K transposed
        v = data[1].permute(0, 2, 1, 3).reshape(n, num_heads, -1)  # [n, H, N*D]
        kv.index_copy_(0, blocks, torch.stack((kt, v), 2).reshape(n, num_heads, block_size, width))


class TokenMajorLayout:
    """Token-major CUDA backends: per (block, head, token), K's head_dim then V's."""

    name = "TOKEN_MAJOR"

    @staticmethod
    def read(kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        head_dim = kv.shape[-1] // 2
        x = kv.index_select(0, blocks).permute(0, 2, 1, 3)  # [n, N, H, 2D]
        return torch.stack((x[..., :head_dim], x[..., head_dim:]))

    @staticmethod
    def write(kv: torch.Tensor, blocks: torch.Tensor, data: torch.Tensor) -> None:
        kv.index_copy_(0, blocks, torch.cat((data[0], data[1]), -1).permute(0, 2, 1, 3))


def layout_for(backend: str, isa: str | None) -> type[CpuLayout] | type[TokenMajorLayout]:
    """The converter for an attention backend (and the CPU backend's ISA); ValueError for one not checked."""
    if backend == "CPU_ATTN":
        if isa not in CPU_ISAS:
            raise ValueError(
                f"RadixKVConnector: vLLM's CPU attention runs ISA {isa!r}, whose KV block layout is not one this "
                f"connector converts ({', '.join(CPU_ISAS)}; AMX packs bfloat16 tiles): use float32 or float16"
            )
        return CpuLayout
    if backend in TOKEN_MAJOR_BACKENDS:
        return TokenMajorLayout
    raise ValueError(
        f"RadixKVConnector: attention backend {backend!r} is not one this connector converts "
        f"(CPU_ATTN, {', '.join(TOKEN_MAJOR_BACKENDS)})"
    )


_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def block_checksums(blocks: torch.Tensor) -> list[int]:
    """One nonzero 64-bit checksum per block of `blocks` [L, 2, n, N, H, D] (radixkv's layout, n blocks).

    A position-weighted sum of the block's 32-bit words with odd 64-bit weights (wrapping): any change of one
    word changes it, and independent changes cancel with probability ~2^-64. The same torch ops on CPU and
    CUDA, batched over the step's blocks; bit 0 is set so that 0 stays "none" on the wire.
    """
    n = blocks.shape[2]
    words = blocks.movedim(2, 0).contiguous().view(n, -1).view(torch.int32).to(torch.int64)  # [n, m]
    key = (words.shape[1], str(words.device))
    weights = _WEIGHTS.get(key)
    if weights is None:
        seeded = torch.Generator().manual_seed(0x5AD1C5)
        weights = torch.randint(-(2**62), 2**62, (words.shape[1],), generator=seeded, dtype=torch.int64) | 1
        weights = _WEIGHTS.setdefault(key, weights.to(words.device))
    sums = (words * weights).sum(1) | 1
    return [s & 0xFFFFFFFFFFFFFFFF for s in sums.tolist()]
