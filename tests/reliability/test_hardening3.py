"""Issue 42's attacks (hardening, round 3), one test each, against a real server process: what each now gets.

Each bounded a count where the bytes or the work behind it went unbounded: request-id windows
(bytes per tenant and server-wide), Session frames (steps per frame, measured once each, stopped
when the caller leaves), a tenant's cache eviction (its own leaves only), tenant settings (parsed
strictly, never coerced).
"""

from __future__ import annotations

import importlib.util
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from radixkv.server.process.spawn import patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc, kvcache_pb2_grpc
from radixkv.v1 import kvcache_pb2 as pb


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load(Path(__file__).parent / "conftest.py", "hardening3_conftest")  # the server process, the ErrorInfo reader
POOL = "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=256,dtype=float16"
TOKENS = {"alpha": "alpha-token-000000", "beta": "beta-token-111111", "root": "root-token-222222"}
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
        # type: ignore[attr-defined]
        session_id = str(self.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=3600)).session_id)
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


def metric(server, name: str, labels: str = "") -> float:  # type: ignore[no-untyped-def]
    """A gauge or counter (with these labels, as exported: '{pool="default"}'), scraped."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    for line in urllib.request.urlopen(url, timeout=60).read().decode().splitlines():
        if line.startswith(f"{name}{labels} ") or line.startswith(f"{name}_total{labels} "):
            return float(line.split()[1])
    raise AssertionError(f"{name}{labels} not exported")


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


# type: ignore[no-untyped-def]
def test_request_windows_hold_bytes_within_the_session_tenant_and_server_bounds(shared, callers) -> None:
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


# -- 2. a Session frame costs linear work, at most max_steps_per_frame steps, and stops when its caller leaves ---


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_suite.ServerProcess]:
    d = tmp_path_factory.mktemp("frames")
    tenants = "".join(f'[tenants.{name}]\ntoken = "{token}"\n' for name, token in TOKENS.items())
    (d / "tenants.toml").write_text(tenants + "admin = true\n")  # the last one, root, is the admin
    proc = _suite.ServerProcess(
        ["--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=4096,dtype=float16",
         "--auth-tokens", str(d / "tenants.toml"), "--metrics-port", "0", "--max-workers", "8", "--debug-rpc"],
        d / "server.log",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, (d / "server.log").read_text()[-2000:]


def _frame(session: str, num_steps: int) -> pb.SessionRequest:
    """A frame of `num_steps` steps, each opening a one-block prompt of its own."""
    steps = [
        pb.SessionRequest(session_id=session, opens=[pb.StepOpen(token_ids=struct.pack("<5i", *[i + 1] * 5))])
        for i in range(num_steps)
    ]
    return pb.SessionRequest(steps=steps)


def _live(caller: Caller) -> int:
    return int(caller.call("Stats", pb.StatsRequest()).stats.num_live_sequences)  # type: ignore[attr-defined]


# type: ignore[no-untyped-def]
def test_a_frame_of_too_many_steps_is_refused_whole_with_the_limit_named(frames) -> None:
    beta = Caller(frames.address, "beta")
    try:
        session = beta.session()
        (response,) = beta.stub.Session(iter([_frame(session, 257)]), metadata=beta.metadata, timeout=60)
        assert not response.steps and response.error.reason == "LIMIT_EXCEEDED"
        assert dict(response.error.metadata) == {"limit": "max_steps_per_frame", "requested": "257", "allowed": "256"}
        assert _live(beta) == 0, "a step of the refused frame applied"
        (response,) = beta.stub.Session(iter([_frame(session, 256)]), metadata=beta.metadata, timeout=60)
        assert len(response.steps) == 256 and not any(a.HasField("error") for a in response.steps)
    finally:
        beta.close()


def test_a_frame_measures_each_answer_once(frames) -> None:  # type: ignore[no-untyped-def]
    """Before: each step re-measured the whole response so far (2k / 6k / 18k steps: 0.3 / 1.9 / 20.9 s). Now
    the bytes measured for a frame are its answers' bytes (and their framing), once each."""
    beta = Caller(frames.address, "beta")
    try:
        session = beta.session()
        measured = []
        for num_steps in (16, 256):
            before = metric(frames, "radixkv_frame_bytes_measured")
            (response,) = beta.stub.Session(iter([_frame(session, num_steps)]), metadata=beta.metadata, timeout=60)
            assert len(response.steps) == num_steps
            measured.append(metric(frames, "radixkv_frame_bytes_measured") - before)
            assert response.ByteSize() <= measured[-1] <= response.ByteSize() + 8 * num_steps
        assert measured[1] / 256 <= 2 * measured[0] / 16, "bytes measured per step grew with the frame"
    finally:
        beta.close()


def test_a_frame_whose_caller_left_stops_between_steps(frames) -> None:  # type: ignore[no-untyped-def]
    """Before: an abandoned frame ran to its end (two 120 KB frames: 20.6 s of CPU after their callers left). Now
    the step being applied when the caller leaves finishes; the rest never apply. The first step is held inside
    the pool's lock (Debug.StallSteps) while the caller cancels, so the order is certain, not timed."""
    beta, root = Caller(frames.address, "beta"), Caller(frames.address, "root")
    try:
        session = beta.session()
        debug = debug_pb2_grpc.DebugStub(root.channel)
        stall = debug.StallSteps(
            debug_pb2.StallStepsRequest(pool="default", max_seconds=60), metadata=root.metadata, timeout=120
        )
        assert not next(stall).stalled, "armed"
        before = metric(frames, "radixkv_frame_steps_abandoned")
        call = beta.stub.Session(iter([_frame(session, 200)]), metadata=beta.metadata, timeout=120)
        assert next(stall).stalled, "the frame's first step is held inside the pool's lock"
        call.cancel()
        # The same connection: the server reads the cancellation before this call, and answers this call first.
        beta.call("KeepAlive", pb.KeepAliveRequest(session_id=session))
        stall.cancel()  # the first step goes on
        with pytest.raises(grpc.RpcError):
            next(call)
        deadline = time.monotonic() + patient(120)
        while metric(frames, "radixkv_frame_steps_abandoned") == before:
            assert time.monotonic() < deadline, "the abandoned frame never stopped"
            time.sleep(0.05)
        assert metric(frames, "radixkv_frame_steps_abandoned") - before == 199
        assert _live(beta) == 1, "steps after the caller left applied"
    finally:
        beta.close()
        root.close()


# -- 3. a tenant's eviction down to its share looks only at its own leaves ----------------------------------


@pytest.fixture(scope="module")
def two_sizes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_suite.ServerProcess]:
    """A big tenant (beta, an even share: half the pool) and a small one (alpha, 8 cached blocks)."""
    d = tmp_path_factory.mktemp("two-sizes")
    (d / "tenants.toml").write_text(
        f'[tenants.alpha]\ntoken = "{TOKENS["alpha"]}"\nmax_cached_blocks = 8\n'
        f'[tenants.beta]\ntoken = "{TOKENS["beta"]}"\n'
    )
    proc = _suite.ServerProcess(
        ["--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=65536,dtype=float16",
         "--auth-tokens", str(d / "tenants.toml"), "--metrics-port", "0", "--max-workers", "8"],
        d / "server.log",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, (d / "server.log").read_text()[-2000:]


def _cache_prompts(caller: Caller, session: str, first: int, count: int) -> None:
    """`count` one-block prompts cached, 256 to a call: opened, written, released with cache."""
    for start in range(first, first + count, 256):
        prompts = [pb.Prompt(token_ids=[p, p, p, p, 0]) for p in range(start, min(start + 256, first + count))]
        opened = caller.call("OpenSequences", pb.OpenSequencesRequest(session_id=session, prompts=prompts))
        seq_ids = [s.seq_id for s in opened.sequences]  # type: ignore[attr-defined]
        caller.call(
            "CommitTokens", pb.CommitTokensRequest(session_id=session, seq_ids=seq_ids, num_tokens=[5] * len(seq_ids))
        )
        caller.call("ReleaseSequences", pb.ReleaseSequencesRequest(session_id=session, seq_ids=seq_ids, cache=True))


# type: ignore[no-untyped-def]
def test_evicting_a_tenant_to_its_share_looks_at_no_other_tenants_leaves(two_sizes) -> None:
    """Before: the eviction scanned the global LRU list for the tenant's leaves, under the pool's lock, so every
    one of beta's older cached prompts was visited (20,000 prompts: a 64-block release held the lock 392 ms).
    Now each of alpha's evictions visits its own leaves only: the same count with 1,000 or 20,000 of beta's."""
    alpha, beta = Caller(two_sizes.address, "alpha"), Caller(two_sizes.address, "beta")
    visited = '{pool="default"}'
    try:
        mine, theirs = alpha.session(), beta.session()
        _cache_prompts(alpha, mine, 1, 8)  # alpha at its share
        work = []
        for beta_prompts in (1_000, 20_000):
            _cache_prompts(beta, theirs, 100_000 + len(work) * 1_000, beta_prompts - (1_000 if work else 0))
            before = metric(two_sizes, "radixkv_eviction_leaves_visited", visited)
            _cache_prompts(alpha, mine, 1_000 + 100 * len(work), 64)  # one call caching 64 past the share
            work.append(metric(two_sizes, "radixkv_eviction_leaves_visited", visited) - before)
        assert metric(two_sizes, "radixkv_blocks_cached", visited) == 20_000 + 8, "beta's prompts all stayed"
        assert work[0] == work[1] == 64, f"leaves visited for 64 of alpha's evictions: {work}"
    finally:
        alpha.close()
        beta.close()


# -- 5. tenant settings parse strictly -----------------------------------------------------------------

# Every key of a [tenants.NAME] table, with a value of the wrong kind that a lenient parser would accept.
BAD_TENANT_VALUES = {
    "token": "token = 12345678",
    "namespaces": 'namespaces = "chat"',  # a string is not a list: it would read as ["c", "h", "a", "t"]
    "max_blocks": 'max_blocks = "64"',
    "max_cached_blocks": "max_cached_blocks = -1",
    "map_pools": 'map_pools = "false"',  # text read as a boolean is true: pool handles for this tenant
    "admin": 'admin = "false"',  # ... and the Debug service, Upgrade included
    "max_tokens_per_second": "max_tokens_per_second = true",
    "publish_kv_events": 'publish_kv_events = "false"',
}


def test_every_tenant_key_has_a_bad_value_here() -> None:
    from radixkv.server.rules.tenant_config import TENANT_KEYS

    assert sorted(BAD_TENANT_VALUES) == sorted(TENANT_KEYS)


@pytest.mark.parametrize("key", sorted(BAD_TENANT_VALUES))
# type: ignore[no-untyped-def]
def test_a_tenant_setting_of_the_wrong_kind_stops_the_server_at_start_with_the_key_named(key, tmp_path) -> None:
    lines = [f"[tenants.mallory]\n{BAD_TENANT_VALUES[key]}\n"]
    if key != "token":
        lines.append('token = "mallory-token-000000"\n')
    (tmp_path / "tenants.toml").write_text("".join(lines))
    with pytest.raises(RuntimeError) as caught:  # the process exits before it serves
        proc = _suite.ServerProcess(["--pool", POOL, "--auth-tokens", str(tmp_path / "tenants.toml")],
                                    tmp_path / "server.log")  # fmt: skip
        proc.stop()
    assert "exited" in str(caught.value) and "mallory" in str(caught.value) and key in str(caught.value)


def test_a_stray_key_in_the_auth_tokens_file_stops_the_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "tenants.toml").write_text('admin = false\n[tenants.acme]\ntoken = "acme-token-0000"\n')
    with pytest.raises(RuntimeError) as caught:
        proc = _suite.ServerProcess(["--pool", POOL, "--auth-tokens", str(tmp_path / "tenants.toml")],
                                    tmp_path / "server.log")  # fmt: skip
        proc.stop()
    assert "exited" in str(caught.value) and "unknown top-level keys ['admin']" in str(caught.value)
