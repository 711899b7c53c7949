"""Which unlocked leaf the radix tree evicts first: the eviction policies, each an ordered set of leaves.

The tree lists a leaf here when it becomes evictable and takes it out when it is locked or evicted; a policy
only orders (SGLang's "eviction policy is just a priority key"). The key a leaf was listed under is stored on
it (`Node.evict_key`), so a key may read fields that change while the leaf is listed (its depth, after a
split) without breaking removal. The policies (`make_policy`):

- `lru`: least recently used first (the tree clock).
- `slru`: SGLang's segmented LRU: leaves hit fewer than `threshold` times go before the others, LRU within.
- `tlru`: SGLang's tail-optimized LRU (arXiv:2510.15152): a leaf that starts past the branch's high-water
  depth plus `q_hat` minus `xi` tokens cannot push the branch's next prefill over `xi`, so it goes first.
- `agent` (the default for agent traffic): superseded branches first, then each branch's predicted next use
  from its own typical pause (`AgentPolicy`).
- an oracle (`KeyedPolicy`): a key the caller computes (Belady's MIN in `radixkv replay`).

Retention hints (`radixkv.tree.eviction`) sit above every policy, in tiers: leaves of an ended session (or of a
negative priority) go before all others; leaves kept by a TTL or a positive priority after all others, until
the TTL runs out (`first` moves an expired one back among the others). Soft: nothing is ever refused for them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

from sortedcontainers import SortedList

from radixkv.errors import InvalidArgument
from radixkv.tree.radix_node import Node

# -- from tree/retention.py (merged, issue 41: one concept, one module):
# Retention hints on cached prefixes: a TTL (refreshed on use unless asked otherwise), a priority, an end of session.
#
# Hints are soft: they order eviction (`radixkv.tree.eviction`), never refuse it. A prefix kept by a TTL or a
# positive priority is evicted only after every leaf without one, and its priority decays to the default when its
# TTL runs out; an ended session's own branch (the part no other branch or holder shares) goes first, as does a
# negative priority. Hard pins stay what they were (`radixkv.tree.pins`, bounded by the pool's pinned share).
# A hint is written on each node of the prefix's path (`apply`); a use stamps the node (`stamp`, at unlock).

DOOMED, NORMAL, RETAINED = 0, 1, 2  # the eviction tiers, first to go first
MAX_TTL_S = 7 * 24 * 3600.0  # a week: longer is a pin, which has its own bound
MAX_PRIORITY = 1_000_000


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    """What a caller asks for a prefix. `ttl_s` 0: no TTL; `refresh`: each use restarts the TTL (the hosted APIs'
    prompt caching); `priority`: higher stays longer, negative goes first; `end_session`: the session is over,
    its own branch may go first."""

    ttl_s: float = 0.0
    priority: int = 0
    refresh: bool = True
    end_session: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttl_s) and 0 <= self.ttl_s <= MAX_TTL_S):
            raise InvalidArgument("retention.ttl_s", f"must be in [0, {MAX_TTL_S:.0f}] seconds, got {self.ttl_s}")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidArgument(
                "retention.priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority}"
            )

    @property
    def is_default(self) -> bool:
        return self == NO_RETENTION


NO_RETENTION = Retention()


def tier(node: Node, now: float) -> int:
    """The eviction tier `node` lists in at `now` (read only when it has a deadline)."""
    if node.ended or node.retain_priority < 0:
        return DOOMED
    if node.retain_until_s:
        return RETAINED if node.retain_until_s > now else NORMAL
    return RETAINED if node.retain_priority > 0 else NORMAL


def stamp(node: Node, now: float) -> None:
    """A use of `node` ended at `now`: its branch's typical pause (`gap_s`: a moving geometric mean of 1 + each
    pause between uses, half the newest, so one long break does not make a busy session look idle; a new node
    starts from its parent's), its count, and its TTL restarted where it refreshes."""
    parent = node.parent
    previous = node.used_s or (parent.used_s if parent is not None else 0.0)
    typical = node.gap_s if node.gap_s >= 0 or parent is None else parent.gap_s
    if previous:
        pause = now - previous
        node.gap_s = pause if typical < 0 else math.sqrt((1.0 + pause) * (1.0 + typical)) - 1.0
    else:
        node.gap_s = typical
    node.used_s = now
    node.num_uses += 1
    if node.retain_ttl_s:
        node.retain_until_s = now + node.retain_ttl_s
    elif node.retain_until_s and node.retain_until_s <= now:  # expired while locked: back to the default
        node.retain_until_s, node.retain_priority = 0.0, 0
    node.ended = False  # used again: the session was not over


def apply(path: list[Node], retention: Retention, now: float) -> list[Node]:
    """Write `retention` on the nodes of a cached path (top-down, deepest last); returns the nodes changed.

    An end of session marks only the path's own tail: from the deepest node up to (not including) the first
    node another branch or a live holder shares.
    """
    if retention.end_session:
        own: list[Node] = []
        for node in reversed(path):
            if node.lock_ref or node.pin_ref or len(node.children) > (1 if own else 0):
                break  # a live holder, a pin or another branch shares it
            own.append(node)
        for node in own:
            node.ended = True
        return own
    for node in path:
        if retention.ttl_s:
            node.retain_until_s = max(node.retain_until_s, now + retention.ttl_s)
            node.retain_ttl_s = retention.ttl_s if retention.refresh else 0.0
        node.retain_priority = retention.priority
        node.ended = False
    return path


def describe(node: Node, now: float) -> dict[str, float | int | bool]:
    """A node's retention as Describe and explain show it."""
    return {
        "ttl_left_s": max(0.0, node.retain_until_s - now) if node.retain_until_s else 0.0,
        "refresh_s": node.retain_ttl_s,
        "priority": node.retain_priority,
        "ended": node.ended,
    }


def inherit(upper: Node, node: Node) -> None:
    """A split made `upper` the head of `node`: it was used, and is retained, exactly as `node` was."""
    upper.used_s, upper.gap_s, upper.num_uses, upper.high_water = node.used_s, node.gap_s, node.num_uses, 0
    upper.retain_until_s, upper.retain_ttl_s, upper.retain_priority = (
        node.retain_until_s,
        node.retain_ttl_s,
        node.retain_priority,
    )
    upper.ended = node.ended


__all__ = ["POLICIES", "EvictionPolicy", "KeyedPolicy", "make_policy"]


def lru_key(node: Node) -> tuple[int, int]:
    """The evictable lists' order: least recently accessed first, node id breaking ties."""
    return (node.last_access, node.node_id)


POLICIES = ("agent", "lru", "slru", "tlru")


Key = tuple[Any, ...]


def _stored(node: Node) -> Key:
    assert node.evict_key is not None, "a listed leaf has its key"
    return node.evict_key


def _until(node: Node) -> float:
    return float(_stored(node)[2])  # the deadline it was listed with (a hint may write a new one before relisting)


def _node(item: object) -> Node:
    assert isinstance(item, Node), "the lists hold nodes"
    return item


class EvictionPolicy:
    """The evictable leaves in eviction order (LRU here; a subclass changes `key`, or the normal tier's lists).

    `first()` is the next victim; iteration goes in eviction order (the normal tier's, approximately, for a
    policy with more than one list). `clock` (seconds) stamps each use (`radixkv.tree.eviction.stamp`).
    """

    name = "lru"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._normal: SortedList = SortedList(key=_stored)
        self._doomed: SortedList = SortedList(key=_stored)
        self._retained: SortedList = SortedList(key=_stored)
        self._expiring: SortedList = SortedList(key=_until)  # retained leaves with a deadline, soonest first

    def key(self, node: Node) -> Key:
        return lru_key(node)

    # -- the normal tier (a policy with its own lists overrides these three) ----------------------------------

    def add_normal(self, node: Node) -> None:
        node.evict_key = (NORMAL, *self.key(node))
        self._normal.add(node)

    def remove_normal(self, node: Node) -> None:
        self._normal.remove(node)

    def first_normal(self) -> Node | None:
        return _node(self._normal[0]) if self._normal else None

    def iter_normal(self) -> Iterator[Node]:
        return iter(self._normal)

    def num_normal(self) -> int:
        return len(self._normal)

    # -- the tiers --------------------------------------------------------------------------------------------

    def add(self, node: Node) -> None:
        t = tier(node, self.clock() if node.retain_until_s else 0.0)
        if t == NORMAL:
            self.add_normal(node)
        elif t == DOOMED:
            node.evict_key = (DOOMED, node.retain_priority, *lru_key(node))
            self._doomed.add(node)
        else:
            node.evict_key = (RETAINED, node.retain_priority, node.retain_until_s or float("inf"), *lru_key(node))
            self._retained.add(node)
            if node.retain_until_s:
                self._expiring.add(node)  # after the key: `_until` reads it

    def remove(self, node: Node) -> None:
        t = _stored(node)[0]
        if t == NORMAL:
            self.remove_normal(node)
        elif t == DOOMED:
            self._doomed.remove(node)
        else:
            self._retained.remove(node)
            if _until(node) != float("inf"):
                self._expiring.remove(node)
        node.evict_key = None

    def discard(self, node: Node) -> None:
        if node.evict_key is not None:
            self.remove(node)

    def relist(self, node: Node) -> None:
        """A listed leaf's retention or tail changed: list it again under its new key."""
        self.remove(node)
        self.add(node)

    def first(self) -> Node | None:
        if self._doomed:
            return _node(self._doomed[0])
        if self._expiring:
            self.expire(self.clock())
        node = self.first_normal()
        return node if node is not None else (_node(self._retained[0]) if self._retained else None)

    def expire(self, now: float) -> list[Node]:
        """Move the retained leaves whose deadline passed back among the others; returns them."""
        expired = []
        while self._expiring and _until(self._expiring[0]) <= now:
            node = self._expiring[0]
            self.remove(node)
            node.retain_until_s, node.retain_priority = 0.0, 0  # an expired priority decays to the default
            self.add(node)
            expired.append(node)
        return expired

    def __contains__(self, node: Node) -> bool:
        t = node.evict_key[0] if node.evict_key is not None else None
        if t is None:
            return False
        lists = {DOOMED: self._doomed, RETAINED: self._retained}
        return node in lists[t] if t in lists else self.contains_normal(node)

    def contains_normal(self, node: Node) -> bool:
        return node in self._normal

    def __len__(self) -> int:
        return len(self._doomed) + self.num_normal() + len(self._retained)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Node]:
        return chain(self._doomed, self.iter_normal(), self._retained)

    def check(self, listed: list[Node]) -> None:
        """Raise AssertionError when a listed leaf is out of its tier's order."""
        for sub in (self._doomed, self._retained):
            keys = [n.evict_key for n in sub]
            assert keys == sorted(keys), f"{self.name}: a retention tier is out of order"
        del listed  # the LRU order of a plain tree is checked by `RadixTree.check_order`


class KeyedPolicy(EvictionPolicy):
    """A policy whose normal order is one key per leaf, computed by `key_fn` when the leaf is listed."""

    def __init__(self, name: str, key_fn: Callable[[Node], Key], clock: Callable[[], float] = time.monotonic):
        super().__init__(clock)
        self.name, self.key_fn = name, key_fn

    def key(self, node: Node) -> Key:
        return self.key_fn(node)


class SLRU(EvictionPolicy):
    """Probationary (hit fewer than `threshold` times) before protected; LRU within each segment."""

    name = "slru"

    def __init__(self, threshold: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.threshold = threshold

    def key(self, node: Node) -> Key:
        return (node.num_uses - 1 >= self.threshold, *lru_key(node))  # the first use put it in the tree


def depth_blocks(node: Node) -> int:
    """Blocks above `node` on its path (a walk to the root)."""
    depth, parent = 0, node.parent
    while parent is not None:
        depth += len(parent.block_ids)
        parent = parent.parent
    return depth


class TLRU(EvictionPolicy):
    """Tail-optimized LRU, in tokens: `xi`, the prefill a turn may recompute within its latency target;
    `q_hat`, the next prompt's expected new tokens. The branch's history is the leaf's high-water end."""

    name = "tlru"

    def __init__(
        self, block_size: int, *, xi: int = 16384, q_hat: int = 2048, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(clock)
        self.block_size, self.xi, self.q_hat = block_size, xi, q_hat

    def key(self, node: Node) -> Key:
        start = depth_blocks(node)
        node.high_water = max(node.high_water, start + len(node.block_ids))  # a trimmed tail keeps it
        budget = max(0, node.high_water * self.block_size + self.q_hat - self.xi)
        return (start * self.block_size < budget, *lru_key(node))


SUPERSEDED, OVERDUE = -2.0, -1.0  # a normal-tier key's second field for the agent policy's other two lists


class AgentPolicy(EvictionPolicy):
    """Predicts each leaf's next use from its branch's typical pause, and evicts the leaf needed last.

    An agent session re-sends its whole context every few seconds while tools run, then pauses for minutes
    while a person reads, then comes back or ends; all its cached prefix is reused at its next request. So a
    leaf last used at `used_s` in a branch whose typical pause is `gap_s` (`radixkv.tree.retention.stamp`) is due
    at `used_s + gap_s` (`default_gap_s` where nothing is known; at most `max_gap_s`: a longer pause is a person's,
    whose length says little, so such branches keep LRU's order among themselves). Three lists, first to go first:

    - superseded leaves: a session rewrote (compacted) its context, so its new request left the old branch at a
      node that had no other child; the old tail is almost never sent again. A node with more children is a
      prefix many sessions share (the system prompt and tools): nothing below it counts as superseded, and a
      third child takes back what the second marked (two sessions on one prompt look like one rewrite).
    - leaves still due (the one due last goes first: it holds capacity longest for one hit), and overdue ones,
      whose expected wait grows with how long they have been idle (`now + (now - used_s)`; oldest first). The
      victim is whichever of the two heads is expected back later.

    LRU is the case of equal pauses with nobody overdue; unlike it, a session that comes back every few seconds
    keeps its context while one that paused for minutes gives way.
    """

    name = "agent"

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, default_gap_s: float = 30.0, max_gap_s: float = 60.0
    ) -> None:
        super().__init__(clock)
        self.default_gap_s, self.max_gap_s = default_gap_s, max_gap_s
        self._overdue: SortedList = SortedList(key=_stored)  # _normal holds the leaves still due
        self._superseded: SortedList = SortedList(key=_stored)

    def add_normal(self, node: Node) -> None:
        parent = node.parent
        if parent is not None and parent.parent is not None and len(parent.children) == 2:
            (other,) = (child for child in parent.children.values() if child is not node)
            if other.used_s > node.used_s:  # this leaf is the old branch
                self._add_superseded(node)
                return
            key = other.evict_key
            if key is not None and key[0] == NORMAL and key[1] != SUPERSEDED and other.used_s < node.used_s:
                self.remove_normal(other)  # the old branch, listed before the new one was used
                self._add_superseded(other)
        elif parent is not None and parent.parent is not None and len(parent.children) == 3:  # shared after all
            for other in parent.children.values():
                key = other.evict_key
                if other is not node and key is not None and key[0] == NORMAL and key[1] == SUPERSEDED:
                    self._superseded.remove(other)
                    self._add_due(other)
        self._add_due(node)

    def _add_due(self, node: Node) -> None:
        gap = min(node.gap_s, self.max_gap_s) if node.gap_s >= 0 else self.default_gap_s
        node.evict_key = (NORMAL, node.used_s + gap, node.node_id)
        self._normal.add(node)

    def _add_superseded(self, node: Node) -> None:
        node.evict_key = (NORMAL, SUPERSEDED, node.used_s, node.node_id)
        self._superseded.add(node)

    def _list_of(self, node: Node) -> SortedList:
        second = _stored(node)[1]
        return self._superseded if second == SUPERSEDED else self._overdue if second == OVERDUE else self._normal

    def remove_normal(self, node: Node) -> None:
        self._list_of(node).remove(node)

    def contains_normal(self, node: Node) -> bool:
        return node in self._list_of(node)

    def first_normal(self) -> Node | None:
        if self._superseded:
            return _node(self._superseded[0])
        due, overdue = self._normal, self._overdue
        if not due and not overdue:
            return None
        now = self.clock()
        while due and _stored(due[0])[1] < now:  # no longer due: among the overdue, by when it was last used
            node = due.pop(0)
            node.evict_key = (NORMAL, OVERDUE, node.used_s, node.node_id)
            overdue.add(node)
        if not overdue:
            return _node(due[-1])
        if not due:
            return _node(overdue[0])
        latest_due, idlest = _node(due[-1]), _node(overdue[0])
        return idlest if 2 * now - idlest.used_s >= _stored(latest_due)[1] else latest_due

    def iter_normal(self) -> Iterator[Node]:
        return chain(self._superseded, self._overdue, reversed(self._normal))

    def num_normal(self) -> int:
        return len(self._superseded) + len(self._normal) + len(self._overdue)


def make_policy(
    name: str, block_size: int, clock: Callable[[], float] = time.monotonic, tokens_per_id: int = 1
) -> EvictionPolicy:
    """The policy named `name` (one of POLICIES) for a tree of `block_size`-token blocks, each token id standing
    for `tokens_per_id` model tokens (a trace of hashed 64-token blocks: TLRU's budgets are in model tokens)."""
    if name == "lru":
        return EvictionPolicy(clock)
    if name == "slru":
        return SLRU(clock=clock)
    if name == "tlru":
        return TLRU(block_size, xi=16384 // tokens_per_id, q_hat=2048 // tokens_per_id, clock=clock)
    if name == "agent":
        return AgentPolicy(clock)
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}")
