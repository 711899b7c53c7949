"""`radixkv` command line: plan capacity, replay a workload through the core, serve, keep pool memory, demo."""

from __future__ import annotations

import argparse
import sys
import time
from importlib import metadata

from radixkv.arguments import Parser, integer, kv_dtype, size
from radixkv.disk.simulated import SimulatedDisk
from radixkv.errors import OutOfBlocks
from radixkv.extras import install_hint
from radixkv.kv_cache import KVCache
from radixkv.planning.model_shape import MODEL_SHAPES, ModelShape, resolve_model
from radixkv.planning.plan import format_plan, plan_capacity
from radixkv.planning.workload import make_trace, replay, working_set


def _plan(args: argparse.Namespace) -> int:
    if args.model:
        name, shape = resolve_model(args.model)
    elif None not in (args.layers, args.kv_heads, args.head_dim):
        name, shape = "(given)", ModelShape(args.layers, args.kv_heads, args.head_dim)
    else:
        print("radixkv plan: give --model NAME|PATH or all of --layers --kv-heads --head-dim", file=sys.stderr)
        return 2
    plan = plan_capacity(
        shape,
        device_memory_bytes=args.gpu_memory,
        memory_utilization=args.utilization,
        weight_bytes=args.weights,
        block_size=args.block_size,
        context_len=args.context,
        dtype=args.dtype,
    )
    print(format_plan(name, plan, device=args.device))
    return 0


LIVE_HEADROOM = 1.2  # simulate's default pool: at least this times the blocks the trace's live sequences peak at


def _simulate(args: argparse.Namespace) -> int:
    trace = make_trace(args.tokens, seed=args.seed)
    kinds: dict[str, int] = {}
    for request in trace:
        kinds[request.kind] = kinds.get(request.kind, 0) + 1
    infinite = working_set(trace, args.block_size)
    live_floor = int(infinite.peak_in_use_blocks * LIVE_HEADROOM)  # the live sequences must fit
    num_blocks = args.num_blocks or max(int(infinite.num_blocks * args.pool_fraction), live_floor)
    disk_blocks = infinite.num_blocks if args.disk_blocks < 0 else args.disk_blocks
    if num_blocks < infinite.peak_in_use_blocks:
        raise ValueError(_too_small(num_blocks, infinite.peak_in_use_blocks, live_floor))
    cache = KVCache(num_blocks, args.block_size, host_num_blocks=num_blocks // 2 if disk_blocks else 0)
    disk = SimulatedDisk(cache, disk_blocks) if disk_blocks else None
    print(
        f"trace: {len(trace):,} requests, {sum(r.num_tokens for r in trace):,} tokens "
        f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})"
    )
    print(f"pool: {num_blocks:,} blocks of {args.block_size} tokens; the working set is {infinite.num_blocks:,} blocks")
    if disk is not None:
        print(f"disk tier: {disk_blocks:,} blocks, through a host tier of {num_blocks // 2:,} blocks")
    if num_blocks >= infinite.num_blocks:
        why = "" if args.num_blocks else f"its live sequences need {live_floor:,} blocks at their peak, so "
        print(f"(this trace is too short for eviction: {why}the pool holds its whole working set; try more --tokens)")
    started = time.perf_counter()
    check = cache.check_invariants if args.check else None
    before_open = disk.promote if disk is not None else None
    try:
        result = replay(cache, trace, timed=False, check=check, before_open=before_open)
    except OutOfBlocks:  # admission reserves more than the live blocks alone
        raise ValueError(_too_small(num_blocks, infinite.peak_in_use_blocks, live_floor)) from None
    stats = cache.stats()
    print(
        f"replayed in {time.perf_counter() - started:.2f} s: {result.num_tokens / result.seconds / 1e6:.2f} M tokens/s "
        "through the core"
    )
    print(
        f"hit ratio {result.hit_ratio:.3f} (an infinite cache: {infinite.hit_ratio:.3f}); evicted "
        f"{result.num_evicted_blocks:,} blocks"
        + (f"; {disk.num_promoted_blocks:,} blocks loaded from disk" if disk is not None else "")
    )
    print(
        f"copy-on-write copies {stats.num_cow_copies:,}; forked {stats.num_forked_sequences:,}; peak in use "
        f"{result.peak_in_use_blocks:,} blocks"
    )
    cache.check_invariants()
    print(
        f"after the run: {stats.num_blocks_free:,} free + {stats.num_blocks_evictable:,} cached = "
        f"{stats.num_blocks_total:,} blocks; invariants hold"
    )
    return 0


def _too_small(num_blocks: int, peak: int, live_floor: int) -> str:
    return (
        f"--num-blocks {num_blocks:,} is too small for this trace: its live sequences hold {peak:,} blocks at their "
        f"peak; give --num-blocks {live_floor} or more, or leave it out"
    )


def _version() -> str:
    try:
        return f"radixkv {metadata.version('radixkv')}"
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "radixkv (not installed: no version)"


def _replay(args: argparse.Namespace) -> int:
    from radixkv.planning import replay_report

    capacities = [replay_report.parse_tokens(c) for c in args.capacity_tokens or ["1M"]]
    if args.ttl < 0:
        raise ValueError(f"--ttl: must be >= 0 seconds, got {args.ttl}")
    if args.concurrency <= 0:
        raise ValueError(f"--concurrency: must be > 0, got {args.concurrency}")
    report = replay_report.run(
        args.traces, args.concurrency, capacities, args.policy, ttl_s=args.ttl, seed=args.seed, jobs=args.jobs
    )
    print(replay_report.format_report(report))
    if args.out:
        replay_report.write_json(report, args.out)
    return 0


# The commands that live in a subsystem: the modules each runs (imported only when asked for, in this
# order) and the extras that install what they import. The demo's server runs in a child process, so the
# demo imports the server's modules here too: a missing server extra is this one line, not the child's log.
DELEGATED = {
    "serve": (("radixkv.server.process.app",), "server"),
    "keeper": (("radixkv.server.process.keeper",), "server"),
    "demo": (("radixkv.server.process.app", "radixkv.demo.main"), "demo,server"),
}


def _delegate(command: str, argv: list[str]) -> int:
    """Hand `argv` to the command's own `main`. A third-party module that is not installed, at import or
    while it runs, is an extra left out: one line naming it, exit status 2."""
    import importlib

    modules, extras = DELEGATED[command]
    try:
        for name in modules:
            module = importlib.import_module(name)
        return int(module.main(argv) or 0)  # the last module's
    except ModuleNotFoundError as e:
        if not e.name or e.name.partition(".")[0] == "radixkv":
            raise  # one of ours: a bug, not a missing extra
        print(f"radixkv {command}: needs the {e.name} package: {install_hint(extras)}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    parser = Parser(prog="radixkv", description="A paged KV-cache manager with radix-tree prefix sharing.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the gRPC service (see radixkv serve --help)")
    sub.add_parser("keeper", help="own the pools' memory so servers restart without losing it (radixkv keeper --help)")
    sub.add_parser("demo", help="generate with a small model through the service (see radixkv demo --help)")

    plan = sub.add_parser("plan", help="capacity arithmetic: blocks, tokens and sequences that fit")
    plan.add_argument(
        "--model",
        metavar="NAME|PATH",
        help=f"a Hugging Face directory (config.json), a .gguf file, or one of: {', '.join(MODEL_SHAPES)}",
    )
    plan.add_argument("--layers", type=integer(1), help="with --kv-heads and --head-dim: a shape instead of --model")
    plan.add_argument("--kv-heads", type=integer(1))
    plan.add_argument("--head-dim", type=integer(1))
    plan.add_argument("--dtype", default="float16", type=kv_dtype, help="KV cache dtype; fp8 = float8_e4m3fn")
    plan.add_argument(
        "--gpu-memory", default="80GiB", type=size, help="device memory, all GPUs together; GiB = 2^30 bytes, GB = 10^9"
    )
    plan.add_argument("--utilization", type=float, default=0.9, help="fraction of device memory for weights + KV")
    plan.add_argument("--weights", default="0", type=size, help="memory taken by the weights, e.g. 16GiB")
    plan.add_argument("--block-size", type=integer(1), default=16, help="tokens per block")
    plan.add_argument("--context", type=integer(1), default=4096, help="context length for the per-sequence figures")
    plan.add_argument("--device", default="cuda", help="device of the printed --pool string")
    plan.set_defaults(run=_plan)

    simulate = sub.add_parser("simulate", help="replay a synthetic serving trace through the core and report")
    simulate.add_argument("--tokens", type=integer(1), default=1_000_000, help="trace size in tokens")
    simulate.add_argument("--seed", type=int, default=0, help="the trace's random seed")
    simulate.add_argument("--block-size", type=integer(1), default=16, help="tokens per block")
    simulate.add_argument(
        "--num-blocks",
        type=integer(0),
        default=0,
        help="pool size; default: --pool-fraction of the working set, or 1.2 x the blocks the trace's live sequences "
        "hold at their peak if that is more (on a short trace, the whole working set: nothing is evicted, and the "
        "output says so)",
    )
    simulate.add_argument("--pool-fraction", type=float, default=0.15, help="of the working set, for the default pool")
    simulate.add_argument(
        "--disk-blocks",
        type=integer(-1),
        default=0,
        help="a disk tier of this many blocks, over a host tier half the pool's size (-1: the working set; 0: none)",
    )
    simulate.add_argument("--check", action="store_true", help="run the invariant checker after every request (slow)")
    simulate.set_defaults(run=_simulate)

    replay_cmd = sub.add_parser(
        "replay", help="replay agent traces through the core: eviction policies next to LRU, MIN and infinite"
    )
    replay_cmd.add_argument("--traces", required=True, metavar="DIR", help="a folder of *.json.gz sessions")
    replay_cmd.add_argument("--concurrency", type=float, default=32.0, metavar="K", help="sessions in flight, mean")
    replay_cmd.add_argument(
        "--capacity-tokens", action="append", metavar="N", help="cache size, e.g. 1M or 500k; repeatable (default 1M)"
    )
    replay_cmd.add_argument("--policy", default="all", metavar="NAME|all", help="agent, lru, slru, tlru or all")
    replay_cmd.add_argument("--ttl", type=float, default=0.0, metavar="SECONDS", help="also: infinite cache, TTL")
    replay_cmd.add_argument("--seed", type=int, default=7, help="for the sessions' start times (default 7)")
    replay_cmd.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    replay_cmd.add_argument("--out", metavar="FILE.json", help="write the points as JSON")
    replay_cmd.set_defaults(run=_replay)

    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as e:
        print(f"radixkv {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
