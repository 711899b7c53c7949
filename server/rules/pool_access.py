"""Which tenants may use a pool, and who may map its memory: no tenant gets a writable mapping of another's blocks.

A pool's memory mapping (GetPool's handle, `map_pools`) reads and writes every block of the pool, so it is
granted only to a `map_pools` tenant that the pool serves alone: a pool naming that tenant as its only
`tenants` entry (or, unnamed, a server with that one tenant). Another tenant may not use such a pool at all,
and a pool shared by several tenants is never mapped: its K/V moves only through the server's own calls.
With auth off every caller is the one trusted tenant and every pool may be mapped.
"""

from __future__ import annotations

from radixkv.errors import PermissionDenied
from radixkv.server.rules.config import ServerConfig
from radixkv.server.rules.tenants import Tenant


class PoolAccess:
    def __init__(self, config: ServerConfig) -> None:
        """ValueError (the server refuses to start) for a pool naming a tenant that is not configured."""
        everyone = frozenset(t.name for t in config.tenants)
        for pool in config.pools:
            unknown = sorted(set(pool.tenants) - everyone)
            if unknown:
                raise ValueError(f"pool {pool.name!r}: tenants {unknown} are not configured tenants")
        self.auth = bool(config.tenants)
        self.users = {p.name: frozenset(p.tenants) or everyone for p in config.pools}

    def check_use(self, pool: str, caller: Tenant) -> None:
        """PermissionDenied naming the pool unless the caller is one of the tenants it serves."""
        if self.auth and caller.name not in self.users[pool]:
            raise PermissionDenied(
                f"tenant {caller.name!r} may not use pool {pool!r} (its tenants: {sorted(self.users[pool])})",
                field="pool", pool=pool, tenant=caller.name,
            )  # fmt: skip

    def check_map(self, pool: str, caller: Tenant) -> None:
        """PermissionDenied naming the pool unless the caller may map memory and is the pool's only tenant."""
        if not caller.map_pools:
            raise PermissionDenied(
                f"tenant {caller.name!r} may not map pool memory (map_pools)", field="pool", tenant=caller.name
            )
        others = sorted(self.users[pool] - {caller.name}) if self.auth else []
        if others:
            raise PermissionDenied(
                f"pool {pool!r} also serves tenants {others}: its memory is mapped only by a tenant it serves alone "
                f'(a mapping writes every block; give the tenant its own pool, tenants = ["{caller.name}"])',
                field="pool", pool=pool, tenant=caller.name,
            )  # fmt: skip
