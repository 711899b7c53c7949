"""Real server processes for the fleet tests: each publishes vLLM KV events on loopback ZMQ sockets.

`FleetServer` starts `radixkv serve` on 127.0.0.1 (port 0 unless told), learns its gRPC port and
its KV-events endpoints (events, replay, digest) from the announcement line, and can be killed (SIGKILL)
and restarted on the same port, as a crashed pod comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from radixkv.server.process.spawn import STOP_SECONDS, ServerProcess, patient

BLOCK_SIZE = 4


def pool_flag(num_blocks: int, block_size: int = BLOCK_SIZE) -> str:
    return (
        f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={block_size},num_blocks={num_blocks},dtype=float16"
    )


class FleetServer:
    def __init__(
        self,
        log_dir: Path,
        name: str,
        num_blocks: int = 64,
        port: int = 0,
        replay: bool = True,
        extra: tuple[str, ...] = (),
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.log_dir, self.name, self.num_blocks, self.replay, self.extra = log_dir, name, num_blocks, replay, extra
        self.block_size = block_size
        self.port = port
        self.num_starts = 0
        self.start()

    def start(self, timeout: float = 60.0) -> None:
        self.topic = f"kv@127.0.0.1:{self.port}@test-model"  # port 0 on a first start: still a valid topic
        args = [
            "--port", str(self.port), "--pool", pool_flag(self.num_blocks, self.block_size), "--debug-rpc",
            "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-topic", self.topic,
            *(["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"] if self.replay else []),
            "--kv-events-digest-endpoint", "tcp://127.0.0.1:0", *self.extra,
        ]  # fmt: skip
        self.log_path = self.log_dir / f"{self.name}.{self.num_starts}.log"
        self.num_starts += 1
        self.server = ServerProcess(args, self.log_path, timeout)
        self.port, self.address = self.server.port, self.server.address
        kv = self.server.announcement["kv_events"]["default"]
        self.events_endpoint: str = kv["endpoint"]
        self.replay_endpoint: str | None = kv["replay_endpoint"]
        self.digest_endpoint: str = kv["digest_endpoint"]

    def kill(self) -> None:
        """SIGKILL: no graceful stop, as a crashed pod."""
        self.server.kill()

    def stop(self, timeout: float = STOP_SECONDS) -> int:
        return self.server.stop(timeout)


@pytest.fixture
def start_fleet_server(tmp_path: Path) -> Iterator[Callable[..., FleetServer]]:
    started: list[FleetServer] = []

    def start(**kwargs: object) -> FleetServer:
        server = FleetServer(tmp_path, f"server{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.02) -> bool:
    """Poll `predicate` until true or `patient(timeout)` seconds pass (the bound stretches on a loaded machine)."""
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
