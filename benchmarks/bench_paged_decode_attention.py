"""Benchmark paged_decode_attention on the shapes of issues 18 and 34: ragged batches (1x128k + 31x1k; 256
sequences of 100-8,000 tokens), long single contexts (1x32k, 1x8k) and a uniform batch (64x4k), GQA 32/8,
head_dim 128, block 16, fp16/bf16/fp8 caches.

CUDA: the Triton kernel with a plan made from host-side lengths (the hot path: no device read), timed with
CUDA events after a warm-up, the L2 cleared before each call, the median reported. Reported as K/V bytes
read over time, as a % of the device's peak bandwidth, with ratios measured in the same run: against the
batch-size-only split heuristic this kernel had before (the ragged batch's regression test), fp8 against
fp16 tokens/s, dense SDPA on pre-gathered K/V, and FlashInfer / vLLM when they import (optional, never a
dependency: `pip install flashinfer-python` or `vllm` to add them). `--configs` also times neighbouring tile /
stages / warps choices against the `DECODE_CONFIGS` default.
CPU: tiny shapes through the torch path (what CPU serving runs), timed with perf_counter. CPU figures
are not bandwidth figures. Examples:

    python benchmarks/bench_paged_decode_attention.py --quick
    python benchmarks/bench_paged_decode_attention.py --configs --out results/decode_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from radixkv.kernels import DecodeConfig, paged_decode_attention, plan_decode, quantize_fp8
from radixkv.kernels.decode_plan import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, decode_config

BLOCK_SIZE = 16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B's attention
SHAPES = {  # name -> seq_lens
    "ragged 1x128k+31x1k": [131072] + [1024] * 31,
    "ragged 256x100-8k": random.Random(0).choices(range(100, 8001), k=256),
    "1x32k": [32768],
    "1x8k": [8192],
    "64x4k": [4096] * 64,
}
CPU_SHAPES = {"ragged 1x2k+7x128": [2048] + [128] * 7, "1x1k": [1024], "8x256": [256] * 8}
KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
CONFIG_SHAPES = ("64x4k", "1x32k")  # where --configs times the neighbours
# Peak HBM bandwidth in bytes/s by device-name substring, most specific first.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("B200", 8.0e12),
    ("GH200", 4.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("RTX 4090", 1.008e12),
]


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor  # [num_seqs, num_q_heads, head_dim]
    kv_layer: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_scales: torch.Tensor | None  # fp32 [2] for fp8
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    lens: list[int]
    scale: float

    def args(self) -> tuple:
        return (self.q, self.kv_layer, self.block_tables, self.seq_lens, self.scale)


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BANDWIDTH if key in name), None)


def build_inputs(lens: list[int], kv_dtype: torch.dtype, device: torch.device) -> Inputs:
    """A pool holding every sequence's blocks in shuffled order; q in fp16 for fp8 caches."""
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    dtype = torch.float16 if kv_dtype.itemsize == 1 else kv_dtype
    kv = torch.empty((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=dtype, device=device).normal_()
    kv_scales = None
    if kv_dtype.itemsize == 1:
        kv_scales = torch.tensor([0.05, 0.05], device=device)
        kv = torch.stack([quantize_fp8(kv[i], kv_scales[i]) for i in range(2)])
    perm = torch.randperm(num_blocks, device=device).int()
    block_tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        block_tables[i, :n] = perm[start : start + n]
        start += n
    return Inputs(
        q=torch.randn(len(lens), NUM_Q_HEADS, HEAD_DIM, dtype=dtype, device=device),
        kv_layer=kv,
        kv_scales=kv_scales,
        block_tables=block_tables,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        lens=lens,
        scale=HEAD_DIM**-0.5,
    )


def time_us(fn: Callable[[], object], device: torch.device, warmup: int = 5, reps: int = 30) -> float:
    """Median microseconds per call. CUDA: CUDA events around each call, after `warmup` calls, with the L2 cleared
    before each (so a call reads its K/V from memory, as a model's next layer would)."""
    if device.type == "cuda":
        flush = _l2_flush_buffer(device)
        for _ in range(warmup):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3
    fn()  # warm-up
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < 0.2 and len(samples) < 20):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


@functools.cache
def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    """Bytes whose zeroing evicts the whole L2: twice its size, and at least 256 MiB."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.empty(max(2 * l2_bytes, 256 * 2**20), dtype=torch.uint8, device=device)


def batch_only_splits(num_seqs: int, max_len: int, num_sms: int) -> int:
    """The split count this kernel used before issue 18: from the batch size only, blind to ragged lengths."""
    if max_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = math.ceil(2 * num_sms / max(1, num_seqs * NUM_KV_HEADS))
    return max(1, min(wanted, max_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def ours(inputs: Inputs, *, num_splits: int | None = None, config: DecodeConfig | None = None) -> Callable[[], object]:
    """The hot path: a plan from host lengths, made once (as a worker does per step), no validation."""
    device = inputs.q.device
    if device.type != "cuda":
        return lambda: paged_decode_attention(*inputs.args(), kv_scales=inputs.kv_scales, backend="torch")
    plan = plan_decode(
        inputs.lens,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        cache_dtype=inputs.kv_layer.dtype,
        device=device,
        num_splits=num_splits,
        config=config,
    )
    return lambda: paged_decode_attention(*inputs.args(), kv_scales=inputs.kv_scales, plan=plan, validate=False)


def dense_sdpa(inputs: Inputs) -> Callable[[], torch.Tensor] | None:
    """SDPA over K/V already gathered into dense [batch, kv_heads, context, head_dim] (uniform batches only)."""
    if len(set(inputs.lens)) != 1 or inputs.kv_scales is not None:
        return None
    context, batch = inputs.lens[0], len(inputs.lens)
    k_cache, v_cache = inputs.kv_layer
    tables = inputs.block_tables.long()
    k = torch.empty((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype=k_cache.dtype, device=k_cache.device)
    v = torch.empty_like(k)
    for i in range(batch):  # one sequence at a time: a whole-batch gather would need a third copy
        k[i] = k_cache[tables[i]].flatten(0, 1)[:context].transpose(0, 1)
        v[i] = v_cache[tables[i]].flatten(0, 1)[:context].transpose(0, 1)
    q = inputs.q[:, :, None, :]  # [batch, num_q_heads, 1, head_dim]
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=inputs.scale, enable_gqa=True)[:, :, 0]


def flashinfer_decode(inputs: Inputs) -> Callable[[], torch.Tensor] | None:
    try:
        import flashinfer
    except ImportError:
        return None
    if inputs.kv_scales is not None:
        return None
    device, lens = inputs.q.device, inputs.lens
    blocks = [math.ceil(n / BLOCK_SIZE) for n in lens]
    indptr = torch.tensor([0, *itertools.accumulate(blocks)], dtype=torch.int32, device=device)
    indices = torch.cat([inputs.block_tables[i, :n] for i, n in enumerate(blocks)])
    last = [n - (b - 1) * BLOCK_SIZE for n, b in zip(lens, blocks, strict=True)]  # tokens in each last block
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 * 2**20, dtype=torch.uint8, device=device), "NHD", use_tensor_cores=True
    )
    wrapper.plan(
        indptr,
        indices,
        torch.tensor(last, dtype=torch.int32, device=device),
        NUM_Q_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        BLOCK_SIZE,
        q_data_type=inputs.q.dtype,
        kv_data_type=inputs.kv_layer.dtype,
        sm_scale=inputs.scale,
    )
    return lambda: wrapper.run(inputs.q, (inputs.kv_layer[0], inputs.kv_layer[1]))


def vllm_decode(inputs: Inputs) -> Callable[[], torch.Tensor] | None:
    try:
        from vllm.vllm_flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    if inputs.kv_scales is not None:
        return None
    q = inputs.q[:, None]  # [batch, 1, num_q_heads, head_dim]
    return lambda: flash_attn_with_kvcache(
        q,
        inputs.kv_layer[0],
        inputs.kv_layer[1],
        cache_seqlens=inputs.seq_lens,
        block_table=inputs.block_tables,
        softmax_scale=inputs.scale,
    )[:, 0]


ALTERNATIVES = [("sdpa", dense_sdpa), ("flashinfer", flashinfer_decode), ("vllm", vllm_decode)]


def bench_shape(name: str, lens: list[int], kv_name: str, device: torch.device, peak: float | None) -> dict:
    kv_dtype = KV_DTYPES[kv_name]
    inputs = build_inputs(lens, kv_dtype, device)
    expected = (
        paged_decode_attention(*inputs.args(), kv_scales=inputs.kv_scales, backend="torch", validate=False)
        if device.type != "cuda" or sum(lens) <= 40_000
        else None
    )  # the per-sequence torch loop is slow at 128k
    us = time_us(ours(inputs), device)
    kv_bytes = 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    on_cuda = device.type == "cuda"
    plan = plan_decode(
        lens,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        cache_dtype=kv_dtype,
        device="meta",
        num_sms=torch.cuda.get_device_properties(device).multi_processor_count if on_cuda else 132,
    )
    row: dict = dict(
        shape=name,
        kv_dtype=kv_name,
        num_seqs=len(lens),
        tokens=sum(lens),
        path="triton" if on_cuda else "torch",
        num_splits=plan.num_splits,
        split_len=plan.split_len,
        radixkv_us=us,
        kv_bytes=kv_bytes,
        radixkv_GBps=kv_bytes / us / 1e3,
        peak_fraction=kv_bytes / (us * 1e-6) / peak if peak else None,
    )
    if on_cuda:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        old = batch_only_splits(len(lens), max(lens), sms)
        row |= dict(batch_only_splits=old, batch_only_over_radixkv=time_us(ours(inputs, num_splits=old), device) / us)
    for alt_name, make in ALTERNATIVES:
        try:
            fn = make(inputs)
            if fn is None:
                continue
            err = (fn().float() - expected.float()).abs().max().item() if expected is not None else None
            alt_us = time_us(fn, device)
        except Exception as exc:  # an optional library's API drift must not lose the other columns
            print(f"  {alt_name} failed on {name} {kv_name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        row |= {f"{alt_name}_us": alt_us, f"{alt_name}_over_radixkv": alt_us / us, f"{alt_name}_max_abs_diff": err}
    return row


def bench_configs(name: str, lens: list[int], kv_name: str, device: torch.device) -> list[dict]:
    """Each neighbour of the default config (tile x2 and /2, stages 3-5, warps 4/8), as time / the default's."""
    kv_dtype = KV_DTYPES[kv_name]
    inputs = build_inputs(lens, kv_dtype, device)
    default = decode_config(HEAD_DIM, kv_dtype)
    base_us = time_us(ours(inputs, config=default), device)
    candidates = (
        {dataclasses.replace(default, tile_n=t) for t in (default.tile_n // 2, default.tile_n * 2) if 16 <= t <= 256}
        | {dataclasses.replace(default, num_stages=s) for s in (3, 4, 5)}
        | {dataclasses.replace(default, num_warps=w) for w in (4, 8)}
    )
    rows = []
    for config in sorted(candidates - {default}, key=dataclasses.astuple):
        try:
            us = time_us(ours(inputs, config=config), device)
        except Exception as exc:  # e.g. out of shared memory: a config the device cannot run
            print(f"  config {config} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        rows.append(dict(shape=name, kv_dtype=kv_name, **dataclasses.asdict(config), us=us, over_default=us / base_us))
    rows.append(dict(shape=name, kv_dtype=kv_name, **dataclasses.asdict(default), us=base_us, over_default=1.0))
    return rows


def fmt(value: object, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    extra = [name for name, _ in ALTERNATIVES if any(f"{name}_us" in r for r in rows)]
    head = f"{'shape':<21}{'kv':>9}{'splits':>7}{'us':>10}{'GB/s':>9}{'%peak':>7}{'old/new':>8}{'fp8 x':>7}"
    head += "".join(f"{name + ' x':>13}" for name in extra)
    print(head)
    fp16_us = {r["shape"]: r["radixkv_us"] for r in rows if r["kv_dtype"] == "float16"}
    for r in rows:
        line = f"{r['shape']:<21}{r['kv_dtype']:>9}{r['num_splits']:>7}"
        line += f"{r['radixkv_us']:>10.1f}{r['radixkv_GBps']:>9.1f}"
        line += f"{fmt(r['peak_fraction'] and 100 * r['peak_fraction'], '.1f'):>7}"
        line += f"{fmt(r.get('batch_only_over_radixkv'), '.2f'):>8}"
        if r["kv_dtype"] == "fp8" and r["shape"] in fp16_us:
            r["fp8_tokens_per_s_over_fp16"] = fp16_us[r["shape"]] / r["radixkv_us"]
        line += f"{fmt(r.get('fp8_tokens_per_s_over_fp16'), '.2f'):>7}"
        line += "".join(f"{fmt(r.get(f'{name}_over_radixkv'), '.2f'):>13}" for name in extra)
        print(line)
    print("old/new = time with the batch-size-only splits of before / time with length-aware splits (> 1: better now)")
    print("fp8 x = fp8 tokens/s / fp16 tokens/s at the shape")
    print("<alt> x = alternative's time / radixkv's (> 1: radixkv faster)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-dtypes", default="float16,bfloat16,fp8", help="comma-separated, of float16 bfloat16 fp8")
    parser.add_argument("--quick", action="store_true", help="CPU: the tiny shapes, fp16 and fp8 only (under 30 s)")
    parser.add_argument(
        "--configs", action="store_true", help=f"also time tile/stages/warps neighbours on {CONFIG_SHAPES}"
    )
    parser.add_argument("--out", help="write every row as JSON to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kv_names = [k for k in args.kv_dtypes.split(",") if k]
    unknown = sorted(set(kv_names) - set(KV_DTYPES))
    if unknown:
        parser.error(f"--kv-dtypes: unknown {unknown}; choose from {sorted(KV_DTYPES)}")
    on_cuda = device.type == "cuda"
    shapes = SHAPES if on_cuda else CPU_SHAPES
    if args.quick and not on_cuda:
        kv_names = [k for k in kv_names if k != "bfloat16"]
    peak = peak_bandwidth(device)
    name = torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu"
    print(
        f"device {name}; peak {fmt(peak and peak / 1e9, '.0f')} GB/s; q/kv heads {NUM_Q_HEADS}/{NUM_KV_HEADS}, "
        f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}"
    )
    if not on_cuda:
        print("CPU: the torch path on tiny shapes. CPU figures are not bandwidth figures: run on CUDA for those.")
    for module, package in (("flashinfer", "flashinfer-python"), ("vllm", "vllm")):
        try:
            __import__(module)
        except ImportError:
            print(f"{module}: not installed, column skipped (optional: pip install {package})")
    rows = [bench_shape(shape, lens, kv, device, peak) for shape, lens in shapes.items() for kv in kv_names]
    if on_cuda:
        torch.cuda.empty_cache()
    print_table(rows)
    config_rows: list[dict] = []
    if args.configs and on_cuda:
        config_kvs = [kv for kv in kv_names if kv != "bfloat16"]  # bf16 moves fp16's bytes: the same choice
        for shape in CONFIG_SHAPES:
            for kv in config_kvs:
                config_rows += bench_configs(shape, SHAPES[shape], kv, device)
        print(f"\n{'shape':<10}{'kv':>9}{'tile':>6}{'warps':>6}{'stages':>7}{'us':>10}{'/default':>9}")
        for r in config_rows:
            print(
                f"{r['shape']:<10}{r['kv_dtype']:>9}{r['tile_n']:>6}{r['num_warps']:>6}{r['num_stages']:>7}"
                f"{r['us']:>10.1f}{r['over_default']:>9.2f}"
            )
    if args.out:
        meta = dict(
            device=name,
            peak_bytes_per_s=peak,
            torch=torch.__version__,
            triton=triton.__version__,
            bandwidth_figures=on_cuda,
        )
        with open(args.out, "w") as f:
            json.dump(meta | {"rows": rows, "configs": config_rows}, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
