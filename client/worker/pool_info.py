"""What GetPool says about a pool: its layout, device and memory handles, in plain fields a worker can be sent.

Its own module, below both the client that asks for it (`RadixKVClient.get_pool`) and the view that maps it
(`PoolView`); no torch.
"""

from __future__ import annotations

import dataclasses

from radixkv.memory.layout import PoolLayout
from radixkv.v1 import kvcache_pb2 as pb


@dataclasses.dataclass(frozen=True, slots=True)
class HostTierInfo:
    """A pool's host tier: its layout (the pool's, with its own num_blocks) and the handle of its host memory."""

    layout: PoolLayout
    handle: pb.PoolHandle  # shared_memory


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolInfo:
    """What GetPool returns: the layout, the device, and the handle to map the memory with."""

    name: str
    layout: PoolLayout
    device: str
    handle: pb.PoolHandle  # oneof memory: shared_memory (CPU) or cuda_ipc
    host: HostTierInfo | None = None  # the host tier, when the pool has one
