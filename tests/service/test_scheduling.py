"""The integrator's path over the wire: the computed watermark and the scheduling queries, on a real server.

Block size 4 in both pools. The "default" pool (256 blocks) is shared by the session's tests, so
figures about it are read as differences; "tiny" (8 blocks) holds one test's sequences at a time.
"""

from __future__ import annotations

import grpc
import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import InvalidArgument, OutOfBlocks, UnknownSequence
from radixkv.v1 import kvcache_pb2 as pb
from radixkv.v1 import kvcache_pb2_grpc


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_nothing_unwritten_is_ever_cached(server, debug):
    # The garbage hit of issue 19: a prompt released with cache=True before its K/V was written
    # must not serve the next request that shares it.
    prompt = _tokens(9100, 10)  # 2 full blocks + 2 tokens
    with RadixKVClient(server.address) as client:
        seq = client.open(prompt)
        assert client.describe_sequences([seq.seq_id]) == [(10, 0)]
        assert client.cache(seq.seq_id) == 0, "no block is computed yet"
        client.release(seq.seq_id, cache=True)
        assert client.match(prompt) == 0
        again = client.open(prompt)
        assert again.num_cached_tokens == 0

        client.commit([again.seq_id], [6])  # the worker wrote 6 tokens: one full block
        assert client.num_computed_tokens(again.seq_id) == 6
        assert client.cache(again.seq_id) == 4
        client.commit([again.seq_id], [10])
        client.release(again.seq_id, cache=True)
        assert client.match(prompt) == 8
        assert client.open(prompt).num_cached_tokens == 8
    debug.check()


def test_append_commits_the_tokens_before_it(server, debug):
    with RadixKVClient(server.address) as client:
        a, b = client.open_many([(_tokens(9200, 8), "default"), (_tokens(9300, 3), "default")])
        client.append_batch([a.seq_id, b.seq_id], [1, 2], [1, 2, 3])
        assert client.describe_sequences([a.seq_id, b.seq_id]) == [(9, 8), (5, 3)]
        assert (client.num_tokens(b.seq_id), client.num_computed_tokens(b.seq_id)) == (5, 3)
        client.release_many([a.seq_id, b.seq_id], cache=True)
        assert client.match(_tokens(9200, 8) + [1]) == 8
    debug.check()


def test_commit_refusals_name_the_field_and_change_nothing(server, debug):
    with RadixKVClient(server.address) as client, RadixKVClient(server.address) as other:
        seq = client.open(_tokens(9400, 6)).seq_id
        client.commit([seq], [4])
        with pytest.raises(InvalidArgument) as below:
            client.commit([seq], [3])
        with pytest.raises(InvalidArgument) as past:
            client.commit([seq], [7])
        assert below.value.field.startswith("num_tokens") and past.value.field.startswith("num_tokens")
        with pytest.raises(InvalidArgument):
            client.commit([seq], [4, 5])  # one count per sequence
        with pytest.raises(UnknownSequence):
            client.commit([seq, 2**62], [5, 1])
        # Another session's sequence is answered exactly as an absent one (ids are not probed).
        with pytest.raises(UnknownSequence):
            other.commit([seq], [5])
        with pytest.raises(UnknownSequence):
            other.describe_sequences([seq])
        with pytest.raises(UnknownSequence):
            other.freeable_blocks([seq])
        with pytest.raises(UnknownSequence):
            other.can_append([seq], [1])
        assert client.describe_sequences([seq]) == [(6, 4)], "every refusal left the watermark alone"
    debug.check()


def test_can_append_and_available_blocks_agree_with_append(server, debug):
    with RadixKVClient(server.address, pool="tiny") as client:
        seq = client.open(_tokens(9500, 28)).seq_id  # 7 of the 8 blocks
        assert client.num_available_blocks() == 1
        assert client.can_append([seq], [4]) is True
        assert client.can_append([seq], [5]) is False
        with pytest.raises(OutOfBlocks):
            client.append_batch([seq], [5], _tokens(0, 5))
        assert client.num_available_blocks() == 1, "can_append and the refused append changed nothing"
        client.append_batch([seq], [4], _tokens(0, 4))
        assert client.num_available_blocks() == 0 and client.can_append([seq], [1]) is False
        client.release(seq, cache=False)
    debug.check("tiny")


def test_freeable_blocks_predicts_what_a_release_frees(server, debug):
    with RadixKVClient(server.address) as client:
        parent = client.open(_tokens(9600, 10)).seq_id  # 3 blocks
        client.commit([parent], [10])
        (child,) = client.fork(parent, 1)  # shares the 2 cached blocks and the partial third
        client.append_batch([child], [1], [7])  # the child copies the partial block: 3 + 1 blocks in all
        assert client.freeable_blocks([parent]) == 1, "only the parent's own partial block"
        both = client.freeable_blocks([parent, child])
        before = client.num_available_blocks()
        client.release_many([parent, child], cache=True)
        assert client.num_available_blocks() - before == both == 4
    debug.check()


def test_close_releases_without_caching_even_what_is_committed(server, debug):
    prompt = _tokens(9700, 9)
    with RadixKVClient(server.address) as client:
        seq = client.open(prompt).seq_id
        client.commit([seq], [9])
    with RadixKVClient(server.address) as probe:
        assert probe.match(prompt) == 0, "close() ended the session: nothing it held was cached"
        seq = probe.open(prompt).seq_id
        probe.commit([seq], [9])
        probe.release(seq, cache=True)
        assert probe.match(prompt) == 8
    debug.check()


def test_an_expired_lease_caches_nothing_even_what_was_committed(server, debug, wait_until):
    prompt = _tokens(9800, 12)
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        baseline = debug.check().num_live_sequences
        session = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0.3)).session_id
        (opened,) = stub.OpenSequences(
            pb.OpenSequencesRequest(session_id=session, prompts=[pb.Prompt(token_ids=prompt)])
        ).sequences
        stub.CommitTokens(pb.CommitTokensRequest(session_id=session, seq_ids=[opened.seq_id], num_tokens=[12]))
        assert wait_until(lambda: debug.check().num_live_sequences == baseline, timeout=60)
        assert stub.Match(pb.MatchRequest(token_ids=prompt)).num_cached_tokens == 0
