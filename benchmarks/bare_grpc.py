"""The transport's floor for the service benchmarks: bare gRPC carrying a step's bytes, with no radixkv in it.

A server process built as radixkv's is (grpcio's sync server, a handler thread per stream) answers
each message on a stream, or each unary call, with as many bytes as a step's response takes on the
wire; the client helpers send a step's request bytes the way radixkv's clients do (blocking: a
request iterator fed by a queue; asyncio: `write()` then `read()`). What a radixkv step costs above
this round trip (and above the in-process core call) is radixkv's own work, client and server.

    python benchmarks/bare_grpc.py   # serves; prints its port
"""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

# A step's (request, response) bytes on the wire, as radixkv's clients and server send them: an empty step,
# and a decode step of 256 sequences (packed ids and tokens; packed result columns and slots).
SIZES = {"empty": (56, 47), "decode": (3_137, 5_182)}


def serve() -> None:
    answers = {request: b"r" * response for request, response in SIZES.values()}

    def session(requests: Any, context: Any) -> Any:
        for request in requests:
            yield answers[len(request)]

    def step(request: bytes, context: Any) -> bytes:
        return answers[len(request)]

    handler = grpc.method_handlers_generic_handler(
        "bare.Bare",
        {
            "Session": grpc.stream_stream_rpc_method_handler(session),
            "Step": grpc.unary_unary_rpc_method_handler(step),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


class BareServer:
    """The bare server as a child process (`address`, `pid`); `stop()` ends it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.address = f"127.0.0.1:{int(self.proc.stdout.readline())}"
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class BlockingFloor:
    """A blocking client's round trips to the bare server: a stream message (as `RadixKVClient.step` sends one),
    or a unary call."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._responses = self._channel.stream_stream("/bare.Bare/Session")(iter(self._outbox.get, b""))
        self._unary = self._channel.unary_unary("/bare.Bare/Step")

    def stream(self, kind: str) -> None:
        self._outbox.put(b"q" * SIZES[kind][0])
        next(self._responses)

    def unary(self, kind: str) -> None:
        self._unary(b"q" * SIZES[kind][0])

    def close(self) -> None:
        self._outbox.put(b"")
        self._channel.close()


class AsyncFloor:
    """An asyncio client's stream round trip to the bare server; create and use it inside one event loop."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._call = self._channel.stream_stream("/bare.Bare/Session")()

    async def stream(self, kind: str) -> None:
        await self._call.write(b"q" * SIZES[kind][0])
        await self._call.read()

    async def close(self) -> None:
        self._call.cancel()
        await self._channel.close()


def timed(call: Any, n: int) -> list[float]:
    """Seconds of each of `n` calls."""
    walls = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
    return walls


if __name__ == "__main__":
    serve()
