"""swap_blocks: the Triton kernel and the torch path against a reference loop over two pools, and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.kernels import swap_blocks, swap_blocks_reference

gpu = pytest.mark.gpu


def case_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def random_pool(shape: tuple[int, ...], num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    num_layers, block_size, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    pool.view(torch.uint8)[..., 0, 0, 0] = 0x7F if dtype.itemsize == 1 else 0  # fp8 NaN codes: copied as bits
    return pool


def expected_after(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """The reference as a plain loop, one block at a time (independent of the index_copy_ reference)."""
    out = dst.clone()
    for s, d in pairs:
        out[:, :, d] = src[:, :, s]
    return out


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=case_id)
@pytest.mark.parametrize("shape", [(1, 1, 1, 64), (3, 4, 2, 80), (2, 16, 8, 128)])  # last: 16k elements, 2 programs
def test_offload_and_load_match_a_loop(device, backend, dtype, shape):
    device_pool = random_pool(shape, 7, dtype, seed=1).to(device)
    host_pool = random_pool(shape, 11, dtype, seed=2)
    if device == "cuda":
        host_pool = host_pool.pin_memory()
    offloads = [(6, 0), (2, 10), (6, 3), (0, 5)]  # one device block offloaded twice
    expected_host = expected_after(device_pool.cpu(), host_pool, offloads)
    event = swap_blocks(device_pool, host_pool, offloads, backend=backend)
    if event is not None:
        event.synchronize()
    assert torch.equal(host_pool.view(torch.uint8), expected_host.view(torch.uint8))

    loads = np.array([[10, 1], [5, 4], [3, 6]], dtype=np.int64)  # host -> device, back into other blocks
    expected_device = expected_after(host_pool, device_pool.cpu(), loads.tolist())
    event = swap_blocks(host_pool, device_pool, loads, backend=backend)
    if event is not None:
        event.synchronize()
    assert torch.equal(device_pool.cpu().view(torch.uint8), expected_device.view(torch.uint8))
    assert torch.equal(device_pool.cpu()[:, :, 1].view(torch.uint8), expected_host[:, :, 10].view(torch.uint8))


def test_reference_matches_the_loop():
    src, dst = random_pool((2, 4, 2, 8), 5, torch.float32, 3), random_pool((2, 4, 2, 8), 9, torch.float32, 4)
    pairs = [(4, 8), (0, 0), (4, 1)]
    expected = expected_after(src, dst, pairs)
    swap_blocks_reference(src, dst, torch.tensor(pairs))
    assert torch.equal(dst, expected)


def test_no_pairs_is_a_no_op(device):
    src, dst = torch.randn(1, 2, 3, 4, 1, 64, device=device), torch.randn(1, 2, 5, 4, 1, 64)
    if device == "cuda":
        dst = dst.pin_memory()
    before = dst.clone()
    event = swap_blocks(src, dst, [], backend="triton")
    if event is not None:
        event.synchronize()
    assert torch.equal(dst, before)


def keep_the_current_stream_busy() -> None:
    """Queue milliseconds of work on the current stream: matmuls, public ops (torch.cuda._sleep is private)."""
    x = torch.randn(4096, 4096, device="cuda")  # [4096, 4096]; each product takes ~1e11 flops
    for _ in range(8):
        x = (x @ x) * 4096**-0.5  # entries stay ~N(0, 1)


@gpu
def test_cuda_copies_on_a_side_stream_after_queued_writes():
    """The swap waits for writes queued on the caller's stream and the returned event orders the reads after it."""
    device_pool = torch.zeros(2, 2, 8, 16, 4, 64, device="cuda")
    host_pool = torch.zeros(2, 2, 8, 16, 4, 64).pin_memory()
    keep_the_current_stream_busy()  # so a copy not ordered after the write below would read zeros
    device_pool[:, :, 3] = 7.0
    event = swap_blocks(device_pool, host_pool, [(3, 5)])
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    assert bool((host_pool[:, :, 5] == 7.0).all()) and bool((host_pool[:, :, :5] == 0).all())
    device_pool.zero_()
    event = swap_blocks(host_pool, device_pool, torch.tensor([[5, 0]]))
    torch.cuda.current_stream().wait_event(event)
    assert bool((device_pool[:, :, 0] == 7.0).all())


@gpu
def test_cuda_refuses_a_pageable_host_pool():
    with pytest.raises(ValueError, match=r"^dst\b.*pinned"):
        swap_blocks(torch.zeros(1, 2, 2, 4, 1, 8, device="cuda"), torch.zeros(1, 2, 2, 4, 1, 8), [(0, 1)])


@pytest.fixture
def args() -> dict:
    return dict(src=torch.randn(2, 2, 6, 4, 2, 64), dst=torch.randn(2, 2, 3, 4, 2, 64), pairs=torch.tensor([[5, 0]]))


BAD = [
    ("src past its pool", lambda a: a | {"pairs": torch.tensor([[6, 0]])}, "pairs"),
    ("dst past its pool", lambda a: a | {"pairs": torch.tensor([[0, 3]])}, "pairs"),
    ("negative src", lambda a: a | {"pairs": torch.tensor([[-1, 2]])}, "pairs"),
    ("duplicate dst", lambda a: a | {"pairs": torch.tensor([[0, 1], [2, 1]])}, "pairs"),
    ("pairs int32", lambda a: a | {"pairs": a["pairs"].int()}, "pairs"),
    ("pairs of three", lambda a: a | {"pairs": [(0, 1, 2)]}, "pairs"),
    ("pairs float array", lambda a: a | {"pairs": np.zeros((1, 2))}, "pairs"),
    ("pairs device", lambda a: a | {"pairs": a["pairs"].to("meta")}, "pairs"),
    ("dst dtype", lambda a: a | {"dst": a["dst"].half()}, "dst"),
    ("dst block shape", lambda a: a | {"dst": torch.randn(2, 2, 3, 4, 2, 32)}, "dst"),
    ("dst layers", lambda a: a | {"dst": torch.randn(1, 2, 3, 4, 2, 64)}, "dst"),
    ("src 5-D", lambda a: a | {"src": a["src"][0]}, "src"),
    ("src blocks not contiguous", lambda a: a | {"src": a["src"].transpose(3, 4)}, "src"),
    ("backend unknown", lambda a: a | {"backend": "gpu"}, "backend"),
]


@pytest.mark.parametrize("change,name", [(c, n) for _, c, n in BAD], ids=[label for label, _, _ in BAD])
def test_bad_argument_names_itself(args, change, name):
    before = args["dst"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        swap_blocks(**change(args))
    assert torch.equal(args["dst"], before), "nothing may be copied before the checks pass"
