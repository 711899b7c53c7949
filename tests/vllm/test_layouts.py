"""vLLM's KV layouts against radixkv's pool layout, checked against the engine's own code.

The CPU backend: K and V written by vLLM's own cache op (`cpu_attn_reshape_and_cache`, what its attention layer
calls) read back by `CpuLayout.read` exactly, and `CpuLayout.write` producing byte for byte what that op writes.
The token-major CUDA backends: the split their attention does (`kv_cache.transpose(1, 2).split(head_size, -1)`),
on a view strided as vLLM allocates it. And the pool's rows: a gather is the blocks' bytes, digested per block.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (make test-vllm sets it up)")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402  # the engine's own op: the reference, in a test only

from radixkv.server.process.spawn import patient  # noqa: E402
from radixkv.vllm.layouts import CpuLayout, PoolRows, TokenMajorLayout, block_digests, layout_for  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, DIM = 6, 3, 32, 64


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_layout_is_what_the_engine_writes(isa: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens = 3 * BLOCK  # blocks 1..3 (slots from BLOCK on)
    key = torch.randn(num_tokens, HEADS, DIM, generator=gen).to(dtype)
    value = torch.randn(num_tokens, HEADS, DIM, generator=gen).to(dtype)
    engine = torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    k_cache, v_cache = engine.view(NUM_BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)  # as the backend views it
    slots = torch.arange(BLOCK, BLOCK + num_tokens, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0)

    read = torch.zeros(3, 2, BLOCK, HEADS, DIM, dtype=dtype)  # [n, 2, N, H, D]
    CpuLayout.read(engine, [1, 2, 3], read)
    assert torch.equal(read[:, 0].reshape(num_tokens, HEADS, DIM), key)
    assert torch.equal(read[:, 1].reshape(num_tokens, HEADS, DIM), value)

    ours = torch.zeros_like(engine)
    CpuLayout.write(ours, [1, 2, 3], read)  # consecutive: converted straight into the blocks
    assert torch.equal(ours, engine)
    scattered = torch.zeros_like(engine)
    CpuLayout.write(scattered, [5, 0, 3], read)  # scattered: through one buffer
    assert torch.equal(scattered[[5, 0, 3]], engine[[1, 2, 3]]) and not scattered[[1, 2, 4]].any()
    staged = torch.zeros(3, 4, 2, BLOCK, HEADS, DIM, dtype=dtype)  # [n, L, 2, N, H, D]: one layer of a staging
    CpuLayout.read(scattered, [5, 0, 3], staged[:, 2])  # scattered blocks, into a strided slice
    assert torch.equal(staged[:, 2], read) and not staged[:, [0, 1, 3]].any()


def test_token_major_layout_is_the_cuda_backends_split() -> None:
    gen = torch.Generator().manual_seed(1)
    # vLLM allocates [L, B, N, H, C] physically (LBNHC) and hands each layer its [B, H, N, C] logical view.
    raw = torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, 2 * DIM, generator=gen)
    kv = raw[1].permute(0, 2, 1, 3)  # [B, H, N, 2D], strided
    key_cache, value_cache = kv.transpose(1, 2).split(DIM, dim=-1)  # flash_attn.py / triton_attn.py
    blocks = torch.tensor([4, 0, 2])
    read = torch.zeros(3, 2, BLOCK, HEADS, DIM)
    TokenMajorLayout.read(kv, [4, 0, 2], read)
    assert torch.equal(read[:, 0], key_cache[blocks]) and torch.equal(read[:, 1], value_cache[blocks])
    before = raw.clone()
    TokenMajorLayout.write(kv, [5], read[:1])
    assert torch.equal(raw[1, 5], before[1, 4]) and torch.equal(raw[0], before[0])  # only that block of that layer
    TokenMajorLayout.write(kv, [1, 3], read[1:])
    assert torch.equal(raw[1, 1], before[1, 0]) and torch.equal(raw[1, 3], before[1, 2])


def test_unchecked_layouts_are_refused_by_name() -> None:
    assert layout_for("CPU_ATTN", "vec") is CpuLayout
    assert layout_for("FLASH_ATTN", None) is TokenMajorLayout
    with pytest.raises(ValueError, match="ISA 'amx'"):
        layout_for("CPU_ATTN", "amx")
    with pytest.raises(ValueError, match="FLASHINFER"):
        layout_for("FLASHINFER", None)


def test_pool_rows_gather_and_scatter_whole_blocks() -> None:
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(4, 2, 7, BLOCK, HEADS, DIM, generator=gen)  # [L, 2, B, N, H, D]
    rows = PoolRows(pool)
    staged = rows.gather([5, 1, 3])
    assert staged.shape == (3, 4, 2, BLOCK, HEADS, DIM) and staged.is_contiguous()
    assert torch.equal(staged, pool[:, :, [5, 1, 3]].permute(2, 0, 1, 3, 4, 5))
    staged[0] += 1  # a private copy: the pool is untouched
    assert torch.equal(pool[:, :, 5], rows.gather([5])[0])
    rows.scatter([0, 6], staged[:2])
    assert torch.equal(pool[:, :, 0], staged[0]) and torch.equal(pool[:, :, 6], staged[1])


def test_a_digest_sees_every_change() -> None:
    gen = torch.Generator().manual_seed(3)
    staged = torch.randn(5, 4, 2, BLOCK, HEADS, DIM, generator=gen)  # [n, L, 2, N, H, D]
    digests = block_digests(staged)
    assert len(set(digests)) == 5 and all(len(d) == 32 for d in digests) and block_digests(staged.clone()) == digests
    for index in [(2, 0, 0, 0, 0, 0), (2, 3, 1, BLOCK - 1, HEADS - 1, DIM - 1), (2, 1, 0, 7, 1, 33)]:
        changed = staged.clone()
        changed[index] = torch.nextafter(changed[index], torch.tensor(float("inf")))  # the smallest change
        after = block_digests(changed)
        assert after[2] != digests[2] and after[:2] + after[3:] == digests[:2] + digests[3:]
    swapped = staged.clone()
    swapped[2, :, :, 0], swapped[2, :, :, 1] = staged[2, :, :, 1], staged[2, :, :, 0]  # two tokens exchanged
    assert block_digests(swapped)[2] != digests[2]


def test_importing_radixkv_never_imports_vllm() -> None:
    """Only asking for the connector class loads vLLM: the package, its plan and layouts stay free of it."""
    import subprocess
    import sys

    code = (
        "import sys, radixkv, radixkv.client, radixkv.server.process.app, radixkv.vllm\n"
        "import radixkv.vllm.plan, radixkv.vllm.layouts\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\n"
        "radixkv.vllm.RadixKVConnector\n"
        "assert 'vllm' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(300))
    assert done.returncode == 0, done.stderr[-2000:]
