"""Real server processes for the service tests: started once per test session, stopped with SIGTERM.

`server`: no auth; pools "default" (256 blocks) and "tiny" (8 blocks, for refusals and eviction);
the test-only Debug service on, so tests can ask the server to check its own invariants.
`auth_server`: bearer tokens for tenants acme (namespaces chat, code; an 8-block quota) and globex
(any namespace, no quota, may map pools, admin: may call Debug), served over TLS with a self-signed
certificate made here; besides the shared pools, pool "globex" serves globex alone (the one it may map).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from radixkv.server.process.spawn import ServerProcess, patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc

POOL_FLAGS = [
    "--pool",
    "default:num_layers=2,num_kv_heads=2,head_dim=8,block_size=4,num_blocks=256,dtype=float32,max_fork_children=8",
    "--pool", "tiny:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8,dtype=float16",
]  # fmt: skip
GLOBEX_POOL = "globex:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=8,dtype=float16,tenants=globex"
ACME_TOKEN = "acme-secret-token"
GLOBEX_TOKEN = "globex-secret-token"
AUTH_TOKENS = f"""
[tenants.acme]
token = "{ACME_TOKEN}"
namespaces = ["chat", "code"]
max_blocks = 8

[tenants.globex]
token = "{GLOBEX_TOKEN}"
map_pools = true
admin = true
"""


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(
        [
            *POOL_FLAGS,
            "--debug-rpc",
            "--metrics-port",
            "0",
            "--max-message-bytes",
            str(1 << 20),
            "--max-session-ttl",
            "600",
        ],
        log,
    )
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory, tls_files: tuple[Path, Path]) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("auth_server")
    tokens = d / "tokens.toml"
    tokens.write_text(AUTH_TOKENS)
    cert, key = tls_files
    proc = ServerProcess(
        [
            *POOL_FLAGS,
            "--pool",
            GLOBEX_POOL,
            "--debug-rpc",
            "--auth-tokens",
            str(tokens),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        d / "server.log",
    )
    yield proc
    assert proc.stop() == 0, (d / "server.log").read_text()[-2000:]


class Debug:
    """The server's own view: invariants, live sequences and sessions, checksums of its storage."""

    def __init__(
        self, address: str, credentials: grpc.ChannelCredentials | None = None, token: str | None = None
    ) -> None:
        self._channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
        self._stub = debug_pb2_grpc.DebugStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def check(self, pool: str = "default") -> debug_pb2.CheckInvariantsResponse:
        response = self._stub.CheckInvariants(
            debug_pb2.CheckInvariantsRequest(pool=pool), metadata=self._metadata, timeout=10
        )
        assert response.violation == "", response.violation
        return response

    def checksum(self, block_ids: list[int], pool: str = "default") -> str:
        return self._stub.ChecksumBlocks(
            debug_pb2.ChecksumBlocksRequest(pool=pool, block_ids=block_ids), metadata=self._metadata, timeout=10
        ).sha256

    def close(self) -> None:
        self._channel.close()


@pytest.fixture(scope="session")
def debug(server: ServerProcess) -> Iterator[Debug]:
    d = Debug(server.address)
    yield d
    d.close()


@pytest.fixture(scope="session")
def auth_debug(auth_server: ServerProcess, tls_files: tuple[Path, Path]) -> Iterator[Debug]:
    d = Debug(auth_server.address, grpc.ssl_channel_credentials(tls_files[0].read_bytes()), GLOBEX_TOKEN)
    yield d
    d.close()


@pytest.fixture(scope="session")
def tokens() -> dict[str, str]:
    return {"acme": ACME_TOKEN, "globex": GLOBEX_TOKEN}


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start extra server processes (stopped, if still running, when the test ends)."""
    started: list[ServerProcess] = []

    def start(*args: str, pool_flags: bool = True) -> ServerProcess:
        proc = ServerProcess([*(POOL_FLAGS if pool_flags else []), *args], tmp_path / f"server{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def _wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until true or `patient(timeout)` seconds pass (the bound stretches on a loaded machine)."""
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., bool]:
    """Poll `predicate` until true or `timeout` seconds pass; returns its last value."""
    return _wait_until
