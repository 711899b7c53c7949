"""A CUDA allocation shared between processes through torch's public reductions, as a handle's plain fields.

torch shares a CUDA tensor as `reduce_tensor(t) -> (rebuild_cuda_tensor, args)`, the pair pickle would send. Of
those arguments only the storage's travel (which allocation, the storage's place in it, the producer's reference
counter and event), as `PoolHandle` fields, so nothing is pickled; the tensor's own (a uint8 view of the whole
storage) follow from the pool's layout. The arguments are matched to `rebuild_cuda_tensor`'s parameters by name, so
a torch that reorders them still maps, and one that renames them fails here with a message naming the parameter.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from radixkv.memory.pool_handle import PoolHandle

# rebuild_cuda_tensor's parameter -> (the PoolHandle field that carries it, that field's plain type)
STORAGE_FIELDS: dict[str, tuple[str, type]] = {
    "storage_device": ("device_index", int),
    "storage_handle": ("ipc_handle", bytes),
    "storage_size_bytes": ("storage_size_bytes", int),
    "storage_offset_bytes": ("storage_offset_bytes", int),
    "ref_counter_handle": ("ref_counter_handle", bytes),
    "ref_counter_offset": ("ref_counter_offset", int),
    "event_handle": ("event_handle", bytes),  # None (no event to wait for) travels as b""
    "event_sync_required": ("event_sync_required", bool),
}
_REBUILD = inspect.signature(rebuild_cuda_tensor)


def handle_fields(reduced: tuple[Any, tuple[Any, ...]]) -> dict[str, Any]:
    """The plain `PoolHandle` fields of `reduce_tensor(t)`'s result for a CUDA tensor `t`.

    Raises:
        ValueError: the result does not rebuild a CUDA tensor, or torch's parameters are not the ones mapped here.
    """
    rebuild, args = reduced
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"export_handle: torch shares this tensor by {getattr(rebuild, '__name__', rebuild)!r}")
    arguments = _bind(args)
    return {field: kind(arguments[parameter] or kind()) for parameter, (field, kind) in STORAGE_FIELDS.items()}


def rebuild_arguments(handle: PoolHandle) -> dict[str, Any]:
    """`rebuild_cuda_tensor`'s keyword arguments for the whole allocation `handle` names, as uint8 `[total_bytes]`."""
    arguments: dict[str, Any] = {
        "tensor_cls": torch.Tensor,
        "tensor_size": (handle.layout.total_bytes,),
        "tensor_stride": (1,),
        "tensor_offset": 0,
        "storage_cls": torch.UntypedStorage,
        "dtype": torch.uint8,
        "requires_grad": False,
        **{parameter: getattr(handle, field) for parameter, (field, _) in STORAGE_FIELDS.items()},
    }
    arguments["event_handle"] = handle.event_handle or None
    _bind((), arguments)
    return arguments


def export_fields(tensor: torch.Tensor) -> dict[str, Any]:
    """The plain fields naming `tensor`'s CUDA storage; one set per opening process (each carries its own
    reference-counter slot, which the opener releases when its mapping goes)."""
    return handle_fields(reduce_tensor(tensor))


def open_allocation(handle: PoolHandle) -> torch.Tensor:
    """The allocation `handle` names, mapped into this process: uint8 `[total_bytes]` on `cuda:<device_index>`.

    Raises:
        ValueError: the storage is smaller than the handle's layout, or this process has no CUDA.
    """
    if handle.storage_size_bytes < handle.layout.total_bytes:
        needs = handle.layout.total_bytes
        raise ValueError(f"handle: the CUDA storage holds {handle.storage_size_bytes} bytes, layout needs {needs}")
    if not torch.cuda.is_available():
        raise ValueError(f"handle: mapping a CUDA pool needs CUDA in this process (torch {torch.__version__})")
    return rebuild_cuda_tensor(**rebuild_arguments(handle))


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """`rebuild_cuda_tensor`'s arguments by parameter name; a ValueError naming torch's signature if they do not fit."""
    where = f"torch.multiprocessing.reductions.rebuild_cuda_tensor{_REBUILD}"
    try:
        arguments = dict(_REBUILD.bind(*args, **(kwargs or {})).arguments)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from e
    missing = sorted(set(STORAGE_FIELDS) - set(arguments))
    if missing:
        raise ValueError(f"{where}: no parameter {missing[0]!r}")
    return arguments
