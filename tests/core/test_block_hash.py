"""Block content hashes: vLLM's sha256_cbor formula checked byte by byte, and the table kept by the tree's observer."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from radixkv.errors import OutOfBlocks
from radixkv.kv_cache import DEFAULT_NAMESPACE, KVCache
from radixkv.tree.block_hash import (
    NONE_HASH,
    BlockHashes,
    block_hash,
    cache_salt,
    chain_hashes,
    event_salt,
    namespace_salt,
    wire_hash,
)
from radixkv.tree.radix_tree import Node

# CBOR by hand (RFC 8949): 0x6e = text of 14 bytes; 0x83 = array of 3; 0x58 0x20 = 32-byte string;
# 0x84 = array of 4; 0x00-0x17 = small unsigned ints; 0xf6 = null; 0x81 0x64 = array of 1, text of 4.
HAND_NONE_HASH = hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()


def _hand_block(parent: bytes, tokens: bytes, extra: bytes = b"\xf6") -> bytes:
    return hashlib.sha256(b"\x83\x58\x20" + parent + b"\x84" + tokens + extra).digest()


def test_root_hash_is_sha256_of_the_canonical_cbor_seed() -> None:
    assert NONE_HASH == HAND_NONE_HASH


def test_block_hashes_match_the_formula_by_hand() -> None:
    first = _hand_block(HAND_NONE_HASH, b"\x01\x02\x03\x04")
    second = _hand_block(first, b"\x05\x06\x07\x08")
    assert block_hash(None, [1, 2, 3, 4]) == first
    assert block_hash(first, [5, 6, 7, 8]) == second
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4) == [first, second]  # the partial block is not hashed
    assert wire_hash(first) == int.from_bytes(first[-8:], "big")


def test_a_namespace_salts_only_the_first_block_tagged_as_vllm_cache_salt() -> None:
    """vLLM 0.31+ hashes `(("cache_salt", salt),)` into the first block (0x81 0x82: an array of one pair;
    0x6a: text of 10 bytes) and publishes it untagged in the event's `extra_keys`."""
    salted = _hand_block(HAND_NONE_HASH, b"\x01\x02\x03\x04", b"\x81\x82\x6acache_salt\x64chat")
    assert namespace_salt(DEFAULT_NAMESPACE) is None and event_salt(DEFAULT_NAMESPACE) is None
    assert namespace_salt("chat") == (("cache_salt", "chat"),)
    assert event_salt("chat") == ("chat",)
    hashes = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "chat")
    assert hashes[0] == salted
    assert hashes[1] == _hand_block(salted, b"\x05\x06\x07\x08")  # no salt after the first block
    assert set(hashes).isdisjoint(chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4))
    untagged = _hand_block(HAND_NONE_HASH, b"\x01\x02\x03\x04", b"\x81\x64chat")  # the salt rule of format 1
    assert hashes[0] != untagged


@pytest.mark.parametrize(
    ("namespace", "salt"),
    [("chat", "chat"), ("acme/chat", "acme%2Fchat"), ("acme/default", "acme%2Fdefault"), ("a%2Fb", "a%252Fb"),
     ("x@y\\z\x00", "x%40y%5Cz%00")],
)  # fmt: skip
def test_the_salt_is_one_vllm_accepts_and_distinct_namespaces_keep_distinct_salts(namespace: str, salt: str) -> None:
    """vLLM's OpenAI server refuses a cache_salt holding '@', '/', '\\' or NUL (validate_cache_salt, 0.33/0.34)."""
    assert cache_salt(namespace) == salt
    assert not set("@/\\\x00") & set(salt)
    assert cache_salt("acme/chat") != cache_salt("acme%2Fchat")


class _HashingObserver:
    """What the server's event hub does with the table, recording what was stored and removed."""

    def __init__(self, block_size: int) -> None:
        self.hashes = BlockHashes(block_size)
        self.num_stored = self.num_removed = 0

    def blocks_stored(self, node: Node) -> None:
        self.hashes.store(node)
        self.num_stored += len(node.block_ids)

    def blocks_removed(self, namespace: str, block_ids: list[int]) -> None:
        self.hashes.remove(block_ids)
        self.num_removed += len(block_ids)


def _check_table(cache: KVCache, observer: _HashingObserver) -> None:
    """Every cached block's hash equals the chain recomputed from its namespace's root."""
    tree = cache.tree
    observer.hashes.check_against(tree.tree_block_ids())
    for namespace, node in tree.nodes():
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        tokens = np.frombuffer(b"".join(p.token_bytes for p in reversed(path)), dtype="<i4").tolist()
        expected = chain_hashes(tokens, tree.block_size, namespace)[-len(node.block_ids) :]
        assert observer.hashes.node_hashes(node) == expected, f"node {node.node_id}: hash differs from the chain"


@pytest.mark.parametrize("seed", range(4))
def test_table_follows_splits_trims_and_evictions(seed: int) -> None:
    rng = random.Random(seed)
    block_size = 4
    cache = KVCache(num_blocks=48, block_size=block_size)
    observer = _HashingObserver(block_size)
    cache.tree.observer = observer
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    live: list[int] = []
    for _ in range(150):
        action = rng.random()
        if action < 0.55:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 25)] + [
                rng.randrange(50) for _ in range(rng.randrange(0, 12))
            ]
            try:
                tokens = tokens or [1]
                live.append(cache.open(tokens, rng.choice([DEFAULT_NAMESPACE, "chat"])).seq_id)
                cache.commit(live[-1:], [len(tokens)])  # its K/V is written: a cached release stores it
            except OutOfBlocks:
                pass
        elif live:
            seq_id = live.pop(rng.randrange(len(live)))
            cache.release(seq_id, cache=rng.random() < 0.9)
        _check_table(cache, observer)
    assert observer.num_stored > 0 and observer.num_removed > 0, "the workload must store and evict"
    assert len(observer.hashes) == cache.tree.num_cached_blocks
