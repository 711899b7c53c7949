"""Issue 10's attacks, one test each, against a real server process: what each now gets.

The `shared` server has two tenants with any namespace (alpha with a 64-block quota, beta with
none) and an admin, small server-wide limits so that one tenant could exhaust each in a few calls,
a message limit smaller than the largest response its token limit allows, and 8 RPC threads.
"""

from __future__ import annotations

import importlib.util
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from radixkv.client import RadixKVClient
from radixkv.errors import LimitExceeded
from radixkv.sequences.step import Commit, Step
from radixkv.server.process.spawn import patient
from radixkv.v1 import debug_pb2, debug_pb2_grpc, kvcache_pb2_grpc
from radixkv.v1 import kvcache_pb2 as pb

TOKENS = {"alpha": "alpha-token-000000", "beta": "beta-token-111111", "root": "root-token-222222"}
TENANTS = f"""
[tenants.alpha]
token = "{TOKENS["alpha"]}"
max_blocks = 64
[tenants.beta]
token = "{TOKENS["beta"]}"
[tenants.root]
token = "{TOKENS["root"]}"
admin = true
"""
BLOCK_SIZE = 4
NUM_BLOCKS = 4096
MAX_TOKENS = 16384  # the largest open's response (~2.5 bytes a token) exceeds the message limit below
MAX_MESSAGE_BYTES = 36 * 1024
MAX_SESSIONS = 9  # three tenants: a share of 3 each
MAX_NAMESPACES = 9
FLAGS = [
    "--pool", f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={BLOCK_SIZE},num_blocks={NUM_BLOCKS},"
    f"dtype=float16,max_tokens_per_request={MAX_TOKENS},max_namespaces={MAX_NAMESPACES},max_pinned_fraction=0.25",
    "--max-workers", "8",  # max_streams 4, per peer 2, public 1
    "--max-sessions", str(MAX_SESSIONS),
    "--max-message-bytes", str(MAX_MESSAGE_BYTES),
    "--max-session-ttl", "3600",
    "--metrics-port", "0",
    "--debug-rpc",
]  # fmt: skip
LIMITED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _load(Path(__file__).parent / "conftest.py", "hardening_conftest")  # the server process, the ErrorInfo reader


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("shared")
    (d / "tenants.toml").write_text(TENANTS)
    proc = _suite.ServerProcess([*FLAGS, "--auth-tokens", str(d / "tenants.toml")], d / "server.log")
    yield proc
    assert proc.stop() == 0, Path(d / "server.log").read_text()[-2000:]


class Tenant:
    """One tenant's raw stub (what the wire says, exactly) and the sessions it opened."""

    def __init__(self, address: str, name: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.metadata = [("authorization", f"Bearer {TOKENS[name]}")]
        self.sessions: list[str] = []

    def call(self, method: str, request: object, timeout: float = 10) -> object:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)

    def session(self) -> str:
        # type: ignore[attr-defined]
        session_id = self.call("OpenSession", pb.OpenSessionRequest(ttl_seconds=3600)).session_id
        self.sessions.append(session_id)
        return str(session_id)

    def open(self, session_id: str, tokens: list[int], namespace: str = "") -> int:
        request = pb.OpenSequencesRequest(
            session_id=session_id, prompts=[pb.Prompt(token_ids=tokens, namespace=namespace)]
        )
        return int(self.call("OpenSequences", request).sequences[0].seq_id)  # type: ignore[attr-defined]

    def close(self) -> None:
        for session_id in self.sessions:
            try:
                self.call("CloseSession", pb.CloseSessionRequest(session_id=session_id))
            except grpc.RpcError:
                pass
        self.channel.close()


@pytest.fixture
def tenants(shared) -> Iterator[dict[str, Tenant]]:  # type: ignore[no-untyped-def]
    opened = {name: Tenant(shared.address, name) for name in TOKENS}
    yield opened
    for tenant in opened.values():
        tenant.close()
    with grpc.insecure_channel(shared.address) as channel:
        debug = debug_pb2_grpc.DebugStub(channel)
        check = debug.CheckInvariants(
            debug_pb2.CheckInvariantsRequest(), metadata=[("authorization", f"Bearer {TOKENS['root']}")], timeout=10
        )
        assert check.violation == "" and check.num_live_sequences == 0, check


def refused(call, *args, **kwargs):  # type: ignore[no-untyped-def]
    """(code, ErrorInfo reason, metadata) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return _suite.describe(caught.value)


# -- 1. streams cannot starve anything -------------------------------------------------------------


# type: ignore[no-untyped-def]
def test_sixteen_streams_without_a_token_leave_health_and_unary_calls_answered(shared, tenants) -> None:
    channels = [grpc.insecure_channel(shared.address) for _ in range(16)]
    streams, refusals, done = [], [], threading.Event()

    def reflection_requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        done.wait(patient(120))  # then hold the stream open, as an idle client does

    try:
        for i, channel in enumerate(channels):
            if i % 2:
                stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
            else:
                stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    reflection_requests(), timeout=60
                )
            streams.append(stream)
            try:
                next(stream)
            except grpc.RpcError as e:  # refused at once, with the bound's name
                refusals.append(_suite.describe(e))
        assert refusals, "every stream was accepted"
        assert {r[:2] for r in refusals} == {(LIMITED, "LIMIT_EXCEEDED")}
        assert {r[2]["limit"] for r in refusals} <= {"max_public_streams", "max_streams"}
        health = health_pb2_grpc.HealthStub(channels[0]).Check(health_pb2.HealthCheckRequest(), timeout=patient(5))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert tenants["alpha"].session()  # an authenticated unary call is answered too
    finally:
        done.set()
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()


# -- 2. every server-wide limit has a per-tenant share ---------------------------------------------


def test_one_tenant_cannot_take_every_session(tenants) -> None:  # type: ignore[no-untyped-def]
    alpha, beta = tenants["alpha"], tenants["beta"]
    share = MAX_SESSIONS // 3
    for _ in range(share):
        alpha.session()
    assert refused(alpha.call, "OpenSession", pb.OpenSessionRequest(ttl_seconds=3600)) == (
        LIMITED, "LIMIT_EXCEEDED",
        {"limit": "max_sessions_per_tenant", "requested": str(share + 1), "allowed": str(share)},
    )  # fmt: skip
    assert beta.session()  # the other tenant still opens its own


def test_one_tenant_cannot_take_every_namespace_even_after_it_leaves(tenants) -> None:  # type: ignore[no-untyped-def]
    alpha, beta = tenants["alpha"], tenants["beta"]
    session, share = alpha.session(), MAX_NAMESPACES // 3
    for i in range(share):  # one-block cached prompts, each in a new namespace (the first: default)
        seq = alpha.open(session, [1, 2, 3, 4, 5], f"ns{i}" if i else "")
        alpha.call("CommitTokens", pb.CommitTokensRequest(session_id=session, seq_ids=[seq], num_tokens=[5]))  # written
        alpha.call("ReleaseSequences", pb.ReleaseSequencesRequest(session_id=session, seq_ids=[seq]))
    code, reason, metadata = refused(alpha.open, session, [1, 2, 3, 4, 5], "one-more")
    assert (code, reason, metadata["limit"]) == (LIMITED, "LIMIT_EXCEEDED", "max_namespaces_per_tenant")
    alpha.call("CloseSession", pb.CloseSessionRequest(session_id=session))
    other = beta.session()  # alpha's cached namespaces stay alpha's; beta opens in new ones of its own
    seq = beta.open(other, [9, 9, 9, 9, 9], "beta-own")
    beta.call("ReleaseSequences", pb.ReleaseSequencesRequest(session_id=other, seq_ids=[seq], cache=False))


def test_one_tenant_cannot_take_every_watch_stream(tenants, shared) -> None:  # type: ignore[no-untyped-def]
    alpha, beta = tenants["alpha"], tenants["beta"]
    share = 4 // 3  # max_streams 4 with 8 threads, split three ways
    channels = [grpc.insecure_channel(shared.address) for _ in range(share + 1)]
    streams = []
    try:
        for channel in channels[:share]:
            stream = kvcache_pb2_grpc.KVCacheStub(channel).WatchEvents(
                pb.WatchEventsRequest(include_snapshot=True), metadata=alpha.metadata, timeout=60
            )
            assert next(stream).snapshot
            streams.append(stream)
        extra = kvcache_pb2_grpc.KVCacheStub(channels[share]).WatchEvents(
            pb.WatchEventsRequest(include_snapshot=True), metadata=alpha.metadata, timeout=10
        )
        code, reason, metadata = refused(next, extra)
        assert (code, reason, metadata["limit"]) == (LIMITED, "LIMIT_EXCEEDED", "max_streams_per_tenant")
        theirs = beta.stub.WatchEvents(
            pb.WatchEventsRequest(include_snapshot=True), metadata=beta.metadata, timeout=patient(10)
        )
        assert next(theirs).snapshot  # beta's share is untouched
        theirs.cancel()
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()


# type: ignore[no-untyped-def]
def test_pins_count_against_the_block_quota_and_pinned_blocks_are_shared(tenants) -> None:
    alpha, beta = tenants["alpha"], tenants["beta"]
    session = alpha.session()
    prompts = [[p] * (16 * BLOCK_SIZE) + [0] for p in range(1, 6)]  # 16 full blocks each, then one token
    for tokens in prompts:  # each within the 64-block quota while open; cached on release
        seq = alpha.open(session, tokens)
        alpha.call("CommitTokens", pb.CommitTokensRequest(session_id=session, seq_ids=[seq], num_tokens=[len(tokens)]))
        alpha.call("ReleaseSequences", pb.ReleaseSequencesRequest(session_id=session, seq_ids=[seq]))
    pinned = 0
    for tokens in prompts[:4]:
        pinned += (
            alpha.call("Pin", pb.PinRequest(session_id=session, token_ids=tokens[:-1])).num_pinned_tokens // BLOCK_SIZE
        )  # type: ignore[attr-defined]
    assert pinned == 64
    code, reason, metadata = refused(alpha.call, "Pin", pb.PinRequest(session_id=session, token_ids=prompts[4][:-1]))
    assert (code, reason, metadata["limit"], metadata["needed"]) == (LIMITED, "QUOTA_EXCEEDED", "max_blocks", "16")
    # Pinned blocks hold the quota as sequences do: nothing is left for a new sequence either.
    assert refused(alpha.open, session, [7] * 8)[1] == "QUOTA_EXCEEDED"
    # beta's pins still succeed: alpha holds 64 of the 1024 pinnable blocks, far from all of them.
    other = beta.session()
    seq = beta.open(other, [8] * (4 * BLOCK_SIZE) + [0])
    beta.call("CommitTokens", pb.CommitTokensRequest(session_id=other, seq_ids=[seq], num_tokens=[4 * BLOCK_SIZE + 1]))
    beta.call("ReleaseSequences", pb.ReleaseSequencesRequest(session_id=other, seq_ids=[seq]))
    # type: ignore[attr-defined]
    assert beta.call("Pin", pb.PinRequest(session_id=other, token_ids=[8] * (4 * BLOCK_SIZE))).num_pinned_tokens == 16


# type: ignore[no-untyped-def]
def test_one_tenant_cannot_keep_the_pool_resident_by_caching(start_server, tmp_path) -> None:
    """Cached blocks count against a cache share: past it a tenant evicts its own oldest blocks, not others'."""
    tokens = {"alpha": "alpha-cache-0000", "beta": "beta-cache-11111", "gamma": "gamma-cache-2222"}
    (tmp_path / "tenants.toml").write_text(
        "".join(f'[tenants.{name}]\ntoken = "{token}"\n' for name, token in tokens.items()) + "max_cached_blocks = 8\n"
    )
    srv = start_server(
        "--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=64,dtype=float16",
        "--auth-tokens", str(tmp_path / "tenants.toml"),
    )  # fmt: skip
    clients = {name: RadixKVClient(srv.address, token=token) for name, token in tokens.items()}
    try:

        def cache(name: str, prompt: list[int]) -> None:
            client = clients[name]
            seq = client.open(prompt).seq_id
            client.commit([seq], [len(prompt)])
            client.release(seq)

        def cached(name: str, prompt: list[int]) -> int:
            return clients[name].match(prompt) // 4

        beta_prompt = [500 + t for t in range(33)]  # 8 full blocks
        cache("beta", beta_prompt)
        alpha_prompts = [[1000 * (p + 1) + t for t in range(33)] for p in range(14)]  # 112 blocks: the pool is 64
        for prompt in alpha_prompts:
            cache("alpha", prompt)
            assert sum(cached("alpha", p) for p in alpha_prompts) <= 64 // 3, "alpha kept more than its share cached"
        assert cached("beta", beta_prompt) == 8, "alpha's caching evicted beta's prefix"
        assert cached("alpha", alpha_prompts[-1]) == 8 and cached("alpha", alpha_prompts[0]) == 0, (
            "alpha's oldest go first"
        )
        for p in range(2):  # gamma's configured share is 8 blocks: its second prompt evicts its first
            cache("gamma", [[7000, 8000][p] + t for t in range(33)])
        assert (cached("gamma", [7000 + t for t in range(33)]), cached("gamma", [8000 + t for t in range(33)])) == (
            0,
            8,
        )
        assert clients["beta"].stats().num_blocks_cached == 8 + 64 // 3 + 8
        # A Session step that caches keeps the share too.
        stepped = clients["gamma"].step(Step(opens=[([9000 + t for t in range(33)], "")])).opened[0].seq_id
        clients["gamma"].step(Step(commit=Commit([stepped], [33]), releases=[([stepped], True)]))
        assert (cached("gamma", [8000 + t for t in range(33)]), cached("gamma", [9000 + t for t in range(33)])) == (
            0,
            8,
        )
    finally:
        for client in clients.values():
            client.close()


# type: ignore[no-untyped-def]
def test_one_tenant_cannot_take_every_sequence_of_a_pool(start_server, tmp_path) -> None:
    tokens = {"alpha": "alpha-seqs-00000", "beta": "beta-seqs-111111"}
    (tmp_path / "tenants.toml").write_text("".join(f'[tenants.{n}]\ntoken = "{t}"\n' for n, t in tokens.items()))
    srv = start_server(
        "--pool", "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=64,dtype=float16",
        "--auth-tokens", str(tmp_path / "tenants.toml"), "--max-sequences", "4",
    )  # fmt: skip
    with (
        RadixKVClient(srv.address, token=tokens["alpha"]) as alpha,
        RadixKVClient(srv.address, token=tokens["beta"]) as beta,
    ):
        first = alpha.open([1, 2, 3]).seq_id
        alpha.open([4, 5, 6])
        for take_one_more in (lambda: alpha.open([7]), lambda: alpha.fork(first, 1)):  # a share of 4 // 2
            with pytest.raises(LimitExceeded) as caught:
                take_one_more()
            assert caught.value.metadata["limit"] == "max_sequences_per_tenant"
        assert [beta.open([8]).num_cached_tokens, beta.open([9]).num_cached_tokens] == [0, 0], (
            "beta still gets its share"
        )


# -- 3. a call applies and its response arrives, or it changes nothing -------------------------


# type: ignore[no-untyped-def]
def test_a_response_over_the_message_limit_is_refused_before_anything_is_opened(tenants, shared) -> None:
    beta = tenants["beta"]
    session = beta.session()
    code, reason, metadata = refused(beta.open, session, list(range(MAX_TOKENS)))  # a 33 KB request, a ~40 KB response
    assert (code, reason, metadata["limit"], metadata["allowed"]) == (
        LIMITED,
        "LIMIT_EXCEEDED",
        "max_message_bytes",
        str(MAX_MESSAGE_BYTES),
    )
    # type: ignore[attr-defined]  # nothing opened
    assert beta.call("Stats", pb.StatsRequest()).stats.num_live_sequences == 0
    seq = beta.open(session, list(range(MAX_TOKENS // 8)))  # one that fits is opened, and its response arrives
    num = MAX_TOKENS - MAX_TOKENS // 8  # within the token limit, but its slots would not fit the response
    append = pb.AppendTokensRequest(session_id=session, seq_ids=[seq], num_token_ids=[num], token_ids=[1] * num)
    assert refused(beta.call, "AppendTokens", append)[2]["limit"] == "max_message_bytes"


# type: ignore[no-untyped-def]
def test_calls_that_time_out_while_waiting_are_applied_once_after_retries(tenants) -> None:
    """Appends with a tight deadline race slow opens on the same pool. Some time out: the server either
    refused them after taking the lock (deadline passed) or applied them as the client gave up. Retried
    with their request ids, every append is applied exactly once: the sequence grows by one per append."""
    beta = tenants["beta"]
    session = beta.session()
    seq = beta.open(session, [1, 2, 3])
    slow = pb.OpenSequencesRequest(session_id=session, prompts=[pb.Prompt(token_ids=[5] * 2000)] * 2)

    def open_and_release() -> None:
        opened = beta.call("OpenSequences", slow).sequences  # type: ignore[attr-defined]
        beta.call(
            "ReleaseSequences",
            pb.ReleaseSequencesRequest(session_id=session, seq_ids=[s.seq_id for s in opened], cache=False),
        )

    def append(request_id: int, timeout: float) -> None:
        request = pb.AppendTokensRequest(
            session_id=session, request_id=request_id, seq_ids=[seq], num_token_ids=[1], token_ids=[7]
        )
        beta.call("AppendTokens", request, timeout=timeout)

    timed_out = []
    for round_ in range(5):
        opener = threading.Thread(target=open_and_release)
        opener.start()
        for i in range(10):
            try:
                append(1000 + 10 * round_ + i, 0.005)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e  # type: ignore[attr-defined]
                timed_out.append(1000 + 10 * round_ + i)
        opener.join()
    for request_id in timed_out:
        append(request_id, 10)
    final = pb.AppendTokensRequest(session_id=session, seq_ids=[seq], num_token_ids=[1], token_ids=[8])
    assert beta.call("AppendTokens", final).num_tokens == [3 + 50 + 1]  # type: ignore[attr-defined]


# type: ignore[no-untyped-def]
def test_a_retried_request_id_is_answered_with_the_first_result_and_applied_once(tenants) -> None:
    beta = tenants["beta"]
    session = beta.session()
    open_request = pb.OpenSequencesRequest(
        session_id=session, request_id=41, prompts=[pb.Prompt(token_ids=[1, 2, 3, 4, 5])]
    )
    first, again = beta.call("OpenSequences", open_request), beta.call("OpenSequences", open_request)
    assert first == again  # same seq id, same blocks: nothing opened twice
    seq = first.sequences[0].seq_id  # type: ignore[attr-defined]
    append = pb.AppendTokensRequest(
        session_id=session, request_id=42, seq_ids=[seq], num_token_ids=[3], token_ids=[6, 7, 8]
    )
    assert beta.call("AppendTokens", append) == beta.call("AppendTokens", append)
    assert beta.call("AppendTokens", append).num_tokens == [8]  # type: ignore[attr-defined]  # appended once
    reuse = pb.ForkSequenceRequest(session_id=session, request_id=42, seq_id=seq, num_children=1)
    code, reason, metadata = refused(beta.call, "ForkSequence", reuse)
    assert (code, reason, metadata["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "request_id")


# type: ignore[no-untyped-def]
def test_the_client_sends_request_ids_and_retries_a_lost_response(tenants, shared) -> None:
    """A client whose first attempt times out after the server applied it gets the first result on retry."""
    with RadixKVClient(shared.address, token=TOKENS["beta"], timeout=patient(10)) as client:
        opened = client.open([1, 2, 3, 4, 5])
        sent: list[int] = []
        real = client._stub.AppendTokens

        def lose_first_response(request, **kwargs):  # type: ignore[no-untyped-def]
            sent.append(request.request_id)
            response = real(request, **kwargs)
            if len(sent) == 1:  # applied on the server; the client never sees it
                raise _Lost()
            return response

        client._stub.AppendTokens = lose_first_response  # type: ignore[method-assign]
        result = client.append(opened.seq_id, [6])
        assert len(sent) == 2 and sent[0] == sent[1] != 0
        assert result.num_tokens == 6  # applied once, not twice
        client.release(opened.seq_id)


class _Lost(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED


# -- 4. sizes are checked before conversion --------------------------------------------------------


@pytest.mark.parametrize("method", ["Match", "Pin", "Unpin", "OpenSequences", "AppendTokens"])
# type: ignore[no-untyped-def]
def test_every_token_limit_is_checked_before_the_tokens_are_read(tenants, method) -> None:
    beta = tenants["beta"]
    session = beta.session()
    tokens = [0] * (MAX_TOKENS + 1)
    requests = {
        "Match": pb.MatchRequest(session_id=session, token_ids=tokens),
        "Pin": pb.PinRequest(session_id=session, token_ids=tokens),
        "Unpin": pb.UnpinRequest(session_id=session, token_ids=tokens),
        "OpenSequences": pb.OpenSequencesRequest(session_id=session, prompts=[pb.Prompt(token_ids=tokens)]),
        "AppendTokens": pb.AppendTokensRequest(
            session_id=session, seq_ids=[1], num_token_ids=[len(tokens)], token_ids=tokens
        ),
    }
    code, reason, metadata = refused(beta.call, method, requests[method])
    assert (code, reason, metadata["limit"]) == (LIMITED, "LIMIT_EXCEEDED", "max_tokens_per_request")


# -- 5. smaller failures -----------------------------------------------------------------------------


def test_an_oversized_echo_still_arrives_as_a_radixkv_error(tenants) -> None:  # type: ignore[no-untyped-def]
    beta = tenants["beta"]
    for request, reason in (
        (pb.KeepAliveRequest(session_id="s" * 6000), "UNKNOWN_SESSION"),
        (pb.StatsRequest(pool="p" * 6000), "UNKNOWN_POOL"),
    ):
        code, got, metadata = refused(beta.call, type(request).__name__.removesuffix("Request"), request)
        assert (code, got) == (grpc.StatusCode.NOT_FOUND, reason)
        assert all(len(v) < 300 for v in metadata.values())


def test_another_sessions_sequence_reads_exactly_as_an_absent_one(tenants) -> None:  # type: ignore[no-untyped-def]
    alpha, beta = tenants["alpha"], tenants["beta"]
    theirs = alpha.open(alpha.session(), [1, 2, 3])
    mine = beta.session()
    answers = []
    for seq_id in (theirs, theirs + 1, 2**62 + 12345):
        append = pb.AppendTokensRequest(session_id=mine, seq_ids=[seq_id], num_token_ids=[1], token_ids=[1])
        code, reason, metadata = refused(beta.call, "AppendTokens", append)
        answers.append((code, reason, sorted(metadata)))
    assert answers[0] == answers[1] == answers[2] == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_SEQUENCE", ["seq_id"])


def test_the_debug_service_answers_only_an_admin(tenants) -> None:  # type: ignore[no-untyped-def]
    debug = debug_pb2_grpc.DebugStub(tenants["beta"].channel)
    checksum = debug_pb2.ChecksumBlocksRequest(block_ids=[0])
    for name in ("alpha", "beta"):
        code, reason, _ = refused(debug.ChecksumBlocks, checksum, metadata=tenants[name].metadata, timeout=patient(10))
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    assert len(debug.ChecksumBlocks(checksum, metadata=tenants["root"].metadata, timeout=patient(10)).sha256) == 64


def test_an_empty_batch_is_a_no_op_everywhere(tenants) -> None:  # type: ignore[no-untyped-def]
    beta = tenants["beta"]
    session = beta.session()
    assert beta.call("AppendTokens", pb.AppendTokensRequest(session_id=session)) == pb.AppendTokensResponse()
    assert beta.call("OpenSequences", pb.OpenSequencesRequest(session_id=session)) == pb.OpenSequencesResponse()
    # type: ignore[attr-defined]
    assert beta.call("ReleaseSequences", pb.ReleaseSequencesRequest(session_id=session)).num_released_sequences == 0


def test_refusals_are_counted_by_limit_and_streams_are_counted(tenants, shared) -> None:  # type: ignore[no-untyped-def]
    beta = tenants["beta"]
    session = beta.session()
    refused(beta.call, "Match", pb.MatchRequest(session_id=session, token_ids=[1] * (MAX_TOKENS + 1)))
    stream = beta.stub.WatchEvents(
        pb.WatchEventsRequest(include_snapshot=True), metadata=beta.metadata, timeout=patient(10)
    )
    next(stream)
    stream.cancel()

    def scrape() -> list[str]:
        return (
            urllib.request.urlopen(f"http://127.0.0.1:{shared.metrics_port}/metrics", timeout=patient(10))
            .read()
            .decode()
            .splitlines()
        )

    refusals = [line for line in scrape() if line.startswith("radixkv_refusals_total{")]
    assert any('method="Match"' in line and 'limit="max_tokens_per_request"' in line for line in refusals), refusals
    deadline = time.monotonic() + patient(60)  # the server counts a stream when it notices it ended
    while not any(line.startswith("radixkv_rpcs_total{") and 'method="WatchEvents"' in line for line in scrape()):
        assert time.monotonic() < deadline, "WatchEvents never counted"
        time.sleep(0.2)
