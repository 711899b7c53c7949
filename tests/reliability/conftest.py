"""Servers for the reliability suite, and how to read what a refusal carried.

`hardened`: no auth, small pools with tight limits so every limit is reachable in a few calls, the
Debug service on. `secure`: bearer tokens for tenants acme (namespaces chat and code, a block quota)
and globex (any namespace), over TLS with a certificate made here by the `openssl` CLI. The server
process and the Debug client are the service suite's (tests/service/conftest.py), loaded by path.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from radixkv.errors import ERRORS_BY_REASON
from radixkv.server.process.spawn import patient
from radixkv.server.wire.status import STATUS_BY_REASON


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


service = _load(Path(__file__).parents[1] / "service" / "conftest.py", "service_conftest")
ServerProcess = service.ServerProcess
Debug = service.Debug

BLOCK_SIZE = 4
LIMITS = {
    "max_tokens_per_request": 4096,
    "max_fork_children": 8,
    "max_sequences_per_session": 64,
    "max_pins_per_session": 16,
    "max_watch_streams": 4,
    "max_sessions": 400,
}
_POOL = f"num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},dtype=float16," + ",".join(
    f"{name}={LIMITS[name]}" for name in ("max_fork_children", "max_tokens_per_request")
)
HARDENED_FLAGS = [
    "--pool", f"default:num_blocks=64,{_POOL}",  # small: out of blocks within a few requests
    "--pool", f"big:num_blocks=8192,{_POOL}",
    "--max-sequences-per-session", str(LIMITS["max_sequences_per_session"]),
    "--max-pins-per-session", str(LIMITS["max_pins_per_session"]),
    "--max-watch-streams", str(LIMITS["max_watch_streams"]),
    "--max-streams", "6", "--max-streams-per-peer", "6",
    "--max-sessions", str(LIMITS["max_sessions"]),
    "--max-workers", "12",
    "--max-message-bytes", str(1 << 20),
    "--max-session-ttl", "120",
    "--debug-rpc",
]  # fmt: skip
TOKENS = {"acme": "acme-token-0123456789", "globex": "globex-token-9876543210"}
ACME_QUOTA = 16
AUTH_TOKENS = f"""
[tenants.acme]
token = "{TOKENS["acme"]}"
namespaces = ["chat", "code"]
max_blocks = {ACME_QUOTA}

[tenants.globex]
token = "{TOKENS["globex"]}"
admin = true
"""


@pytest.fixture(scope="session")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("hardened") / "server.log"
    proc = ServerProcess(HARDENED_FLAGS, log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


@pytest.fixture(scope="session")
def hardened_debug(hardened: ServerProcess) -> Iterator[Debug]:
    d = Debug(hardened.address)
    yield d
    d.close()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start server processes with these flags (stopped, if still running, when the test ends)."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        proc = ServerProcess(list(args), tmp_path / f"server{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def make_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1: (cert.pem, key.pem)."""
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1",
         "-subj", f"/CN={name}", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=patient(120),
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """The server's certificate, and an unrelated one (a CA the server's certificate does not chain to)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("certificates")
    return {"server": make_certificate(d, "radixkv-test"), "stranger": make_certificate(d, "stranger")}


@pytest.fixture(scope="session")
def secure(
    tmp_path_factory: pytest.TempPathFactory, certificates: dict[str, tuple[Path, Path]]
) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("secure")
    (d / "tokens.toml").write_text(AUTH_TOKENS)
    cert, key = certificates["server"]
    proc = ServerProcess(
        [*HARDENED_FLAGS, "--auth-tokens", str(d / "tokens.toml"), "--tls-cert", str(cert), "--tls-key", str(key)],
        d / "server.log",
    )
    yield proc
    assert proc.stop() == 0, (d / "server.log").read_text()[-2000:]


@pytest.fixture(scope="session")
def secure_debug(secure: ServerProcess, certificates: dict[str, tuple[Path, Path]]) -> Iterator[Debug]:
    credentials = grpc.ssl_channel_credentials(certificates["server"][0].read_bytes())
    d = Debug(secure.address, credentials, TOKENS["globex"])
    yield d
    d.close()


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The one radixkv ErrorInfo a refusal carries, or None (a transport-level refusal)."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    infos = []
    for detail in status.details if status else []:
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info), f"a status detail that is not an ErrorInfo: {detail.type_url}"
        infos.append(info)
    assert len(infos) <= 1, "one ErrorInfo per error"
    if infos:
        assert infos[0].domain == "radixkv", infos[0]
    return infos[0] if infos else None


def assert_defined_refusal(error: grpc.RpcError) -> str:
    """A refusal is a status code with an ErrorInfo whose reason is known and maps to exactly that code.

    Returns the reason."""
    info = error_info(error)
    code = error.code()  # type: ignore[attr-defined]
    assert info is not None, f"{code} without an ErrorInfo: {error.details()}"  # type: ignore[attr-defined]
    # type: ignore[attr-defined]
    assert info.reason in ERRORS_BY_REASON, f"unknown reason {info.reason} ({error.details()})"
    assert STATUS_BY_REASON[info.reason] == code, f"{info.reason} came with {code}"
    return str(info.reason)


Refusal = tuple[grpc.StatusCode, str | None, dict[str, str]]


def describe(error: grpc.RpcError) -> Refusal:
    """(code, ErrorInfo reason or None, metadata)."""
    info = error_info(error)
    code = error.code()  # type: ignore[attr-defined]
    return (code, None, {}) if info is None else (code, info.reason, dict(info.metadata))


@pytest.fixture(scope="session")
def refusal() -> Callable[..., Refusal]:
    """Call `rpc(request)`, which must fail: (code, ErrorInfo reason or None, metadata)."""

    def call(rpc: Callable[..., object], request: object, **kwargs: object) -> Refusal:
        with pytest.raises(grpc.RpcError) as caught:
            rpc(request, timeout=patient(10), **kwargs)
        return describe(caught.value)

    return call


@pytest.fixture(scope="session")
def described() -> Callable[[grpc.RpcError], Refusal]:
    return describe


@pytest.fixture(scope="session")
def limits() -> dict[str, int]:
    """The hardened server's limits."""
    return dict(LIMITS)


@pytest.fixture(scope="session")
def wait_until() -> Callable[..., bool]:
    """Poll `predicate` until true or `timeout` seconds pass; returns its last value."""
    return service._wait_until  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def defined_refusal() -> Callable[[grpc.RpcError], str]:
    return assert_defined_refusal


@pytest.fixture(scope="session")
def server_errors() -> Callable[[ServerProcess], list[str]]:
    """The error lines of a server's log (an internal error is logged there with its traceback)."""

    def read(proc: ServerProcess) -> list[str]:
        return [line for line in proc.log_path.read_text().splitlines() if '"level": "error"' in line]

    return read
