"""Benchmark paged_decode_attention over batch x context x head shapes, against dense SDPA and, when they
import, FlashInfer and vLLM's flash-attention, as ratios measured in the same run.

CUDA: the Triton kernel, timed with triton.testing.do_bench (median, L2 flushed between runs); achieved
bandwidth is the K/V bytes the shape must read over the time, and its fraction of the device's peak.
CPU: the torch path (what CPU serving runs), timed with perf_counter. Examples:

    python benchmarks/bench_decode.py --quick
    python benchmarks/bench_decode.py --device cuda --out results/decode_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from radixkv.kernels import choose_num_splits, paged_decode_attention
from radixkv.storage import free_memory_bytes

BLOCK_SIZE = 16
# (name, num_q_heads, num_kv_heads, head_dim): Llama-3-8B, and Llama-3-70B's heads on one GPU.
MODELS = [("llama3-8b", 32, 8, 128), ("llama3-70b", 64, 8, 128)]
FULL_GRID = dict(batches=[1, 8, 32, 64, 128, 256], contexts=[512, 2048, 8192, 32768])
QUICK_GRID = {
    "cpu": dict(batches=[1, 4], contexts=[512, 2048]),
    "cuda": dict(batches=[1, 64], contexts=[2048, 32768]),
}
# Peak HBM bandwidth in bytes/s by device-name substring, most specific first.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12),
    ("B200", 8.0e12), ("GH200", 4.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("RTX 4090", 1.008e12),
]


@dataclasses.dataclass(frozen=True)
class Shape:
    model: str
    batch: int
    context: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BANDWIDTH if key in name), None)


def build_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict:
    """A pool holding every sequence's blocks in shuffled order; each sequence is `context` tokens long."""
    blocks_per_seq = math.ceil(shape.context / BLOCK_SIZE)
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.empty(cache_shape, dtype=dtype, device=device).normal_()
    v_cache = torch.empty(cache_shape, dtype=dtype, device=device).normal_()
    block_tables = torch.randperm(num_blocks, device=device).view(shape.batch, blocks_per_seq).int()
    return dict(
        q=torch.randn(shape.batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device),
        k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device),
        scale=shape.head_dim**-0.5,
    )


def time_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median microseconds per call."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    fn()  # warm-up
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < 0.2 and len(samples) < 20):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def dense_sdpa(inputs: dict, shape: Shape) -> Callable[[], torch.Tensor]:
    """SDPA over K/V already gathered into dense [batch, kv_heads, context, head_dim] (the gather is not timed)."""
    k_cache, v_cache, tables = inputs["k_cache"], inputs["v_cache"], inputs["block_tables"].long()
    dense_shape = (shape.batch, shape.num_kv_heads, shape.context, shape.head_dim)
    k = torch.empty(dense_shape, dtype=k_cache.dtype, device=k_cache.device)
    v = torch.empty_like(k)
    for i in range(shape.batch):  # one sequence at a time: a whole-batch gather would need a third copy
        k[i] = k_cache[tables[i]].flatten(0, 1)[: shape.context].transpose(0, 1)
        v[i] = v_cache[tables[i]].flatten(0, 1)[: shape.context].transpose(0, 1)
    q = inputs["q"][:, :, None, :]  # [batch, num_q_heads, 1, head_dim]
    try:
        F.scaled_dot_product_attention(q, k, v, scale=inputs["scale"], enable_gqa=True)
    except TypeError:  # torch < 2.5 has no enable_gqa: expand the KV heads beforehand, untimed
        group_size = shape.num_q_heads // shape.num_kv_heads
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=inputs["scale"])[:, :, 0]
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=inputs["scale"], enable_gqa=True)[:, :, 0]


def flashinfer_decode(inputs: dict, shape: Shape) -> Callable[[], torch.Tensor] | None:
    try:
        import flashinfer
    except ImportError:
        return None
    device, blocks_per_seq = inputs["q"].device, inputs["block_tables"].shape[1]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 * 2**20, dtype=torch.uint8, device=device), "NHD",
        use_tensor_cores=shape.num_q_heads // shape.num_kv_heads >= 4,
    )
    wrapper.plan(
        torch.arange(shape.batch + 1, dtype=torch.int32, device=device) * blocks_per_seq,
        inputs["block_tables"].flatten(),
        torch.full((shape.batch,), shape.context - (blocks_per_seq - 1) * BLOCK_SIZE, dtype=torch.int32, device=device),
        shape.num_q_heads, shape.num_kv_heads, shape.head_dim, BLOCK_SIZE,
        q_data_type=inputs["q"].dtype, kv_data_type=inputs["k_cache"].dtype, sm_scale=inputs["scale"],
    )
    return lambda: wrapper.run(inputs["q"], (inputs["k_cache"], inputs["v_cache"]))


def vllm_decode(inputs: dict, shape: Shape) -> Callable[[], torch.Tensor] | None:
    try:
        from vllm.vllm_flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    q = inputs["q"][:, None]  # [batch, 1, num_q_heads, head_dim]
    return lambda: flash_attn_with_kvcache(
        q, inputs["k_cache"], inputs["v_cache"], cache_seqlens=inputs["seq_lens"],
        block_table=inputs["block_tables"], softmax_scale=inputs["scale"],
    )[:, 0]


ALTERNATIVES = [("sdpa", dense_sdpa), ("flashinfer", flashinfer_decode), ("vllm", vllm_decode)]


def bench_shape(shape: Shape, dtype: torch.dtype, device: torch.device, peak: float | None) -> dict:
    inputs = build_inputs(shape, dtype, device)
    on_cuda = device.type == "cuda"
    # On CUDA the checks read seq_lens and block_tables (a sync); they run once here, outside the timing.
    backend = None if on_cuda else "torch"
    expected = paged_decode_attention(**inputs, backend=backend)

    def ours() -> torch.Tensor:
        return paged_decode_attention(**inputs, backend=backend, validate=not on_cuda)

    ours_us = time_us(ours, device)
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * dtype.itemsize
    splits = choose_num_splits(
        shape.batch, shape.num_kv_heads, shape.context, torch.cuda.get_device_properties(device).multi_processor_count
    ) if on_cuda else None
    row = dataclasses.asdict(shape) | dict(
        dtype=str(dtype).removeprefix("torch."), block_size=BLOCK_SIZE, path="triton" if on_cuda else "torch",
        num_splits=splits, radixkv_us=ours_us, kv_bytes=kv_bytes, radixkv_GBps=kv_bytes / ours_us / 1e3,
        peak_fraction=kv_bytes / (ours_us * 1e-6) / peak if peak else None,
    )
    for name, make in ALTERNATIVES:
        try:
            fn = make(inputs, shape)
            if fn is None:
                continue
            err = (fn().float() - expected.float()).abs().max().item()
            us = time_us(fn, device)
        except Exception as exc:  # an optional library's API drift must not lose the other columns
            print(f"  {name} failed on {shape}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        row |= {f"{name}_us": us, f"{name}_over_radixkv": us / ours_us, f"{name}_max_abs_diff": err}
    return row


def fmt(value: object, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    extra = [name for name, _ in ALTERNATIVES if any(f"{name}_us" in r for r in rows)]
    head = f"{'model':<11}{'batch':>6}{'ctx':>7}{'splits':>7}{'radixkv us':>12}{'GB/s':>9}{'%peak':>7}"
    head += "".join(f"{name + ' us':>14}{'x':>7}" for name in extra)
    print(head)
    for r in rows:
        line = f"{r['model']:<11}{r['batch']:>6}{r['context']:>7}{fmt(r['num_splits'], 'd'):>7}"
        line += f"{r['radixkv_us']:>12.1f}{r['radixkv_GBps']:>9.1f}"
        line += f"{fmt(r['peak_fraction'] and 100 * r['peak_fraction'], '.1f'):>7}"
        for name in extra:
            line += f"{fmt(r.get(f'{name}_us'), '.1f'):>14}{fmt(r.get(f'{name}_over_radixkv'), '.2f'):>7}"
        print(line)
    print("x = alternative's time / radixkv's time (> 1: radixkv is faster); GB/s = K/V bytes read / time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: float16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="a few small shapes (under 30 s on a laptop CPU)")
    parser.add_argument("--out", help="write every row as JSON to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    grid = QUICK_GRID[device.type] if args.quick else FULL_GRID
    peak = peak_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device {name}; peak {fmt(peak and peak / 1e9, '.0f')} GB/s; {dtype}; block_size {BLOCK_SIZE}")
    rows = []
    for model, num_q_heads, num_kv_heads, head_dim in MODELS:
        for batch in grid["batches"]:
            for context in grid["contexts"]:
                shape = Shape(model, batch, context, num_q_heads, num_kv_heads, head_dim)
                needed = 4 * batch * context * num_kv_heads * head_dim * dtype.itemsize  # pool K/V + dense K/V
                if needed > 0.8 * free_memory_bytes(device):
                    print(f"  skipped {shape}: needs {needed / 2**30:.1f} GiB", file=sys.stderr)
                    continue
                rows.append(bench_shape(shape, dtype, device, peak))
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the shape's pool and dense copies are garbage now
    print_table(rows)
    if args.out:
        meta = dict(device=name, dtype=str(dtype), peak_bytes_per_s=peak, torch=torch.__version__, triton=triton.__version__)
        with open(args.out, "w") as f:
            json.dump(meta | {"rows": rows}, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
