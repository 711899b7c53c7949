"""A TCP proxy between a client and a server, for tests that need a connection to fail under them.

`hold()` keeps forwarding what the client sends but keeps back what the server answers (the server
applies requests whose responses never arrive); `drop()` then closes every connection at once, as a
network fault does, and the proxy forwards new connections whole again.
"""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Listens on 127.0.0.1 (`address`) and forwards each connection to `upstream` ("host:port")."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._holding = threading.Event()  # answers are kept back, not forwarded
        self._closed = False
        threading.Thread(target=self._accept_forever, name="proxy-accept", daemon=True).start()

    def hold(self) -> None:
        """From now on, what the server sends is read and kept back (the server's writes still complete)."""
        self._holding.set()

    def drop(self) -> None:
        """Close every open connection (what was kept back is lost), then forward new ones whole."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
            self._holding.clear()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop()

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(65536):
                if answers and self._holding.is_set():
                    continue  # kept back: the client never sees it
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
