"""The radix tree of token prefixes: which full blocks hold which prefix, per namespace, and which go first.

A node holds a run of whole blocks: `token_bytes` (int32, `len(block_ids) * block_size` tokens) and
their `block_ids`. Children are keyed by the bytes of their first block, so a walk costs one dict
lookup and one memcmp per node, never a Python loop per token. The tree owns one hold (ref_count)
on each block it keeps; the caller (`KVCache`) turns the block ids the tree drops into decrefs.
Eviction takes the first unlocked leaf's tail blocks in the policy's order (`radixkv.tree.eviction`; LRU by
default; O(log n) per leaf touched); an owner's eviction (a tenant past its cache share) takes its own least
recently used leaf from its own list, never looking at another owner's leaves (O(log n) per leaf too, however
many leaves others cache).
Token ids as it keys them (`TokenKey`: int32 bytes), a match's record (`Match`) and namespace roots are here; the
node record is in `radix_node.py`, which the eviction policies read too.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from radixkv.errors import InvalidArgument, LimitExceeded
from radixkv.memory.block_pool import NO_BLOCKS, BlockIds
from radixkv.tree.eviction import EvictionPolicy, inherit, lru_key, stamp
from radixkv.tree.radix_node import OWNER_SEPARATOR, HostHook, Node, TreeObserver

# -- from tree/token_ids.py (merged, issue 41: one concept, one module):
# Token ids as the core keeps them: little-endian int32 bytes, so prefixes compare with one memcmp.

TOKEN_BYTES = 4
MAX_TOKEN_ID = 2**31 - 1

_INT32 = np.dtype("<i4")

TokenIds = Sequence[int] | npt.NDArray[np.integer] | bytes


def to_token_bytes(token_ids: TokenIds, field: str = "token_ids", *, allow_empty: bool = False) -> bytes:
    """Validate token ids (integers in [0, 2^31)) and pack them as int32 bytes.

    Raises:
        InvalidArgument: naming `field`, for an empty list, non-integers or ids out of range.
    """
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == _INT32 and token_ids.ndim == 1 and token_ids.size:
        # The hot path (a scheduler's arrays): int32 cannot exceed the maximum, so one pass checks it.
        if token_ids.min() < 0:
            raise InvalidArgument(field, f"token ids must lie in [0, {MAX_TOKEN_ID}]")
        return token_ids.tobytes()
    if type(token_ids) is list and token_ids:  # a tokenizer's or sampler's list: packed in one C call
        try:
            data = struct.pack(f"<{len(token_ids)}I", *token_ids)  # unsigned: a negative id does not pack
        except struct.error:
            pass  # not all integers in [0, 2^32): the general path below names what is wrong
        else:
            if np.frombuffer(data, dtype=_INT32).min() < 0:  # an id of 2^31 or more reads as negative
                raise InvalidArgument(field, f"token ids must lie in [0, {MAX_TOKEN_ID}]")
            return data
    if isinstance(token_ids, bytes):
        if len(token_ids) % TOKEN_BYTES:
            raise InvalidArgument(field, f"packed token ids must be a multiple of {TOKEN_BYTES} bytes")
        array = np.frombuffer(token_ids, dtype="<i4")
    else:
        try:
            array = np.asarray(token_ids)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(field, f"not a list of integers ({e})") from None
        if array.ndim != 1:
            raise InvalidArgument(field, f"must be a flat list of integers, got shape {array.shape}")
        if array.size and array.dtype.kind not in "iu":
            raise InvalidArgument(field, f"must be integers, got {array.dtype}")
    if array.size == 0:
        if allow_empty:
            return b""
        raise InvalidArgument(field, "must not be empty")
    if int(array.min()) < 0 or (array.dtype.itemsize > 4 and int(array.max()) > MAX_TOKEN_ID):  # int32: never past
        raise InvalidArgument(field, f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    if isinstance(token_ids, bytes):
        return token_ids
    return array.astype("<i4", copy=False).tobytes()


class TokenKey:
    """Validated token ids as little-endian int32 bytes: the form the radix tree compares with one memcmp.

    Owns the arithmetic between token counts and byte offsets, so the core never multiplies by
    TOKEN_BYTES itself.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data  # already validated: use `TokenKey.of` for a caller's token ids

    @classmethod
    def of(cls, token_ids: TokenIds, field: str = "token_ids", *, max_tokens: int | None = None) -> TokenKey:
        """Raises InvalidArgument naming `field` (see `to_token_bytes`), LimitExceeded past `max_tokens`."""
        key = cls(to_token_bytes(token_ids, field))
        if max_tokens is not None and key.num_tokens > max_tokens:
            raise LimitExceeded("max_tokens_per_request", key.num_tokens, max_tokens)
        return key

    @property
    def num_tokens(self) -> int:
        return len(self.data) // TOKEN_BYTES

    def whole_blocks(self, block_size: int) -> int:
        """How many full blocks of `block_size` tokens these tokens fill."""
        return self.num_tokens // block_size

    def head(self, num_tokens: int) -> bytes:
        """The bytes of the first `num_tokens` tokens."""
        return self.data[: num_tokens * TOKEN_BYTES]

    def tail_after(self, num_tokens: int) -> bytes:
        """The bytes of every token after the first `num_tokens`."""
        return self.data[num_tokens * TOKEN_BYTES :]

    def whole_block_prefix(self, block_size: int) -> bytes:
        """The bytes of the tokens that fill whole blocks (what a pin or a match can cover)."""
        return self.head(self.whole_blocks(block_size) * block_size)

    @staticmethod
    def num_bytes(num_tokens: int) -> int:
        """Byte length of `num_tokens` tokens (for slicing a sequence's tail bytes)."""
        return num_tokens * TOKEN_BYTES

    @staticmethod
    def count(data: bytes | bytearray | memoryview) -> int:
        """How many tokens `data` holds."""
        return len(data) // TOKEN_BYTES


def from_token_bytes(data: bytes | bytearray) -> list[int]:
    token_ids: list[int] = np.frombuffer(bytes(data), dtype="<i4").tolist()
    return token_ids


def common_blocks(key: bytes, pos: int, end: int, run: bytes, block_size: int) -> int:
    """Whole blocks at the start of `run` equal to `key[pos:end]`: where a prefix match ending inside a tree
    node (device or host) stops."""
    n = min(len(run), end - pos) // TOKEN_BYTES
    ours = np.frombuffer(key, dtype="<i4", count=n, offset=pos)
    differ = np.flatnonzero(ours != np.frombuffer(run, dtype="<i4", count=n))
    return (int(differ[0]) if differ.size else n) // block_size


def owner_of(namespace: str) -> str:
    """Whose a namespace is, for per-owner eviction: the name before its first "/" (the server scopes a tenant's
    namespaces as "<tenant>/<name>"), or the whole name when it has none."""
    return namespace.partition(OWNER_SEPARATOR)[0]


@dataclasses.dataclass(slots=True)
class Match:
    """Where a prefix ends in the tree: `node` (deepest, possibly matched part-way), and counts."""

    node: Node
    num_blocks_in_node: int  # how many of node's blocks matched (all, unless the match ends inside it)
    num_blocks: int  # blocks matched from the root
    _: dataclasses.KW_ONLY
    path: list[Node]  # root excluded, top-down, `node` last

    def unlocked_on_path(self) -> list[tuple[int, int]]:
        """(node id, matched blocks in it) of each unlocked node on the path: what locking it takes out of the
        evictable blocks."""
        return [
            (node.node_id, self.num_blocks_in_node if node is self.node else len(node.block_ids))
            for node in self.path
            if node.lock_ref == 0
        ]

    def num_newly_locked(self) -> int:
        """Cached blocks that locking this match takes out of the evictable ones."""
        return sum(n for _, n in self.unlocked_on_path())


__all__ = ["Match", "Node", "RadixTree", "TreeObserver", "lru_key", "owner_of"]


class RadixTree:
    """Prefixes of full blocks, one root per namespace, with locks and LRU eviction of unlocked leaves.

    Invariants (`radixkv.tree.tree_check.check_tree`): a node's lock_ref counts its own holders and its locked
    children (nonzero exactly when a lock at or below it protects it);
    every unlocked childless non-root node is in `_evictable_leaves` (a SortedList by last access), and in its
    owner's list (`_owner_leaves`, the same order restricted to the namespaces of one `owner_of`);
    `num_evictable_blocks` is the number of blocks in unlocked nodes; unlocked parents are accessed no
    earlier than their children, so evicting leaves in LRU order never skips an older block.

    The SortedList is keyed on `last_access`, which changes; it stays ordered because only `lock`
    and `unlock` write it, and never on a listed node: `lock` removes an unlocked leaf from the list
    before writing, `unlock` writes a node that is still locked and lists it (with the new key) only
    once its count reaches 0. A split gives the new upper node its child's key and leaves the listed
    child as it is; trimming a leaf's tail keeps its key.

    `touched`, while not None (an online audit copying the tree over several lock holds), collects every
    non-root node whose fields or children change: every write to a device node goes through a method here
    (the host tier writes host-only nodes, which the audit does not copy, and moves nodes between the tiers
    only through `unlink` and `attach_loaded`).
    """

    def __init__(
        self, block_size: int, observer: TreeObserver | None = None, policy: EvictionPolicy | None = None
    ) -> None:
        self.block_size = block_size
        self.observer = observer
        self.block_bytes = block_size * TOKEN_BYTES
        self.roots: dict[str, Node] = {}
        self.policy = policy if policy is not None else EvictionPolicy()  # an empty one is falsy
        self._evictable_leaves = self.policy  # the unlocked leaves, in eviction order
        # The same leaves by owner (`owner_of` their namespace), least recently used first: a tenant over its
        # cache share gives up its own LRU leaves (the key is stable while listed: see the class docstring).
        self._owner_leaves: dict[str, SortedList] = {}
        self.num_evictable_blocks = 0
        self.num_pinned_blocks = 0
        self.num_cached_blocks = 0
        self.num_cached_blocks_in: dict[str, int] = {}  # per namespace with any cached block (tenant cache shares)
        self.num_cached_blocks_of: dict[str, int] = {}  # per owner with any cached block (`owner_of`)
        self.num_leaves_visited = 0  # leaves eviction looked at: the work it did under the pool's lock
        self._clock = 0
        self.host: HostHook = DropEvicted(self)  # where evicted blocks go: a host tier plugs in here, else dropped
        self.touched: set[Node] | None = None  # see the class docstring; None: nobody is copying the tree

    def root(self, namespace: str) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Node(b"", NO_BLOCKS, None, namespace=namespace)
        return root

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- matching ---------------------------------------------------------------------------------

    def match(self, root: Node, key: bytes, max_blocks: int | None = None) -> Match:
        """Longest cached prefix of `key` in whole blocks (at most `max_blocks`), below `root`; changes nothing."""
        block_bytes = self.block_bytes
        limit = len(key) // block_bytes if max_blocks is None else min(max_blocks, len(key) // block_bytes)
        end = limit * block_bytes
        node, pos, path = root, 0, []
        num_in_node = 0
        while pos < end:
            child = node.children.get(key[pos : pos + block_bytes])
            if child is None:
                break
            run = child.token_bytes
            path.append(child)
            if pos + len(run) <= end and key.startswith(run, pos):
                node, pos, num_in_node = child, pos + len(run), len(child.block_ids)
                continue
            num_in_node = common_blocks(key, pos, end, run, self.block_size)  # the match ends inside `child`
            node, pos = child, pos + num_in_node * block_bytes
            break
        return Match(node, num_in_node, pos // block_bytes, path=path)

    def split(self, match: Match) -> Node:
        """Make the match end on a node boundary; returns the node that ends exactly there."""
        node, k = match.node, match.num_blocks_in_node
        if node.parent is None or k == len(node.block_ids):
            return node
        assert node.parent is not None and k > 0, "a match ends at least one block into a node"
        cut = k * self.block_bytes
        upper = Node(
            node.token_bytes[:cut],
            node.block_ids[:k],
            node.parent,
            namespace=node.namespace,
            children={},
            lock_ref=1 if node.lock_ref else 0,
            pin_ref=node.pin_ref,
            last_access=node.last_access,
        )
        node.parent.children[node.token_bytes[: self.block_bytes]] = upper
        if self.touched is not None:
            self.touched.update((node, upper, node.parent))
        inherit(upper, node)
        node.token_bytes, node.block_ids, node.parent = node.token_bytes[cut:], node.block_ids[k:], upper
        upper.children[node.token_bytes[: self.block_bytes]] = node
        if len(node.host_block_ids):  # a host copy splits with it
            upper.host_block_ids, node.host_block_ids = node.host_block_ids[:k], node.host_block_ids[k:]
            self.host.split_copy(node, upper)
        return upper

    # -- insertion --------------------------------------------------------------------------------

    def insert(self, start: Node, key: bytes, block_ids: BlockIds) -> tuple[Node, int]:
        """Add the full blocks of `key` (tokens below `start`) under `start`, and lock the deepest node now holding
        the prefix once for the caller (a publish moves its lock there; a new node is made locked, never listed as
        evictable in between).

        Returns that node and how many of `block_ids` (always the last ones) the tree took. Where the tree
        already holds a prefix it keeps its own blocks, and the caller's duplicates stay with the caller, freed
        once unused.
        """
        assert len(key) == len(block_ids) * self.block_bytes, "insert needs whole blocks"
        node, pos = start, 0
        while pos < len(key) and key[pos : pos + self.block_bytes] in node.children:  # else nothing more is known
            match = self.match(node, key[pos:])
            if not match.num_blocks:
                break
            node = self.split(match)
            pos += match.num_blocks * self.block_bytes
        if pos == len(key):
            self.lock(node)
            return node, 0
        new_ids = np.array(block_ids[pos // self.block_bytes :], dtype=np.int32)  # its own copy: the caller's changes
        first = key[pos : pos + self.block_bytes]
        self.host.drop_overlap(node, first)
        child = Node(key[pos:], new_ids, node, namespace=node.namespace, lock_ref=1, last_access=self.tick())
        if node.lock_ref == 0 and not node.children and node.parent is not None:
            self._unlist(node)
        node.children[first] = child
        if self.touched is not None:
            self.touched.update((node, child))
        self._count_cached(child.namespace, len(new_ids), evictable=False)  # locked from the start
        if self.observer is not None:
            self.observer.blocks_stored(child)
        self.lock(node)  # a locked child is one more holder of its parent
        return child, len(new_ids)

    def attach_loaded(self, node: Node) -> None:
        """A host-only node whose `block_ids` were just set (loaded back) joins its parent's device children,
        cached and evictable until the caller locks it; reported stored, as the device tier caches it again."""
        parent = node.parent
        assert parent is not None and len(node.block_ids) == len(node.host_block_ids), "load a whole host node"
        first = node.token_bytes[: self.block_bytes]
        del parent.host_children[first]
        if self.touched is not None:
            self.touched.update((node, parent))
        if parent.lock_ref == 0 and not parent.children and parent.parent is not None:
            self._unlist(parent)
        parent.children[first] = node
        self._list(node)
        self._count_cached(node.namespace, len(node.block_ids))
        if self.observer is not None:
            self.observer.blocks_stored(node)

    def _count_cached(self, namespace: str, n: int, evictable: bool = True) -> None:
        """`n` more cached blocks in `namespace`, unlocked (evictable) or not."""
        if evictable:
            self.num_evictable_blocks += n
        self.num_cached_blocks += n
        self.num_cached_blocks_in[namespace] = self.num_cached_blocks_in.get(namespace, 0) + n
        owner = owner_of(namespace)
        self.num_cached_blocks_of[owner] = self.num_cached_blocks_of.get(owner, 0) + n

    def _list(self, leaf: Node) -> None:
        """`leaf` joins the evictable leaves (and its owner's), under its current key."""
        self._evictable_leaves.add(leaf)
        owner = owner_of(leaf.namespace)
        listed = self._owner_leaves.get(owner)
        if listed is None:
            listed = self._owner_leaves[owner] = SortedList(key=lru_key)
        listed.add(leaf)

    def _unlist(self, leaf: Node) -> None:
        """`leaf` leaves the evictable leaves (and its owner's); an owner with none left is forgotten."""
        self._evictable_leaves.remove(leaf)
        owner = owner_of(leaf.namespace)
        listed = self._owner_leaves[owner]
        listed.remove(leaf)
        if not listed:
            del self._owner_leaves[owner]

    # -- locks ------------------------------------------------------------------------------------

    def lock(self, node: Node, count: int = 1) -> None:
        """Protect `node` and its ancestors from eviction (`count` holders at once).

        A node's lock_ref counts its own holders and its locked children, so the walk up stops at the first
        ancestor that was locked already: a fork, or a publish that moves a lock down its own path, walks only
        the nodes it newly locks, however deep the path. The root counts its namespace's holders too: a
        namespace lives while it holds a lock or a node.
        """
        now = self.tick()
        touched = self.touched
        while node.parent is not None:
            if touched is not None:
                touched.add(node)
            was = node.lock_ref
            if was == 0:
                self.num_evictable_blocks -= len(node.block_ids)
                if not node.children:
                    self._unlist(node)
            node.lock_ref = was + count
            node.last_access = now
            if was:
                return
            node, count = node.parent, 1
        node.lock_ref += count

    def unlock(self, node: Node, count: int = 1) -> None:
        """Drop `count` holders of `node`; the walk up goes on only while nodes unlock (see `lock`), each
        stamped with this access as it joins the evictable ones."""
        now = self.tick()
        touched = self.touched
        now_s = 0.0
        while node.parent is not None:
            if touched is not None:
                touched.add(node)
            node.lock_ref -= count
            assert node.lock_ref >= 0, "unlock without a matching lock"
            node.last_access = now
            if node.lock_ref:
                return
            now_s = now_s or self.policy.clock()
            stamp(node, now_s)
            self.num_evictable_blocks += len(node.block_ids)
            if not node.children:
                self._list(node)
            node, count = node.parent, 1
        node.lock_ref -= count
        self._drop_if_empty(node)

    def add_pin(self, node: Node, delta: int) -> None:
        """Count `node`'s path as pinned (delta +1) or not (-1); the caller also locks/unlocks it."""
        while node.parent is not None:
            if self.touched is not None:
                self.touched.add(node)
            before = node.pin_ref
            node.pin_ref += delta
            if (before == 0) != (node.pin_ref == 0):
                self.num_pinned_blocks += len(node.block_ids) if delta > 0 else -len(node.block_ids)
            node = node.parent

    # -- eviction ---------------------------------------------------------------------------------

    def evict(self, num_blocks: int, owner: str | None = None) -> npt.NDArray[np.int32]:
        """Drop at least `num_blocks` cached blocks (fewer if not that many are evictable), LRU first.

        A leaf larger than what is still needed loses only its tail blocks (a slice), so no more of the
        cache is dropped than asked for. With `owner`, only leaves of its namespaces are dropped (a tenant
        over its cache share), found on its own list: no other owner's leaf is looked at.
        """
        leaves = self._evictable_leaves

        def pick(need: int) -> Node | None:
            if need <= 0 or not leaves:
                return None
            if owner is None:
                return leaves.first()
            own = self._owner_leaves.get(owner)
            return own[0] if own else None

        return self._evict(num_blocks, pick)

    def evict_expired(self, now: float) -> npt.NDArray[np.int32]:
        """Drop the unlocked leaves whose TTL ran out by `now` (policy clock), and their parents whose TTL ran out
        with them: a TTL's hosted-API meaning, for a caller that wants it (`radixkv replay --ttl`)."""
        expired = self._evictable_leaves.expire(now)

        def pick(need: int) -> Node | None:
            while expired:
                leaf = expired.pop()
                if leaf.evict_key is not None and not leaf.children:
                    parent = leaf.parent
                    if parent is not None and parent.parent is not None and 0 < parent.retain_until_s <= now:
                        expired.append(parent)  # goes once it is a leaf
                    return leaf
            return None

        return self._evict(1 << 62, pick)

    def _evict(self, num_blocks: int, pick: Callable[[int], Node | None]) -> npt.NDArray[np.int32]:
        """Drop leaves `pick(blocks still needed)` names (a tail, where a leaf holds more) until it names none."""
        freed: list[npt.NDArray[np.int32]] = []
        num_freed = 0
        removed: dict[str, list[npt.NDArray[np.int32]]] = {}  # one report per namespace per call
        evict_leaf = self.host.evict_leaf
        while (leaf := pick(num_blocks - num_freed)) is not None:
            self.num_leaves_visited += 1
            if self.touched is not None:
                self.touched.add(leaf)
            dropped = evict_leaf(leaf, num_blocks - num_freed)
            freed.append(dropped)
            num_freed += len(dropped)
            removed.setdefault(leaf.namespace, []).append(dropped)
        for namespace, runs in removed.items():
            block_ids = runs[0] if len(runs) == 1 else np.concatenate(runs)
            left = self.num_cached_blocks_in[namespace] - len(block_ids)
            if left:
                self.num_cached_blocks_in[namespace] = left
            else:
                del self.num_cached_blocks_in[namespace]
            owner_left = self.num_cached_blocks_of[owner_of(namespace)] - len(block_ids)
            if owner_left:
                self.num_cached_blocks_of[owner_of(namespace)] = owner_left
            else:
                del self.num_cached_blocks_of[owner_of(namespace)]
            if self.observer is not None:
                self.observer.blocks_removed(namespace, block_ids)
        self.num_evictable_blocks -= num_freed
        self.num_cached_blocks -= num_freed
        if len(freed) == 1:  # the usual case: one leaf trimmed
            return freed[0]
        return np.concatenate(freed) if freed else NO_BLOCKS

    def unlist_leaf(self, leaf: Node) -> None:
        """An evictable leaf leaves the LRU list (the host tier is evicting it)."""
        self._unlist(leaf)

    def drop_leaf(self, leaf: Node, need: int) -> npt.NDArray[np.int32]:
        """Drop an evictable leaf's blocks, or only its tail when it holds more than `need` (trimmed in place: it
        keeps its key and its place); returns them. What eviction does with no host tier to move them to."""
        if len(leaf.block_ids) > need:
            keep = len(leaf.block_ids) - need
            dropped, leaf.block_ids = leaf.block_ids[keep:], leaf.block_ids[:keep]
            leaf.token_bytes = leaf.token_bytes[: keep * self.block_bytes]
            self._evictable_leaves.relist(leaf)  # a key may read its tail (the oracle's next use)
            return dropped
        self._unlist(leaf)
        self.unlink(leaf, to_host=False)
        return leaf.block_ids

    def unlink(self, leaf: Node, to_host: bool) -> None:
        """Take an evicted leaf off the device tier: gone, or (`to_host`) moved among its parent's host children.
        Its parent may become an evictable leaf."""
        parent = leaf.parent
        assert parent is not None
        first = leaf.token_bytes[: self.block_bytes]
        del parent.children[first]
        if self.touched is not None:
            self.touched.add(parent)
        if to_host:
            parent.host_children[first] = leaf
        else:
            leaf.parent = None
        if not parent.children and parent.lock_ref == 0:
            if parent.parent is None:
                self._drop_if_empty(parent)
            else:
                self._list(parent)

    def _drop_if_empty(self, root: Node) -> None:
        """Forget a namespace with nothing cached and no holder, so namespaces cannot pile up."""
        if root.lock_ref == 0 and not root.children and not root.host_children:
            if self.roots.get(root.namespace) is root:
                del self.roots[root.namespace]

    def drop_empty_roots(self) -> None:
        """After a refused request: forget namespaces it created and left empty."""
        for root in list(self.roots.values()):
            self._drop_if_empty(root)

    # -- inspection -------------------------------------------------------------------------------

    def nodes(self) -> Iterator[tuple[str, Node]]:
        """Every non-root node with its namespace, parents before children."""
        for namespace, root in self.roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield namespace, node
                stack.extend(node.children.values())

    def tree_block_ids(self) -> npt.NDArray[np.int32]:
        """Every cached block, node by node (for invariant recounts)."""
        return np.concatenate([NO_BLOCKS, *(node.block_ids for _, node in self.nodes())])

    def evictable_leaves(self) -> list[Node]:
        """In eviction order."""
        return list(self._evictable_leaves)

    def evictable_leaves_by_owner(self) -> dict[str, list[Node]]:
        """Each owner's evictable leaves, least recently used first (for invariant checks)."""
        return {owner: list(leaves) for owner, leaves in self._owner_leaves.items()}

    def check_order(self, listed: list[Node]) -> None:
        """Raise AssertionError where `listed` (the evictable leaves) breaks the policy's order."""
        if type(self.policy) is EvictionPolicy:  # plain LRU: the order is the leaves' LRU keys
            keys = [lru_key(n) for n in listed]
            assert keys == sorted(keys) or self.policy._retained or self.policy._doomed, (
                "evictable leaf list out of LRU order: a listed node's last_access was written"
            )
        self.policy.check(listed)

    def is_listed_evictable(self, node: Node) -> bool:
        """Is `node` on the evictable list, found under its current LRU key? (O(log n), for the audit.)"""
        return node in self._evictable_leaves

    @property
    def num_listed_evictable(self) -> int:
        return len(self._evictable_leaves)

    def count_restored(self, node: Node) -> None:
        """A rebuilt node (restart) counts as cached, and evictable when unlocked."""
        self._count_cached(node.namespace, len(node.block_ids), evictable=node.lock_ref == 0)

    def list_evictable(self, node: Node) -> None:
        """A rebuilt node (restart) joins the evictable list."""
        self._list(node)

    def relist(self, node: Node) -> None:
        """A listed leaf's retention changed: it moves to its new place in the order."""
        if node.evict_key is not None:
            self._evictable_leaves.relist(node)


class DropEvicted:
    """The tree's `HostHook` while no host tier is plugged in (a pool without one, or with a tier of no blocks):
    evicted blocks are dropped, and there is no host copy to split nor host-only child to drop."""

    __slots__ = ("evict_leaf",)

    def __init__(self, tree: RadixTree) -> None:
        self.evict_leaf = tree.drop_leaf

    def drop_overlap(self, parent: Node, first_block: bytes) -> None:
        pass

    def split_copy(self, node: Node, upper: Node) -> None:
        pass


# -- from tree/namespaces.py (merged, issue 41: one concept, one module):
# Namespaces: hits never cross them. A name is checked once, when it first appears.

DEFAULT_NAMESPACE = "default"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:/@=+-]{1,128}")


def check_namespace(namespace: str, field: str = "namespace") -> None:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise InvalidArgument(field, "must be 1-128 characters of A-Z a-z 0-9 _ . : / @ = + -")


def namespace_root(tree: RadixTree, namespace: str, max_namespaces: int, field: str = "namespace") -> Node:
    """The root of `namespace`, created if the name is valid and the cap allows one more."""
    root = tree.roots.get(namespace)
    if root is not None:
        return root
    check_namespace(namespace, field)
    if len(tree.roots) >= max_namespaces:
        raise LimitExceeded("max_namespaces", len(tree.roots) + 1, max_namespaces)
    return tree.root(namespace)


def existing_root(tree: RadixTree, namespace: str) -> Node | None:
    """The root of `namespace` if it exists (None after checking the name): for probes that create nothing."""
    root = tree.roots.get(namespace)
    if root is None:
        check_namespace(namespace)
    return root
