"""Soak of churn: one tenant churns sessions, request ids, Session frames and KV-event replay peers for N minutes
next to a steady control tenant; the server's RSS over time, as a table.

A server (auth on: tenants `churn` and `control`, a 4096-block pool with its KV-event stream and replay
socket on ipc endpoints, short leases) and, in this process:
- `sessions`: open a session, 32 request-id'd opens and releases (each result kept in the session's window),
  then close it, or every other time walk away from it (its lease runs out);
- `frames`: Session streams carrying frames of 64 request-id'd steps (opens; their sequences released after),
  every fourth stream cancelled as soon as its frame is sent (the server stops the frame: issue 42 item 2);
- `replay`: 32 DEALER peers connect to the replay socket, ask for a replay from 0, read part of it and go;
- `control`: one session opening, appending to and releasing a sequence, timed.
Every `--interval` seconds a row: the server's RSS (VmRSS), the request windows' bytes and live sessions (its
metrics), what the churn did in the interval, and the control's p50/p99 latency. `--out FILE.json` writes the
rows and a summary (RSS after warm-up, at the end, the largest, and the growth after warm-up).

    python benchmarks/bench_tenant_churn.py [--quick] [--minutes 10] [--out churn.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import zmq

from radixkv.server.process.spawn import ServerProcess
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

TOKENS = {"churn": "churn-token-0000000", "control": "control-token-00000"}
POOL = "num_layers=1,num_kv_heads=1,head_dim=8,block_size=4,num_blocks=4096,dtype=float16"
FRAME_STEPS = 64  # what the clients send in one frame (client/session/pipeline.py MAX_FRAME_STEPS)


class Churn:
    """The churning tenant's and the control's loops, their counts, and a stop flag."""

    def __init__(self, address: str, replay_endpoint: str) -> None:
        self.address, self.replay_endpoint = address, replay_endpoint
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"sessions_churned": 0, "request_ids": 0, "frames": 0, "abandoned": 0,
                                       "peers": 0, "errors": 0}  # fmt: skip
        self.control_ms: list[float] = []
        self._lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def take(self) -> tuple[dict[str, int], list[float]]:
        """The counts and control latencies since the last call."""
        with self._lock:
            counts, latencies = dict(self.counts), self.control_ms
            self.counts = dict.fromkeys(self.counts, 0)
            self.control_ms = []
        return counts, latencies

    def _loop(self, body: Callable[[int], None]) -> None:
        n = 0
        while not self.stop.is_set():
            try:
                body(n)
            except grpc.RpcError:
                self.count("errors")
            n += 1

    def threads(self) -> list[threading.Thread]:
        return [threading.Thread(target=self._loop, args=(body,), daemon=True)
                for body in (self.sessions, self.frames, self.replay, self.control)]  # fmt: skip

    # -- the loops --------------------------------------------------------------------------------------------------

    def _stub(self, tenant: str) -> tuple[grpc.Channel, Any, list[tuple[str, str]]]:
        channel = grpc.insecure_channel(self.address)
        return channel, kvcache_pb2_grpc.KVCacheStub(channel), [("authorization", f"Bearer {TOKENS[tenant]}")]

    def sessions(self, n: int) -> None:
        channel, stub, md = self._stub("churn")
        with channel:
            session = stub.OpenSession(pb.OpenSessionRequest(), metadata=md, timeout=60).session_id
            for i in range(32):
                prompt = pb.Prompt(token_ids=[n % 1000 + 1, i + 1] * 32)
                opened = stub.OpenSequences(
                    pb.OpenSequencesRequest(session_id=session, request_id=2 * i + 1, prompts=[prompt]),
                    metadata=md, timeout=60,
                )  # fmt: skip
                release = pb.ReleaseSequencesRequest(
                    session_id=session, request_id=2 * i + 2, seq_ids=[opened.sequences[0].seq_id]
                )
                stub.ReleaseSequences(release, metadata=md, timeout=60)
            self.count("request_ids", 64)
            if n % 2 == 0:
                stub.CloseSession(pb.CloseSessionRequest(session_id=session), metadata=md, timeout=60)
            self.count("sessions_churned")

    def frames(self, n: int) -> None:
        channel, stub, md = self._stub("churn")
        with channel:
            session = stub.OpenSession(pb.OpenSessionRequest(), metadata=md, timeout=60).session_id
            steps = [
                pb.SessionRequest(session_id=session, request_id=i + 1,
                                  opens=[pb.StepOpen(token_ids=struct.pack("<9i", n % 997, i, *[7] * 7))])
                for i in range(FRAME_STEPS)
            ]  # fmt: skip
            call = stub.Session(iter([pb.SessionRequest(steps=steps)]), metadata=md, timeout=60)
            if n % 4 == 3:
                call.cancel()  # walk away from the frame
                self.count("abandoned")
            else:
                for _ in call:
                    pass
                self.count("frames")
            stub.CloseSession(pb.CloseSessionRequest(session_id=session), metadata=md, timeout=60)

    def replay(self, n: int) -> None:
        context = zmq.Context.instance()
        peers = []
        for _ in range(32):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            peers.append(dealer)
        for dealer in peers[::2]:  # half read a little of their replay, then all go
            if dealer.poll(200):
                dealer.recv_multipart()
        for dealer in peers:
            dealer.close()
        self.count("peers", len(peers))
        self.stop.wait(0.05)

    def control(self, n: int) -> None:
        channel, stub, md = self._stub("control")
        with channel:
            session = stub.OpenSession(pb.OpenSessionRequest(), metadata=md, timeout=60).session_id
            for i in range(50):
                start = time.perf_counter()
                seq = stub.OpenSequences(
                    pb.OpenSequencesRequest(session_id=session, prompts=[pb.Prompt(token_ids=[1, 2, 3, i + 4] * 8)]),
                    metadata=md, timeout=60,
                ).sequences[0].seq_id  # fmt: skip
                stub.AppendTokens(
                    pb.AppendTokensRequest(session_id=session, seq_ids=[seq], num_token_ids=[1], token_ids=[9]),
                    metadata=md, timeout=60,
                )  # fmt: skip
                stub.ReleaseSequences(pb.ReleaseSequencesRequest(session_id=session, seq_ids=[seq]), metadata=md,
                                      timeout=60)  # fmt: skip
                with self._lock:
                    self.control_ms.append((time.perf_counter() - start) * 1e3)
                if self.stop.wait(0.01):
                    break
            stub.CloseSession(pb.CloseSessionRequest(session_id=session), metadata=md, timeout=60)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line")


def scrape(metrics_port: int, names: tuple[str, ...]) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


def rows(server: ServerProcess, churn: Churn, seconds: float, interval: float) -> Iterator[dict[str, Any]]:
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        churn.stop.wait(min(interval, seconds - elapsed))
        counts, latencies = churn.take()
        metrics = scrape(server.metrics_port, ("radixkv_request_window_bytes", "radixkv_sessions"))
        ordered = sorted(latencies) or [0.0]
        yield {
            "seconds": round(time.monotonic() - start, 1),
            "rss_mib": rss_bytes(server.pid) / 2**20,
            "window_kib": metrics.get("radixkv_request_window_bytes", 0) / 1024,
            "sessions": int(metrics.get("radixkv_sessions", 0)),
            **counts,
            "control_p50_ms": statistics.median(ordered),
            "control_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="one minute")
    parser.add_argument("--interval", type=float, help="seconds between rows (default: a tenth of the run)")
    parser.add_argument("--out", type=Path, help="write the rows and a summary as JSON")
    args = parser.parse_args()
    seconds = 60.0 if args.quick else args.minutes * 60
    interval = args.interval or seconds / 10
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "tenants.toml").write_text(
            "".join(f'[tenants.{name}]\ntoken = "{token}"\nmax_blocks = 512\n' for name, token in TOKENS.items())
        )
        replay = f"ipc://{d}/replay"
        server = ServerProcess(
            ["--pool", f"default:{POOL},kv_events_endpoint=ipc://{d}/events,kv_events_replay_endpoint={replay},"
             "kv_events_buffer_steps=1000", "--auth-tokens", f"{d}/tenants.toml", "--metrics-port", "0",
             "--session-ttl", "2", "--max-session-ttl", "5", "--max-workers", "16", "--log-level", "warning",
             "--kv-events-insecure-publish-tenant-prompts"],
            Path(d) / "server.log",
        )  # fmt: skip
        churn = Churn(server.address, replay)
        threads = churn.threads()
        for thread in threads:
            thread.start()
        table = []
        header = ("seconds", "rss_mib", "window_kib", "sessions", "sessions_churned", "request_ids", "frames",
                  "abandoned", "peers", "errors", "control_p50_ms", "control_p99_ms")  # fmt: skip
        print(" ".join(f"{h:>16}" for h in header))
        try:
            for row in rows(server, churn, seconds, interval):
                table.append(row)
                values = [row[h] for h in header]
                print(" ".join(f"{v:>16.1f}" if isinstance(v, float) else f"{v:>16}" for v in values), flush=True)
        finally:
            churn.stop.set()
            for thread in threads:
                thread.join(timeout=120)
            code = server.stop(timeout=60)
    warm = table[min(1, len(table) - 1)]["rss_mib"]  # after the first interval: the cache and rings are warm
    summary = {
        "seconds": seconds,
        "rss_after_warmup_mib": warm,
        "rss_end_mib": table[-1]["rss_mib"],
        "rss_max_mib": max(r["rss_mib"] for r in table),
        "rss_growth_after_warmup_mib": table[-1]["rss_mib"] - warm,
        "server_exit": code,
    }
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "tenant_churn", "quick": args.quick, "rows": table,
                                        "summary": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
