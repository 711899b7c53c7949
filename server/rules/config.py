"""Server configuration: named pools, tenants and limits, from command-line flags or a TOML file.

A TOML file holds server options at the top level, one `[pools.NAME]` table per pool and one
`[tenants.NAME]` table per tenant (the `--auth-tokens` file holds only `[tenants.*]` tables):

    max_message_bytes = 67108864
    [pools.default]
    num_layers = 32
    num_kv_heads = 8
    head_dim = 128
    memory_fraction = 0.8   # or num_blocks = 4096, or memory_bytes = 17179869184
    host_num_blocks = 16384 # optional host tier (or host_memory_bytes): evicted prefixes move there
    tenants = ["acme"]      # who may use it (absent: every tenant); map_pools maps only a pool one tenant uses
    [tenants.acme]
    token = "secret"
    namespaces = ["chat", "code"]   # "*": any namespace
    max_blocks = 2048               # per pool; absent: no quota
    max_cached_blocks = 4096        # per pool; absent: an even share of the pool when tenants are several
    map_pools = true                # may map (GetPool) the memory of a pool it alone uses (co-located workers)
    admin = false                   # may call the Debug service (--debug-rpc): it reads every tenant's blocks
    max_tokens_per_second = 5000    # token bucket: each open costs prompt + max_new_tokens; absent: no budget

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
from collections.abc import Mapping
from typing import Any

from radixkv.kv_cache import Limits
from radixkv.memory.layout import DTYPE_BYTES, PoolLayout, canonical_dtype
from radixkv.planning.model_shape import ModelShape
from radixkv.server.events import kv_events_config
from radixkv.server.events.kv_events_config import KVEventsConfig
from radixkv.server.rules.checks import DEFAULT_MAX_STEPS_PER_FRAME, message_bytes_needed
from radixkv.server.rules.disk_config import DISK_KEYS, with_disk
from radixkv.server.rules.sessions import DEFAULT_MAX_BYTES, DEFAULT_MAX_SESSION_BYTES
from radixkv.server.rules.tenant_config import TenantConfig, tenants_from_mapping
from radixkv.tree.eviction import POLICIES

DEFAULT_POOL = "default"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """One pool: its layout, device, and size by exactly one of num_blocks, memory_bytes, memory_fraction."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "float16"
    device: str = "cpu"
    num_blocks: int | None = None
    memory_bytes: int | None = None
    memory_fraction: float | None = None  # of the device's free memory, as vLLM's --gpu-memory-utilization
    reserved_bytes: int = 0  # kept free of KV (the worker's weights and activations), off memory_fraction's budget
    limits: Limits = Limits()
    kv_events: KVEventsConfig | None = None  # vLLM's KV-events stream of this pool (`kv_events_*` keys); None: off
    tombstones: int = 65_536  # evicted block hashes remembered, so Match(explain) can say EVICTED
    # The host tier (same layout in host memory; pinned when CUDA is present), by at most one of these; none: no tier.
    host_num_blocks: int | None = None
    host_memory_bytes: int | None = None
    disk_dir: str | None = None
    disk_capacity: str | None = None
    disk_prefill_tokens_per_s: float | None = None
    reserve_fraction: float = 1.0  # of a budgeted open's growth reserved at admission (radixkv.sequences.admission)
    watermark_fraction: float = 0.01  # of the pool kept free of budgeted admissions
    eviction_policy: str = "lru"  # which unlocked prefix goes first (radixkv.tree.eviction; "agent" for agents)
    tenants: tuple[str, ...] = ()  # who may use it (empty: every tenant); mapped only by one alone: tenants.PoolAccess

    def __post_init__(self) -> None:
        if self.host_num_blocks is not None and self.host_memory_bytes is not None:
            raise ValueError(f"pool {self.name!r}: give at most one of host_num_blocks, host_memory_bytes")
        if self.tombstones < 0:
            raise ValueError(f"pool {self.name!r}: tombstones must be >= 0")
        sizes = [f for f in ("num_blocks", "memory_bytes", "memory_fraction") if getattr(self, f) is not None]
        if len(sizes) != 1:
            raise ValueError(
                f"pool {self.name!r}: give exactly one of num_blocks, memory_bytes, memory_fraction (got "
                f"{sizes or 'none'})"
            )
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"pool {self.name!r}: memory_fraction must lie in (0, 1]")
        if not 0 <= self.reserve_fraction <= 1:
            raise ValueError(f"pool {self.name!r}: reserve_fraction must lie in [0, 1]")
        if not 0 <= self.watermark_fraction < 1:
            raise ValueError(f"pool {self.name!r}: watermark_fraction must lie in [0, 1)")
        if self.eviction_policy not in POLICIES:
            raise ValueError(
                f"pool {self.name!r}: eviction_policy must be one of {', '.join(POLICIES)}, "
                f"got {self.eviction_policy!r}"
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Everything `create_server` needs besides the address. Without tenants, auth is off."""

    pools: tuple[PoolConfig, ...]
    tenants: tuple[TenantConfig, ...] = ()
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    session_ttl_seconds: float = 30.0
    max_session_ttl_seconds: float = 3600.0
    max_sessions: int = 10_000
    # Per session and pool: each live sequence costs server memory even when its blocks are shared (forks).
    max_sequences_per_session: int = 4096
    max_pins_per_session: int = 256  # per session and pool; a pin keeps its prefix's tokens in server memory
    max_sequences: int = 1 << 18  # live sequences per pool, all sessions together
    # Request-id windows (server/rules/sessions.py) keep recent results for retries: bytes, all sessions together (a
    # tenant's share of it bounds the tenant's), and per session.
    max_request_window_bytes: int = DEFAULT_MAX_BYTES
    max_request_window_bytes_per_session: int = DEFAULT_MAX_SESSION_BYTES
    # Every long-lived stream (Session, WatchEvents, health Watch, reflection) holds an RPC thread
    # while open, so streams are bounded below max_workers (None: half of them), per connection
    # (None: half of max_streams), and for the calls that need no token (None: a quarter).
    max_streams: int | None = None
    max_streams_per_peer: int | None = None
    max_public_streams: int | None = None
    max_watch_streams: int | None = None  # WatchEvents streams, server-wide; None: max_streams
    max_session_streams: int | None = None  # Session streams, server-wide; None: max_streams
    max_steps_per_frame: int = DEFAULT_MAX_STEPS_PER_FRAME  # steps one Session message may carry (the clients send 64)
    # None: what the largest max_tokens_per_request needs (its request and its response, see sizes.py).
    max_message_bytes: int | None = None
    max_workers: int = 16  # RPC threads; each WatchEvents stream holds one while open
    watch_queue_size: int = 10_000  # events buffered per watcher before it misses some
    grace_seconds: float = 5.0
    tls_cert: str | None = None
    tls_key: str | None = None
    debug_rpc: bool = False  # serve radixkv.v1.Debug (tests only)
    audit_interval_seconds: float = (
        0.0  # online audit: one pool's recount per interval (server/process/audit.py); 0: off
    )
    audit_slice_ms: float = (
        2.0  # the longest the audit holds a pool's lock at once (about; server/process/audit_image.py)
    )
    # The pools' memory from a keeper (server/process/keeper.py) so it outlives this process: attach to the keeper on
    # this socket, or to the one on this state directory, started there when none listens. Neither: own it.
    keeper_socket: str | None = None
    state_dir: str | None = None
    disk_dir: str | None = None  # every pool's disk tier under DIR/POOL, disk_capacity split evenly between them
    disk_capacity: str | None = None

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("configure at least one pool")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names repeat: {names}")
        tokens = [t.token for t in self.tenants]
        if len(set(tokens)) != len(tokens) or len({t.name for t in self.tenants}) != len(tokens):
            raise ValueError("tenant names and tokens must be unique")
        object.__setattr__(self, "pools", with_disk(self.pools, self.disk_dir, self.disk_capacity))
        published = [(t.name, t.publish_kv_events) for t in self.tenants]  # auth on: the stream's trust boundary
        object.__setattr__(
            self,
            "pools",
            tuple(
                dataclasses.replace(p, kv_events=p.kv_events.with_tenants(p.name, published)) if p.kv_events else p
                for p in self.pools
            ),
        )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both tls_cert and tls_key, or neither")
        if not 0 < self.session_ttl_seconds <= self.max_session_ttl_seconds:
            raise ValueError("session_ttl_seconds must lie in (0, max_session_ttl_seconds]")
        if self.max_message_bytes is None:
            needed = max(
                message_bytes_needed(
                    p.limits.max_tokens_per_request,
                    self.max_sequences_per_session,
                    p.host_num_blocks is not None or p.host_memory_bytes is not None,
                )
                for p in self.pools
            )
            object.__setattr__(self, "max_message_bytes", needed)
        if self.max_streams is None:
            object.__setattr__(self, "max_streams", self.max_workers // 2)
        assert self.max_streams is not None
        if not 0 <= self.max_streams < self.max_workers:
            raise ValueError("max_streams must lie in [0, max_workers): streams must leave threads for unary calls")
        for name, default in (
            ("max_streams_per_peer", max(1, self.max_streams // 2)),
            ("max_public_streams", max(1, self.max_streams // 4)),
            ("max_watch_streams", self.max_streams),
            ("max_session_streams", self.max_streams),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, min(default, self.max_streams))
            elif not 0 <= getattr(self, name) <= self.max_streams:
                raise ValueError(f"{name} must lie in [0, max_streams]: streams must leave threads for unary calls")
        if self.keeper_socket is not None and self.state_dir is not None:
            raise ValueError("give keeper_socket (attach to a running keeper) or state_dir (start one), not both")
        if self.audit_interval_seconds < 0:
            raise ValueError("audit_interval_seconds must be >= 0 (0: no audit)")
        if self.audit_slice_ms <= 0:
            raise ValueError("audit_slice_ms must be > 0")
        for name in (
            "max_sessions",
            "max_sequences_per_session",
            "max_pins_per_session",
            "max_sequences",
            "max_request_window_bytes",
            "max_request_window_bytes_per_session",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_steps_per_frame < 1:
            raise ValueError("max_steps_per_frame must be >= 1")


_LIMIT_FIELDS = {f.name for f in dataclasses.fields(Limits)}
_POOL_FIELDS = {f.name for f in dataclasses.fields(PoolConfig)} - {"name", "limits", "kv_events"}
_SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)} - {"pools", "tenants"}

# Every key a pool takes (`--pool NAME:key=val,...` or a `[pools.NAME]` table), in the order --help lists them.
POOL_KEYS: dict[str, str] = {
    "num_layers": "transformer layers",
    "num_kv_heads": "KV heads per layer",
    "head_dim": "dimension of one head",
    "block_size": "tokens per block, a power of two",
    "dtype": f"KV dtype: {', '.join(DTYPE_BYTES)}",
    "device": "cpu (named shared memory) or cuda[:N] (CUDA IPC)",
    "num_blocks": "size in blocks; give exactly one of num_blocks, memory_bytes, memory_fraction",
    "memory_bytes": "size as a byte budget",
    "memory_fraction": "size as a fraction of the device's free memory (vLLM's --gpu-memory-utilization)",
    "reserved_bytes": "bytes memory_fraction leaves free for the worker's weights and activations",
    "max_tokens_per_request": "tokens one request may carry or a sequence may reach",
    "max_fork_children": "children one fork may create",
    "max_namespaces": "namespaces the pool's prefix tree holds at once",
    "max_pinned_fraction": "fraction of the pool pins may keep resident",
    "host_num_blocks": "host tier size in blocks (host memory, same layout): evicted prefixes move there",
    "host_memory_bytes": "host tier size as a byte budget; give at most one of host_num_blocks, host_memory_bytes",
    **DISK_KEYS,
    "tombstones": "recently evicted block hashes kept so Match(explain) can answer EVICTED (about 180 B each)",
    "reserve_fraction": "share of a budgeted open's max_new_tokens growth reserved at admission (1: no preemption)",
    "watermark_fraction": "share of the pool kept free of budgeted admissions (NOT_ADMITTED past it)",
    "eviction_policy": f"which unlocked prefix goes first: {', '.join(POLICIES)} (agent: for coding-agent traffic)",
    "tenants": "tenants that may use the pool, a TOML list or a+b (unset: all); one alone to map it (map_pools)",
}
_DEFAULTS = {
    f.name: f.default for f in (*dataclasses.fields(PoolConfig), *dataclasses.fields(Limits)) if f.name != "kv_events"
}
_ALL_KEYS = [*POOL_KEYS, *sorted((_POOL_FIELDS | _LIMIT_FIELDS) - set(POOL_KEYS))]
_REQUIRED = [k for k in _ALL_KEYS if _DEFAULTS[k] is dataclasses.MISSING]
_TYPES = {f.name: str(f.type) for f in (*dataclasses.fields(PoolConfig), *dataclasses.fields(Limits))}
_TEXT_KEYS = {k for k, t in _TYPES.items() if "str" in t}
_FLOAT_KEYS = {k for k, t in _TYPES.items() if "float" in t}


def pool_keys_help() -> str:
    """The --help table of pool keys: name, default, meaning."""
    rows = []
    for key in _ALL_KEYS:
        meaning, default = POOL_KEYS.get(key, "see PoolConfig and radixkv.Limits"), _DEFAULTS[key]
        shown = "required" if default is dataclasses.MISSING else "unset" if default is None else str(default) or '""'
        rows.append(f"  {key:<24} {shown:<10} {meaning}")
    return (
        "pool keys (--pool NAME:key=val,... or a [pools.NAME] table):\n  key                      default\n"
        + "\n".join([*rows, *kv_events_config.keys_help()])
    )


def _check_pool_values(name: str, values: Mapping[str, Any]) -> None:
    """One line naming the first key that is unknown, missing or of the wrong kind (never a TypeError)."""
    for key in values:
        if key not in _DEFAULTS or key in ("name", "limits"):
            close = difflib.get_close_matches(key, [*_ALL_KEYS, *kv_events_config.KEYS], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"pool {name!r}: unknown key {key!r}{hint}; radixkv serve --help lists every key")
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ValueError(f"pool {name!r}: missing {', '.join(missing)}; radixkv serve --help lists every key")
    for key, value in values.items():
        if key == "tenants":
            names = value.split("+") if isinstance(value, str) else value
            ok, kind = isinstance(names, list | tuple) and all(isinstance(n, str) and n for n in names), "tenant names"
        elif key in _TEXT_KEYS:
            ok, kind = isinstance(value, str), "text"
        elif key in _FLOAT_KEYS:
            ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        else:
            ok, kind = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "a whole number >= 0"
        if not ok:
            raise ValueError(f"pool {name!r}: {key}={value!r} must be {kind}")
    layout = {k: values.get(k, _DEFAULTS[k]) for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")}
    try:
        PoolLayout(**layout, num_blocks=values.get("num_blocks") or 1)
    except ValueError as e:
        raise ValueError(f"pool {name!r}: {e}") from None


CPU_DEFAULT_POOL_BYTES = 512 * 2**20
DEFAULT_MEMORY_FRACTION = 0.9
DEFAULT_RESERVED_BYTES = 2**30


def default_pool(shape: ModelShape, *, device: str, memory_fraction: float | None = None) -> PoolConfig:
    """The pool `radixkv serve` serves when none is configured: one pool named "default" shaped as `shape`.

    On CUDA sized as vLLM sizes its KV cache: `memory_fraction` (0.9 when None) of the device's free
    memory, less a 1 GiB reserve for the worker's weights and activations. On CPU 512 MiB of shared
    memory, or `memory_fraction` of what is free when given.
    """
    layout = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    if device.startswith("cuda"):
        size = {"memory_fraction": memory_fraction or DEFAULT_MEMORY_FRACTION, "reserved_bytes": DEFAULT_RESERVED_BYTES}
    elif memory_fraction is not None:
        size = {"memory_fraction": memory_fraction}
    else:
        size = {"memory_bytes": CPU_DEFAULT_POOL_BYTES}
    return pool_from_mapping(DEFAULT_POOL, {**layout, "device": device, **size})


def pool_from_mapping(name: str, values: Mapping[str, Any]) -> PoolConfig:
    """A pool from `key: value` pairs; the core's `Limits` fields and the `kv_events_*` keys beside the layout."""
    events = {k: v for k, v in values.items() if k.startswith(kv_events_config.PREFIX)}
    values = {k: str(v) if k == "disk_capacity" else v for k, v in values.items() if k not in events}
    if isinstance(values.get("dtype"), str):  # fp8 is float8_e4m3fn here as in plan and demo
        values = {**values, "dtype": canonical_dtype(values["dtype"])}
    _check_pool_values(name, values)
    if isinstance(tenants := values.get("tenants", ()), str | list):  # TOML list, or a+b in a --pool flag
        values = {**values, "tenants": tuple(tenants.split("+") if isinstance(tenants, str) else tenants)}
    limits = Limits(**{k: v for k, v in values.items() if k in _LIMIT_FIELDS})
    kv_events = kv_events_config.from_mapping(name, events)
    return PoolConfig(
        name=name, limits=limits, kv_events=kv_events, **{k: v for k, v in values.items() if k in _POOL_FIELDS}
    )


def parse_pool_flag(flag: str) -> PoolConfig:
    """`NAME:key=val,key=val` (as `--pool default:num_layers=2,num_kv_heads=2,head_dim=64,num_blocks=512`)."""
    name, sep, rest = flag.partition(":")
    if not sep or not name:
        raise ValueError(f"--pool {flag!r}: expected NAME:key=val,...")
    values: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"--pool {flag!r}: {item!r} is not key=val")
        values[key.strip()] = _scalar(raw.strip())
    return pool_from_mapping(name, values)


def _scalar(raw: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def load_toml(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


_SERVER_TYPES = {f.name: str(f.type) for f in dataclasses.fields(ServerConfig)}


def _check_server_value(key: str, value: Any) -> None:
    """A top-level key of the kind its field takes, as TOML spells it (`debug_rpc = "false"` is text, not false)."""
    kind = _SERVER_TYPES[key]
    if kind == "bool":
        ok, wanted = isinstance(value, bool), "true or false"
    elif "str" in kind:
        ok, wanted = isinstance(value, str), "text"
    elif "float" in kind:
        ok, wanted = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    else:
        ok, wanted = isinstance(value, int) and not isinstance(value, bool), "a whole number"
    if not ok:
        raise ValueError(f"{key} = {value!r} must be {wanted}")


def config_from_mapping(data: Mapping[str, Any], **overrides: Any) -> ServerConfig:
    """A `ServerConfig` from a parsed TOML document; `overrides` (flags given) win over the file."""
    unknown = set(data) - _SERVER_FIELDS - {"pools", "tenants"}
    if unknown:
        raise ValueError(
            f"unknown top-level keys {sorted(unknown)}; known: {sorted(_SERVER_FIELDS | {'pools', 'tenants'})}"
        )
    fields: dict[str, Any] = {k: v for k, v in data.items() if k in _SERVER_FIELDS}
    for key, value in fields.items():
        _check_server_value(key, value)
    fields["pools"] = tuple(pool_from_mapping(name, values) for name, values in data.get("pools", {}).items())
    fields["tenants"] = tenants_from_mapping(data.get("tenants", {}))
    fields.update(overrides)
    return ServerConfig(**fields)
