"""One soak client process (started by bench_soak.py): every operation, mixed, until its deadline or a SIGKILL.

    python benchmarks/soak_client.py ADDRESS OUT_FILE SEED DEADLINE TTL [STOP_FILE]

Drives one `RadixKVClient` (a session with a `TTL`-second lease) through a random mix of batched
opens over shared prompts, decode steps, forks, caching, releases, matches, pins, stats, event
streams, session renewal and reopening, and two requests that must be refused (a fork past
`max_fork_children`, an append to a sequence that does not exist). Until the wall-clock `DEADLINE`
(seconds since the epoch) it appends a JSON line to OUT_FILE about every half second, what happened
since the last line: {"outcomes": {"op OUTCOME": count}, "latencies_ms": {op: [...]}} where OUTCOME is
OK, a refusal's reason, or a transport status. A SIGKILL loses at most the lines not yet written;
the reader skips a line the kill cut short. At the deadline, or once STOP_FILE exists (the harness
ends a run that lasts until enough has happened), it closes its session and exits 0.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from radixkv.client import RadixKVClient
from radixkv.errors import RadixKVError, UnknownSession

FLUSH_SECONDS = 0.5
SYSTEM_PROMPTS = [list(range(10_000 * (p + 1), 10_000 * (p + 1) + 64)) for p in range(8)]  # 4 blocks of 16 each
NAMESPACES = ["soak-0", "soak-1"]
MAX_LIVE = 16
MUST_FAIL = {"bad_fork", "bad_append"}  # the harness checks these were refused, never served


class Recorder:
    """Counts outcomes and keeps latencies per operation; `flush` appends them to the file and starts over."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a")  # noqa: SIM115 -- open for the life of the process
        self._outcomes: dict[str, int] = {}
        self._latencies: dict[str, list[float]] = {}
        self._last_flush = time.monotonic()

    def timed(self, op: str, call: Callable[[], Any]) -> tuple[bool, Any]:
        """(served, result) of `call`; a refusal or a transport failure is recorded, not raised (a lost session is)."""
        start = time.perf_counter()
        outcome, result = "OK", None
        try:
            result = call()
        except RadixKVError as e:
            outcome = e.reason
            if isinstance(e, UnknownSession):
                raise
        except grpc.RpcError as e:
            outcome = e.code().name  # type: ignore[attr-defined]
        finally:
            self._latencies.setdefault(op, []).append(round((time.perf_counter() - start) * 1000, 3))
            key = f"{op} {outcome}"
            self._outcomes[key] = self._outcomes.get(key, 0) + 1
            if time.monotonic() - self._last_flush > FLUSH_SECONDS:
                self.flush()
        return outcome == "OK", result

    def flush(self) -> None:
        self._file.write(json.dumps({"outcomes": self._outcomes, "latencies_ms": self._latencies}) + "\n")
        self._file.flush()
        self._outcomes, self._latencies = {}, {}
        self._last_flush = time.monotonic()


def prompt(rng: random.Random) -> list[int]:
    return rng.choice(SYSTEM_PROMPTS) + [rng.randrange(5000) for _ in range(rng.randrange(1, 40))]


def watch_once(client: RadixKVClient) -> int:
    """Open an event stream, read what arrives for a moment, cancel it; returns the events read."""
    stream = client.watch_events(include_snapshot=True)
    timer = threading.Timer(0.2, stream.cancel)
    timer.start()
    try:
        return sum(1 for _ in stream)
    finally:
        timer.cancel()
        stream.cancel()


def step(client: RadixKVClient, rng: random.Random, live: list[int], pins: list[list[int]], rec: Recorder) -> None:
    """One random operation; `live` and `pins` follow what the server now holds for this session."""
    namespace = rng.choice(NAMESPACES)
    op = rng.choices(
        ["open", "append", "fork", "cache", "release", "match", "pin", "unpin", "stats", "keep_alive", "watch",
         "reopen", "bad_fork", "bad_append"],
        weights=[6, 10, 2, 2, 5, 3, 1, 1, 1, 1, 0.3, 0.2, 0.3, 0.3],
    )[0]  # fmt: skip
    if op == "open" or not live:
        _, opened = rec.timed(
            "open", lambda: client.open_many([(prompt(rng), namespace) for _ in range(rng.randrange(1, 9))])
        )
        live += [o.seq_id for o in opened or ()]
    elif op == "append":  # a decode step: one token for each of a batch of live sequences
        batch = rng.sample(live, min(len(live), 16))
        rec.timed("append", lambda: client.append_many([(s, [rng.randrange(5000)]) for s in batch]))
    elif op == "fork":
        live += rec.timed("fork", lambda: client.fork(rng.choice(live), rng.randrange(1, 4)))[1] or []
    elif op == "cache":
        rec.timed("cache", lambda: client.cache(rng.choice(live)))
    elif op == "release":
        victims = rng.sample(live, min(len(live), rng.randrange(1, 6)))
        if rec.timed("release", lambda: client.release_many(victims, cache=rng.random() < 0.8))[0]:
            live[:] = [s for s in live if s not in victims]
    elif op == "match":
        rec.timed("match", lambda: client.match(prompt(rng), namespace))
    elif op == "pin" and len(pins) < 4:
        prefix = rng.choice(SYSTEM_PROMPTS)
        if rec.timed("pin", lambda: client.pin(prefix, NAMESPACES[0]))[0]:
            pins.append(prefix)
    elif op == "unpin" and pins:
        rec.timed("unpin", lambda: client.unpin(pins.pop(), NAMESPACES[0]))
    elif op == "keep_alive":
        rec.timed("keep_alive", client.keep_alive)
    elif op == "watch":
        rec.timed("watch", lambda: watch_once(client))
    elif op == "reopen":
        rec.timed("reopen", client.reopen)
        live.clear()
        pins.clear()
    elif op == "bad_fork":
        rec.timed("bad_fork", lambda: client.fork(rng.choice(live), 10**6))
    elif op == "bad_append":
        rec.timed("bad_append", lambda: client.append(2**62 + rng.randrange(1000), [1]))
    else:
        rec.timed("stats", client.stats)
    if len(live) > MAX_LIVE:  # keep one client from holding the pool
        oldest = live[: len(live) // 2]
        if rec.timed("release", lambda: client.release_many(oldest))[0]:
            del live[: len(oldest)]


def main(address: str, out_path: str, seed: int, deadline: float, ttl: float, stop_path: str | None = None) -> int:
    rng = random.Random(seed)
    rec = Recorder(out_path)
    with RadixKVClient(address, session_ttl=ttl, timeout=30) as client:
        live: list[int] = []
        pins: list[list[int]] = []
        while time.time() < deadline and not (stop_path and os.path.exists(stop_path)):
            try:
                step(client, rng, live, pins, rec)
            except UnknownSession:  # the lease ran out (the machine stalled past the ttl): start over
                rec.timed("reopen", client.reopen)
                live.clear()
                pins.clear()
        rec.flush()
    return 0


if __name__ == "__main__":
    address, out_path, seed, deadline, ttl = sys.argv[1:6]
    sys.exit(main(address, out_path, int(seed), float(deadline), float(ttl), *sys.argv[6:7]))
