"""How a pool publishes vLLM's KV events, and the trust boundary around them.

The stream carries prompts: every cached block's `token_ids` and its namespace's salt (with auth on,
`<tenant>/<namespace>`). So the rules here are those of a service that holds other people's prompts:

- It binds where it is told and never every interface by default: a wildcard host (`*`, `0.0.0.0`,
  `::`) is refused unless `bind_all_interfaces` says so by name. Bind loopback or the pod's IP.
- With auth on (`--auth-tokens`), a pool publishes only if the operator secured the stream (ZMQ CURVE:
  this publisher's secret key and a directory of the subscribers' public keys, every other peer refused)
  or opted in to the trust boundary by a flag that says what it does
  (`--kv-events-insecure-publish-tenant-prompts`). A tenant with `publish_kv_events = false` has its
  blocks kept out of the stream entirely (`withheld_tenants`); if every tenant withholds, nothing
  tenant-owned is published and neither is needed.

Pool keys are flat (`kv_events_endpoint = ...` in a `[pools.NAME]` table, or `--pool NAME:kv_events_...`);
the `--kv-events-*` flags set them for the one pool there is (`add_arguments`, `apply_arguments`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

PREFIX = "kv_events_"
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", "::0", "[::0]"})
MIN_BATCH_BYTES = 4096  # room for one block of any block size a pool may have (the publisher checks its own)
INSECURE_FLAG = "--kv-events-insecure-publish-tenant-prompts"
BIND_ALL_FLAG = "--kv-events-bind-all-interfaces"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KVEventsConfig:
    """One pool's KV-events stream (`radixkv.server.events.kv_events`)."""

    endpoint: str  # the vLLM-format PUB socket: bound here, or connected to when `connect`
    topic: str = ""  # e.g. kv@<pod ip>:<model server port>@<model>, as llm-d's precise prefix-cache producer expects
    connect: bool = False  # connect out to `endpoint` (a subscriber that binds) instead of binding it
    replay_endpoint: str | None = None  # ROUTER answering replay requests (always bound)
    digest_endpoint: str | None = None  # PUB carrying the pool's digest after every batch (never the vLLM socket)
    buffer_steps: int = 10_000  # batches kept for replay
    buffer_bytes: int = 64 << 20  # payload bytes kept for replay: the oldest batches go first past it
    max_batch_bytes: int = 64 << 10  # one batch's payload at most; a larger event is split into chained events
    max_replays: int = 8  # replays served at once, one per peer; further requests wait (one per peer)
    max_replay_peers: int = 64  # connections to the replay socket at once; one more is refused at its handshake
    max_subscribers: int = 8  # connections to each bound PUB socket (events, digest) at once; likewise refused
    replay_seconds: int = 30  # a replay's time budget: past it (or past 1 s while a peer waits) it is cut short
    bind_all_interfaces: bool = False  # allow a wildcard host: every interface, every network on it
    insecure_publish_tenant_prompts: bool = False  # with auth on: publish to whoever connects, knowingly
    curve_secret_key: str | None = None  # this publisher's secret certificate (zmq.auth format)
    curve_allowed_keys: str | None = None  # directory of the public certificates of the subscribers allowed
    withheld_tenants: frozenset[str] = frozenset()  # set from the tenants (`with_tenants`), not a key

    def __post_init__(self) -> None:
        if self.buffer_steps < 1:
            raise ValueError("kv_events_buffer_steps must be >= 1")
        for key in ("buffer_bytes", "max_replays", "max_replay_peers", "max_subscribers", "replay_seconds"):
            if getattr(self, key) < 1:
                raise ValueError(f"kv_events_{key} must be >= 1")
        if not MIN_BATCH_BYTES <= self.max_batch_bytes <= self.buffer_bytes:
            raise ValueError(
                f"kv_events_max_batch_bytes must lie in [{MIN_BATCH_BYTES}, kv_events_buffer_bytes "
                f"({self.buffer_bytes})], got {self.max_batch_bytes}"
            )
        if (self.curve_secret_key is None) != (self.curve_allowed_keys is None):
            raise ValueError("give both kv_events_curve_secret_key and kv_events_curve_allowed_keys, or neither")
        if self.curve_secret_key is not None and not os.path.isfile(self.curve_secret_key):
            raise ValueError(f"kv_events_curve_secret_key {self.curve_secret_key!r}: no such file")
        if self.curve_allowed_keys is not None and not os.path.isdir(self.curve_allowed_keys):
            raise ValueError(f"kv_events_curve_allowed_keys {self.curve_allowed_keys!r}: no such directory")
        bound = [
            ("kv_events_replay_endpoint", self.replay_endpoint),
            ("kv_events_digest_endpoint", self.digest_endpoint),
        ]
        if not self.connect:
            bound.insert(0, ("kv_events_endpoint", self.endpoint))
        for key, endpoint in bound:
            if endpoint is not None and is_wildcard(endpoint) and not self.bind_all_interfaces:
                raise ValueError(
                    f"{key} {endpoint!r} binds every interface, so anyone on any network of this host can read "
                    f"every cached prompt; bind loopback or the pod's IP (tcp://$(POD_IP):PORT), or say so with "
                    f"{BIND_ALL_FLAG}"
                )

    @property
    def secured(self) -> bool:
        """Whether only the subscribers whose public keys are allowed can connect (ZMQ CURVE)."""
        return self.curve_secret_key is not None

    def with_tenants(self, pool: str, tenants: Sequence[tuple[str, bool]]) -> KVEventsConfig:
        """This stream under auth: `tenants` as (name, publish_kv_events). Auth off (no tenants): unchanged.

        Raises:
            ValueError: auth is on, some tenant's blocks would be published, and the stream is neither secured
                nor opted in; the message names both ways out.
        """
        if not tenants:
            return self
        withheld = frozenset(name for name, publish in tenants if not publish)
        if len(withheld) < len(tenants) and not (self.secured or self.insecure_publish_tenant_prompts):
            raise ValueError(
                f"pool {pool!r}: with --auth-tokens the KV-events stream carries every tenant's prompt tokens and "
                f"namespaces to any peer that connects; secure it with --kv-events-curve-secret-key and "
                f"--kv-events-curve-allowed-keys (ZMQ CURVE, for subscribers that support it), keep tenants out of "
                f"it (publish_kv_events = false), or accept that boundary by name with {INSECURE_FLAG}"
            )
        return dataclasses.replace(self, withheld_tenants=withheld)


def is_wildcard(endpoint: str) -> bool:
    """Whether binding `endpoint` listens on every interface (tcp only; ipc/inproc never leave the host)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
    return host in WILDCARD_HOSTS


# -- keys --------------------------------------------------------------------------------------------------------

_FIELDS = {f.name: f for f in dataclasses.fields(KVEventsConfig) if f.name != "withheld_tenants"}
KEYS: dict[str, str] = {  # pool key -> meaning, in --help order
    "kv_events_endpoint": "ZMQ PUB endpoint for vLLM's KV events, bound (tcp://127.0.0.1:5557, tcp://$(POD_IP):5557)",
    "kv_events_topic": "topic of those events, e.g. kv@<ip:port>@<model>",
    "kv_events_connect": "true: connect to kv_events_endpoint (a subscriber that binds) instead of binding it",
    "kv_events_replay_endpoint": "ZMQ ROUTER endpoint that replays missed event batches (bound)",
    "kv_events_digest_endpoint": "ZMQ PUB endpoint for the pool's digest after every batch (bound; own socket)",
    "kv_events_buffer_steps": "event batches kept for replay",
    "kv_events_buffer_bytes": "bytes of event batches kept for replay (the oldest go first past it)",
    "kv_events_max_batch_bytes": "bytes of one batch at most; a larger event is split into chained events",
    "kv_events_max_replays": "replays served at once (one per peer; others wait, one request per peer)",
    "kv_events_max_replay_peers": "connections to the replay socket at once; more are refused at the handshake",
    "kv_events_max_subscribers": "subscribers of each bound PUB socket (events, digest) at once; more are refused",
    "kv_events_replay_seconds": "a replay's time budget; past it, or past 1 s while another peer waits, it ends "
    "early (the consumer asks again from there)",
    "kv_events_bind_all_interfaces": "true: allow a wildcard host (*, 0.0.0.0, ::) in the endpoints above",
    "kv_events_insecure_publish_tenant_prompts": "true: with auth on, publish tenants' prompts to any peer",
    "kv_events_curve_secret_key": "ZMQ CURVE: this publisher's secret certificate file (zmq.auth format)",
    "kv_events_curve_allowed_keys": "ZMQ CURVE: directory of the public certificates of allowed subscribers",
}
assert set(KEYS) == {PREFIX + f for f in _FIELDS}, "every field has a key and a meaning"


def keys_help() -> list[str]:
    """--help rows for the pool keys of this stream: name, default, meaning."""
    rows = []
    for key, meaning in KEYS.items():
        default = _FIELDS[key.removeprefix(PREFIX)].default
        shown = "required" if default is dataclasses.MISSING else "unset" if default is None else str(default) or '""'
        rows.append(f"  {key:<24} {shown:<10} {meaning}")
    return rows


def from_mapping(pool: str, values: Mapping[str, Any]) -> KVEventsConfig | None:
    """The stream from a pool's `kv_events_*` keys (None when there are none); one line naming a bad key.

    Raises:
        ValueError: an unknown key, a value of the wrong kind, a key without kv_events_endpoint, or a rule broken.
    """
    if not values:
        return None
    fields: dict[str, Any] = {}
    for key, value in values.items():
        field = _FIELDS.get(key.removeprefix(PREFIX))
        if field is None or not key.startswith(PREFIX):
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(f"pool {pool!r}: unknown key {key!r}{hint}; radixkv serve --help lists every key")
        fields[field.name] = _typed(pool, key, value, str(field.type))
    if "endpoint" not in fields:
        raise ValueError(f"pool {pool!r}: {', '.join(sorted(values))} needs kv_events_endpoint")
    try:
        return KVEventsConfig(**fields)
    except ValueError as e:
        raise ValueError(f"pool {pool!r}: {e}") from None


def _typed(pool: str, key: str, value: Any, kind: str) -> Any:
    if "bool" in kind:
        if isinstance(value, str) and value.lower() in ("true", "false"):  # --pool NAME:key=true
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
        raise ValueError(f"pool {pool!r}: {key}={value!r} must be true or false")
    if "int" in kind:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"pool {pool!r}: {key}={value!r} must be a whole number")
    if isinstance(value, str):
        return value
    raise ValueError(f"pool {pool!r}: {key}={value!r} must be text")


def to_mapping(config: KVEventsConfig | None) -> dict[str, Any]:
    """The pool keys that give `config` back (none for None)."""
    if config is None:
        return {}
    return {PREFIX + name: getattr(config, name) for name in _FIELDS if getattr(config, name) != _FIELDS[name].default}


# -- flags -------------------------------------------------------------------------------------------------------

_BOOL_FLAGS = {
    "connect": "connect to --kv-events-endpoint (a subscriber that binds, llm-d's global socket) instead of binding",
    "bind_all_interfaces": "allow a wildcard host (*, 0.0.0.0, ::) in the events endpoints: every interface",
    "insecure_publish_tenant_prompts": "with --auth-tokens, publish every tenant's prompt tokens to any peer that "
    "connects (without it, the server refuses to start unless CURVE secures the stream)",
}
_VALUE_FLAGS = {
    "endpoint": (
        "ENDPOINT",
        "publish the pool's KV events in vLLM's ZMQ format, bound here: tcp://127.0.0.1:5557, "
        "tcp://$(POD_IP):5557 (one pool; else per [pools.NAME])",
    ),
    "topic": ("TOPIC", "ZMQ topic, e.g. kv@<ip:port>@<model>"),
    "replay_endpoint": ("ENDPOINT", "ROUTER socket answering replay requests, e.g. tcp://127.0.0.1:5558"),
    "digest_endpoint": ("ENDPOINT", "PUB socket for the pool's digest after every batch (never the vLLM socket)"),
    "curve_secret_key": ("FILE", "ZMQ CURVE: this publisher's secret certificate (zmq.auth.create_certificates)"),
    "curve_allowed_keys": ("DIR", "ZMQ CURVE: the public certificates of the subscribers allowed; others get nothing"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--kv-events-*` flags of `radixkv serve`."""
    for name, (metavar, help_text) in _VALUE_FLAGS.items():
        parser.add_argument(
            f"--kv-events-{name.replace('_', '-')}", dest=PREFIX + name, metavar=metavar, help=help_text
        )
    for name, help_text in _BOOL_FLAGS.items():
        flag = f"--kv-events-{name.replace('_', '-')}"
        parser.add_argument(flag, dest=PREFIX + name, action="store_true", default=None, help=help_text)


def apply_arguments(namespace: argparse.Namespace, pools: Sequence[Any]) -> tuple[Any, ...]:
    """`pools` (PoolConfigs) with the `--kv-events-*` flags given applied to the one pool there must be."""
    given = {k: v for k, v in vars(namespace).items() if k.startswith(PREFIX) and v is not None}
    if not given:
        return tuple(pools)
    if len(pools) != 1:
        raise ValueError(
            f"--kv-events-* flags need exactly one pool (got {len(pools)}); "
            "set kv_events_endpoint in each [pools.NAME] table instead"
        )
    pool = pools[0]
    kv_events = from_mapping(pool.name, {**to_mapping(pool.kv_events), **given})
    return (dataclasses.replace(pool, kv_events=kv_events),)
