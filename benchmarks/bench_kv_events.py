"""KV-event lag and service throughput of one radixkv server, quiet and under a replay flood.

One real server process on 127.0.0.1 publishing vLLM's KV events (PUB + replay ROUTER). A client
drives the service as an orchestrator's request loop does: open a new prompt, commit what the worker
wrote, release it cached (so each request stores blocks and the stream announces them). A subscriber
as llm-d's reads the live stream and times each announcement from the moment its release was sent.
Then the same again while peers flood the replay socket: each connection asks for a full replay from
seq 0 as fast as its socket takes requests and never reads a reply (what an unauthenticated peer
could do before replays were bounded: 27 KB of such requests held live events back for over 60 s).

Three phases: quiet; the control, the same flood aimed at another process (a ROUTER that drops every
request), so the flood's own CPU weighs on this host as it does in the last phase; and the flood at the
server's replay socket. Reported per phase: requests served per second, event lag p50/p99/max, events
announced and missed, the server's CPU per request, replay requests sent, the server's RSS before and
after; then the ratios of the flood to its control and to quiet, from this run.

    python benchmarks/bench_kv_events.py [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from radixkv.client import RadixKVClient
from radixkv.server.process.spawn import ServerProcess
from radixkv.tree.block_hash import chain_hashes, wire_hash

BLOCK_SIZE = 16
PROMPT_BLOCKS = 4


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sink(endpoint: Any, stop: Any) -> None:
    """The control's target: a ROUTER in a process of its own that reads every request and answers none."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint.value = f"tcp://127.0.0.1:{port}".encode()
    while not stop.is_set():
        if router.poll(50):
            router.recv_multipart()
    router.close()
    context.term()


class LiveSubscriber(threading.Thread):
    """Reads the events socket; records when each stored chain's first block hash arrived."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.arrived: dict[int, float] = {}
        self.stop = threading.Event()
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.connect(endpoint)

    def run(self) -> None:
        import msgspec

        decoder = msgspec.msgpack.Decoder()
        while not self.stop.is_set():
            if not self.sub.poll(50):
                continue
            _, _, payload = self.sub.recv_multipart()
            now = time.perf_counter()
            for event in decoder.decode(payload)[1]:
                if event["type"] == "BlockStored" and event["parent_block_hash"] is None:
                    self.arrived[event["block_hashes"][0]] = now
        self.sub.close()


def _flood(endpoint: str, num_peers: int, stop: Any, num_requests: Any) -> None:
    """A process of its own (it would otherwise take the measuring client's GIL): `num_peers` DEALER connections
    asking for replays from seq 0 as fast as their sockets take requests, reading nothing."""
    context = zmq.Context()
    peers = []
    for _ in range(num_peers):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        peers.append(dealer)
    request = [b"", (0).to_bytes(8, "big")]
    while not stop.is_set():
        sent = 0
        for dealer in peers:
            try:
                dealer.send_multipart(request, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
        with num_requests.get_lock():
            num_requests.value += sent
        if not sent:
            time.sleep(0.001)
    for dealer in peers:
        dealer.close()
    context.term()


def _phase(server: ServerProcess, seconds: float, flood_peers: int, target: str | None, seed: int) -> dict[str, Any]:
    """`flood_peers` flooding `target` (the server's replay socket, or another process's) while measuring."""
    kv = server.announcement["kv_events"]["default"]
    live = LiveSubscriber(kv["endpoint"])
    live.start()
    time.sleep(0.3)  # the subscription reaches the publisher
    stop, num_flood_requests = multiprocessing.Event(), multiprocessing.Value("q", 0)
    flood = multiprocessing.Process(target=_flood, args=(target, flood_peers, stop, num_flood_requests))
    if flood_peers:
        flood.start()
        time.sleep(0.5)  # the flood is under way before the measured requests start
    rss_before, cpu_before = _rss_mib(server.pid), _cpu_seconds(server.pid)
    rng = random.Random(seed)
    released: dict[int, float] = {}
    num_requests = 0
    with RadixKVClient(server.address) as client:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            prompt = [rng.randrange(1, 32_000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE + 1)]
            seq_id = client.open(prompt).seq_id
            client.commit([seq_id], [len(prompt)])
            released[wire_hash(chain_hashes(prompt, BLOCK_SIZE)[0])] = time.perf_counter()  # the release is sent
            client.release(seq_id)
            num_requests += 1
        elapsed = time.perf_counter() - start
        server_cpu = _cpu_seconds(server.pid) - cpu_before
    deadline = time.perf_counter() + 10.0  # what is still on its way arrives (later than this: missed)
    while time.perf_counter() < deadline and not all(h in live.arrived for h in released):
        time.sleep(0.05)
    rss_after = _rss_mib(server.pid)
    if flood_peers:
        stop.set()
        flood.join()
    live.stop.set()
    live.join()
    lags = np.array([live.arrived[h] - t for h, t in released.items() if h in live.arrived]) * 1e3
    return {
        "seconds": round(elapsed, 2),
        "requests_per_s": round(num_requests / elapsed, 1),
        "lag_ms_p50": round(float(np.percentile(lags, 50)), 2) if lags.size else None,
        "lag_ms_p99": round(float(np.percentile(lags, 99)), 2) if lags.size else None,
        "lag_ms_max": round(float(lags.max()), 2) if lags.size else None,
        "num_announced": int(lags.size),
        "num_missed": len(released) - int(lags.size),
        "server_cpu_ms_per_request": round(server_cpu / max(1, num_requests) * 1e3, 3),
        "replay_requests_sent": num_flood_requests.value,
        "rss_mib_before": round(rss_before, 1),
        "rss_mib_after": round(rss_after, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s phases instead of 20 (a check that it runs)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--flood-peers", type=int, default=32, help="replay-flooding connections")
    args = parser.parse_args(argv)
    seconds = 2.0 if args.quick else 20.0
    pool = f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},num_blocks=8192"
    server = ServerProcess(
        ["--pool", pool, "--log-level", "warning", "--kv-events-endpoint", "tcp://127.0.0.1:0",
         "--kv-events-topic", "kv@127.0.0.1:8000@bench", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
    )  # fmt: skip
    sink_stop, sink_endpoint = multiprocessing.Event(), multiprocessing.Array("c", 64)
    sink = multiprocessing.Process(target=_sink, args=(sink_endpoint, sink_stop))
    sink.start()
    try:
        while not sink_endpoint.value:
            time.sleep(0.01)
        replay = server.announcement["kv_events"]["default"]["replay_endpoint"]
        phases = {
            "quiet": _phase(server, seconds, 0, None, 1),
            # The control: the same flood at another process, so its CPU on this host is the same.
            "flood elsewhere": _phase(server, seconds, args.flood_peers, sink_endpoint.value.decode(), 2),
            "flood": _phase(server, seconds, args.flood_peers, replay, 3),
        }
    finally:
        server.stop()
        sink_stop.set()
        sink.join()
    quiet, control, flood = phases["quiet"], phases["flood elsewhere"], phases["flood"]
    ratios = {
        "requests_per_s flood/flood elsewhere": round(flood["requests_per_s"] / control["requests_per_s"], 3),
        "requests_per_s flood/quiet": round(flood["requests_per_s"] / quiet["requests_per_s"], 3),
        "lag p99 flood/flood elsewhere": round(flood["lag_ms_p99"] / control["lag_ms_p99"], 2),
        "lag p99 flood/quiet": round(flood["lag_ms_p99"] / quiet["lag_ms_p99"], 2),
    }
    columns = list(quiet)
    print(f"{'phase':<16} " + " ".join(f"{c:>26}" for c in columns))
    for name, row in phases.items():
        print(f"{name:<16} " + " ".join(f"{row[c]!s:>26}" for c in columns))
    for key, value in ratios.items():
        print(f"{key}: {value}")
    if args.out:
        Path(args.out).write_text(json.dumps({"phases": phases, "ratios": ratios, "quick": args.quick}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
