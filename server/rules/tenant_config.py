"""Tenant settings (`[tenants.NAME]` tables, of a config file or the `--auth-tokens` file), parsed strictly.

Every key is checked for its kind as TOML spells it, never coerced: `admin = "false"` is text, and
text read as a boolean is true, so a quoted flag would fail open (grant Debug, pool handles). A
setting of the wrong kind, out of range or unknown stops the server at start with the tenant and
the key named; `TenantConfig` checks itself, so a config built in code is held to the same rules.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

ANY_NAMESPACE = "*"
_TENANT_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TOKEN_RE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,4094}[\x21-\x7e])?")  # printable ASCII, as metadata carries it
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.:/@=+-]{1,128}")  # the core's names (radixkv.tree.radix_tree)
_MAX_SCOPED_NAMESPACE = 128  # with the tenant's prefix: the core's longest name
MAX_NAMESPACES_LISTED = 4096
_BOOLEANS = ("map_pools", "admin", "publish_kv_events")
_COUNTS = ("max_blocks", "max_cached_blocks")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    """A bearer token's owner: the namespaces it may use and its block quota per pool."""

    name: str
    token: str
    namespaces: tuple[str, ...] = (ANY_NAMESPACE,)
    max_blocks: int | None = None
    max_cached_blocks: int | None = None  # None: an even share of each pool's blocks (several tenants)
    map_pools: bool = False  # may map a pool's memory, read and write: only a pool this tenant alone uses
    admin: bool = False  # may call radixkv.v1.Debug (when served): it reads every tenant's blocks
    max_tokens_per_second: float | None = None  # token bucket charged prompt + max_new_tokens per open; None: none
    publish_kv_events: bool = True  # False: the tenant's blocks never enter a pool's KV-events stream

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TENANT_NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"tenant {self.name!r}: names are 1-64 characters of A-Z a-z 0-9 _ . - (they prefix namespaces)"
            )
        if not isinstance(self.token, str) or not _TOKEN_RE.fullmatch(self.token):
            raise ValueError(
                f"tenant {self.name!r}: token must be text of 1-4096 printable ASCII characters, no space at either end"
            )
        names = self.namespaces
        if not isinstance(names, tuple) or not names or len(names) > MAX_NAMESPACES_LISTED:
            raise ValueError(f"tenant {self.name!r}: namespaces must be a list of 1-{MAX_NAMESPACES_LISTED} names")
        for ns in names:
            if not isinstance(ns, str) or not (
                ns == ANY_NAMESPACE
                or (_NAMESPACE_RE.fullmatch(ns) and len(self.name) + 1 + len(ns) <= _MAX_SCOPED_NAMESPACE)
            ):
                raise ValueError(
                    f'tenant {self.name!r}: namespaces: {ns!r} is not "*" or a name of A-Z a-z 0-9 _ . : / @ = + - '
                    f"that fits {_MAX_SCOPED_NAMESPACE} characters after the tenant's name and a /"
                )
        for key in _COUNTS:
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"tenant {self.name!r}: {key} = {value!r} must be a whole number >= 0")
        rate = self.max_tokens_per_second
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf
        ):
            raise ValueError(f"tenant {self.name!r}: max_tokens_per_second = {rate!r} must be a number > 0")
        for key in _BOOLEANS:  # "false" as text must not read as True
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"tenant {self.name!r}: {key} = {getattr(self, key)!r} must be true or false")


TENANT_KEYS = (
    "token",
    "namespaces",
    "max_blocks",
    "max_cached_blocks",
    "map_pools",
    "admin",
    "max_tokens_per_second",
    "publish_kv_events",
)


def tenants_from_mapping(tables: Any) -> tuple[TenantConfig, ...]:
    """The `[tenants]` table's tenants, each checked (ValueError naming the tenant and the key)."""
    if not isinstance(tables, Mapping):
        raise ValueError(f"tenants must be a table of [tenants.NAME] tables, got {tables!r}")
    tenants = []
    for name, values in tables.items():
        if not isinstance(values, Mapping):
            raise ValueError(f"tenant {name!r}: must be a [tenants.{name}] table")
        unknown = set(values) - set(TENANT_KEYS)
        if unknown:
            raise ValueError(f"tenant {name!r}: unknown keys {sorted(unknown)}; known: {list(TENANT_KEYS)}")
        if "token" not in values:
            raise ValueError(f"tenant {name!r}: token is missing")
        namespaces = values.get("namespaces", [ANY_NAMESPACE])
        if not isinstance(namespaces, list):
            raise ValueError(f"tenant {name!r}: namespaces = {namespaces!r} must be a list of names")
        kept = {k: v for k, v in values.items() if k != "namespaces"}
        tenants.append(TenantConfig(name=name, namespaces=tuple(namespaces), **kept))
    return tuple(tenants)


def auth_tokens_tenants(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `--auth-tokens` file's `[tenants]` table: the file holds nothing else (a stray key is a typo)."""
    unknown = set(data) - {"tenants"}
    if unknown:
        raise ValueError(f"--auth-tokens file: unknown top-level keys {sorted(unknown)}; it holds [tenants.NAME] only")
    tenants = data.get("tenants", {})
    if not isinstance(tenants, Mapping):
        raise ValueError("--auth-tokens file: tenants must be a table of [tenants.NAME] tables")
    return tenants
