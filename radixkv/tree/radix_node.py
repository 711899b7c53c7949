"""The radix tree's node record (a run of whole blocks and who holds it) and the two hooks the tree calls out
through (an observer of what it caches, the host tier under it). Records only, no behaviour: apart from
`radix_tree.py` because the eviction policies and retention hints (`eviction.py`), which the tree holds, read
nodes too."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from radixkv.memory.block_pool import NO_BLOCKS

_node_ids = itertools.count()


@dataclasses.dataclass(slots=True, eq=False)
class Node:
    token_bytes: bytes  # this node's tokens (int32 LE), len(block_ids) * block_size of them; root: b""
    # The blocks holding them, one per block_size tokens; the tree's hold on each. Owned by the node
    # (or a view shared with the other half of a split): never written in place, only re-sliced.
    block_ids: npt.NDArray[np.int32]
    parent: Node | None  # None for a namespace's root (and for an evicted, detached node)
    _: dataclasses.KW_ONLY  # the rest by name
    namespace: str  # the root's namespace: hits never cross namespaces
    children: dict[bytes, Node] = dataclasses.field(default_factory=dict)  # keyed by each child's first block's bytes
    # Its own holders (live sequences and pins that lock this node) plus its locked children: nonzero exactly when a
    # lock at or below protects it (`RadixTree.lock`; root: the namespace's).
    lock_ref: int = 0
    pin_ref: int = 0  # pins whose path runs through here (each also holds a lock)
    last_access: int = 0  # tree clock when it last locked, unlocked or took a holder: the LRU key
    node_id: int = dataclasses.field(default_factory=_node_ids.__next__)  # tie-break and identity in checks
    # The host tier (`radixkv.tree.host_tier`): this node's blocks there (empty: none; with block_ids too: a copy),
    # and its host-only children (no device blocks), which device walks never see.
    host_block_ids: npt.NDArray[np.int32] = dataclasses.field(default_factory=itertools.repeat(NO_BLOCKS).__next__)
    host_children: dict[bytes, Node] = dataclasses.field(default_factory=dict)
    # Eviction order and retention (`radixkv.tree.eviction`): the key it is listed
    # under (None: not listed); its last use and its branch's typical pause (policy clock, seconds; -1: unknown); uses;
    # the deepest end its branch reached (blocks); a TTL's deadline and refresh length, a priority, a session end.
    evict_key: tuple[Any, ...] | None = None
    used_s: float = 0.0
    gap_s: float = -1.0
    num_uses: int = 0
    high_water: int = 0
    retain_until_s: float = 0.0
    retain_ttl_s: float = 0.0
    retain_priority: int = 0
    ended: bool = False


OWNER_SEPARATOR = "/"


class TreeObserver(Protocol):
    """Told of every change to what the tree caches (for KV-aware routers' event streams)."""

    def blocks_stored(self, node: Node) -> None:
        """`node` is a new leaf: all its blocks are newly cached."""

    def blocks_removed(self, namespace: str, block_ids: npt.NDArray[np.int32]) -> None:
        """These blocks of `namespace` were evicted (one report per namespace per eviction)."""


class HostHook(Protocol):
    """What the device tier asks of a host tier under it (`radixkv.tree.host_tier.HostTier`, which plugs in; without
    one, `radixkv.tree.radix_tree.DropEvicted`)."""

    def evict_leaf(self, leaf: Node, need: int) -> npt.NDArray[np.int32]:
        """Take an evictable leaf's blocks (its tail, when it holds more than `need`) off the device."""
        ...

    def drop_overlap(self, parent: Node, first_block: bytes) -> None:
        """A device insert under `parent` starts with `first_block`: drop a host-only child it makes stale."""
        ...

    def split_copy(self, node: Node, upper: Node) -> None:
        """A device split gave `upper` the head of `node`'s host copy."""
        ...
