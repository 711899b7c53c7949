"""KVStorage: shared-memory pools mapped by another process, handles as plain dicts, closing, and sizing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

import radixkv.memory.memory_sizing
from radixkv.memory.layout import DTYPE_BYTES, PoolLayout
from radixkv.memory.memory_sizing import free_memory_bytes, layout_for_memory
from radixkv.memory.pool_handle import LAYOUT_FIELDS, PoolHandle
from radixkv.memory.storage import TORCH_DTYPES, KVStorage
from radixkv.server.process.spawn import patient

LAYOUT = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, dtype="float16")
HAS_SHM_DIR = os.path.isdir("/dev/shm")


def shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(name in line for line in f)


@pytest.fixture
def storage():
    with KVStorage.create(LAYOUT) as s:
        yield s


def pattern(numel: int, salt: int, device: str = "cpu") -> torch.Tensor:
    return ((torch.arange(numel, dtype=torch.int32, device=device) * 7 + salt) % 65521 - 32760).to(torch.int16)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_create_is_zero_filled_and_shaped(dtype):
    layout = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, dtype=dtype)
    with KVStorage.create(layout) as s:
        assert s.data.shape == layout.shape and s.data.dtype == TORCH_DTYPES[dtype] and s.data.is_contiguous()
        assert s.data.numel() * s.data.element_size() == layout.kv_bytes
        assert layout.total_bytes == (layout.scales_offset + 2 * 2 * 4 if layout.is_scaled else layout.kv_bytes)
        assert (s.kv_scales(1) is not None) == dtype.startswith("float8")
        assert not s.data.view(torch.uint8).any()
        assert s.layer(1).shape == (2, 8, 4, 2, 16)
        k, v = s.layer(1)
        assert k.shape == (8, 4, 2, 16)
        k.view(torch.uint8).fill_(1)
        assert s.data[1, 0].view(torch.uint8).all() and not s.data[1, 1].view(torch.uint8).any()


def test_fp8_pool_carries_its_scales():
    """Per-layer K and V scales live in the pool's own memory, after the blocks: a mapping process reads them."""
    layout = PoolLayout(
        num_layers=2, num_kv_heads=1, head_dim=18, block_size=1, num_blocks=3, dtype="float8_e4m3fn"
    )  # 216 bytes of blocks: the scales start aligned, at 224
    with KVStorage.create(layout, kv_scales=[(0.5, 0.25), (2.0, 4.0)]) as s:
        assert layout.kv_bytes == 216 and layout.scales_offset == 224 and layout.total_bytes == 224 + 16
        assert s.kv_scales(1).tolist() == [2.0, 4.0] and s.kv_scales(0).dtype == torch.float32
        mapped_too = KVStorage.open(s.export_handle())
        assert mapped_too.kv_scales(0).tolist() == [0.5, 0.25]
        s.kv_scales(0)[1] = 8.0
        assert mapped_too.kv_scales(0).tolist() == [0.5, 8.0], "one allocation, seen by every mapping"
        assert not s.data.view(torch.uint8).any(), "the scales sit past the blocks"
        mapped_too.close()
    with KVStorage.create(layout) as s:
        assert s.kv_scales(0).tolist() == [1.0, 1.0] and s.kv_scales(1).tolist() == [1.0, 1.0]
    with KVStorage.create(LAYOUT) as s:
        assert s.kv_scales(0) is None


@pytest.mark.parametrize(
    "layout,kv_scales",
    [
        (LAYOUT, [(1.0, 1.0), (1.0, 1.0)]),  # float16: nothing to scale
        (
            PoolLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, num_blocks=2, dtype="float8_e4m3fn"),
            [(1.0, 1.0)],
        ),  # one pair for two layers
        (
            PoolLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=4, num_blocks=2, dtype="float8_e4m3fn"),
            [(1.0, 0.0), (1.0, 1.0)],
        ),  # a zero scale
    ],
)
def test_bad_kv_scales(layout, kv_scales):
    with pytest.raises(ValueError, match="^kv_scales"):
        KVStorage.create(layout, kv_scales=kv_scales)


def test_fp8_layout_for_a_budget_fits_it():
    shape = dict(num_layers=3, num_kv_heads=1, head_dim=64, block_size=16)
    layout = PoolLayout.for_budget(2**20, **shape, dtype="float8_e4m3fn")
    fp16 = PoolLayout.for_budget(2**20, **shape, dtype="float16")
    assert layout.total_bytes <= 2**20
    assert layout.num_blocks == (2**20 - 16 - 24) // 6144 == 2 * fp16.num_blocks  # the scales' 24 bytes (+16 align) off


def test_layer_out_of_range(storage):
    with pytest.raises(ValueError, match="^layer"):
        storage.layer(2)


def test_handle_round_trips_through_json(storage):
    handle = storage.export_handle()
    assert handle.kind == "shm" and handle.layout == LAYOUT
    plain = json.loads(json.dumps(handle.to_dict()))
    assert PoolHandle.from_dict(plain) == handle
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
        ref_counter_handle=b"rc",
        ref_counter_offset=3,
        event_handle=b"\x01",
        event_sync_required=True,
    )
    plain = json.loads(json.dumps(cuda_like.to_dict()))
    assert plain["ipc_handle"] == "00ff697063"
    assert PoolHandle.from_dict(plain) == cuda_like


@pytest.mark.parametrize(
    "change",
    [
        lambda d: {k: v for k, v in d.items() if k != "num_blocks"},
        lambda d: d | {"extra": 1},
        lambda d: d | {"num_blocks": "8"},
        lambda d: d | {"num_blocks": True},
        lambda d: d | {"ipc_handle": "zz"},
        lambda d: d | {"kind": "nfs"},
        lambda d: d | {"block_size": 3},
    ],
    ids=["missing", "unknown", "str for int", "bool for int", "bad hex", "bad kind", "bad layout"],
)
def test_handle_from_dict_rejects(storage, change):
    with pytest.raises(ValueError):
        PoolHandle.from_dict(change(storage.export_handle().to_dict()))


# The worker side: map the pool from the handle's JSON, check the parent's pattern in layer 0, write layer 1.
WORKER = """
import json, sys, torch
from radixkv.memory.pool_handle import LAYOUT_FIELDS, PoolHandle
from radixkv.memory.storage import KVStorage
handle = PoolHandle.from_dict(json.loads(sys.argv[1]))
salt_in, salt_out = int(sys.argv[2]), int(sys.argv[3])
device = "cuda" if handle.kind == "cuda_ipc" else "cpu"
def pattern(n, salt):
    return ((torch.arange(n, dtype=torch.int32, device=device) * 7 + salt) % 65521 - 32760).to(torch.int16)
s = KVStorage.open(handle)
layer0 = s.data[0].view(torch.int16).flatten()
if not torch.equal(layer0, pattern(layer0.numel(), salt_in)):
    sys.exit(3)
layer1 = s.data[1].view(torch.int16).flatten()
layer1.copy_(pattern(layer1.numel(), salt_out))
del layer0, layer1
s.close()
"""


def run_worker(handle: PoolHandle, salt_in: int, salt_out: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(handle.to_dict()), str(salt_in), str(salt_out)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_another_process_maps_the_same_memory(storage):
    layer0 = storage.data[0].view(torch.int16).flatten()
    layer0.copy_(pattern(layer0.numel(), 11))
    handle = storage.export_handle()
    result = run_worker(handle, 11, 29)
    assert result.returncode == 0, result.stderr
    assert "leaked" not in result.stderr and "resource_tracker" not in result.stderr
    layer1 = storage.data[1].view(torch.int16).flatten()
    assert torch.equal(layer1, pattern(layer1.numel(), 29))
    if HAS_SHM_DIR:  # the worker's exit must not have unlinked the creator's segment
        assert shm_exists(handle.name)
    with KVStorage.open(handle) as reopened:  # the name still opens after the worker's exit
        assert torch.equal(reopened.data[1].view(torch.int16).flatten(), layer1)


@pytest.mark.skipif(not HAS_SHM_DIR, reason="needs /dev/shm")
def test_unlink_leaves_nothing_in_dev_shm():
    s = KVStorage.create(LAYOUT)
    name = s.export_handle().name
    assert name.startswith(f"radixkv-{os.getpid()}-") and shm_exists(name)
    s.close()
    s.unlink()
    assert not shm_exists(name)
    s.unlink()  # idempotent
    with pytest.raises(ValueError, match="^export_handle"):
        s.export_handle()
    with KVStorage.create(LAYOUT) as s:
        name = s.export_handle().name
        with KVStorage.open(s.export_handle()) as opened:
            opened.data[0, 0, 0, 0, 0, 0] = 1.5
        assert shm_exists(name), "an opener's exit does not unlink"
        assert float(s.data[0, 0, 0, 0, 0, 0]) == 1.5
    assert not shm_exists(name), "the creator's exit unlinks"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_close_keeps_live_views_mapped_until_freed():
    with KVStorage.create(LAYOUT) as s:
        name = s.export_handle().name
        k, v = s.layer(0)
        k.fill_(2.0)
        s.close()
        with pytest.raises(ValueError, match="closed"):
            s.data  # noqa: B018
        assert mapped(name) and float(k.sum()) == 2.0 * k.numel()  # a live view still reads valid memory
        del k, v
        assert not mapped(name), "the last view freed unmaps the segment"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_an_openers_live_views_keep_its_mapping_until_freed(storage):
    opened = KVStorage.open(storage.export_handle())
    name = storage.export_handle().name
    k, v = opened.layer(1)
    k.fill_(3.0)
    opened.close()
    storage.close()
    assert mapped(name) and float(k.sum()) == 3.0 * k.numel()
    del k, v
    assert not mapped(name), "the opener's last view freed unmaps its attachment"


def test_named_create_and_refusals():
    name = f"radixkv-test-{uuid.uuid4().hex[:8]}"
    with KVStorage.create(LAYOUT, name=name) as s:
        handle = s.export_handle()
        assert handle.name == name
        with KVStorage.open(handle) as opened:
            with pytest.raises(ValueError, match="^unlink"):
                opened.unlink()
        too_big = PoolHandle.from_dict(handle.to_dict() | {"num_blocks": LAYOUT.num_blocks * 2})
        with pytest.raises(ValueError, match="^handle"):
            KVStorage.open(too_big)
    with pytest.raises(ValueError, match="^name"):
        KVStorage.create(LAYOUT, "cuda", name="x")
    with pytest.raises(ValueError, match="^device"):
        KVStorage.create(LAYOUT, "meta")


@pytest.mark.parametrize("name", ["", "../etc/hostname", "a/b", ".", ".."])
def test_open_refuses_a_segment_name_that_is_a_path(name):
    handle = PoolHandle(kind="shm", name=name, **{f: getattr(LAYOUT, f) for f in LAYOUT_FIELDS})
    with pytest.raises(ValueError, match="^handle: .* is not a shared-memory segment name"):
        KVStorage.open(handle)


def test_open_of_a_missing_segment_raises_file_not_found():
    handle = PoolHandle(
        kind="shm", name=f"radixkv-absent-{uuid.uuid4().hex[:8]}", **{f: getattr(LAYOUT, f) for f in LAYOUT_FIELDS}
    )
    with pytest.raises(FileNotFoundError):
        KVStorage.open(handle)


# A creator and the child it spawns share one resource tracker: the child's opening must leave the creator's
# registration alone (an unregister would drop it and the creator's unlink would then trip the tracker).
SPAWNED = """
import multiprocessing, os, sys
from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import LAYOUT_FIELDS, PoolHandle
from radixkv.memory.storage import KVStorage

def child(plain):
    with KVStorage.open(PoolHandle.from_dict(plain)) as s:
        s.data[1, 0, 2] = 5.0

if __name__ == "__main__":
    layout = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, dtype="float16")
    with KVStorage.create(layout) as s:
        handle = s.export_handle()
        for _ in range(2):
            p = multiprocessing.get_context("spawn").Process(target=child, args=(handle.to_dict(),))
            p.start()
            p.join(600)
            assert p.exitcode == 0, p.exitcode
        assert os.path.exists(os.path.join("/dev/shm", handle.name)), "a child's exit unlinked the segment"
        assert bool((s.data[1, 0, 2] == 5.0).all())
    print(handle.name)
"""


@pytest.mark.skipif(not HAS_SHM_DIR, reason="needs /dev/shm")
def test_a_spawned_child_shares_the_creators_tracker_and_leaves_its_registration(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=patient(180))
    assert result.returncode == 0, result.stderr
    assert "resource_tracker" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not shm_exists(result.stdout.strip()), "the creator's exit unlinks"


@pytest.mark.skipif(not HAS_SHM_DIR, reason="needs /dev/shm")
def test_create_refuses_more_than_dev_shm_holds():
    st = os.statvfs("/dev/shm")
    probe = PoolLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, num_blocks=1, dtype="float32")
    huge = PoolLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        num_blocks=st.f_bavail * st.f_frsize // probe.bytes_per_block + 1,
        dtype="float32",
    )
    with pytest.raises(ValueError, match="^layout"):
        KVStorage.create(huge)


MODEL = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")  # Llama-3-8B: 2 MiB/block


def test_layout_for_a_byte_budget():
    layout = layout_for_memory(**MODEL, device="cpu", budget_bytes=10 * 2**30, reserved_bytes=2**30)
    assert layout.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16 == 2**21
    assert layout.num_blocks == 9 * 2**30 // 2**21 == 4608
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (32, 8, 128, "float16")


def test_layout_for_a_memory_fraction(monkeypatch):
    monkeypatch.setattr(radixkv.memory.memory_sizing, "free_memory_bytes", lambda device: 80 * 2**30)
    layout = layout_for_memory(**MODEL, device="cuda", memory_fraction=0.9, reserved_bytes=16 * 2**30)
    assert layout.num_blocks == (int(80 * 2**30 * 0.9) - 16 * 2**30) // 2**21


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(), "budget_bytes"),
        (dict(budget_bytes=2**30, memory_fraction=0.5), "budget_bytes"),
        (dict(budget_bytes=0), "budget_bytes"),
        (dict(memory_fraction=0.0), "memory_fraction"),
        (dict(memory_fraction=1.5), "memory_fraction"),
        (dict(memory_fraction=True), "memory_fraction"),
        (dict(budget_bytes=2**30, reserved_bytes=-1), "reserved_bytes"),
        (dict(budget_bytes=2**30, reserved_bytes=2**30), "reserved_bytes"),
        (dict(budget_bytes=2**20), "a budget"),  # less than one 2 MiB block
    ],
)
def test_layout_for_memory_rejects(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        layout_for_memory(**MODEL, device="cpu", **kwargs)


def test_cpu_free_memory_is_plausible():
    free = free_memory_bytes("cpu")
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < free <= total
    if HAS_SHM_DIR:
        st = os.statvfs("/dev/shm")
        assert free <= st.f_bavail * st.f_frsize
    with pytest.raises(ValueError, match="^device"):
        free_memory_bytes("meta")


@pytest.mark.gpu
def test_cuda_pool_shared_with_another_process():
    layout = PoolLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=32, dtype="bfloat16")
    s = KVStorage.create(layout, "cuda")
    assert s.data.is_cuda and not s.data.view(torch.int16).any()
    layer0 = s.data[0].view(torch.int16).flatten()
    layer0.copy_(pattern(layer0.numel(), 5, "cuda"))
    torch.cuda.synchronize()
    handle = s.export_handle()
    assert handle.kind == "cuda_ipc" and handle.ipc_handle
    result = run_worker(handle, 5, 17)
    assert result.returncode == 0, result.stderr
    layer1 = s.data[1].view(torch.int16).flatten()
    assert torch.equal(layer1, pattern(layer1.numel(), 17, "cuda"))
    s.close()


def test_a_host_pool_is_shared_memory_another_process_maps():
    host = KVStorage.create_host(LAYOUT, pin=False)
    try:
        assert host.device.type == "cpu" and not host.is_pinned
        handle = host.export_handle()
        assert handle.kind == "shm"
        with KVStorage.open(handle) as mapped:
            mapped.data[0, 1, 2] = 3.0
            assert bool((host.data[0, 1, 2] == 3.0).all())
    finally:
        host.close()
        host.unlink()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_pinning_needs_cuda():
    with KVStorage.create(LAYOUT) as storage, pytest.raises(ValueError, match="^pin: .*needs CUDA"):
        storage.pin()


@pytest.mark.gpu
def test_a_pinned_host_pool_swaps_with_a_cuda_pool():
    from radixkv.kernels import swap_blocks

    host = KVStorage.create_host(LAYOUT, pin=True)
    try:
        assert host.is_pinned and host.data.is_pinned()
        device = torch.randn(LAYOUT.shape, device="cuda").to(host.data.dtype)
        swap_blocks(device, host.data, [(1, 2)]).synchronize()
        assert torch.equal(host.data[:, :, 2], device[:, :, 1].cpu())
    finally:
        host.close()
        host.unlink()
