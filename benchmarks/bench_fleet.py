"""A fleet of 4 radixkv servers: random vs round-robin vs `radixkv.client.Router`, on one multi-tenant trace.

Four real server processes on 127.0.0.1, and as the ceiling one cache with the whole fleet's
capacity (in-process: its hit ratio is the cache's, not the wire's). The trace: tenants, each with
a shared system prompt (its own namespace), and many
multi-turn chats; each turn's prompt is the system prompt plus the whole conversation so far plus
a new user message, and a turn runs for a while (appends its reply) before it is released and
cached, so about `running` requests are in flight at once. Each policy replays the same trace in
namespaces of its own, so no policy hits another's blocks (their leftovers are the least recently
used blocks, evicted first).

Reported per policy: fleet hit ratio (cached prompt tokens / prompt tokens), prefill tokens
computed, load imbalance (max/mean running sequences per instance, averaged over steps), and for
the Router its decision time p50/p99 and the event lag p50/p99 (from a release returning until the
router's index holds the new blocks). Then the Router once more with one instance SIGKILLed a third
of the way in and restarted at two thirds: requests sent to it before the router noticed (they
fail), any sent after (the target is none), and how long it took to leave and come back.

    python benchmarks/bench_fleet.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from radixkv.client import Balance, RadixKVClient, Router
from radixkv.errors import RadixKVError
from radixkv.server.process.spawn import ServerProcess

BLOCK_SIZE = 16
NUM_INSTANCES = 4


@dataclasses.dataclass(frozen=True)
class TraceShape:
    num_tenants: int
    num_conversations: int
    num_turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    running: int  # requests in flight at once
    blocks_per_instance: int


# The fleet's capacity holds every conversation once (the single cache's hits are the ceiling); one
# instance holds about a quarter of them: a policy that scatters a conversation loses its history.
# QUICK keeps those proportions on a small trace (24 conversations of 52 blocks, 320 blocks an instance).
QUICK = TraceShape(4, 24, 8, 64, 16, 80, 12, 320)
FULL = TraceShape(8, 96, 10, 128, 32, 96, 48, 2048)
SWEEP_WEIGHTS = (1.0, 2.0)  # the Router at other prefill weights too, to show the hit/balance trade


@dataclasses.dataclass(frozen=True)
class Request:
    conversation: int
    tenant: int
    prompt: list[int]
    reply: list[int]


def make_trace(shape: TraceShape, seed: int = 0) -> list[Request]:
    """Turns of all conversations interleaved at random, each conversation's turns in order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30_000) for _ in range(shape.system_tokens)] for _ in range(shape.num_tenants)]
    histories = [list(systems[c % shape.num_tenants]) for c in range(shape.num_conversations)]
    turns_left = [shape.num_turns] * shape.num_conversations
    trace = []
    while any(turns_left):
        c = rng.choice([i for i, n in enumerate(turns_left) if n])
        turns_left[c] -= 1
        prompt = histories[c] + [rng.randrange(1, 30_000) for _ in range(shape.user_tokens)]
        reply = [rng.randrange(1, 30_000) for _ in range(shape.reply_tokens)]
        trace.append(Request(c, c % shape.num_tenants, prompt, reply))
        histories[c] = prompt + reply
    return trace


# -- servers ---------------------------------------------------------------------------------------


class Server:
    def __init__(self, num_blocks: int, port: int = 0) -> None:
        self.num_blocks = num_blocks
        self.port = port
        self.server: ServerProcess | None = None

    def start(self) -> Server:
        pool = (
            f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},"
            f"num_blocks={self.num_blocks},dtype=float16"
        )
        self.server = ServerProcess(
            ["--port", str(self.port), "--pool", pool, "--log-level", "warning", "--max-workers", "16",
             "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-topic", f"kv@127.0.0.1:{self.port}@bench"],
        )  # fmt: skip
        self.port = self.server.port
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        assert self.server is not None
        self.server.kill()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


# -- one policy over the trace ---------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    policy: str
    num_requests: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    imbalance: list[float] = dataclasses.field(default_factory=list)
    event_lag_s: list[float] = dataclasses.field(default_factory=list)
    kill: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    def summary(self) -> dict[str, Any]:
        out = {
            "policy": self.policy,
            "num_requests": self.num_requests,
            "num_failed": self.num_failed,
            "hit_ratio": round(self.hit_ratio, 4),
            "prefill_tokens": self.prompt_tokens - self.hit_tokens,
            "load_imbalance_max_over_mean": round(float(np.mean(self.imbalance)), 3) if self.imbalance else None,
        }
        if self.event_lag_s:
            out["event_lag_ms_p50"] = round(float(np.percentile(self.event_lag_s, 50)) * 1e3, 3)
            out["event_lag_ms_p99"] = round(float(np.percentile(self.event_lag_s, 99)) * 1e3, 3)
        return out | ({"kill": self.kill} if self.kill else {})


class Fleet:
    """Clients to each address, reopened after a restart."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.clients = {a: RadixKVClient(a, session_ttl=600) for a in addresses}

    def reconnect(self, address: str) -> None:
        old = self.clients.pop(address, None)
        if old is not None:
            try:
                old.close()
            except (RadixKVError, grpc.RpcError):
                pass
        deadline = time.monotonic() + 10
        while True:  # the channel may still be backing off from the refused connections of the dead server
            try:
                self.clients[address] = RadixKVClient(address, session_ttl=600, timeout=2)
                return
            except (RadixKVError, grpc.RpcError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        for client in self.clients.values():
            try:
                client.close()
            except (RadixKVError, grpc.RpcError):
                pass


class LocalFleet:
    """One in-process cache behind the same calls as `Fleet` (open, append, release)."""

    ADDRESS = "in-process"

    def __init__(self, num_blocks: int) -> None:
        self.addresses = [self.ADDRESS]
        from radixkv.kv_cache import KVCache

        self.clients = {self.ADDRESS: KVCache(num_blocks, BLOCK_SIZE)}


def run_policy(
    name: str,
    trace: list[Request],
    fleet: Fleet | LocalFleet,
    choose: Callable[[Request, str], str],
    shape: TraceShape,
    router: Router | None = None,
    lag_every: int = 4,
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Replay `trace`: open each request where `choose` says, release it (cached) `running` steps later."""
    result = RunResult(name)
    rng = random.Random(1)
    in_flight: list[tuple[int, str, int, Request, str]] = []  # (end step, address, seq_id, request, namespace)
    namespace_of = [f"{name}-tenant{t}" for t in range(shape.num_tenants)]

    def finish(item: tuple[int, str, int, Request, str], sample_lag: bool) -> None:
        _, address, seq_id, request, namespace = item
        client = fleet.clients[address]
        try:
            client.append(seq_id, request.reply)
            client.commit([seq_id], [len(request.prompt) + len(request.reply)])  # the worker wrote it all
            client.release(seq_id)
        except (RadixKVError, grpc.RpcError):
            return  # its server died meanwhile
        if sample_lag and router is not None:
            tokens = request.prompt + request.reply
            expected = len(tokens) // BLOCK_SIZE
            start = time.perf_counter()
            while time.perf_counter() - start < 2.0:
                if router.num_cached_blocks(address, tokens, namespace) >= expected:
                    result.event_lag_s.append(time.perf_counter() - start)
                    break
                time.sleep(0.0002)

    # A conversation's next turn comes after its previous reply: it waits while that turn runs.
    queues: dict[int, list[Request]] = {}
    for request in trace:
        queues.setdefault(request.conversation, []).append(request)
    busy: set[int] = set()
    step = 0
    while result.num_requests < len(trace):
        step += 1
        due = [item for item in in_flight if item[0] <= step]
        in_flight = [item for item in in_flight if item[0] > step]
        for k, item in enumerate(due):
            busy.discard(item[3].conversation)
            finish(item, sample_lag=(item[2] % lag_every == 0) and k == 0)
        ready = [c for c, q in queues.items() if q and c not in busy]
        if not ready:
            continue
        request = queues[rng.choice(ready)].pop(0)
        if on_step is not None:
            on_step(result.num_requests)
        namespace = namespace_of[request.tenant]
        address = choose(request, namespace)
        result.num_requests += 1
        result.prompt_tokens += len(request.prompt)
        try:
            opened = fleet.clients[address].open(request.prompt, namespace)
        except (RadixKVError, grpc.RpcError):
            result.num_failed += 1
            continue
        result.hit_tokens += opened.num_cached_tokens
        busy.add(request.conversation)
        lifetime = rng.randint(shape.running // 2, shape.running * 3 // 2)
        in_flight.append((step + lifetime, address, opened.seq_id, request, namespace))
        running = [sum(1 for item in in_flight if item[1] == a) for a in fleet.addresses]
        if result.num_requests >= shape.running and np.mean(running) > 0:
            result.imbalance.append(max(running) / float(np.mean(running)))
    for item in in_flight:
        finish(item, sample_lag=False)
    return result


# -- what hashing costs the server -------------------------------------------------------------------


def bench_hash_cost(total_tokens: int, num_blocks: int = 4096) -> dict[str, Any]:
    """The core's trace replayed in-process with and without the server's event hub (which hashes
    every block entering the tree and builds its events), best of three each; and one block_hash."""
    from radixkv.kv_cache import KVCache
    from radixkv.planning.workload import make_trace as make_core_trace
    from radixkv.planning.workload import replay
    from radixkv.server.events.hub import EventHub
    from radixkv.tree.block_hash import block_hash

    trace = make_core_trace(total_tokens, seed=0)
    seconds = {}
    num_hashed = 0
    for name in ("plain", "hashed"):
        best = float("inf")
        for _ in range(3):
            cache = KVCache(num_blocks, BLOCK_SIZE)
            hub = EventHub(cache, 16) if name == "hashed" else None
            best = min(best, replay(cache, trace).seconds)
            if hub is not None:
                num_hashed = hub.num_events and len(hub.hashes) + cache.stats().num_evicted_blocks
        seconds[name] = best
    tokens = list(range(BLOCK_SIZE))
    reps = 20_000
    start = time.perf_counter()
    for _ in range(reps):
        block_hash(None, tokens)
    per_hash_us = (time.perf_counter() - start) / reps * 1e6
    return {
        "trace_tokens": sum(len(r.prompt) for r in trace),
        "hashed_blocks": num_hashed,
        "replay_s_plain": round(seconds["plain"], 3),
        "replay_s_hashed": round(seconds["hashed"], 3),
        "hashed_over_plain": round(seconds["hashed"] / seconds["plain"], 3),
        "us_per_hashed_block_in_replay": round((seconds["hashed"] - seconds["plain"]) / max(1, num_hashed) * 1e6, 2),
        "us_per_block_hash": round(per_hash_us, 2),
    }


# -- the benchmark ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller trace (< 30 s)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--prefill-weight",
        type=float,
        default=6.0,
        help="the Router's Dynamo overlap weight: load blocks one uncached block is worth (default 6: a turn's "
        "history is worth keeping over a few requests' worth of imbalance)",
    )
    parser.add_argument("--blocks-per-instance", type=int, help="override the trace shape's pool size")
    parser.add_argument("--balance", metavar="ABS,REL", help="the Router's SGLang balance thresholds (blocks, ratio)")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.blocks_per_instance:
        shape = dataclasses.replace(shape, blocks_per_instance=args.blocks_per_instance)
    balance = Balance(int(args.balance.split(",")[0]), float(args.balance.split(",")[1])) if args.balance else None
    trace = make_trace(shape)
    started = time.monotonic()
    with ThreadPoolExecutor(NUM_INSTANCES) as pool:
        servers = list(pool.map(lambda s: s.start(), [Server(shape.blocks_per_instance) for _ in range(NUM_INSTANCES)]))
    startup_s = time.monotonic() - started
    addresses = [s.address for s in servers]
    fleet = Fleet(addresses)
    # The ceiling: one cache with the fleet's capacity. In-process: its hit ratio is the cache's, not the wire's.
    single_fleet = LocalFleet(shape.blocks_per_instance * NUM_INSTANCES)
    results: list[RunResult] = []
    router = Router(addresses, block_size=BLOCK_SIZE, prefill_weight=args.prefill_weight, health_interval=0.5,
                    load_interval=0.05, balance=balance, seed=0)  # fmt: skip
    try:
        assert router.wait_ready(60), "router never saw every instance healthy"
        results.append(run_policy("single", trace, single_fleet, lambda r, ns: LocalFleet.ADDRESS, shape))
        rng = random.Random(2)
        results.append(run_policy("random", trace, fleet, lambda r, ns: rng.choice(addresses), shape))
        counter = iter(range(10**9))
        results.append(
            run_policy("round_robin", trace, fleet, lambda r, ns: addresses[next(counter) % NUM_INSTANCES], shape)
        )
        num_decisions = len(router.decision_seconds())
        results.append(run_policy("router", trace, fleet, lambda r, ns: router.route(r.prompt, ns), shape, router))
        decisions = router.decision_seconds()[num_decisions:]
        for weight in SWEEP_WEIGHTS if not args.quick else ():
            router.prefill_weight = weight
            results.append(
                run_policy(f"router_w{weight:g}", trace, fleet, lambda r, ns: router.route(r.prompt, ns), shape, router)
            )
        router.prefill_weight = args.prefill_weight
        results.append(run_with_a_kill(trace, fleet, router, servers[-1], shape))
    finally:
        router.close()
        fleet.close()
        for s in servers:
            s.stop()

    hash_cost = bench_hash_cost(200_000 if args.quick else 1_000_000)
    rows = {r.policy: r.summary() for r in results}
    single_hit, random_hit, router_hit = (rows[p]["hit_ratio"] for p in ("single", "random", "router"))
    report = {
        "shape": dataclasses.asdict(shape),
        "num_instances": NUM_INSTANCES,
        "prefill_weight": args.prefill_weight,
        "balance": args.balance,
        "server_startup_s": round(startup_s, 2),
        "policies": rows,
        "router_decision_us_p50": round(float(np.percentile(decisions, 50)) * 1e6, 1),
        "router_decision_us_p99": round(float(np.percentile(decisions, 99)) * 1e6, 1),
        "router_hit_over_single": round(router_hit / single_hit, 3),
        "router_hit_over_random": round(router_hit / random_hit, 3),
        "hash_cost": hash_cost,
    }
    report["targets"] = {
        "router_hit >= 0.9 x single": report["router_hit_over_single"] >= 0.9,
        "router_hit >= 2 x random": report["router_hit_over_random"] >= 2.0,
        "router max/mean load <= 1.3": rows["router"]["load_imbalance_max_over_mean"] <= 1.3,
        "none routed to the dead instance after its health check failed": rows["router_kill"]["kill"][
            "routed_to_dead_after_detected"
        ]
        == 0,
    }
    print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_with_a_kill(trace: list[Request], fleet: Fleet, router: Router, victim: Server, shape: TraceShape) -> RunResult:
    """The Router again; `victim` SIGKILLed a third of the way in, restarted (same port) at two thirds."""
    kill_step, restart_step = len(trace) // 3, 2 * len(trace) // 3
    index = fleet.addresses.index(victim.address)
    info: dict[str, Any] = {"killed_at_step": kill_step, "restarted_at_step": restart_step}
    state: dict[str, float | None] = {"killed": None, "detected": None, "restarted": None, "back": None}
    counts = {"routed_to_dead_before_detected": 0, "routed_to_dead_after_detected": 0}

    def on_step(step: int) -> None:
        now = time.monotonic()
        if step == kill_step:
            victim.kill()
            state["killed"] = now
        if step == restart_step:
            victim.start()
            state["restarted"] = time.monotonic()
            fleet.reconnect(victim.address)
        healthy = router.status()[index].healthy
        if state["killed"] is not None and state["detected"] is None and not healthy:
            state["detected"] = time.monotonic()
        if state["restarted"] is not None and state["back"] is None and healthy and router.status()[index].epoch:
            state["back"] = time.monotonic()

    def choose(request: Request, namespace: str) -> str:
        address = router.route(request.prompt, namespace)
        dead = state["killed"] is not None and state["restarted"] is None
        if address == victim.address and dead:
            key = "routed_to_dead_after_detected" if state["detected"] is not None else "routed_to_dead_before_detected"
            counts[key] += 1
        return address

    result = run_policy("router_kill", trace, fleet, choose, shape, router, on_step=on_step)
    if state["restarted"] is not None:  # still waiting for the router to take it back: bounded by the trace end
        deadline = time.monotonic() + 10
        while state["back"] is None and time.monotonic() < deadline:
            on_step(-1)
            time.sleep(0.01)
    killed, detected, restarted, back = state["killed"], state["detected"], state["restarted"], state["back"]
    info |= counts
    info["left_candidates_s_after_kill"] = round(detected - killed, 3) if detected and killed else None
    info["back_s_after_restart"] = round(back - restarted, 3) if back and restarted else None
    result.kill = info
    return result


def print_table(report: dict[str, Any]) -> None:
    print(f"bench_fleet: {report['num_instances']} servers on loopback (started in {report['server_startup_s']} s)")
    print(f"trace {report['shape']}; router prefill_weight {report['prefill_weight']}")
    header = (
        f"{'policy':<12} {'requests':>8} {'failed':>6} {'hit ratio':>9} {'prefill tok':>11} {'max/mean load':>13} "
        f"{'event lag p50/p99 ms':>21}"
    )
    print(header)
    print("-" * len(header))
    for row in report["policies"].values():
        lag = f"{row['event_lag_ms_p50']:.2f} / {row['event_lag_ms_p99']:.2f}" if "event_lag_ms_p50" in row else "-"
        imbalance = row["load_imbalance_max_over_mean"]
        print(
            f"{row['policy']:<12} {row['num_requests']:>8} {row['num_failed']:>6} {row['hit_ratio']:>9.3f} "
            f"{row['prefill_tokens']:>11} {imbalance if imbalance is not None else '-':>13} {lag:>21}"
        )
    print(f"router decision time p50 {report['router_decision_us_p50']} us, p99 {report['router_decision_us_p99']} us")
    print(
        f"router hit / single cache {report['router_hit_over_single']}, router hit / random "
        f"{report['router_hit_over_random']}"
    )
    print(f"kill and restart: {report['policies']['router_kill']['kill']}")
    h = report["hash_cost"]
    print(
        f"hashing (in-process core trace, {h['trace_tokens']:,} prompt tokens, {h['hashed_blocks']:,} blocks hashed): "
        f"replay {h['replay_s_plain']} s plain, {h['replay_s_hashed']} s with the event hub = "
        f"{h['hashed_over_plain']}x; "
        f"{h['us_per_hashed_block_in_replay']} us per hashed block with its event, {h['us_per_block_hash']} us per "
        "block_hash"
    )
    for target, met in report["targets"].items():
        print(f"  [{'met' if met else 'MISSED'}] {target}")


if __name__ == "__main__":
    sys.exit(main())
