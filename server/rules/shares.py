"""Tenant shares: every server-wide limit split evenly between the configured tenants.

A server-wide limit alone lets one tenant take all of it (every session, every namespace, every
stream slot) and lock the others out. So each tenant may hold at most its share, `limit //
num_tenants` (at least 1), and however the others behave, it can always get that much. Without
auth there is one caller and its share is the whole limit.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Shares:
    num_tenants: int  # 0 or 1: auth off, or one tenant: no split

    def of(self, limit: int) -> int:
        """One tenant's share of `limit`."""
        if self.num_tenants <= 1:
            return limit
        return max(1, limit // self.num_tenants)
