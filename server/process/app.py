"""The radixkv server process: assemble pools, services, health, reflection and metrics; serve until SIGTERM.

`create_server(config, address) -> (server, port)` builds everything and binds without starting,
so tests and embedders choose when to start and stop; `serve(config)` is the process around it
(signals, the port announcement, graceful stop); `main(argv)` is `radixkv serve`.

On start the process prints one JSON line to stdout, `{"event": "serving", "port": P, "metrics_port": M}`,
so a parent that asked for port 0 learns the port; logs go to stderr as JSON lines.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixkv.server.keeper.keeper_protocol import KeeperError
from radixkv.server.process.audit import PoolAuditor
from radixkv.server.process.debug import DebugServicer
from radixkv.server.process.flags import check_devices, check_ports_free, parse_args
from radixkv.server.process.logs import configure_logging
from radixkv.server.process.metrics import ServerMetrics
from radixkv.server.process.pool_setup import build_pool
from radixkv.server.rules.config import (
    ServerConfig,
)
from radixkv.server.rules.disk_tier import PoolDisk, attach_disk
from radixkv.server.rules.pools import Pool
from radixkv.server.rules.restart import restore_sessions, snapshot_all
from radixkv.server.rules.service import KVService
from radixkv.server.rules.tenants import ANONYMOUS, SCOPE_SEPARATOR, Tenant
from radixkv.server.wire.auth import AuthInterceptor
from radixkv.server.wire.servicer import KVCacheServicer, SessionStreams
from radixkv.server.wire.status import DecodingInterceptor
from radixkv.server.wire.stream_gate import StreamBound, StreamGate
from radixkv.v1 import debug_pb2, debug_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc

if TYPE_CHECKING:
    from radixkv.server.keeper.keeper_client import KeeperClient

log = logging.getLogger("radixkv.server")

FROZEN_GRACE_SECONDS = 1.0  # after a restart's snapshot: long enough to send the answers already made

KVCACHE_SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KVCache"].full_name
DEBUG_SERVICE = debug_pb2.DESCRIPTOR.services_by_name["Debug"].full_name


class RadixKVServer:
    """A bound gRPC server with its pools; `start`, then `stop(grace)` (which also frees the pools)."""

    def __init__(
        self,
        server: grpc.Server,
        service: KVService,
        *,
        health_servicer: health.HealthServicer,
        metrics: ServerMetrics,
        config: ServerConfig,
        auditor: PoolAuditor | None = None,
        keeper: KeeperClient | None = None,
    ) -> None:
        self._server = server
        self.keeper = keeper  # holds the pools' memory when the server does not own it
        self.service = service
        self._health = health_servicer
        self.metrics = metrics
        self._config = config
        self.metrics_port: int | None = None
        self.auditor = auditor
        self._services = [KVCACHE_SERVICE, *([DEBUG_SERVICE] if config.debug_rpc else [])]

    def start(self) -> None:
        self.service.start()
        self._server.start()
        if self._config.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(self._config.host, self._config.metrics_port)
        for name in ("", *self._services):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.auditor is not None:
            self.auditor.start()
        if self.keeper is not None:
            self.keeper.watch()

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, end event streams, let in-flight RPCs finish within `grace`, then free everything."""
        self._health.enter_graceful_shutdown()
        for pool in self.service.pools.values():
            pool.events.close_all()
        try:  # before draining: a call from now on is refused SERVER_RESTARTING, and retried on the next server
            snapshot_all(self.service.pools, self.service.sessions)
        except OSError:
            log.exception("writing the restart snapshots failed: the next server starts cold")
        grace = self._config.grace_seconds if grace is None else grace
        if self.service.pools and all(pool.frozen for pool in self.service.pools.values()):
            grace = min(grace, FROZEN_GRACE_SECONDS)  # every call from now on is refused: only answers in flight
        self._server.stop(grace).wait()
        if self.auditor is not None:
            self.auditor.stop()
        self.service.close()
        if self.keeper is not None:
            self.keeper.close()  # the keeper keeps the memory for the next server
        self.metrics.stop_http()

    def keeper_lost_with_device_memory(self) -> bool:
        """The keeper died and took CUDA memory with it: this server's KV memory is no longer valid."""
        if self.keeper is None or not self.keeper.lost.is_set():
            return False
        return any(pool.device.startswith("cuda") for pool in self.service.pools.values())

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return bool(self._server.wait_for_termination(timeout))


def create_server(config: ServerConfig, address: str) -> tuple[RadixKVServer, int]:
    """Build the pools and the gRPC server and bind `address` (port 0: any free port); not started.

    Raises:
        RuntimeError: the address cannot be bound (the pools are freed again).
    """
    pools: dict[str, Pool] = {}
    keeper = _connect_keeper(config)
    try:
        for pool_config in config.pools:
            prefixes = frozenset(f"{t.name}{SCOPE_SEPARATOR}" for t in config.tenants)
            pools[pool_config.name] = build_pool(pool_config, config.watch_queue_size, keeper, prefixes)
        service = KVService(config, pools)
        for pool_config in config.pools:
            attach_disk(pools[pool_config.name], pool_config, service.shares)
        _restore_sessions(service, config)
        metrics = ServerMetrics(service)
        assert config.max_streams is not None and config.max_streams_per_peer is not None
        assert config.max_public_streams is not None
        assert config.max_session_streams is not None
        session_bound = StreamBound(
            "max_session_streams", config.max_session_streams, service.shares.of(config.max_session_streams)
        )
        gate = StreamGate(
            max_streams=config.max_streams,
            max_per_peer=config.max_streams_per_peer,
            max_per_tenant=service.shares.of(config.max_streams),
            max_public=config.max_public_streams,
            bounds={f"/{KVCACHE_SERVICE}/Session": session_bound},
        )
        metrics.watch_streams(gate)
        interceptors = [  # outermost first; why this order: server/wire/interceptors.py
            metrics.interceptor(),
            *([AuthInterceptor(config.tenants)] if config.tenants else []),
            gate,
            DecodingInterceptor(),
        ]
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port already in use must fail, not be shared
            # Ping idle connections, so a Session stream whose peer vanished ends (and its lease runs again).
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(config.max_workers, thread_name_prefix="radixkv-rpc"),
            interceptors=interceptors,
            options=options,
        )
        session_streams = SessionStreams(config.max_steps_per_frame)
        metrics.count_frames(session_streams)
        servicer = KVCacheServicer(service, session_streams, metrics.observe)
        kvcache_pb2_grpc.add_KVCacheServicer_to_server(servicer, server)
        if config.debug_rpc:
            debug_pb2_grpc.add_DebugServicer_to_server(DebugServicer(service), server)
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        services = [
            KVCACHE_SERVICE,
            *([DEBUG_SERVICE] if config.debug_rpc else []),
            health.SERVICE_NAME,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(services, server)
        if config.tls_cert is not None and config.tls_key is not None:
            with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
                port = server.add_secure_port(address, grpc.ssl_server_credentials([(key.read(), cert.read())]))
        else:
            port = server.add_insecure_port(address)
    except BaseException:
        for pool in pools.values():
            pool.close()
        if keeper is not None:
            keeper.close()
        raise
    auditor = (
        PoolAuditor(
            pools,
            interval=config.audit_interval_seconds,
            registry=metrics.registry,
            slice_seconds=config.audit_slice_ms / 1000,
        )
        if config.audit_interval_seconds
        else None
    )
    return RadixKVServer(
        server, service, health_servicer=health_servicer, metrics=metrics, config=config, auditor=auditor, keeper=keeper
    ), port


def _connect_keeper(config: ServerConfig) -> KeeperClient | None:
    """The keeper that holds the pools' memory, if the config names one (starting it on `state_dir` if needed).

    Raises:
        RuntimeError: no keeper answers.
    """
    if config.keeper_socket is None and config.state_dir is None:
        return None
    from radixkv.server.keeper.keeper_client import KeeperClient, connect_or_spawn

    if config.state_dir is not None:
        return connect_or_spawn(config.state_dir)
    assert config.keeper_socket is not None
    try:
        return KeeperClient(config.keeper_socket)
    except OSError as e:
        raise RuntimeError(f"--keeper {config.keeper_socket}: no keeper answers there ({e})") from None


def _restore_sessions(service: KVService, config: ServerConfig) -> None:
    """The sessions of the snapshots the pools adopted, back with a full lease each (see `server/rules/restart.py`)."""
    tenants = {t.name: Tenant.from_config(t) for t in config.tenants} if config.tenants else {ANONYMOUS.name: ANONYMOUS}
    for pool in service.pools.values():
        if pool.adopted_extras is not None:
            restore_sessions(pool, pool.adopted_extras, service.sessions, tenants)
            pool.adopted_extras = None


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT, then stop gracefully (health NOT_SERVING, drain, free pools); returns the exit
    status: 0, or 1 when the keeper died with this server's CUDA memory."""
    stop = threading.Event()  # SIGTERM, SIGINT, or (via the service) the Upgrade call
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    address = f"{config.host}:{config.port}"
    server, port = create_server(config, address)
    server.service.stop_requested = stop
    server.start()
    pools = {name: str(pool.layout) for name, pool in server.service.pools.items()}
    log.info(
        "serving",
        extra={
            "address": address,
            "port": port,
            "metrics_port": server.metrics_port,
            "pools": pools,
            "auth": bool(config.tenants),
            "tls": config.tls_cert is not None,
        },
    )
    kv_events = {
        name: pool.kv_publisher.endpoints
        for name, pool in server.service.pools.items()
        if pool.kv_publisher is not None
    }
    announcement = {"event": "serving", "port": port, "metrics_port": server.metrics_port, "kv_events": kv_events}
    if server.keeper is not None:
        announcement["keeper"] = _keeper_summary(server)
    disks = {name: p.disk for name, p in server.service.pools.items() if isinstance(p.disk, PoolDisk)}
    if disks:  # what each pool's disk tier rebuilt from its directory alone
        announcement["disk"] = {
            n: {"blocks": len(d.store), "rebuild_s": d.store.rebuild_seconds} for n, d in disks.items()
        }
    print(json.dumps(announcement), flush=True)
    status = 0
    while not stop.wait(0.1):  # a timed wait: the signal handler runs promptly between waits
        if server.keeper_lost_with_device_memory():
            log.error("keeper lost with the CUDA pools' memory: stopping")
            status = 1
            break
    log.info("stopping", extra={"grace_seconds": config.grace_seconds})
    server.stop()
    log.info("stopped")
    return status


def _keeper_summary(server: RadixKVServer) -> dict[str, object]:
    """For the announcement: the keeper's incarnation and each pool's memory, fresh or retained."""
    assert server.keeper is not None
    pools = {
        name: "fresh" if pool.keeper.fresh else "retained"
        for name, pool in server.service.pools.items()
        if pool.keeper is not None
    }
    return {"socket": str(server.keeper.path), "incarnation": server.keeper.incarnation, "pools": pools}


def main(argv: Sequence[str] | None = None) -> int:
    """`radixkv serve ...`; returns the exit status: 0 after a graceful stop, 2 for a bad configuration,
    1 if it cannot serve."""
    try:
        config, log_level = parse_args(sys.argv[1:] if argv is None else argv)
        check_ports_free(config)
        check_devices(config)
    except (ValueError, TypeError, OSError) as e:
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 2
    configure_logging(log_level)
    try:
        return serve(config)
    except (RuntimeError, OSError, ValueError, KeeperError) as e:  # cannot bind, cannot allocate a pool, ...
        log.exception("cannot serve")
        print(f"radixkv serve: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
