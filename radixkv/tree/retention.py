"""Retention hints on cached prefixes: a TTL (refreshed on use unless asked otherwise), a priority, an end of session.

Hints are soft: they order eviction (`radixkv.tree.eviction`), never refuse it. A prefix kept by a TTL or a
positive priority is evicted only after every leaf without one, and its priority decays to the default when its
TTL runs out; an ended session's own branch (the part no other branch or holder shares) goes first, as does a
negative priority. Hard pins stay what they were (`radixkv.tree.pins`, bounded by the pool's pinned share).
A hint is written on each node of the prefix's path (`apply`); a use stamps the node (`stamp`, at unlock).
"""

from __future__ import annotations

import dataclasses
import math

from radixkv.errors import InvalidArgument
from radixkv.tree.radix_node import Node

DOOMED, NORMAL, RETAINED = 0, 1, 2  # the eviction tiers, first to go first
MAX_TTL_S = 7 * 24 * 3600.0  # a week: longer is a pin, which has its own bound
MAX_PRIORITY = 1_000_000


@dataclasses.dataclass(frozen=True, slots=True)
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
        node.retain_until_s, node.retain_ttl_s, node.retain_priority
    )  # fmt: skip
    upper.ended = node.ended
