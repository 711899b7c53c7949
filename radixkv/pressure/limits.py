"""Caps that keep one caller from taking the pool."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Caps that keep one caller from taking the pool. Refused with `LimitExceeded` naming the cap."""

    max_tokens_per_request: int = 1 << 20
    max_fork_children: int = 1024
    max_namespaces: int = 4096
    max_pinned_fraction: float = 0.25
