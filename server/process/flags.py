"""`radixkv serve` flags: the command line (and --config, --auth-tokens files) as a `ServerConfig`.

Imports neither gRPC nor torch (only `--device`'s default asks torch whether CUDA is there), so the
flags parse, and `--help` prints, before anything heavy loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import socket
from collections.abc import Sequence

from radixkv.arguments import Parser, integer, kv_dtype, port
from radixkv.planning.model_shape import DEFAULT_MODEL, MODEL_SHAPES, resolve_model
from radixkv.server.events import kv_events_config
from radixkv.server.rules.config import (
    CPU_DEFAULT_POOL_BYTES,
    DEFAULT_MEMORY_FRACTION,
    DEFAULT_RESERVED_BYTES,
    PoolConfig,
    ServerConfig,
    config_from_mapping,
    default_pool,
    load_toml,
    parse_pool_flag,
    pool_from_mapping,
    pool_keys_help,
)
from radixkv.server.rules.tenant_config import auth_tokens_tenants


def parse_args(argv: Sequence[str]) -> tuple[ServerConfig, str]:
    """`radixkv serve` flags (a leading "serve" is accepted) -> (config, log level). Flags win over --config."""
    args = list(argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    parser = Parser(
        prog="radixkv serve",
        description="Serve radixkv pools over gRPC.",
        epilog=_DEFAULT_POOL_HELP + "\n\n" + pool_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="TOML file: server options, [pools.NAME] and [tenants.NAME] tables")
    parser.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME:key=val,...",
        help="a pool, e.g. default:num_layers=32,num_kv_heads=8,head_dim=128,num_blocks=4096 "
        "(repeatable; replaces a --config pool of that name)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME|PATH",
        help=f"shape the default pool for this model: a Hugging Face directory (config.json), a .gguf file, "
        f"or a known name (default: {DEFAULT_MODEL}); only when no pool is configured",
    )
    parser.add_argument("--device", help="the default pool's device (default: cuda when there is one, else cpu)")
    parser.add_argument(
        "--block-size", type=integer(1), help="the default pool's tokens per block (default 16; vLLM's CPU backend: 32)"
    )
    parser.add_argument(
        "--kv-dtype",
        type=kv_dtype,
        help="the default pool's KV dtype (default float16; fp8 = float8_e4m3fn; the engine's for vLLM's connector)",
    )
    parser.add_argument("--num-blocks", type=integer(1), help="the default pool's size in blocks (default: by memory)")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        help=f"the default pool's share of free device memory (default on CUDA: {DEFAULT_MEMORY_FRACTION})",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port, help="gRPC port (default 50051; 0: any free port, printed on stdout)")
    parser.add_argument(
        "--metrics-port", type=port, help="Prometheus /metrics port (0: any free port); off when absent"
    )
    parser.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="TOML file of [tenants.NAME] tables (token, namespaces, max_blocks, map_pools): turns auth on",
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key, serve TLS")
    parser.add_argument("--tls-key", help="PEM private key")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        help="largest request or response (default: enough for the largest request the pools allow)",
    )
    parser.add_argument("--session-ttl", type=float, dest="session_ttl_seconds", help="default session lease, seconds")
    parser.add_argument(
        "--max-session-ttl", type=float, dest="max_session_ttl_seconds", help="longest lease a client may ask for"
    )
    parser.add_argument("--max-workers", type=int, help="RPC threads (each open WatchEvents stream holds one)")
    parser.add_argument("--max-sessions", type=int, help="live sessions, server-wide (default 10000)")
    parser.add_argument(
        "--max-request-window-bytes",
        type=int,
        help="bytes the request-id windows keep for retries, all sessions together; a tenant's share of it bounds its "
        "own (default 1 GiB)",
    )
    parser.add_argument(
        "--max-request-window-bytes-per-session", type=int, help="bytes one session's request-id window keeps (16 MiB)"
    )
    parser.add_argument(
        "--max-sequences-per-session", type=int, help="live sequences one session may hold in one pool (default 4096)"
    )
    parser.add_argument("--max-pins-per-session", type=int, help="pins one session may hold in one pool (default 256)")
    parser.add_argument(
        "--max-streams",
        type=int,
        help="open long-lived streams (WatchEvents, health Watch, reflection), below --max-workers (default: half)",
    )
    parser.add_argument(
        "--max-streams-per-peer", type=int, help="open streams per connection (default: half of --max-streams)"
    )
    parser.add_argument(
        "--max-public-streams",
        type=int,
        help="open streams that need no token: health, reflection (default: a quarter)",
    )
    parser.add_argument("--max-sequences", type=int, help="live sequences per pool, all sessions (default 262144)")
    parser.add_argument("--max-watch-streams", type=int, help="open WatchEvents streams (default: --max-streams)")
    parser.add_argument(
        "--max-steps-per-frame", type=int, help="steps one Session message may carry (default 256; the clients send 64)"
    )
    parser.add_argument("--max-session-streams", type=int, help="open Session streams (default: --max-streams)")
    parser.add_argument("--grace", type=float, dest="grace_seconds", help="seconds in-flight RPCs get on shutdown")
    kv_events_config.add_arguments(parser)
    parser.add_argument(
        "--audit-interval",
        type=float,
        dest="audit_interval_seconds",
        metavar="S",
        help="every S seconds, recount one pool's bookkeeping (server/process/audit.py); 0: off (default)",
    )
    parser.add_argument(
        "--audit-slice-ms",
        type=float,
        dest="audit_slice_ms",
        metavar="MS",
        help="the audit copies a pool in lock holds of about MS milliseconds each, whatever its size (default 2)",
    )
    keeper = parser.add_mutually_exclusive_group()
    keeper.add_argument(
        "--keeper",
        dest="keeper_socket",
        metavar="SOCKET",
        help="take the pools' memory from the keeper on this socket (radixkv keeper), so it outlives this server",
    )
    keeper.add_argument(
        "--state-dir",
        metavar="DIR",
        help="as --keeper DIR/keeper.sock, starting `radixkv keeper --state-dir DIR` (detached) if none runs there",
    )
    parser.add_argument("--disk-dir", metavar="DIR", help="a disk tier per pool in DIR/POOL (needs a host tier)")
    parser.add_argument("--disk-capacity", metavar="SIZE", help="the disk tier's byte cap, split between pools: 200GiB")
    parser.add_argument("--debug-rpc", action="store_true", default=None, help="serve radixkv.v1.Debug (tests only)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ns = parser.parse_args(args)
    data = load_toml(ns.config) if ns.config else {}
    if ns.auth_tokens:
        data["tenants"] = {**data.get("tenants", {}), **auth_tokens_tenants(load_toml(ns.auth_tokens))}
    shaping = ("model", "device", "memory_fraction", "block_size", "kv_dtype", "num_blocks")
    own_flags = ("config", "pool", "auth_tokens", "log_level", *shaping)
    overrides = {
        k: v for k, v in vars(ns).items() if v is not None and k not in own_flags and not k.startswith("kv_events")
    }
    flagged = [parse_pool_flag(flag) for flag in ns.pool]
    from_file = [pool_from_mapping(name, values) for name, values in data.get("pools", {}).items()]
    pools = (*[p for p in from_file if p.name not in {f.name for f in flagged}], *flagged)
    if not pools:
        _, shape = resolve_model(ns.model or DEFAULT_MODEL)
        pool = default_pool(shape, device=ns.device or _default_device(), memory_fraction=ns.memory_fraction)
        pools = (_reshaped(pool, ns),)
    elif any(getattr(ns, flag) is not None for flag in shaping):
        raise ValueError(
            "--model, --device, --memory-fraction, --block-size, --kv-dtype and --num-blocks shape the default pool; "
            "with --pool or [pools] tables, give them there"
        )
    pools = kv_events_config.apply_arguments(ns, pools)
    config = config_from_mapping(data, **overrides, pools=pools)
    return config, ns.log_level


def check_ports_free(config: ServerConfig) -> None:
    """A port in use is refused before the pools are built, in one line that says so (gRPC's own failure is a C-core
    log line and "Failed to bind"). A port taken between this probe and the bind still fails there."""
    host = config.host.strip("[]")
    for flag, number in (("--port", config.port), ("--metrics-port", config.metrics_port)):
        if not number:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a port in TIME_WAIT is free
            try:
                probe.bind((host, number))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(
                        f"{flag} {number}: {config.host}:{number} is in use by another process; stop it, or pick "
                        f"another {flag} (0: any free port)"
                    ) from None
                # anything else (a host name that resolves elsewhere, ...): the bind itself reports it


def check_devices(config: ServerConfig) -> None:
    """A CUDA pool needs a CUDA device: refused before the pools are built, in one line, not by torch's traceback."""
    cuda = sorted({p.device for p in config.pools if p.device.startswith("cuda")})
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (", a CPU build" if torch.version.cuda is None else "")
        raise ValueError(f"device {cuda[0]}: no CUDA device is visible here ({build}); use --device cpu")


def _reshaped(pool: PoolConfig, ns: argparse.Namespace) -> PoolConfig:
    """The default pool with --block-size, --kv-dtype and --num-blocks applied (checked as a --pool key would be)."""
    keys = {"block_size": ns.block_size, "dtype": ns.kv_dtype, "num_blocks": ns.num_blocks}
    given = {k: v for k, v in keys.items() if v is not None}
    if not given:
        return pool
    values = {k: v for k, v in dataclasses.asdict(pool).items() if k not in ("name", "limits") and v is not None}
    if "num_blocks" in given:
        values = {k: v for k, v in values.items() if k not in ("memory_bytes", "memory_fraction", "reserved_bytes")}
    return pool_from_mapping(pool.name, {**values, **given})


_DEFAULT_POOL_HELP = f"""\
without --pool or [pools] tables, one pool named "default" is served, shaped for --model
(default {DEFAULT_MODEL}: {MODEL_SHAPES[DEFAULT_MODEL].num_layers} layers,
{MODEL_SHAPES[DEFAULT_MODEL].num_kv_heads} KV heads, head_dim {MODEL_SHAPES[DEFAULT_MODEL].head_dim}; block_size 16,
float16) and sized as vLLM sizes its KV cache: on CUDA, --memory-fraction
({DEFAULT_MEMORY_FRACTION} by default) of the device's free memory less a
{DEFAULT_RESERVED_BYTES // 2**30} GiB reserve for the worker's weights and activations; on CPU,
{CPU_DEFAULT_POOL_BYTES // 2**20} MiB of shared memory."""


def _default_device() -> str:
    import torch  # the server needs it for the pools anyway

    return "cuda" if torch.cuda.is_available() else "cpu"
