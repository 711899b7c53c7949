"""Issue 42's attacks (hardening, round 3), one test each, against a real server process: what each now gets.

Each bounded a count where the bytes or the work behind it went unbounded: request-id windows
(bytes per tenant and server-wide), Session frames (steps per frame, measured once each, stopped
when the caller leaves), a tenant's cache eviction (its own leaves only), tenant settings (parsed
strictly, never coerced).
"""

from __future__ import annotations

import importlib.util
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load(Path(__file__).parent / "conftest.py", "hardening3_conftest")  # the server process, the ErrorInfo reader
POOL = "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=256,dtype=float16"
TOKENS = {"alpha": "alpha-token-000000", "beta": "beta-token-111111"}
WINDOW_BYTES, WINDOW_BYTES_PER_SESSION = 4 << 20, 1 << 20  # two tenants: a share of 2 MiB each
QUOTA = 64  # alpha's blocks: a prompt of 64 blocks at most, whatever it does with its request ids
SHARED_FLAGS = [
    "--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=1024,dtype=float16",
    "--max-request-window-bytes", str(WINDOW_BYTES),
    "--max-request-window-bytes-per-session", str(WINDOW_BYTES_PER_SESSION),
    "--max-session-ttl", "3600", "--metrics-port", "0", "--max-workers", "8",
]  # fmt: skip
LIMITED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_suite.ServerProcess]:
    d = tmp_path_factory.mktemp("shared3")
    (d / "tenants.toml").write_text(
        f'[tenants.alpha]\ntoken = "{TOKENS["alpha"]}"\nmax_blocks = {QUOTA}\n'
        f'[tenants.beta]\ntoken = "{TOKENS["beta"]}"\n'
    )
    proc = _suite.ServerProcess([*SHARED_FLAGS, "--auth-tokens", str(d / "tenants.toml")], d / "server.log")
    yield proc
    assert proc.stop() == 0, (d / "server.log").read_text()[-2000:]


class Caller:
    """One tenant's raw stub and the sessions it opened (closed at the end)."""

    def __init__(self, address: str, name: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.metadata = [("authorization", f"Bearer {TOKENS[name]}")]
        self.sessions: list[str] = []

    def call(self, method: str, request: object, timeout: float = 60) -> object:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)

    def session(self) -> str:
        session_id = str(self.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=3600)).session_id)  # type: ignore[attr-defined]
        self.sessions.append(session_id)
        return session_id

    def close(self) -> None:
        for session_id in self.sessions:
            try:
                self.call("CloseSession", pb.CloseSessionRequest(session_id=session_id))
            except grpc.RpcError:
                pass
        self.sessions.clear()
        self.channel.close()


@pytest.fixture
def callers(shared) -> Iterator[dict[str, Caller]]:  # type: ignore[no-untyped-def]
    opened = {name: Caller(shared.address, name) for name in TOKENS}
    yield opened
    for caller in opened.values():
        caller.close()


def metric(server, name: str) -> float:  # type: ignore[no-untyped-def]
    """A server-wide gauge or counter (no labels), scraped."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    for line in urllib.request.urlopen(url, timeout=60).read().decode().splitlines():
        if line.startswith(f"{name} ") or line.startswith(f"{name}_total "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def refused(call, *args, **kwargs):  # type: ignore[no-untyped-def]
    """(code, ErrorInfo reason, metadata) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return _suite.describe(caught.value)


# -- 1. request-id windows are bounded in bytes, per session, per tenant and server-wide ------------------------


def _open_and_release(caller: Caller, session: str, request_id: int) -> None:
    """The largest open the quota allows (64 blocks), kept in the window under its id, then released."""
    tokens = [request_id % 1000 + 1] * (QUOTA * 4)
    opened = caller.call("OpenSequences", pb.OpenSequencesRequest(
        session_id=session, request_id=request_id, prompts=[pb.Prompt(token_ids=tokens)]
    ))  # fmt: skip
    seq_id = opened.sequences[0].seq_id  # type: ignore[attr-defined]
    release = pb.ReleaseSequencesRequest(session_id=session, request_id=request_id + 1, seq_ids=[seq_id], cache=False)
    caller.call("ReleaseSequences", release)


def test_request_windows_hold_bytes_within_the_session_tenant_and_server_bounds(shared, callers) -> None:  # type: ignore[no-untyped-def]
    """Before: each session kept up to ~36 MiB of results (1 M ids), and a tenant as many sessions as it liked.
    Now a session drops its oldest results past its bytes, and a tenant's sessions together stay within its share
    (a new one keeps what room is left, or is refused by name: `test_request_window.py`); the other tenant keeps
    its own share; closed sessions give their bytes back."""
    alpha, beta = callers["alpha"], callers["beta"]
    share = WINDOW_BYTES // 2
    sessions = []
    for _ in range(2 * share // WINDOW_BYTES_PER_SESSION + 2):  # more sessions than the share holds
        session = alpha.session()
        try:
            for n in range(120):  # ~1.6 MiB of results: past the session's bound
                _open_and_release(alpha, session, 2 * n + 1)
        except grpc.RpcError as e:  # no room left at all: refused before it applies, with the bound named
            code, reason, metadata = _suite.describe(e)
            assert (code, reason, metadata["limit"]) == (
                LIMITED,
                "LIMIT_EXCEEDED",
                "max_request_window_bytes_per_tenant",
            )
        sessions.append(session)
        held = metric(shared, "radixkv_request_window_bytes")
        assert held <= min(len(sessions), 2) * WINDOW_BYTES_PER_SESSION, "a session kept more than its bound"
        assert held <= share, "a tenant kept more than its share"
    # The oldest results were dropped: a retry of one is refused as too old, never applied again.
    with pytest.raises(grpc.RpcError) as too_old:
        _open_and_release(alpha, sessions[0], 1)
    assert too_old.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    # beta's share is its own: its window keeps all 40 results, and retries answer from it.
    theirs = beta.session()
    for n in range(40):
        _open_and_release(beta, theirs, 2 * n + 1)
    _open_and_release(beta, theirs, 1)  # answered from the window (a new open would have another seq id's release)
    assert share < metric(shared, "radixkv_request_window_bytes") <= WINDOW_BYTES
    alpha.close()
    beta.close()
    assert metric(shared, "radixkv_request_window_bytes") == 0, "closed sessions kept their windows' bytes"
