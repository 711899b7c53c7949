"""The KV-events stream's ZMQ sockets: where they listen, and who may connect (ZMQ CURVE).

Each pool's stream gets a context of its own, so its authenticator (a ZAP handler, pyzmq's
`zmq.auth.thread.ThreadAuthenticator`) answers for its sockets only. Secured, every socket of the
stream (events, replay, digest) is a CURVE server with this publisher's key pair and the handler
admits only the subscribers whose public certificates sit in the allowed directory: any other peer,
a plain one included, completes no handshake and receives nothing. CURVE and bind/connect are
independent, so a publisher that connects out (llm-d's global socket) is the CURVE server all the same.

Every bound socket is gated whether secured or not: it has a ZAP domain of its own, and the same handler
refuses a handshake there once the socket has its most connections open (`PeerGate`:
`kv_events_max_replay_peers` on the replay socket, `kv_events_max_subscribers` on each PUB socket), after
the CURVE check when there is one. ZMQ closes a refused connection; with a plain (NULL) socket a ZAP domain
is what makes libzmq ask the handler at all. A socket that connects out (`kv_events_connect`) has one peer.
A PUB socket queues at most `PUB_SEND_HWM` batches per subscriber (then drops, as vLLM's does).
"""

from __future__ import annotations

import threading

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from radixkv.server.events.kv_events_config import KVEventsConfig

ZAP_DOMAIN = "radixkv-kv-events"  # a socket that connects out: CURVE only
_MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
PUB_SEND_HWM = 1000  # batches queued per subscriber (ZMQ's default, now stated): past it ZMQ drops them, as vLLM


class PeerGate:
    """Who may connect to one bound socket of the stream: at most `max_peers` connections at once.

    ZMQ reports each accepted and each closed connection on a monitor socket; the stream's ZAP handler asks
    `admit` at each handshake, after reading those reports, so the connection being decided is already
    counted. A refused one is closed by ZMQ and leaves the count.
    """

    def __init__(self, socket: zmq.Socket[bytes], max_peers: int) -> None:
        self.max_peers = max_peers
        self._monitor = socket.get_monitor_socket(_MONITORED)
        self._lock = threading.Lock()  # the monitor socket is read from the ZAP thread and by readers of num_peers
        self._connected: set[int] = set()  # file descriptors of the open connections
        self._closed = False
        self.num_refused = 0  # connections refused at the cap

    def admit(self) -> bool:
        """Whether the connection now in its handshake may stay (False once closed: the stream is stopping)."""
        with self._lock:
            if self._closed:
                return False
            self._read()
            if len(self._connected) <= self.max_peers:
                return True
            self.num_refused += 1
            return False

    @property
    def num_peers(self) -> int:
        """Connections open now (those being refused included, until ZMQ has closed them)."""
        with self._lock:
            if not self._closed:
                self._read()
            return len(self._connected)

    def _read(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._connected.add(event["value"])
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._connected.discard(event["value"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._connected.clear()
            self._monitor.close(linger=0)


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, with each gated socket's connection cap after its usual checks."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        super().__init__(context)
        self.gates: dict[bytes, PeerGate] = {}  # ZAP domain -> the gate of the one socket that has it

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        gate = self.gates.get(msg[2]) if len(msg) > 2 else None
        if gate is not None and not gate.admit():
            # A ZAP reply (RFC 27) with status 400: libzmq closes the connection.
            self.zap_socket.send_multipart([b"1.0", msg[1], b"400", b"too many peers", b"", b""])
            return
        await super().handle_zap_message(msg)


class StreamSockets:
    """A private ZMQ context for one stream's sockets, with its CURVE authenticator when secured."""

    def __init__(self, config: KVEventsConfig) -> None:
        """Raises:
        RuntimeError: CURVE asked for and libzmq lacks it, or the key file holds no secret key.
        """
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._authenticator: _Authenticator | None = None
        self._keys: tuple[bytes, bytes] | None = None
        self._allowed_keys: str | None = None  # the CURVE directory, configured per gated socket's domain
        if config.curve_secret_key is None or config.curve_allowed_keys is None:  # both or neither (the config)
            return
        self._secure(config.curve_secret_key, config.curve_allowed_keys)

    def _secure(self, secret_key: str, allowed_keys: str) -> None:
        try:
            if not zmq.has("curve"):
                raise RuntimeError("this libzmq has no CURVE: kv_events_curve_* cannot be served")
            public, secret = zmq.auth.load_certificate(secret_key)
            if secret is None:
                raise RuntimeError(f"{secret_key!r} holds a public key only; give the secret certificate")
            self._keys = (public, secret)
            self._allowed_keys = allowed_keys
            self._start_authenticator().configure_curve(domain=ZAP_DOMAIN, location=allowed_keys)
        except (OSError, ValueError, zmq.ZMQError) as e:
            self.close()
            raise RuntimeError(f"cannot secure the KV-events stream: {e}") from e
        except BaseException:
            self.close()
            raise

    def _start_authenticator(self) -> _Authenticator:
        if self._authenticator is None:
            self._authenticator = _Authenticator(self.context)
            self._authenticator.start()
        return self._authenticator

    def open_gated(self, kind: int, endpoint: str, max_peers: int) -> tuple[zmq.Socket[bytes], str, PeerGate]:
        """A socket of `kind` bound to `endpoint`, whose handshakes pass `max_peers` (and CURVE, when secured).

        Raises:
            RuntimeError: the endpoint cannot be bound.
        """
        authenticator = self._start_authenticator()
        socket = self.context.socket(kind)
        gate = PeerGate(socket, max_peers)
        domain = f"{ZAP_DOMAIN}-{len(authenticator.gates)}"
        if self._allowed_keys is not None:
            authenticator.configure_curve(domain=domain, location=self._allowed_keys)
        authenticator.gates[domain.encode()] = gate
        try:
            return (*self._bind(socket, endpoint, False, domain), gate)
        except BaseException:
            gate.close()
            raise

    def open(self, kind: int, endpoint: str, connect: bool = False) -> tuple[zmq.Socket[bytes], str]:
        """A socket of `kind` bound to (or connected to) `endpoint`, and the endpoint it actually uses.

        Raises:
            RuntimeError: the endpoint cannot be bound or connected (a bad address, a port in use).
        """
        return self._bind(self.context.socket(kind), endpoint, connect, ZAP_DOMAIN)

    def _bind(
        self, socket: zmq.Socket[bytes], endpoint: str, connect: bool, domain: str
    ) -> tuple[zmq.Socket[bytes], str]:
        socket.setsockopt(zmq.LINGER, 0)
        if socket.type == zmq.PUB:  # before any pipe exists: it applies to each subscriber's
            socket.setsockopt(zmq.SNDHWM, PUB_SEND_HWM)
        if self._keys is not None:
            socket.curve_server = True
            socket.curve_publickey, socket.curve_secretkey = self._keys
        if self._keys is not None or domain != ZAP_DOMAIN:  # a gated socket asks ZAP even when plain
            socket.zap_domain = domain.encode()
        try:
            if connect:
                socket.connect(endpoint)
                return socket, endpoint
            if endpoint.startswith("tcp://") and endpoint.endswith(":0"):  # any free port (tests, benchmarks)
                host = endpoint[: -len(":0")]
                return socket, f"{host}:{socket.bind_to_random_port(host)}"
            socket.bind(endpoint)
            return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            socket.close(linger=0)
            how = "connect" if connect else "bind"
            raise RuntimeError(f"cannot {how} the KV-events socket {endpoint!r}: {e}") from e

    def close(self) -> None:
        """Stop the authenticator and end the context; every socket must be closed first."""
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        self.context.term()
