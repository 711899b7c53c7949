"""A pool's handle on the wire: the server writes it (GetPool), the client reads it back, field for field."""

from __future__ import annotations

import pytest

from radixkv.client.worker.pool_view import handle_from_proto
from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import PoolHandle
from radixkv.memory.storage import KVStorage
from radixkv.server.wire.servicer import _handle
from radixkv.v1 import kvcache_pb2 as pb

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, dtype="float16")


@pytest.fixture
def storage():
    with KVStorage.create(LAYOUT) as s:
        yield s


def test_handle_round_trips_through_the_typed_proto(storage):
    handle = storage.export_handle()
    typed = _handle(handle)
    assert typed.WhichOneof("memory") == "shared_memory" and typed.shared_memory.name == handle.name
    assert handle_from_proto(pb.PoolHandle.FromString(typed.SerializeToString()), LAYOUT) == handle
    cuda_like = PoolHandle(
        kind="cuda_ipc",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        num_blocks=8,
        dtype="bfloat16",
        device_index=1,
        ipc_handle=b"\x00\xffipc",
        storage_size_bytes=4096,
        storage_offset_bytes=512,
        ref_counter_handle=b"rc",
        ref_counter_offset=3,
        event_handle=b"\x01",
        event_sync_required=True,
    )
    typed = pb.PoolHandle.FromString(_handle(cuda_like).SerializeToString())
    assert typed.WhichOneof("memory") == "cuda_ipc" and typed.cuda_ipc.ipc_handle == b"\x00\xffipc"
    assert handle_from_proto(typed, cuda_like.layout) == cuda_like


def test_handle_from_proto_rejects_an_unset_memory():
    with pytest.raises(ValueError, match="neither shared_memory nor cuda_ipc"):
        handle_from_proto(pb.PoolHandle(), LAYOUT)
