"""Retention hints and use stamps in a snapshot: what `radixkv.tree.eviction` keeps on each node.

Times are stored relative to the capture (a TTL's seconds left, a use's age), since the policy clock is
monotonic and starts again with the next process. A snapshot written before hints existed has no
"retention" entry and restores with none (every node unhinted, as then).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixkv.tree.radix_tree import Node


def capture_retention(nodes: list[Node], now: float) -> dict[str, Any]:
    """Columns in `nodes`' order (the snapshot's node order)."""
    return {
        "ttl_left_s": np.asarray(
            [max(0.0, n.retain_until_s - now) if n.retain_until_s else 0.0 for n in nodes], "<f8"
        ).tobytes(),
        "ttl_s": np.asarray([n.retain_ttl_s for n in nodes], "<f8").tobytes(),
        "priority": np.asarray([n.retain_priority for n in nodes], "<i4").tobytes(),
        "ended": np.asarray([n.ended for n in nodes], "u1").tobytes(),
        "used_age_s": np.asarray([now - n.used_s if n.used_s else -1.0 for n in nodes], "<f8").tobytes(),
        "gap_s": np.asarray([n.gap_s for n in nodes], "<f8").tobytes(),
        "num_uses": np.asarray([n.num_uses for n in nodes], "<i4").tobytes(),
    }


def restore_retention(nodes: list[Node], columns: dict[str, bytes] | None, now: float) -> None:
    """Write captured hints back on the rebuilt `nodes` before any is listed; None: an older snapshot."""
    if columns is None:
        return
    ttl_left = np.frombuffer(columns["ttl_left_s"], "<f8").tolist()
    ttl = np.frombuffer(columns["ttl_s"], "<f8").tolist()
    priority = np.frombuffer(columns["priority"], "<i4").tolist()
    ended = np.frombuffer(columns["ended"], "u1").tolist()
    used_age = np.frombuffer(columns["used_age_s"], "<f8").tolist()
    gap = np.frombuffer(columns["gap_s"], "<f8").tolist()
    num_uses = np.frombuffer(columns["num_uses"], "<i4").tolist()
    if not all(len(c) == len(nodes) for c in (ttl_left, ttl, priority, ended, used_age, gap, num_uses)):
        raise ValueError("retention columns and nodes of different lengths")
    for i, node in enumerate(nodes):
        node.retain_until_s = now + ttl_left[i] if ttl_left[i] > 0 else 0.0
        node.retain_ttl_s, node.retain_priority, node.ended = ttl[i], priority[i], bool(ended[i])
        node.used_s = now - used_age[i] if used_age[i] >= 0 else 0.0
        node.gap_s, node.num_uses = gap[i], num_uses[i]
