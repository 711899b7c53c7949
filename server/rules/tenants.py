"""Tenants: whose namespaces a caller may use, how they are scoped in the core, and its block quota.

With auth on, a tenant's namespace `chat` is `<tenant>/chat` in the core: each tenant's prefixes
live under their own roots, so tenant A's prompt never hits (or times) tenant B's cache, whatever
namespace names the two choose. Without auth every caller is `ANONYMOUS`, whose names pass through.
"""

from __future__ import annotations

import dataclasses

from radixkv.errors import PermissionDenied
from radixkv.kv_cache import DEFAULT_NAMESPACE
from radixkv.server.rules.tenant_config import ANY_NAMESPACE, TenantConfig
from radixkv.tree.radix_node import OWNER_SEPARATOR

SCOPE_SEPARATOR = OWNER_SEPARATOR  # a tenant's scoped namespaces are the core's owner's (per-owner eviction)


@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    namespaces: frozenset[str]
    max_blocks: int | None  # per pool, over the block tables of the tenant's live sequences
    map_pools: bool  # may receive pool handles: mapped memory holds every tenant's K/V
    admin: bool = False  # may call the Debug service
    max_cached_blocks: int | None = None  # per pool, over the tree's blocks in the tenant's namespaces
    max_tokens_per_second: float | None = None  # token bucket over opens' prompt + max_new_tokens, all pools

    @classmethod
    def from_config(cls, config: TenantConfig) -> Tenant:
        return cls(
            config.name,
            frozenset(config.namespaces),
            config.max_blocks,
            config.map_pools,
            config.admin,
            config.max_cached_blocks,
            config.max_tokens_per_second,
        )

    @property
    def prefix(self) -> str:
        return f"{self.name}{SCOPE_SEPARATOR}" if self.name else ""

    def scope(self, namespace: str, field: str = "namespace") -> str:
        """The core's name for the caller's `namespace` ("" means default).

        Raises:
            PermissionDenied: the tenant may not use this namespace.
        """
        namespace = namespace or DEFAULT_NAMESPACE
        if not self.name:
            return namespace
        if ANY_NAMESPACE not in self.namespaces and namespace not in self.namespaces:
            raise PermissionDenied(
                f"tenant {self.name!r} may not use namespace {namespace!r}",
                field=field,
                namespace=namespace,
                tenant=self.name,
            )
        return self.prefix + namespace

    def unscope(self, core_namespace: str) -> str:
        return core_namespace[len(self.prefix) :]

    def owns(self, core_namespace: str) -> bool:
        return core_namespace.startswith(self.prefix)


ANONYMOUS = Tenant("", frozenset({ANY_NAMESPACE}), None, True, True)  # auth off: every caller is trusted
