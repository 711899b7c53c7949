"""The KV-events stream's ZMQ sockets: where they listen, and who may connect (ZMQ CURVE).

Each pool's stream gets a context of its own, so its authenticator (a ZAP handler, pyzmq's
`zmq.auth.thread.ThreadAuthenticator`) answers for its sockets only. Secured, every socket of the
stream (events, replay, digest) is a CURVE server with this publisher's key pair and the handler
admits only the subscribers whose public certificates sit in the allowed directory: any other peer,
a plain one included, completes no handshake and receives nothing. CURVE and bind/connect are
independent, so a publisher that connects out (llm-d's global socket) is the CURVE server all the same.
"""

from __future__ import annotations

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from radixkv.server.kv_events_config import KVEventsConfig

ZAP_DOMAIN = "radixkv-kv-events"


class StreamSockets:
    """A private ZMQ context for one stream's sockets, with its CURVE authenticator when secured."""

    def __init__(self, config: KVEventsConfig) -> None:
        """Raises:
        RuntimeError: CURVE asked for and libzmq lacks it, or the key file holds no secret key.
        """
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._authenticator: ThreadAuthenticator | None = None
        self._keys: tuple[bytes, bytes] | None = None
        if config.curve_secret_key is None or config.curve_allowed_keys is None:  # both or neither (the config)
            return
        try:
            if not zmq.has("curve"):
                raise RuntimeError("this libzmq has no CURVE: kv_events_curve_* cannot be served")
            public, secret = zmq.auth.load_certificate(config.curve_secret_key)
            if secret is None:
                raise RuntimeError(f"{config.curve_secret_key!r} holds a public key only; give the secret certificate")
            self._keys = (public, secret)
            self._authenticator = ThreadAuthenticator(self.context)
            self._authenticator.start()
            self._authenticator.configure_curve(domain=ZAP_DOMAIN, location=config.curve_allowed_keys)
        except (OSError, ValueError, zmq.ZMQError) as e:
            self.close()
            raise RuntimeError(f"cannot secure the KV-events stream: {e}") from e
        except BaseException:
            self.close()
            raise

    def open(self, kind: int, endpoint: str, connect: bool = False) -> tuple[zmq.Socket[bytes], str]:
        """A socket of `kind` bound to (or connected to) `endpoint`, and the endpoint it actually uses.

        Raises:
            RuntimeError: the endpoint cannot be bound or connected (a bad address, a port in use).
        """
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            socket.curve_server = True
            socket.curve_publickey, socket.curve_secretkey = self._keys
            socket.zap_domain = ZAP_DOMAIN.encode()
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
