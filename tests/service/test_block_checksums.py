"""Writers' K/V checksums over gRPC (RecordBlockChecksums / GetBlockChecksums): kept only on tree blocks,
first claim wins, forgotten at eviction, refused by name when malformed, another session's sequence absent."""

from __future__ import annotations

import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import InvalidArgument, UnknownSequence
from radixkv.server.process import ServerProcess

BLOCK = 4


def _prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK + 1)]


def test_checksums_stick_to_tree_blocks_only(server: ServerProcess) -> None:
    with RadixKVClient(server.address) as client:
        tokens = _prompt(1, 3)
        seq = client.open(tokens).seq_id
        # Not cached yet: nothing is recorded.
        assert client.checksums.record(seq, 0, [11, 12, 13]) == 0
        client.commit([seq], [len(tokens)])
        client.cache(seq)
        assert client.checksums.record(seq, 0, [11, 12, 13]) == 3
        assert client.checksums.record(seq, 1, [99]) == 0  # the first claim stays
        assert client.checksums.get(seq, 0, 3) == [11, 12, 13]
        # A second sequence with the same prompt hits the tree's blocks: it reads the same checksums.
        other = client.open(tokens).seq_id
        assert client.checksums.get(other, 0, 3) == [11, 12, 13]
        client.release_many([seq, other])


def test_a_duplicate_prefix_block_is_not_the_trees(server: ServerProcess) -> None:
    with RadixKVClient(server.address) as client:
        tokens = _prompt(2, 2)
        first, second = (r.seq_id for r in client.open_many([(tokens, "default"), (tokens, "default")]))
        client.commit([first, second], [len(tokens)] * 2)
        client.cache(first)
        client.cache(second)  # the tree holds first's blocks; second keeps its own copies
        assert client.checksums.record(second, 0, [5, 6]) == 0
        assert client.checksums.record(first, 0, [7, 8]) == 2
        assert client.checksums.get(second, 0, 2) == [0, 0]
        client.release_many([first, second])


def test_eviction_forgets_the_checksum() -> None:
    pool = "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=6,dtype=float32"
    with ServerProcess(["--pool", pool]) as proc, RadixKVClient(proc.address) as client:
        tokens = _prompt(3, 2)
        seq = client.open(tokens).seq_id
        client.commit([seq], [len(tokens)])
        client.cache(seq)
        assert client.checksums.record(seq, 0, [1, 2]) == 2
        client.release(seq)
        filler = client.open(_prompt(4, 5)).seq_id  # needs every block: the cached prefix is evicted
        client.release(filler, cache=False)
        again = client.open(tokens)
        assert again.num_cached_tokens == 0
        assert client.checksums.get(again.seq_id, 0, 2) == [0, 0]


def test_refusals_name_the_field(server: ServerProcess) -> None:
    with RadixKVClient(server.address) as client, RadixKVClient(server.address) as stranger:
        seq = client.open(_prompt(5, 1)).seq_id
        with pytest.raises(InvalidArgument) as e:
            client.checksums.record(seq, 0, [0])
        assert e.value.metadata["field"] == "checksums"
        with pytest.raises(InvalidArgument) as e:
            client.checksums.record(seq, 1, [3, 4])
        assert e.value.metadata["field"] == "first_block"
        with pytest.raises(InvalidArgument) as e:
            client.checksums.get(seq, 0, 5)
        assert e.value.metadata["field"] == "num_blocks"
        with pytest.raises(UnknownSequence):
            stranger.checksums.get(seq, 0, 1)
        client.release(seq)
