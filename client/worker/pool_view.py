"""A co-located worker's view of a server pool's KV memory: the same bytes, mapped, never copied.

The server allocates each pool (named shared memory on CPU, an IPC-exported allocation on CUDA)
and hands out a typed handle through GetPool (`PoolHandle`: shared memory or CUDA IPC); `PoolView` maps
it with `KVStorage.open`. A pool with a host tier also hands out that memory (shared memory, the same layout
with its own num_blocks); the view maps it too (`host_data`), for `kernels.swap_blocks`.
torch is imported only when a view is opened, so `import radixkv.client` stays torch-free.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from radixkv.client.worker.pool_info import PoolInfo
from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import LAYOUT_FIELDS, PoolHandle
from radixkv.v1 import kvcache_pb2 as pb

if TYPE_CHECKING:
    import torch

    from radixkv.memory.storage import KVStorage


class PoolSource(Protocol):
    """What `PoolView.from_client` asks of a client (`RadixKVClient`, above this package, is one)."""

    def get_pool(self) -> PoolInfo: ...


class PoolView:
    """The pool's memory in this process: `data` `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(self, info: PoolInfo) -> None:
        """Map the pool, and its host tier if it has one (page-locked in this process beside a CUDA pool)."""
        try:
            import torch  # noqa: F401  (the storage's; asked here to name the extra that brings it)
        except ModuleNotFoundError as e:
            from radixkv.extras import install_hint

            raise ImportError(
                f"PoolView maps the pool as torch tensors and needs torch: {install_hint('server')}", name="torch"
            ) from e
        from radixkv.memory.storage import KVStorage

        self.info = info
        self._storage = KVStorage.open(handle_from_proto(info.handle, info.layout))
        self._host: KVStorage | None = None
        if info.host is not None:
            try:
                self._host = KVStorage.open(handle_from_proto(info.host.handle, info.host.layout))
                if self._storage.device.type == "cuda":
                    self._host.pin()
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_client(cls, client: PoolSource) -> PoolView:
        """Map the pool `client` talks to."""
        return cls(client.get_pool())

    @property
    def layout(self) -> PoolLayout:
        return self.info.layout

    @property
    def data(self) -> torch.Tensor:
        return self._storage.data

    @property
    def host_data(self) -> torch.Tensor:
        """The host tier's memory `[num_layers, 2, host_num_blocks, block_size, num_kv_heads, head_dim]`: the other
        pool of `kernels.swap_blocks(data, host_data, offloads)` and `swap_blocks(host_data, data, loads)`.

        Raises:
            ValueError: the pool has no host tier.
        """
        if self._host is None:
            raise ValueError(f"host_data: pool {self.info.name!r} has no host tier")
        return self._host.data

    def layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s `kv_layer` `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K at 0, V at 1)."""
        return self._storage.layer(layer)

    def kv_scales(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s fp32 `[2]` (k_scale, v_scale) for an fp8 pool, else None."""
        return self._storage.kv_scales(layer)

    def close(self) -> None:
        """Drop this mapping (tensors still viewing it keep it alive until they go)."""
        self._storage.close()
        if self._host is not None:
            self._host.close()

    def __enter__(self) -> PoolView:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def handle_from_proto(handle: pb.PoolHandle, layout: PoolLayout) -> PoolHandle:
    """The handle GetPool sent (`handle` or `host_handle`) with the layout it announced beside it.

    Raises ValueError when neither kind of memory is set.
    """
    fields = {f: getattr(layout, f) for f in LAYOUT_FIELDS}
    memory = handle.WhichOneof("memory")
    if memory == "shared_memory":
        return PoolHandle(kind="shm", name=handle.shared_memory.name, **fields)
    if memory == "cuda_ipc":
        return PoolHandle(kind="cuda_ipc", **{f: getattr(handle.cuda_ipc, f) for f in _CUDA_IPC_FIELDS}, **fields)
    raise ValueError("handle: neither shared_memory nor cuda_ipc is set")


_CUDA_IPC_FIELDS = tuple(pb.CudaIpcHandle.DESCRIPTOR.fields_by_name)  # the same names as PoolHandle's fields
