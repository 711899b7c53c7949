"""CUDA IPC handles through torch's public reductions: what `reduce_tensor` returns, as plain fields, and back.

No GPU is needed: a reduce result is built the way `reduce_tensor` builds one for a CUDA tensor (positional, in
`rebuild_cuda_tensor`'s order); mapping it for real is tests/core/test_storage.py's gpu-marked test.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from radixkv.memory.cuda_ipc import STORAGE_FIELDS, handle_fields, open_allocation, rebuild_arguments
from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import LAYOUT_FIELDS, PoolHandle
from radixkv.memory.storage import KVStorage
from radixkv.v1 import kvcache_pb2 as pb

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, dtype="float8_e4m3fn")
LAYOUT_ARGS = {f: getattr(LAYOUT, f) for f in LAYOUT_FIELDS}


def reduced(size_bytes: int = LAYOUT.total_bytes, event: bytes | None = b"\x02event") -> tuple:
    """What `reduce_tensor(t)` returns for a CUDA `t`: the tensor's own arguments, then its storage's."""
    return (
        rebuild_cuda_tensor,
        (
            torch.Tensor,  # tensor_cls
            torch.Size([LAYOUT.num_layers, 2, LAYOUT.num_blocks]),  # tensor_size: whatever view was reduced
            (2 * LAYOUT.num_blocks, LAYOUT.num_blocks, 1),  # tensor_stride
            0,  # tensor_offset
            torch.TypedStorage,  # storage_cls
            torch.float8_e4m3fn,  # dtype
            1,  # storage_device
            b"\x00\xffipc-handle",  # storage_handle
            size_bytes,  # storage_size_bytes
            512,  # storage_offset_bytes: the storage's place in the allocator's block
            False,  # requires_grad
            b"/torch_1234_5678_0",  # ref_counter_handle
            7,  # ref_counter_offset
            event,  # event_handle
            True,  # event_sync_required
        ),
    )


def test_the_storage_fields_round_trip_through_json() -> None:
    fields = handle_fields(reduced())
    assert fields == {
        "device_index": 1,
        "ipc_handle": b"\x00\xffipc-handle",
        "storage_size_bytes": LAYOUT.total_bytes,
        "storage_offset_bytes": 512,
        "ref_counter_handle": b"/torch_1234_5678_0",
        "ref_counter_offset": 7,
        "event_handle": b"\x02event",
        "event_sync_required": True,
    }
    handle = PoolHandle(kind="cuda_ipc", **fields, **LAYOUT_ARGS)
    assert PoolHandle.from_dict(json.loads(json.dumps(handle.to_dict()))) == handle
    # the wire's form is the edges' (server/servicer writes it, client/pool_view reads it):
    # tests/service/test_pool_handle_wire.py round-trips a cuda_ipc handle through it

    arguments = rebuild_arguments(handle)
    bound = inspect.signature(rebuild_cuda_tensor).bind(**arguments)  # every parameter, none unknown
    sent = inspect.signature(rebuild_cuda_tensor).bind(*reduced()[1]).arguments
    assert {p: bound.arguments[p] for p in STORAGE_FIELDS} == {p: sent[p] for p in STORAGE_FIELDS}
    # the tensor: the whole allocation as bytes, whatever view was reduced; the layout carves the pool out of it
    assert (arguments["tensor_size"], arguments["tensor_stride"], arguments["tensor_offset"]) == (
        (LAYOUT.total_bytes,),
        (1,),
        0,
    )
    assert arguments["dtype"] == torch.uint8 and arguments["tensor_cls"] is torch.Tensor
    assert arguments["requires_grad"] is False


def test_no_event_travels_as_empty_bytes_and_comes_back_as_none() -> None:
    fields = handle_fields(reduced(event=None))
    assert fields["event_handle"] == b""
    assert rebuild_arguments(PoolHandle(kind="cuda_ipc", **fields, **LAYOUT_ARGS))["event_handle"] is None


def test_the_mapping_names_every_cuda_ipc_field_of_the_handle_and_the_wire() -> None:
    """Each storage argument has its handle field and wire field, and torch still has each parameter."""
    handle_fields_ = {f.name for f in dataclasses.fields(PoolHandle)} - {"kind", "name", *LAYOUT_FIELDS}
    assert (
        {field for field, _ in STORAGE_FIELDS.values()}
        == handle_fields_
        == set(pb.CudaIpcHandle.DESCRIPTOR.fields_by_name)
    )
    assert set(STORAGE_FIELDS) <= set(inspect.signature(rebuild_cuda_tensor).parameters)


def test_a_cpu_tensor_is_not_shared_by_cuda_ipc() -> None:
    with pytest.raises(ValueError, match=r"^export_handle: torch shares this tensor by 'rebuild_tensor'"):
        handle_fields(reduce_tensor(torch.zeros(3)))


def test_a_reduce_result_that_does_not_fit_the_signature_names_it() -> None:
    rebuild, args = reduced()
    with pytest.raises(ValueError, match=r"rebuild_cuda_tensor\(tensor_cls.*event_sync_required"):
        handle_fields((rebuild, args[:-1]))


def test_open_refuses_a_storage_smaller_than_the_layout() -> None:
    handle = PoolHandle(kind="cuda_ipc", **handle_fields(reduced(size_bytes=LAYOUT.total_bytes - 1)), **LAYOUT_ARGS)
    with pytest.raises(ValueError, match=rf"^handle: the CUDA storage holds {LAYOUT.total_bytes - 1} bytes"):
        KVStorage.open(handle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_opening_a_cuda_pool_without_cuda_says_so() -> None:
    with pytest.raises(ValueError, match="^handle: mapping a CUDA pool needs CUDA"):
        open_allocation(PoolHandle(kind="cuda_ipc", **handle_fields(reduced()), **LAYOUT_ARGS))
