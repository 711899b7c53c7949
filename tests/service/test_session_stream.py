"""The Session stream against a real server: a step equals its unary calls, all or none, refusals included.

The property test runs one random sequence of steps through both ends of the same server: the
unary RPCs on one pool, the stream on a twin pool that starts in the same state. While steps
succeed, both ends give the same results, tables, stats and hits; the first refused step must be
refused by the unary calls at the same item with the same status, and must leave the stream's pool
as it was. Each example takes a fresh pair of pools, so no shrinking (it would need more pools).
"""

from __future__ import annotations

import importlib.util
import itertools
import queue
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from radixkv.client import RadixKVClient
from radixkv.errors import InvalidArgument, OutOfBlocks, RadixKVError, UnknownSequence
from radixkv.sequences.step import Append, Commit, Step, StepResult
from radixkv.server.process.spawn import patient
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc


def _load_conftest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("service_conftest", Path(__file__).parent / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_conftest = _load_conftest()
ServerProcess, Debug = _conftest.ServerProcess, _conftest.Debug

NUM_POOL_PAIRS = 30
TWIN_POOL = "num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=12,dtype=float16,max_fork_children=3"


@pytest.fixture(scope="module")
def twin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = []
    for i in range(NUM_POOL_PAIRS):
        flags += ["--pool", f"u{i}:{TWIN_POOL}", "--pool", f"s{i}:{TWIN_POOL}"]
    log: Path = tmp_path_factory.mktemp("twin") / "server.log"
    proc = ServerProcess([*flags, "--debug-rpc", "--log-level", "warning"], log)
    yield proc
    assert proc.stop() == 0, log.read_text()[-2000:]


_pool_pairs = itertools.count()

index = st.integers(0, 39)  # mostly a live sequence; 36..39: a released or an unknown id
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=24)  # few token values: prompts share prefixes
first_step = st.fixed_dictionaries(
    {
        "commit": st.just([]),
        "opens": st.lists(st.tuples(tokens, st.sampled_from(["a", "b"])), min_size=2, max_size=3),
        "append": st.none(),
        "forks": st.just([]),
        "caches": st.just([]),
        "releases": st.just([]),
    }
)
later_steps = st.lists(
    st.fixed_dictionaries(
        {
            "commit": st.lists(index, max_size=2),  # each commits every token it holds
            "opens": st.lists(st.tuples(tokens, st.sampled_from(["a", "b"])), max_size=2),
            "append": st.none() | st.lists(st.tuples(index, st.integers(1, 6)), min_size=1, max_size=3),
            "forks": st.lists(st.tuples(index, st.integers(0, 4)), max_size=1),
            "caches": st.lists(index, max_size=2),
            "releases": st.lists(st.tuples(st.lists(index, min_size=1, max_size=2), st.booleans()), max_size=2),
        }
    ),
    min_size=1,
    max_size=8,
)
steps = st.tuples(first_step, later_steps).map(lambda t: [t[0], *t[1]])


class End:
    """One end of the twin: a client on its pool, its live sequences in order, its released ones."""

    def __init__(self, address: str, pool: str) -> None:
        self.client = RadixKVClient(address, pool=pool, session_ttl=600)
        self.live: list[int] = []
        self.dead: list[int] = []

    def seq(self, i: int) -> int:
        if i < 36 and self.live:
            return self.live[i % len(self.live)]
        i -= 36
        return self.dead[-1 - i] if 0 <= i < len(self.dead) else 1  # 1: no live sequence (ids start far above it)

    def num_tokens(self, seq_id: int) -> int:
        try:
            return self.client.num_tokens(seq_id)
        except RadixKVError:  # a released or unknown id: the step refuses it
            return 0

    def step(self, spec: dict[str, Any]) -> Step:
        commit = None
        if spec["commit"]:
            seq_ids = [self.seq(i) for i in spec["commit"]]
            commit = Commit(seq_ids, [self.num_tokens(s) for s in seq_ids])
        append = None
        if spec["append"] is not None:
            counts = [n for _, n in spec["append"]]
            append = Append([self.seq(i) for i, _ in spec["append"]], counts, [k % 4 for k in range(sum(counts))])
        return Step(
            opens=spec["opens"],
            append=append,
            forks=[(self.seq(i), n) for i, n in spec["forks"]],
            caches=[self.seq(i) for i in spec["caches"]],
            releases=[([self.seq(i) for i in ids], cache) for ids, cache in spec["releases"]],
            commit=commit,
        )

    def unary(self, step: Step) -> tuple[StepResult | None, str, RadixKVError | None]:
        """The step as unary calls, in order, up to the first refusal: (result, refused item, error)."""
        c, item = self.client, "commit"
        try:
            if step.commit is not None:
                c.commit(step.commit.seq_ids, step.commit.num_tokens)
            item = "opens"
            opened = c.open_many(step.opens) if step.opens else []
            item = "append"
            a = step.append
            appended = c.append_batch(a.seq_ids, a.num_token_ids, a.token_ids) if a is not None else None
            forked = []
            for i, (seq_id, n) in enumerate(step.forks):
                item = f"forks[{i}]"
                forked.append(c.fork(seq_id, n))
            num_cached = []
            for i, seq_id in enumerate(step.caches):
                item = f"caches[{i}]"
                num_cached.append(c.cache(seq_id))
            num_released = 0
            for i, (seq_ids, cache) in enumerate(step.releases):
                item = f"releases[{i}]"
                c.release_many(seq_ids, cache)
                num_released += len(seq_ids)
        except RadixKVError as e:
            return None, item, e
        return (
            StepResult(
                opened=opened,
                appended=appended,
                forked=forked,
                num_cached_tokens=num_cached,
                num_released_sequences=num_released,
            ),
            "",
            None,
        )

    def applied(self, step: Step, result: StepResult) -> None:
        self.live += [r.seq_id for r in result.opened] + [c for children in result.forked for c in children]
        for seq_ids, _ in step.releases:
            for seq_id in seq_ids:
                self.live.remove(seq_id)
                self.dead.append(seq_id)

    def tables(self) -> list[list[int]]:
        return [self.client.block_table(s) for s in self.live]


def comparable(r: StepResult) -> tuple:
    """A step's results without sequence ids (each pool numbers its sequences from its own random start)."""
    opened = [(o.num_cached_tokens, o.block_table.tolist(), o.slots.tolist()) for o in r.opened]
    a = r.appended
    appended = (
        None if a is None else (a.num_tokens, a.table_offsets, a.num_block_ids, a.block_ids, a.copies, a.slots.tolist())
    )
    return opened, appended, [len(c) for c in r.forked], r.num_cached_tokens, r.num_released_sequences


def state(end: End) -> tuple:
    stats = end.client.stats()
    return stats, end.tables()


@settings(
    max_examples=NUM_POOL_PAIRS,
    phases=(Phase.generate,),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(specs=steps)
def test_a_step_equals_its_unary_calls_and_a_refused_step_changes_nothing(twin_server: ServerProcess, specs) -> None:  # type: ignore[no-untyped-def]
    i = next(_pool_pairs)
    assert i < NUM_POOL_PAIRS, "more examples than twin pools"
    debug = Debug(twin_server.address)
    unary, stream = End(twin_server.address, f"u{i}"), End(twin_server.address, f"s{i}")
    try:
        for spec in specs:
            before = state(stream)
            stream_step, unary_step = stream.step(spec), unary.step(spec)
            try:
                got: StepResult | None = stream.client.step(stream_step)
                refusal = None
            except RadixKVError as e:
                got, refusal = None, e
            expected, refused_item, unary_refusal = unary.unary(unary_step)
            if refusal is None:
                assert unary_refusal is None, f"unary refused {refused_item} ({unary_refusal!r}), the stream did not"
                assert got is not None and expected is not None
                assert comparable(got) == comparable(expected)
                event("step applied")
                stream.applied(stream_step, got)
                unary.applied(unary_step, expected)
                assert state(stream) == state(unary)
                for prompt, namespace in spec["opens"]:
                    assert stream.client.match(prompt, namespace) == unary.client.match(prompt, namespace)
            else:
                event(f"refused at {refused_item.split('[')[0]}: {refusal.reason}")
                assert unary_refusal is not None, f"the stream refused {refusal!r}, the unary calls did not"
                assert (type(refusal), refusal.reason) == (type(unary_refusal), unary_refusal.reason)
                assert refusal.metadata.pop("item") == refused_item
                twin_ids = {
                    str(s): str(u) for s, u in zip(stream.live + stream.dead, unary.live + unary.dead, strict=True)
                }
                if "seq_id" in refusal.metadata:  # each pool numbers its sequences from its own start
                    refusal.metadata["seq_id"] = twin_ids.get(refusal.metadata["seq_id"], refusal.metadata["seq_id"])
                assert refusal.metadata == unary_refusal.metadata
                stats, tables = state(stream)
                failures = int(refusal.reason == "OUT_OF_BLOCKS")  # a refused allocation is counted, as on unary
                assert stats.num_allocation_failures == before[0].num_allocation_failures + failures
                assert (stats.__class__(**{**vars_of(stats), "num_allocation_failures": 0}), tables) == (
                    before[0].__class__(**{**vars_of(before[0]), "num_allocation_failures": 0}),
                    before[1],
                )
            debug.check(f"s{i}")
            debug.check(f"u{i}")
            if refusal is not None:
                break  # the unary end applied the items before the refused one: the twins differ now
    finally:
        unary.client.close()
        stream.client.close()
        debug.close()


def vars_of(stats: Any) -> dict[str, Any]:
    return {f: getattr(stats, f) for f in stats.__dataclass_fields__}


def test_stream_slots_are_the_unary_slots_for_a_prompt_longer_than_a_block(server: ServerProcess) -> None:
    """Packed slots (int64 bytes) read back as the unary int64 list does."""
    with RadixKVClient(server.address) as unary, RadixKVClient(server.address) as stream:
        prompt = np.arange(1000, 1050, dtype=np.int32)
        by_unary = unary.open(prompt, "slots-a")
        by_stream = stream.step(Step(opens=[(prompt, "slots-b")])).opened[0]
        assert by_stream.slots.dtype == np.int64 and len(by_stream.slots) == len(by_unary.slots) == 50
        table = stream.block_table(by_stream.seq_id)
        assert by_stream.slots.tolist() == [table[t // 4] * 4 + t % 4 for t in range(50)]


def test_a_batch_sent_again_is_its_sequences_until_one_of_them_ends(server: ServerProcess, debug) -> None:  # type: ignore[no-untyped-def]
    """A decode loop sends the same packed ids step after step (the server unpacks them once): a sequence of
    the batch released meanwhile is refused as the unary call refuses it, and another batch is read afresh."""
    with RadixKVClient(server.address) as client:
        opened = client.step(Step(opens=[([3000 + 10 * i + t for t in range(5)], "again") for i in range(3)]))
        a, b, c = (r.seq_id for r in opened.opened)
        for token in range(3):
            appended = client.step(Step(append=Append([a, b], [1, 1], [token, token]))).appended
            assert appended is not None and appended.num_tokens == [6 + token] * 2
        client.step(Step(releases=[([b], False)]))
        with pytest.raises(UnknownSequence) as refused:
            client.step(Step(append=Append([a, b], [1, 1], [7, 7])))
        assert refused.value.metadata["item"] == "append"
        assert client.step(Step(append=Append([a, c], [1, 1], [7, 7]))).appended.num_tokens == [9, 6]  # type: ignore[union-attr]
        assert client.num_tokens(a) == 9
        client.step(Step(releases=[([a, c], False)]))
    debug.check()


def test_a_step_caches_only_what_its_commit_says_was_written(server: ServerProcess) -> None:
    """The cached-garbage case on the stream: a prompt whose K/V was never committed is not served."""
    with RadixKVClient(server.address) as client:
        prompt = np.arange(2000, 2010, dtype=np.int32)  # two full blocks of 4, and two tokens
        unwritten = client.step(Step(opens=[(prompt, "commit-a")])).opened[0].seq_id
        assert client.step(Step(caches=[unwritten])).num_cached_tokens == [0], "nothing is committed yet"
        client.step(Step(releases=[([unwritten], True)]))
        assert client.match(prompt, "commit-a") == 0, "a later request would read unwritten K/V"

        written = client.step(Step(opens=[(prompt, "commit-a")])).opened[0].seq_id
        with pytest.raises(InvalidArgument) as refused:  # past the sequence's length: nothing of the step applies
            client.step(Step(commit=Commit([written], [11]), releases=[([written], True)]))
        assert refused.value.metadata["item"] == "commit"
        result = client.step(Step(commit=Commit([written], [10]), caches=[written]))
        assert result.num_cached_tokens == [8], "the commit comes first: the step caches both full blocks"
        client.step(Step(releases=[([written], True)]))
        assert client.match(prompt, "commit-a") == 8


@pytest.mark.parametrize("then", ["opens", "append"])
def test_a_commit_is_not_applied_when_the_item_after_it_is_refused(server: ServerProcess, debug, then: str) -> None:  # type: ignore[no-untyped-def]
    """The commit comes first and is not checked against blocks; an open or append after it that the pool
    cannot hold is refused, and the commit must not have moved the watermark."""
    with RadixKVClient(server.address, pool="tiny") as client:  # 8 blocks of 4
        seq_id = client.step(Step(opens=[(list(range(100, 106)), "commit-then")])).opened[0].seq_id
        too_big = list(range(200, 240))  # 10 blocks
        item = (
            {"opens": [(too_big, "commit-then")]}
            if then == "opens"
            else {"append": Append([seq_id], [len(too_big)], too_big)}
        )
        with pytest.raises(OutOfBlocks) as refused:
            client.step(Step(commit=Commit([seq_id], [6]), **item))  # type: ignore[arg-type]
        assert refused.value.metadata["item"] == then
        assert client.num_computed_tokens(seq_id) == 0, "the refused step applied its commit"
        client.step(Step(releases=[([seq_id], False)]))
    debug.check("tiny")


def test_a_stream_refused_by_auth_ends_with_the_unary_status(auth_server: ServerProcess, tls_files) -> None:  # type: ignore[no-untyped-def]
    credentials = grpc.ssl_channel_credentials(tls_files[0].read_bytes())
    with grpc.secure_channel(auth_server.address, credentials) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Session(iter([pb.SessionRequest(session_id="x")]), timeout=patient(10)))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def test_an_open_stream_keeps_its_lease_and_streams_are_bounded(start_server, wait_until) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(
        "--session-ttl",
        "0.4",
        "--max-workers",
        "6",
        "--max-watch-streams",
        "2",
        "--max-session-streams",
        "1",
        "--debug-rpc",
    )
    debug = Debug(srv.address)
    with grpc.insecure_channel(srv.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        streamed, idle = (stub.OpenSession(pb.OpenSessionRequest()).session_id for _ in range(2))
        requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        responses = stub.Session(iter(requests.get, None), timeout=patient(30))
        requests.put(pb.SessionRequest(session_id=streamed))
        assert not next(responses).HasField("error")
        with pytest.raises(grpc.RpcError) as refused:  # the one stream allowed is open
            list(stub.Session(iter([pb.SessionRequest(session_id=idle)]), timeout=patient(10)))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]

        # The idle session, opened with the streamed one, expires while no message passes on the stream (counted,
        # not probed: a call naming a session renews it).
        assert wait_until(lambda: debug.check().num_sessions == 1, timeout=60)
        with pytest.raises(grpc.RpcError) as expired:
            stub.KeepAlive(pb.KeepAliveRequest(session_id=idle), timeout=patient(10))
        assert expired.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        requests.put(pb.SessionRequest())
        assert not next(responses).HasField("error"), "the stream kept its session alive"
        requests.put(None)
        assert list(responses) == []
        assert wait_until(lambda: debug.check().num_sessions == 0, timeout=60), "the stream ended: the lease runs again"
    debug.close()


def test_a_step_resent_on_a_new_stream_is_answered_not_applied_again(server, debug) -> None:  # type: ignore[no-untyped-def]
    with RadixKVClient(server.address) as client:
        stub = kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(server.address))
        step = pb.SessionRequest(
            session_id=client.session_id,
            request_id=41,
            opens=[pb.StepOpen(token_ids=np.arange(300, 310, dtype="<i4").tobytes(), namespace="resend")],
        )
        [first] = list(
            stub.Session(iter([step]), timeout=patient(10))
        )  # the stream then ends: a client that reconnects
        opened = client.stats().num_opened_sequences
        [again] = list(stub.Session(iter([step]), timeout=patient(10)))
        assert again == first and not first.HasField("error")
        assert client.stats().num_opened_sequences == opened, "the re-sent step was applied twice"
        release = pb.SessionRequest(
            session_id=client.session_id, request_id=42, releases=[pb.StepRelease(seq_ids=[first.opened[0].seq_id])]
        )
        responses = list(stub.Session(iter([release, release]), timeout=patient(10)))  # re-sent on the same stream too
        assert [r.num_released_sequences for r in responses] == [1, 1] and not responses[1].HasField("error")
        reused = pb.SessionRequest(session_id=client.session_id, request_id=42, pool="tiny", cache_seq_ids=[1])
        [refused] = list(stub.Session(iter([reused]), timeout=patient(10)))
        assert (refused.error.reason, refused.error.metadata["field"]) == ("INVALID_ARGUMENT", "request_id")
        # The blocking client re-sends a step whose stream broke with the same id, once.
        result = client.step(Step(opens=[(list(range(500, 505)), "resend")]))
        client._steps.close()  # the connection is gone: the next step opens a new stream
        assert client.step(Step(releases=[([result.opened[0].seq_id], True)])).num_released_sequences == 1
    debug.check()
