"""Where a prompt leaves the device and host tiers, and the block hashes the disk tier is asked for past there.

The disk tier is keyed by block hash (the hash contract's: the same across processes and restarts), so a lookup
needs the hashes of the prompt's blocks past its device and host match. The chain is hashed from the last
matched device block's known hash when there is one (`hash_of`), else from the namespace's root.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from radixkv.kv_cache import KVCache
from radixkv.tree.block_hash import chain_hashes
from radixkv.tree.radix_tree import TOKEN_BYTES, Match, Node, RadixTree


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Continuation:
    parent: Node | None  # the node the disk's blocks would hang under (device, host-only, a root); None: no root yet
    start: int  # blocks of the prompt the device and host tiers hold
    hashes: list[bytes]  # the prompt's block hashes past `start`, up to (not including) its last token's block
    inside: Match | None = None  # the device match, when it ends inside `parent` (split there to hang below)

    def hang_point(self, tree: RadixTree, namespace: str) -> Node:
        """The node the disk's blocks hang under: `parent`, split where the match ends inside it (as the open that
        loads them would split it anyway), or the namespace's root, made now. Changes the tree: under its lock."""
        if self.inside is not None:
            return tree.split(self.inside)
        return self.parent or tree.root(namespace)


def continuation(
    cache: KVCache, key: bytes, namespace: str, hash_of: Callable[[int], bytes | None]
) -> Continuation | None:
    """Where `key` (int32 token bytes) leaves the device and host tiers. None: the prompt has no block past the
    match, or the match ends inside a host-only node (where no host-only child can hang). A match ending inside a
    device node continues below where that node would split (`Continuation.hang_point`). The prompt's last token
    is always computed, so its last full block is not asked for when the prompt ends on one. Changes nothing."""
    tree, host, bs = cache.tree, cache.host, cache.block_size
    limit = (len(key) // TOKEN_BYTES - 1) // bs
    root = tree.roots.get(namespace)
    parent, start, parent_hash, inside = root, 0, None, None
    if root is not None:
        match = tree.match(root, key, limit)
        node = match.node
        if node.parent is not None and match.num_blocks_in_node < len(node.block_ids):
            inside = match  # the host tier continues no match ending inside a device node
            parent, start = node, match.num_blocks
        else:
            path, num_in_last, num_host = host.match(match, key, limit)
            if path and num_in_last < len(path[-1].host_block_ids):
                return None
            parent, start = (path[-1] if path else node), match.num_blocks + num_host
        if match.num_blocks and start == match.num_blocks:  # the chain continues from a device block's known hash
            parent_hash = hash_of(int(node.block_ids[match.num_blocks_in_node - 1]))
    if start >= limit:
        return None
    tokens = np.frombuffer(key, dtype="<i4")
    if parent_hash is not None:
        hashes = chain_hashes(tokens[start * bs : limit * bs].tolist(), bs, namespace, parent_hash=parent_hash)
    else:
        hashes = chain_hashes(tokens[: limit * bs].tolist(), bs, namespace)[start:]
    return Continuation(parent=parent, start=start, hashes=hashes, inside=inside)
