"""The KV-events stream's ZMQ sockets: where they listen, and who may connect (ZMQ CURVE).

Each pool's stream gets a context of its own, so its authenticator (a ZAP handler, pyzmq's
`zmq.auth.thread.ThreadAuthenticator`) answers for its sockets only. Secured, every socket of the
stream (events, replay, digest) is a CURVE server with this publisher's key pair and the handler
admits only the subscribers whose public certificates sit in the allowed directory: any other peer,
a plain one included, completes no handshake and receives nothing. CURVE and bind/connect are
independent, so a publisher that connects out (llm-d's global socket) is the CURVE server all the same.

The replay socket is gated whether secured or not: it has a ZAP domain of its own, and the same handler
refuses a handshake there once `kv_events_max_replay_peers` connections are open (`PeerGate`), after the
CURVE check when there is one. ZMQ closes a refused connection; with a plain (NULL) socket a ZAP domain is
what makes libzmq ask the handler at all.
"""

from __future__ import annotations

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from radixkv.server.kv_events_config import KVEventsConfig
from radixkv.server.kv_replay import PeerGate

ZAP_DOMAIN = "radixkv-kv-events"
REPLAY_ZAP_DOMAIN = "radixkv-kv-replay"  # the replay socket's: its handshakes also pass the peer cap


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, with the replay socket's peer cap after its usual checks."""

    gate: PeerGate | None = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if self.gate is not None and len(msg) > 2 and msg[2] == REPLAY_ZAP_DOMAIN.encode() and not self.gate.admit():
            # A ZAP reply (RFC 27) with status 400: libzmq closes the connection.
            self.zap_socket.send_multipart([b"1.0", msg[1], b"400", b"too many replay peers", b"", b""])
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
            authenticator = self._start_authenticator()
            for domain in (ZAP_DOMAIN, REPLAY_ZAP_DOMAIN):
                authenticator.configure_curve(domain=domain, location=allowed_keys)
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

    def open_gated(self, endpoint: str, max_peers: int) -> tuple[zmq.Socket[bytes], str, PeerGate]:
        """The replay ROUTER bound to `endpoint`, whose handshakes pass `max_peers` (and CURVE, when secured).

        Raises:
            RuntimeError: the endpoint cannot be bound.
        """
        authenticator = self._start_authenticator()
        socket = self.context.socket(zmq.ROUTER)
        gate = PeerGate(socket, max_peers)
        authenticator.gate = gate
        try:
            return (*self._bind(socket, endpoint, False, REPLAY_ZAP_DOMAIN), gate)
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
        if self._keys is not None:
            socket.curve_server = True
            socket.curve_publickey, socket.curve_secretkey = self._keys
        if self._keys is not None or domain == REPLAY_ZAP_DOMAIN:
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
