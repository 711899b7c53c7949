"""A model-runner stand-in, run as its own process: map the server's pool and write one sequence's K/V.

Usage: python kv_worker.py ADDRESS SLOTS_JSON BLOCK_IDS_JSON SEED
Writes seeded random K and V for every layer at SLOTS through `PoolView`, then prints the SHA-256
of data[:, :, BLOCK_IDS] as its own mapping holds them (the Debug service's checksum format).
"""

import hashlib
import json
import sys

import torch

from radixkv.client import PoolView, RadixKVClient


def seeded_kv(
    num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """kv: [num_layers, 2, num_slots, num_kv_heads, head_dim], the values the worker writes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_layers, 2, num_slots, num_kv_heads, head_dim, generator=generator).to(dtype)


def main(address: str, slots: list[int], block_ids: list[int], seed: int) -> None:
    with RadixKVClient(address) as client, PoolView.from_client(client) as view:
        layout = view.layout
        kv = seeded_kv(len(slots), layout.num_layers, layout.num_kv_heads, layout.head_dim, seed, view.data.dtype)
        index = torch.tensor(slots, dtype=torch.long)
        for layer in range(layout.num_layers):
            k_cache, v_cache = view.layer(layer)  # [num_blocks, block_size, num_kv_heads, head_dim] each
            k_cache.view(-1, layout.num_kv_heads, layout.head_dim)[index] = kv[layer, 0]
            v_cache.view(-1, layout.num_kv_heads, layout.head_dim)[index] = kv[layer, 1]
        written = view.data[:, :, torch.tensor(block_ids, dtype=torch.long)].contiguous()
        print(hashlib.sha256(written.view(torch.uint8).numpy().tobytes()).hexdigest())


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))
