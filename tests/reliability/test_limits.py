"""Every limit that protects a pool refuses with its code, names itself in the ErrorInfo, and changes nothing.

The `hardened` server's limits (conftest.LIMITS) are small, so each is reached in a few calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from radixkv.server.process.app import parse_args
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

LIMITED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Session:
    """One session on the hardened server, through the raw stub (what the wire says, exactly)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)])
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.id = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), timeout=patient(10)).session_id

    def open(self, prompts: list[list[int]], pool: str = "big") -> list[int]:
        request = pb.OpenSequencesRequest(
            pool=pool, session_id=self.id, prompts=[pb.Prompt(token_ids=p, namespace="limits") for p in prompts]
        )
        return [s.seq_id for s in self.stub.OpenSequences(request, timeout=patient(10)).sequences]

    def close(self) -> None:
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.id), timeout=patient(10))
        self.channel.close()


@pytest.fixture
def session(hardened, hardened_debug) -> Iterator[Session]:  # type: ignore[no-untyped-def]
    s = Session(hardened.address)
    yield s
    s.close()
    for pool in ("default", "big"):
        assert hardened_debug.check(pool).num_live_sequences == 0


def test_max_tokens_per_request_counts_each_prompt_and_the_whole_batch(
    session: Session, refusal, hardened_debug
) -> None:  # type: ignore[no-untyped-def]
    one = pb.OpenSequencesRequest(session_id=session.id, prompts=[pb.Prompt(token_ids=[1] * 4097)])
    assert refusal(session.stub.OpenSequences, one) == (
        LIMITED, "LIMIT_EXCEEDED", {"limit": "max_tokens_per_request", "requested": "4097", "allowed": "4096"}
    )  # fmt: skip
    # Two prompts under the limit each, over it together: one request may not carry more.
    two = pb.OpenSequencesRequest(session_id=session.id, prompts=[pb.Prompt(token_ids=[1] * 2049)] * 2)
    assert refusal(session.stub.OpenSequences, two)[2]["requested"] == "4098"
    match = pb.MatchRequest(session_id=session.id, token_ids=[1] * 4097)
    assert refusal(session.stub.Match, match)[1:] == (
        "LIMIT_EXCEEDED",
        {"limit": "max_tokens_per_request", "requested": "4097", "allowed": "4096"},
    )
    # A sequence may not grow past it either.
    (seq_id,) = session.open([[1] * 4090])
    append = pb.AppendTokensRequest(
        pool="big", session_id=session.id, seq_ids=[seq_id], num_token_ids=[7], token_ids=[2] * 7
    )
    assert refusal(session.stub.AppendTokens, append)[2]["limit"] == "max_tokens_per_request"
    assert hardened_debug.check("big").num_live_sequences == 1


# type: ignore[no-untyped-def]
def test_forks_are_limited_per_call_and_per_session(session: Session, refusal, hardened_debug) -> None:
    (parent,) = session.open([[1, 2, 3]])
    nine = pb.ForkSequenceRequest(pool="big", session_id=session.id, seq_id=parent, num_children=9)
    assert refusal(session.stub.ForkSequence, nine) == (
        LIMITED, "LIMIT_EXCEEDED", {"limit": "max_fork_children", "requested": "9", "allowed": "8"}
    )  # fmt: skip
    million = pb.ForkSequenceRequest(pool="big", session_id=session.id, seq_id=parent, num_children=10**6)
    code, reason, metadata = refusal(session.stub.ForkSequence, million)
    assert (code, reason, metadata["limit"], metadata["requested"]) == (
        LIMITED,
        "LIMIT_EXCEEDED",
        "max_sequences_per_session",
        str(10**6 + 1),
    )
    for count in (0, 2**32 - 1):
        request = pb.ForkSequenceRequest(pool="big", session_id=session.id, seq_id=parent, num_children=count)
        assert refusal(session.stub.ForkSequence, request)[0] in (grpc.StatusCode.INVALID_ARGUMENT, LIMITED)
    assert hardened_debug.check("big").num_live_sequences == 1


def test_max_sequences_per_session_refuses_before_opening_anything(
    session: Session, refusal, hardened, hardened_debug, limits
) -> None:  # type: ignore[no-untyped-def]
    limit = limits["max_sequences_per_session"]
    batch = pb.OpenSequencesRequest(pool="big", session_id=session.id, prompts=[pb.Prompt(token_ids=[5])] * (limit + 1))
    assert refusal(session.stub.OpenSequences, batch)[1:] == (
        "LIMIT_EXCEEDED", {"limit": "max_sequences_per_session", "requested": str(limit + 1), "allowed": str(limit)}
    )  # fmt: skip
    assert hardened_debug.check("big").num_live_sequences == 0  # all or none
    assert len(session.open([[5]] * limit)) == limit
    assert (
        refusal(
            session.stub.OpenSequences,
            pb.OpenSequencesRequest(pool="big", session_id=session.id, prompts=[pb.Prompt(token_ids=[6])]),
        )[1]
        == "LIMIT_EXCEEDED"
    )
    other = Session(hardened.address)
    try:
        assert len(other.open([[5]])) == 1  # the limit is per session
    finally:
        other.close()


def test_max_pins_per_session(session: Session, refusal, limits) -> None:  # type: ignore[no-untyped-def]
    prefix = list(range(300, 308))
    seq_ids = session.open([prefix + [1]])
    commit = pb.CommitTokensRequest(pool="big", session_id=session.id, seq_ids=seq_ids, num_tokens=[9])  # as written
    session.stub.CommitTokens(commit, timeout=patient(10))
    session.stub.ReleaseSequences(pb.ReleaseSequencesRequest(pool="big", session_id=session.id, seq_ids=seq_ids))
    pin = pb.PinRequest(pool="big", session_id=session.id, token_ids=prefix, namespace="limits")
    for _ in range(limits["max_pins_per_session"]):
        assert session.stub.Pin(pin, timeout=patient(10)).num_pinned_tokens == 8
    assert refusal(session.stub.Pin, pin) == (
        LIMITED, "LIMIT_EXCEEDED", {"limit": "max_pins_per_session", "requested": "17", "allowed": "16"}
    )  # fmt: skip
    session.stub.Unpin(
        pb.UnpinRequest(pool="big", session_id=session.id, token_ids=prefix, namespace="limits"), timeout=10
    )
    assert session.stub.Pin(pin, timeout=patient(10)).num_pinned_tokens == 8


def test_watch_streams_are_bounded_and_leave_threads_for_unary_calls(
    session: Session, described, limits, wait_until, hardened_debug
) -> None:  # type: ignore[no-untyped-def]
    assert wait_until(lambda: hardened_debug.check().num_watch_streams == 0, timeout=60)  # no stream of another test
    watch = pb.WatchEventsRequest(pool="big", session_id=session.id, include_snapshot=True)
    streams = [session.stub.WatchEvents(watch, timeout=60) for _ in range(limits["max_watch_streams"])]
    try:
        for stream in streams:
            assert next(stream).snapshot
        fifth = session.stub.WatchEvents(watch, timeout=patient(10))
        with pytest.raises(grpc.RpcError) as refused:
            next(fifth)  # the refusal comes as the stream starts
        assert described(refused.value) == (
            LIMITED,
            "LIMIT_EXCEEDED",
            {"limit": "max_watch_streams", "requested": "5", "allowed": "4"},
        )
        assert session.stub.Stats(pb.StatsRequest(pool="big"), timeout=patient(10)).stats.num_blocks_total == 8192
    finally:
        for stream in streams:
            stream.cancel()
    # The server notices the cancelled streams within its poll interval and gives their slots back.
    assert wait_until(lambda: hardened_debug.check().num_watch_streams == 0, timeout=60)
    assert _stream_opens(session, watch)


def _stream_opens(session: Session, request: pb.WatchEventsRequest) -> bool:
    stream = session.stub.WatchEvents(request, timeout=patient(10))
    try:
        return bool(next(stream).snapshot)
    except grpc.RpcError:
        return False
    finally:
        stream.cancel()


def test_max_sessions(hardened, hardened_debug, refusal, limits) -> None:  # type: ignore[no-untyped-def]
    limit = limits["max_sessions"]
    with grpc.insecure_channel(hardened.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        opened = []
        try:
            for _ in range(limit - hardened_debug.check().num_sessions):
                opened.append(stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60), timeout=patient(10)).session_id)
            assert refusal(stub.OpenSession, pb.OpenSessionRequest())[2] == {
                "limit": "max_sessions", "requested": str(limit + 1), "allowed": str(limit)
            }  # fmt: skip
        finally:
            for session_id in opened:
                stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=patient(10))


# type: ignore[no-untyped-def]
def test_a_message_over_the_size_limit_is_refused_by_the_transport(session: Session, refusal) -> None:
    huge = pb.MatchRequest(session_id=session.id, token_ids=[2**31 - 1] * 300_000)  # ~1.5 MB > the server's 1 MiB
    assert refusal(session.stub.Match, huge) == (LIMITED, None, {})  # before any handler: no ErrorInfo
    assert (
        session.stub.Match(pb.MatchRequest(session_id=session.id, token_ids=[1]), timeout=patient(10)).num_cached_tokens
        == 0
    )


def test_limits_come_from_flags_and_toml(tmp_path: Path) -> None:
    config_file = tmp_path / "radixkv.toml"
    config_file.write_text(
        "max_sequences_per_session = 7\nmax_pins_per_session = 3\nmax_workers = 6\n"
        "[pools.default]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 4\nnum_blocks = 8\nmax_tokens_per_request = 99\n"
    )
    config, _ = parse_args(
        ["serve", "--config", str(config_file), "--max-pins-per-session", "5", "--max-sessions", "9"]
    )
    assert (config.max_sequences_per_session, config.max_pins_per_session, config.max_sessions) == (7, 5, 9)
    assert config.max_watch_streams == 3  # half the RPC threads by default
    assert config.pools[0].limits.max_tokens_per_request == 99
    with pytest.raises(ValueError, match="max_watch_streams"):
        parse_args(["serve", "--config", str(config_file), "--max-watch-streams", "6"])
    with pytest.raises(ValueError, match="max_pins_per_session"):
        parse_args(["serve", "--config", str(config_file), "--max-pins-per-session", "-1"])
