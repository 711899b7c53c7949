"""A co-located worker's view of a server pool's KV memory: the same bytes, mapped, never copied.

The server allocates each pool (named shared memory on CPU, an IPC-exported allocation on CUDA)
and hands out a typed handle through GetPool (`PoolHandle`: shared memory or CUDA IPC); `PoolView` maps
it with `KVStorage.open`.
torch is imported only when a view is opened, so `import radixkv.client` stays torch-free.
"""

from __future__ import annotations

import dataclasses
from types import TracebackType
from typing import TYPE_CHECKING

from radixkv.layout import PoolLayout
from radixkv.v1 import kvcache_pb2 as pb

if TYPE_CHECKING:
    import torch

    from radixkv.client.client import RadixKVClient


@dataclasses.dataclass(frozen=True, slots=True)
class PoolInfo:
    """What GetPool returns: the layout, the device, and the handle to map the memory with."""

    name: str
    layout: PoolLayout
    device: str
    handle: pb.PoolHandle  # oneof memory: shared_memory (CPU) or cuda_ipc


class PoolView:
    """The pool's memory in this process: `data` `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(self, info: PoolInfo) -> None:
        from radixkv.storage import KVStorage, PoolHandle

        self.info = info
        self._storage = KVStorage.open(PoolHandle.from_proto(info.handle, info.layout))

    @classmethod
    def from_client(cls, client: RadixKVClient) -> PoolView:
        """Map the pool `client` talks to."""
        return cls(client.get_pool())

    @property
    def layout(self) -> PoolLayout:
        return self.info.layout

    @property
    def data(self) -> torch.Tensor:
        return self._storage.data

    def layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s `kv_layer` `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K at 0, V at 1)."""
        return self._storage.layer(layer)

    def kv_scales(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s fp32 `[2]` (k_scale, v_scale) for an fp8 pool, else None."""
        return self._storage.kv_scales(layer)

    def close(self) -> None:
        """Drop this mapping (tensors still viewing it keep it alive until they go)."""
        self._storage.close()

    def __enter__(self) -> PoolView:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
