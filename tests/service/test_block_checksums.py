"""Writers' K/V digests over gRPC (RecordBlockChecksums / GetBlockChecksums): kept only on tree blocks,
first claim wins, forgotten at eviction, refused by name when malformed (old linear checksums included),
another session's sequence absent."""

from __future__ import annotations

import pytest

from radixkv.client import RadixKVClient
from radixkv.errors import InvalidArgument, UnknownSequence
from radixkv.server.process.spawn import ServerProcess
from radixkv.v1 import kvcache_pb2 as pb

BLOCK = 4


def d(n: int) -> bytes:
    """A 32-byte digest standing for one block's."""
    return n.to_bytes(32, "little")


def _prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK + 1)]


def test_checksums_stick_to_tree_blocks_only(server: ServerProcess) -> None:
    with RadixKVClient(server.address) as client:
        tokens = _prompt(1, 3)
        seq = client.open(tokens).seq_id
        # Not cached yet: nothing is recorded.
        assert client.checksums.record(seq, 0, [d(11), d(12), d(13)]) == 0
        client.commit([seq], [len(tokens)])
        client.cache(seq)
        assert client.checksums.record(seq, 0, [d(11), d(12), d(13)]) == 3
        assert client.checksums.record(seq, 1, [d(99)]) == 0  # the first claim stays
        assert client.checksums.get(seq, 0, 3) == [d(11), d(12), d(13)]
        # A second sequence with the same prompt hits the tree's blocks: it reads the same checksums.
        other = client.open(tokens).seq_id
        assert client.checksums.get(other, 0, 3) == [d(11), d(12), d(13)]
        client.release_many([seq, other])


def test_a_duplicate_prefix_block_is_not_the_trees(server: ServerProcess) -> None:
    with RadixKVClient(server.address) as client:
        tokens = _prompt(2, 2)
        first, second = (r.seq_id for r in client.open_many([(tokens, "default"), (tokens, "default")]))
        client.commit([first, second], [len(tokens)] * 2)
        client.cache(first)
        client.cache(second)  # the tree holds first's blocks; second keeps its own copies
        assert client.checksums.record(second, 0, [d(5), d(6)]) == 0
        assert client.checksums.record(first, 0, [d(7), d(8)]) == 2
        assert client.checksums.get(second, 0, 2) == [b"", b""]
        client.release_many([first, second])


def test_eviction_forgets_the_checksum() -> None:
    pool = "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=6,dtype=float32"
    with ServerProcess(["--pool", pool]) as proc, RadixKVClient(proc.address) as client:
        tokens = _prompt(3, 2)
        seq = client.open(tokens).seq_id
        client.commit([seq], [len(tokens)])
        client.cache(seq)
        assert client.checksums.record(seq, 0, [d(1), d(2)]) == 2
        client.release(seq)
        filler = client.open(_prompt(4, 5)).seq_id  # needs every block: the cached prefix is evicted
        client.release(filler, cache=False)
        again = client.open(tokens)
        assert again.num_cached_tokens == 0
        assert client.checksums.get(again.seq_id, 0, 2) == [b"", b""]


def test_refusals_name_the_field(server: ServerProcess) -> None:
    with RadixKVClient(server.address) as client, RadixKVClient(server.address) as stranger:
        seq = client.open(_prompt(5, 1)).seq_id
        with pytest.raises(InvalidArgument) as e:
            client.checksums.record(seq, 0, [b"short"])
        assert e.value.metadata["field"] == "digests[0]"
        old = pb.RecordBlockChecksumsRequest(pool="default", session_id=client.session_id, seq_id=seq, checksums=[7])
        with pytest.raises(InvalidArgument) as e:  # an older connector's linear checksum: forgeable, refused
            client._call(client._stub.RecordBlockChecksums, old)
        assert e.value.metadata["field"] == "checksums"
        with pytest.raises(InvalidArgument) as e:
            client.checksums.record(seq, 1, [d(3), d(4)])
        assert e.value.metadata["field"] == "first_block"
        with pytest.raises(InvalidArgument) as e:
            client.checksums.get(seq, 0, 5)
        assert e.value.metadata["field"] == "num_blocks"
        with pytest.raises(UnknownSequence):
            stranger.checksums.get(seq, 0, 1)
        client.release(seq)


def test_digests_cross_a_snapshot_and_old_linear_checksums_are_dropped() -> None:
    """What an upgrade's snapshot carries (msgpack, as radixkv.state.snapshot writes it): the digests of blocks the
    adopted tree holds come back; an older snapshot's 64-bit checksums (forgeable) and malformed pairs do not."""
    import msgpack

    from radixkv.server.events.block_checksums import BlockChecksums

    table = BlockChecksums(8)
    assert table.record([1, 2, 5], [d(1), d(2), d(5)]) == 3
    pairs = msgpack.unpackb(msgpack.packb(table.to_pairs(), use_bin_type=True), raw=False)
    adopted = BlockChecksums(8)
    adopted.restore(pairs, tree_block_ids={1, 5})  # block 2 left the tree before the snapshot
    assert adopted.get([1, 2, 5]) == [d(1), b"", d(5)]
    adopted.restore([[1, 12345], [5, b"short"], [9, d(9)]], tree_block_ids={1, 5, 9})
    assert adopted.get([1, 5]) == [b"", b""]
