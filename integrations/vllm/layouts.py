"""vLLM's per-layer KV tensors against radixkv's pool layout, converted explicitly per attention backend.

vLLM 0.32 hands a connector one view per layer, logically `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`
(`[B, H, N, C]`); what the C bytes of a (block, head) mean is the attention backend's:
- `CPU_ATTN` (ISAs `vec`, `vec16`): each (block, head) run of `block_size * 2 * head_dim` elements is K transposed,
  `[head_dim, block_size]`, then V, `[block_size, head_dim]` (its `cpu_attn_reshape_and_cache` writes them so; the
  tests check a round trip against that op and the backend's attention);
- token-major CUDA backends (`FLASH_ATTN`, `TRITON_ATTN`): per (block, head, token) K's `head_dim` then V's
  (`kv_cache.transpose(1, 2).split(head_size, dim=-1)` in those backends).
radixkv's pool is `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` (K at 0, V at 1), the layout
orchestrators, the demo and the kernels read; one layer's blocks move between the two as `[n, 2, N, H, D]`.

A block's digest is BLAKE3 (32 bytes) over its bytes in radixkv's layout, every layer, K then V: the bytes of
`PoolRows.gather`'s `[n, L, 2, N, H, D]` staging, block by block. The saver computes it over what it writes into
the pool, the loader over its private copy, before vLLM sees a byte of it. BLAKE3 (the `blake3` package, which
vLLM itself depends on) hashes at memory speed and releases the GIL, so blocks are hashed on threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import blake3
import numpy as np
import torch

CPU_ISAS = ("vec", "vec16")  # the CPU backend's ISAs whose block layout is checked (the AMX one packs tiles)
TOKEN_MAJOR_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")


def runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in `blocks`, first block, count) of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for i, block in enumerate(blocks):
        if out and out[-1][1] + out[-1][2] == block:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, block, 1))
    return out


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[...] = src` (same shape and dtype, any strides). On CPU numpy's strided copy, over same-width integers
    (bfloat16 has no numpy type): 3-4x torch's `copy_` on these permuted views, near memcpy's speed."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    as_int = _SAME_WIDTH[dst.element_size()]
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


def write_blocks(kv: torch.Tensor, blocks: Sequence[int], data: torch.Tensor, place: Any) -> None:
    """`place(view, data)` for each run of consecutive `blocks` (vLLM allocates a request's blocks mostly in order):
    each byte copied once, converted on the way; scattered blocks go through one block-contiguous buffer and one
    `index_copy_`."""
    spans = runs(blocks)
    if len(spans) * 4 <= len(blocks):
        for at, first, count in spans:
            place(kv[first : first + count], data[at : at + count])
        return
    out = torch.empty((len(blocks), *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    place(out, data)
    kv.index_copy_(0, torch.tensor(blocks, dtype=torch.int64, device=kv.device), out)


def read_blocks(kv: torch.Tensor, blocks: Sequence[int], out: torch.Tensor, take: Any) -> None:
    """`take(view, out)` for each run of consecutive `blocks`: each byte copied once, converted on the way."""
    for at, first, count in runs(blocks):
        take(kv[first : first + count], out[at : at + count])


class CpuLayout:
    """`CPU_ATTN`: per (block, head), K transposed `[D, N]` then V `[N, D]`."""

    name = "CPU_ATTN"

    @staticmethod
    def take(view: torch.Tensor, out: torch.Tensor) -> None:
        """view [n, H, N, 2D] (contiguous blocks) into out [n, 2, N, H, D] (any strides): `place` reversed."""
        n, num_heads, block_size, width = view.shape
        x = view.view(n, num_heads, 2, block_size * (width // 2))
        copy_bytes(out[:, 0].permute(0, 2, 3, 1), x[:, :, 0].view(n, num_heads, width // 2, block_size))
        copy_bytes(out[:, 1].permute(0, 2, 1, 3), x[:, :, 1].view(n, num_heads, block_size, width // 2))

    @staticmethod
    def read(kv: torch.Tensor, blocks: Sequence[int], out: torch.Tensor) -> None:
        """kv [B, H, N, 2D] at `blocks` into out [n, 2, N, H, D] (any strides)."""
        read_blocks(kv, blocks, out, CpuLayout.take)

    @staticmethod
    def place(view: torch.Tensor, data: torch.Tensor) -> None:
        """data [n, 2, N, H, D] (any strides) into view [n, H, N, 2D] (contiguous blocks): K transposed, then V."""
        n, num_heads, block_size, width = view.shape
        x = view.view(n, num_heads, 2, block_size * (width // 2))
        copy_bytes(x[:, :, 0].view(n, num_heads, width // 2, block_size), data[:, 0].permute(0, 2, 3, 1))
        copy_bytes(x[:, :, 1].view(n, num_heads, block_size, width // 2), data[:, 1].permute(0, 2, 1, 3))

    @staticmethod
    def write(kv: torch.Tensor, blocks: Sequence[int], data: torch.Tensor) -> None:
        """data: [n, 2, N, H, D] (any strides) into kv [B, H, N, 2D] at `blocks`."""
        write_blocks(kv, blocks, data, CpuLayout.place)


class TokenMajorLayout:
    """Token-major CUDA backends: per (block, head, token), K's head_dim then V's."""

    name = "TOKEN_MAJOR"

    @staticmethod
    def take(view: torch.Tensor, out: torch.Tensor) -> None:
        tokens = view.permute(0, 2, 1, 3)  # [n, N, H, 2D]
        head_dim = view.shape[-1] // 2
        copy_bytes(out[:, 0], tokens[..., :head_dim])
        copy_bytes(out[:, 1], tokens[..., head_dim:])

    @staticmethod
    def read(kv: torch.Tensor, blocks: Sequence[int], out: torch.Tensor) -> None:
        read_blocks(kv, blocks, out, TokenMajorLayout.take)

    @staticmethod
    def place(view: torch.Tensor, data: torch.Tensor) -> None:
        tokens = view.permute(0, 2, 1, 3)  # [n, N, H, 2D]
        head_dim = view.shape[-1] // 2
        copy_bytes(tokens[..., :head_dim], data[:, 0])
        copy_bytes(tokens[..., head_dim:], data[:, 1])

    @staticmethod
    def write(kv: torch.Tensor, blocks: Sequence[int], data: torch.Tensor) -> None:
        write_blocks(kv, blocks, data, TokenMajorLayout.place)


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


class PoolRows:
    """radixkv's pool `[L, 2, B, N, H, D]` as rows of one (layer, K|V, block) each, for whole-block copies: a run of
    consecutive pool blocks (a sequence's blocks mostly are) moves as one copy of `L * 2` contiguous spans."""

    def __init__(self, data: torch.Tensor) -> None:
        self.num_layers, _, self.num_blocks = data.shape[:3]
        self.block_shape = tuple(data.shape[3:])  # (N, H, D)
        self.planes = data.view(self.num_layers * 2, self.num_blocks, -1)  # a view: the pool itself
        self.block_rows = (self.num_layers * 2, self.planes.shape[2])  # one block's rows, as staged

    def staging(self, num_blocks: int) -> torch.Tensor:
        """A buffer for `gather(..., into=)` of up to `num_blocks` blocks (kept and reused: a fresh one costs a page
        fault per 4 KiB on its first write, more than the copy itself)."""
        return torch.empty((num_blocks, *self.block_rows), dtype=self.planes.dtype, device=self.planes.device)

    def gather(self, blocks: Sequence[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """A private, contiguous copy of `blocks`: `[n, L, 2, N, H, D]` (one copy per run of consecutive blocks),
        in the first blocks of `into` (a `staging` buffer) if given."""
        planes = self.planes
        staged = self.staging(len(blocks)) if into is None else into[: len(blocks)]
        for at, first, count in runs(blocks):
            copy_bytes(staged[at : at + count], planes[:, first : first + count].transpose(0, 1))
        return staged.view(len(blocks), self.num_layers, 2, *self.block_shape)

    def scatter(self, blocks: Sequence[int], staged: torch.Tensor) -> None:
        """Write `staged` `[n, L, 2, N, H, D]` into `blocks` of the pool (one copy per run of consecutive blocks)."""
        rows = staged.reshape(len(blocks), *self.block_rows)
        for at, first, count in runs(blocks):
            copy_bytes(self.planes[:, first : first + count].transpose(0, 1), rows[at : at + count])


def block_digests(staged: torch.Tensor) -> list[bytes]:
    """The 32-byte BLAKE3 digest of each block of `staged` `[n, L, 2, N, H, D]` (contiguous), over its raw bytes."""
    raw = staged.detach().cpu().contiguous().view(torch.uint8).view(staged.shape[0], -1).numpy()
    return [blake3.blake3(raw[i]).digest() for i in range(raw.shape[0])]
