"""The disk tier's bookkeeping without bytes, for `radixkv simulate`: which blocks a disk of `num_blocks` would hold.

It observes the tree as the server's disk tier does (every block the device tree takes is written, LRU beyond
`num_blocks`), and before each open brings the blocks past the prompt's device and host match into the host tier
(`HostTier.adopt`) exactly as the server does, so the open counts them as host hits. No read costs anything here:
`simulate` measures hit ratios, not time.
"""

from __future__ import annotations

import collections

import numpy as np
import numpy.typing as npt

from radixkv.disk.continuation import continuation
from radixkv.kv_cache import KVCache
from radixkv.tree.block_hash import BlockHashes
from radixkv.tree.radix_tree import TOKEN_BYTES, Node, TokenIds, to_token_bytes


class SimulatedDisk:
    """An LRU set of block hashes, `num_blocks` at most, fed by the tree; the tree's observer while attached."""

    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        assert cache.host.enabled, "a disk tier loads through the host tier"
        self.cache, self.num_blocks = cache, num_blocks
        self.hashes = BlockHashes(cache.block_size)
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.num_promoted_blocks = 0
        cache.tree.observer = self

    def blocks_stored(self, node: Node) -> None:
        for h in self.hashes.store(node):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.num_blocks:
            self._lru.popitem(last=False)

    def blocks_removed(self, namespace: str, block_ids: npt.NDArray[np.int32]) -> None:
        self.hashes.remove(block_ids)

    def promote(self, token_ids: TokenIds, namespace: str) -> int:
        """What the server does before an open: the prompt's blocks on disk past its match join the host tier."""
        key = to_token_bytes(token_ids, "token_ids")
        found = continuation(self.cache, key, namespace, self.hashes.get)
        if found is None:
            return 0
        num = 0
        for h in found.hashes:
            if h not in self._lru:
                break
            self._lru.move_to_end(h)
            num += 1
        if not num:
            return 0
        host, tree, bb = self.cache.host, self.cache.tree, self.cache.block_size * TOKEN_BYTES
        tokens = key[found.start * bb : (found.start + num) * bb]
        if host.adopt(found.hang_point(tree, namespace), tokens, lambda host_ids: True) is None:
            tree.drop_empty_roots()
            return 0
        self.num_promoted_blocks += num
        return num
