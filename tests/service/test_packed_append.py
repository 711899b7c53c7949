"""The append item's packed columns on the Session stream: the step the repeated columns make, answered packed.

A raw stream sends the same appends both ways to two sets of sequences opened alike, and each
answer is checked against the block tables it builds; the clients send the packed form.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from radixkv.client import RadixKVClient
from radixkv.client.session import step_messages
from radixkv.errors import InvalidArgument
from radixkv.sequences.step import Append, Step
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc

BLOCK_SIZE = 4  # the `default` pool of tests/service/conftest.py


def u64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def u32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<u4").tobytes()


def i32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


class Stream:
    """A raw Session stream of one session, and the block tables its answers build."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.session = self.stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
        self._requests: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._responses = self.stub.Session(iter(self._requests.get, None), timeout=60)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, request: pb.SessionRequest) -> pb.SessionResponse:
        request.session_id = self.session
        self._requests.put(request)
        return next(self._responses)

    def open(self, prompts: list[list[int]]) -> list[int]:
        response = self.step(pb.SessionRequest(opens=[pb.StepOpen(token_ids=i32(p)) for p in prompts]))
        for opened, prompt in zip(response.opened, prompts, strict=True):
            self.tables[opened.seq_id], self.lengths[opened.seq_id] = list(opened.block_ids), len(prompt)
        return [o.seq_id for o in response.opened]

    def follow(self, seq_ids: list[int], counts: list[int], columns: list[list[int]], slots: bytes) -> None:
        """Apply an answer's columns to the tables, and check every slot against them."""
        num_tokens, offsets, num_blocks, block_ids = columns
        start, expected = 0, []
        for i, (seq_id, count) in enumerate(zip(seq_ids, counts, strict=True)):
            table = self.tables[seq_id]
            table[offsets[i] :] = block_ids[start : start + num_blocks[i]]
            start += num_blocks[i]
            positions = range(self.lengths[seq_id], self.lengths[seq_id] + count)
            expected += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
            self.lengths[seq_id] += count
            assert num_tokens[i] == self.lengths[seq_id]
        assert np.frombuffer(slots, dtype="<i8").tolist() == expected

    def close(self) -> None:
        self._requests.put(None)
        assert list(self._responses) == []
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session))  # its sequences go with it
        self.channel.close()


@pytest.fixture
def stream(server) -> Iterator[Stream]:  # type: ignore[no-untyped-def]
    s = Stream(server.address)
    yield s
    s.close()


NAMES = ("num_tokens", "table_offsets", "num_block_ids", "block_ids")


def repeated(a: pb.StepAppended) -> list[list[int]]:
    return [list(getattr(a, name)) for name in NAMES]


def packed(a: pb.StepAppended) -> list[list[int]]:
    return [np.frombuffer(getattr(a, f"packed_{name}"), dtype="<u4").tolist() for name in NAMES]


@pytest.mark.parametrize("counts_packed", [False, True], ids=["decode step, ones implied", "counts packed"])
# type: ignore[no-untyped-def]
def test_a_packed_append_is_the_repeated_one_answered_packed(stream: Stream, debug, counts_packed: bool) -> None:
    prompts = [list(range(10 * i, 10 * i + n)) for i, n in enumerate([3, 4, 5, 8, 1])]
    first, second = stream.open(prompts), stream.open(prompts)
    for step in range(6):  # sequences fill their last blocks and take new ones on the way
        counts = [1 + (i + step) % 3 for i in range(len(prompts))] if counts_packed else [1] * len(prompts)
        tokens = list(range(100 * step, 100 * step + sum(counts)))
        by_repeated = stream.step(
            pb.SessionRequest(append=pb.StepAppend(seq_ids=first, num_token_ids=counts, token_ids=i32(tokens)))
        ).appended
        append = pb.StepAppend(packed_seq_ids=u64(second), token_ids=i32(tokens))
        if counts_packed:
            append.packed_num_token_ids = u32(counts)
        by_packed = stream.step(pb.SessionRequest(append=append)).appended
        assert not by_repeated.packed_num_tokens and not by_packed.num_tokens, "each answered in its request's form"
        assert repeated(by_repeated)[:3] == packed(by_packed)[:3]  # lengths, offsets, blocks taken: the same
        stream.follow(first, counts, repeated(by_repeated), by_repeated.slots)
        stream.follow(second, counts, packed(by_packed), by_packed.slots)
    debug.check()


A = pb.StepAppend
BAD = [  # (name, the append for a live sequence s, the field it is refused for)
    ("both forms", lambda s: A(seq_ids=[s], packed_seq_ids=u64([s]), token_ids=i32([1])), "packed_seq_ids"),
    ("ragged ids", lambda s: A(packed_seq_ids=u64([s])[:7], token_ids=i32([1])), "packed_seq_ids"),
    ("counts short", lambda s: A(packed_seq_ids=u64([s, s]), packed_num_token_ids=u32([1]), token_ids=i32([1, 2])),
     "packed_num_token_ids"),
    ("ragged counts", lambda s: A(packed_seq_ids=u64([s]), packed_num_token_ids=b"\1\0", token_ids=i32([1])),
     "packed_num_token_ids"),
    ("counts without ids", lambda s: A(packed_num_token_ids=u32([1]), token_ids=i32([1])), "packed_num_token_ids"),
    ("token count disagrees", lambda s: A(packed_seq_ids=u64([s]), token_ids=i32([1, 2])), "token_ids"),
]  # fmt: skip


@pytest.mark.parametrize(("build", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
# type: ignore[no-untyped-def]
def test_a_bad_packed_append_is_refused_naming_its_field(stream: Stream, debug, build, field) -> None:
    (seq,) = stream.open([[1, 2, 3]])
    response = stream.step(pb.SessionRequest(append=build(seq)))
    assert response.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (response.error.metadata["field"], response.error.metadata["item"]) == (field, "append")
    good = stream.step(pb.SessionRequest(append=pb.StepAppend(packed_seq_ids=u64([seq]), token_ids=i32([9]))))
    assert packed(good.appended)[0] == [4], "the refused step appended nothing; the stream carries on"
    debug.check()


def test_an_unknown_packed_sequence_is_refused_as_a_repeated_one(stream: Stream) -> None:
    by_repeated = stream.step(pb.SessionRequest(append=A(seq_ids=[987654], num_token_ids=[1], token_ids=i32([1]))))
    by_packed = stream.step(pb.SessionRequest(append=A(packed_seq_ids=u64([987654]), token_ids=i32([1]))))
    assert by_packed.error == by_repeated.error and by_packed.error.reason == "UNKNOWN_SEQUENCE"


# type: ignore[no-untyped-def]
def test_the_clients_send_a_step_packed_and_a_bad_entry_as_before(server, monkeypatch) -> None:
    sent: list[pb.SessionRequest] = []
    build = step_messages.step_request
    monkeypatch.setattr(step_messages, "step_request", lambda *args: sent.append(build(*args)) or sent[-1])
    with RadixKVClient(server.address) as client:
        ids = [r.seq_id for r in client.step(Step(opens=[([1, 2, 3], ""), ([4, 5], "")])).opened]
        result = client.step(Step(append=Append(ids, [1, 1], [7, 8]))).appended
        tables = [client.block_table(s) for s in ids]
        assert result is not None and result.num_tokens == [4, 3]
        assert result.slots.tolist() == [tables[0][0] * BLOCK_SIZE + 3, tables[1][0] * BLOCK_SIZE + 2]
        assert sent[-1].append.packed_seq_ids == u64(ids) and not sent[-1].append.packed_num_token_ids
        grown = client.step(Step(append=Append(ids, [2, 1], [1, 2, 3]))).appended
        assert grown is not None and grown.num_tokens == [6, 4] and sent[-1].append.packed_num_token_ids == u32([2, 1])
        with pytest.raises(InvalidArgument) as refused:
            client.step(Step(append=Append([ids[0], 1.5], [1, 1], [1, 2])))  # type: ignore[list-item]
        assert refused.value.field.startswith("seq_ids")
        with pytest.raises(InvalidArgument) as refused:  # an array as a count: not "all ones", no crash
            client.step(Step(append=Append(ids, [np.ones(2, dtype=np.int64), 1], [1, 2, 3])))  # type: ignore[list-item]
        assert refused.value.field.startswith("num_token_ids")
        assert client.num_tokens(ids[0]) == 6, "nothing was sent"
