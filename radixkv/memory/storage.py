"""The pool's KV memory: one tensor per pool, shareable with co-located worker processes by a plain-field handle.

CPU pools live in named POSIX shared memory, CUDA pools in the creator's allocation exported as a CUDA
IPC handle, so the memory belongs to the server and outlives the workers that map it. Torch is needed
here, which is why `radixkv/__init__` never imports this module. Beside it: the handle (`radixkv.memory.pool_handle`),
the shared-memory segment (`radixkv.memory.shm_segment`), the CUDA IPC fields (`radixkv.memory.cuda_ipc`) and
sizing a pool to memory (`radixkv.memory.memory_sizing`).
"""

from __future__ import annotations

from multiprocessing import shared_memory

import torch

from radixkv.memory.cuda_ipc import export_fields, open_allocation
from radixkv.memory.layout import DTYPE_BYTES, PoolLayout
from radixkv.memory.pool_handle import LAYOUT_FIELDS, PoolHandle
from radixkv.memory.shm_segment import AttachedSegment, attach_untracked, bytes_over, create_segment

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}  # same names as torch
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped: every device, by address


class KVStorage:
    """A pool's memory as one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, and for
    fp8 pools the fp32 `[num_layers, 2]` K/V scales that follow it in the same allocation.

    The creator owns the memory (`create`); other processes map it (`open(handle)`). Closing drops this
    object's mapping; tensors still viewing it keep it mapped until they are freed, so no view ever
    points at unmapped memory. Exiting a `with` block closes, and the creator also unlinks.
    """

    def __init__(
        self,
        layout: PoolLayout,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        *,
        shm: shared_memory.SharedMemory | AttachedSegment | None,  # the creator's SharedMemory, an opener's attachment
        owner: bool,
    ):
        self.layout = layout
        self.device = data.device
        self._data: torch.Tensor | None = data  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self._scales = scales  # fp32 [num_layers, 2] (k_scale, v_scale) for fp8 pools, else None
        self._shm = shm
        self._owner = owner
        self._unlinked = False
        self._pinned = False  # page-locked in this process (cudaHostRegister): a host tier beside a CUDA pool
        # A CUDA allocation mapped from another process cannot be exported again: its handle is passed on as is.
        self._imported_handle: PoolHandle | None = None
        self.check_invariants()

    @classmethod
    def create(
        cls,
        layout: PoolLayout,
        device: str | torch.device = "cpu",
        *,
        name: str | None = None,
        kv_scales: list[tuple[float, float]] | None = None,
    ) -> KVStorage:
        """Allocate a zero-filled pool: named shared memory on CPU, `torch.zeros` on CUDA.

        Args:
            name: the shared-memory segment (CPU only); None makes `radixkv-<pid>-<random>`.
            kv_scales: fp8 pools only: each layer's (k_scale, v_scale); None gives 1.0 (as vLLM without
                calibrated scales: values beyond +-448 saturate).

        Raises:
            ValueError: an unsupported device, a name given for CUDA, scales for a pool that is not fp8
                or not one positive pair per layer, or more bytes than /dev/shm has free.
        """
        device = torch.device(device)
        scales = _initial_scales(layout, kv_scales)
        if device.type == "cuda":
            if name is not None:
                raise ValueError("name: only CPU pools live in named shared memory")
            storage = cls(
                layout,
                *_views(torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device), layout),
                shm=None,
                owner=True,
            )
            storage._init_scales(scales)
            return storage
        if device.type != "cpu":
            raise ValueError(f"device: expected cpu or cuda, got {device}")
        shm = create_segment(layout, name)
        storage = cls(layout, *_views(bytes_over(shm, layout), layout), shm=shm, owner=True)
        storage._init_scales(scales)
        return storage

    @classmethod
    def create_host(cls, layout: PoolLayout, *, name: str | None = None, pin: bool | None = None) -> KVStorage:
        """A host-tier pool: CPU named shared memory, so co-located workers map it as they map the device pool.

        `pin` (None: when CUDA is present) page-locks it (`pin`), so `kernels.swap_blocks` reads and writes it
        from the GPU directly.
        """
        storage = cls.create(layout, "cpu", name=name)
        if pin if pin is not None else torch.cuda.is_available():
            try:
                storage.pin()
            except BaseException:
                storage.close()
                storage.unlink()
                raise
        return storage

    def pin(self) -> None:
        """Page-lock this process's mapping of a CPU pool (`cudaHostRegister`, portable and mapped), so CUDA
        kernels address it directly; `close` unpins. Each process that swaps with it pins its own mapping.

        Raises:
            ValueError: a CUDA pool, no CUDA, or CUDA refused (the message names its error).
        """
        if self.device.type != "cpu":
            raise ValueError("pin: only a CPU pool is page-locked")
        if not torch.cuda.is_available():
            raise ValueError("pin: page-locking a pool needs CUDA")
        if self._pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.layout.total_bytes, _HOST_REGISTER_FLAGS)
        if int(err) != 0:
            raise ValueError(f"pin: cudaHostRegister failed with CUDA error {int(err)}")
        self._pinned = True

    @property
    def is_pinned(self) -> bool:
        return self._pinned

    @classmethod
    def open(cls, handle: PoolHandle) -> KVStorage:
        """Map the pool `handle` names (exported by another process) into this process.

        CUDA IPC cannot reopen an allocation in the process that exported it.

        Raises:
            ValueError: the segment or CUDA storage is smaller than the handle's layout, or the handle's kind
                is unknown.
        """
        layout = handle.layout
        if handle.kind == "shm":
            shm = attach_untracked(handle.name)
            if shm.size < layout.total_bytes:
                shm.close()
                raise ValueError(
                    f"handle: segment {handle.name!r} holds {shm.size} bytes, layout needs {layout.total_bytes}"
                )
            return cls(layout, *_views(bytes_over(shm, layout), layout), shm=shm, owner=False)
        if handle.kind != "cuda_ipc":
            raise ValueError(f"handle: kind must be 'shm' or 'cuda_ipc', got {handle.kind!r}")
        buffer = open_allocation(handle)  # uint8 [total_bytes] on cuda:<device_index>
        opened = cls(layout, *_views(buffer, layout), shm=None, owner=False)
        opened._imported_handle = handle
        return opened

    @property
    def data(self) -> torch.Tensor:
        """The whole pool `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`."""
        if self._data is None:
            raise ValueError("KVStorage: closed")
        return self._data

    def layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s K and V, the kernels' `kv_layer`: a view
        `[2, num_blocks, block_size, num_kv_heads, head_dim]`
        (`k_cache, v_cache = storage.layer(l)` unpacks it)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.layout.num_layers}, got {layer}")
        return self.data[layer]

    def kv_scales(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s fp32 `[2]` (k_scale, v_scale), the kernels' `kv_scales`: a view, on the pool's device;
        None unless the pool is fp8."""
        self.layer(layer)  # checks the index
        return None if self._scales is None else self._scales[layer]

    def _init_scales(self, scales: list[tuple[float, float]] | None) -> None:
        if self._scales is not None and scales is not None:
            self._scales.copy_(torch.tensor(scales, dtype=torch.float32))

    def export_handle(self) -> PoolHandle:
        """The handle another process passes to `KVStorage.open`; for CUDA, one per opening process."""
        fields = {f: getattr(self.layout, f) for f in LAYOUT_FIELDS}
        if self._imported_handle is not None:
            return self._imported_handle  # the exporter's (a keeper's) allocation, which any process may open
        if self._shm is not None:
            if self._unlinked:
                raise ValueError(f"export_handle: segment {self._shm.name!r} was unlinked")
            return PoolHandle(kind="shm", name=self._shm.name, **fields)
        return PoolHandle(kind="cuda_ipc", **export_fields(self.data), **fields)

    def close(self) -> None:
        """Drop this object's mapping (CUDA: after this process's queued work on it finishes). Idempotent."""
        if self._data is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._pinned:
            torch.cuda.synchronize()  # no queued swap still reads or writes the memory
            torch.cuda.cudart().cudaHostUnregister(self._data.data_ptr())
            self._pinned = False
        self._data = None
        self._scales = None

    def unlink(self) -> None:
        """Creator only: free the shared-memory name (the memory goes with the last mapping).

        Idempotent; CUDA: no-op."""
        if not self._owner:
            raise ValueError("unlink: only the process that created the pool frees it")
        if isinstance(self._shm, shared_memory.SharedMemory) and not self._unlinked:
            self._shm.unlink()
            self._unlinked = True

    def check_invariants(self) -> None:
        if self._data is not None:
            assert tuple(self._data.shape) == self.layout.shape, (
                f"KVStorage: data shape {tuple(self._data.shape)} != layout"
            )
            assert self._data.dtype == TORCH_DTYPES[self.layout.dtype], f"KVStorage: dtype {self._data.dtype} != layout"
            assert self._data.is_contiguous(), "KVStorage: pool tensor is not contiguous"
            assert (self._scales is not None) == self.layout.is_scaled, "KVStorage: scales exist iff the dtype is fp8"

    def __enter__(self) -> KVStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        where = f"shm {self._shm.name!r}" if self._shm is not None else str(self.device)
        return f"KVStorage({self.layout}, {where}, {'closed' if self._data is None else 'open'})"


def _initial_scales(
    layout: PoolLayout, kv_scales: list[tuple[float, float]] | None
) -> list[tuple[float, float]] | None:
    """The scales a new pool starts with: one positive (k, v) pair per layer for fp8, none otherwise."""
    if not layout.is_scaled:
        if kv_scales is not None:
            raise ValueError(f"kv_scales: only fp8 pools are scaled, this one is {layout.dtype}")
        return None
    scales = kv_scales if kv_scales is not None else [(1.0, 1.0)] * layout.num_layers
    ok = len(scales) == layout.num_layers and all(
        len(pair) == 2 and all(isinstance(x, (int, float)) and 0 < x < float("inf") for x in pair) for pair in scales
    )
    if not ok:
        raise ValueError(f"kv_scales: expected {layout.num_layers} (k_scale, v_scale) pairs of positive numbers")
    return [(float(k), float(v)) for k, v in scales]


def _views(buffer: torch.Tensor, layout: PoolLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool tensor and (fp8 only) the scales tensor, as views of the allocation's bytes."""
    data = buffer[: layout.kv_bytes].view(TORCH_DTYPES[layout.dtype]).view(layout.shape)
    if not layout.is_scaled:
        return data, None
    scales = buffer[layout.scales_offset : layout.scales_offset + layout.scales_bytes]
    return data, scales.view(torch.float32).view(layout.num_layers, 2)
