"""A pool's `DiskShape`: its layout's fields and the hash contract its blocks are named by."""

from __future__ import annotations

import dataclasses

from radixkv.disk.object_format import DiskShape
from radixkv.memory.layout import PoolLayout
from radixkv.tree.block_hash import HashContract


def disk_shape(layout: PoolLayout) -> DiskShape:
    """What an object of this pool must say it holds; every other object is foreign."""
    contract = HashContract(block_size=layout.block_size)
    fields = tuple((f.name, getattr(contract, f.name)) for f in dataclasses.fields(contract))
    return DiskShape(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_size=layout.block_size,
        bytes_per_block=layout.bytes_per_block,
        hash_contract=fields,
    )
