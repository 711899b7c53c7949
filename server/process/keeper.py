"""`radixkv keeper`: the process that owns the pools' memory, so a server can stop and the cache stays.

Its only surface is a Unix socket in the state directory (the directory 0700, the socket 0600, and every
peer's uid checked: this user's or root's), speaking `keeper_protocol` frames. One thread serves every
connection from a selector, so no peer can keep another waiting by saying nothing: a connection that
sends no complete frame within `--idle-timeout` seconds of connecting is dropped (reason IDLE), a frame
once begun must be whole within FRAME_TIMEOUT_SECONDS, and past MAX_CONNECTIONS the longest-idle
connection that holds no pool makes room for the new one (a server's hold is never dropped). A request
that allocates runs on that thread too: the registry serialises them anyway. SIGTERM or SIGINT frees
the memory and exits 0. On start it prints one JSON line to stdout, `{"event": "keeping", "socket": ...,
"incarnation": ..., "pid": ...}`; logs go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from radixkv.extras import install_hint
from radixkv.server.keeper.keeper_protocol import (
    LOCK_NAME,
    MAX_FRAME_BYTES,
    FrameError,
    KeeperError,
    error_reply,
    parse_request,
    peer_uid,
    recv_frame,
    send_frame,
    socket_path,
    take_frame,
    trusted_uid,
)
from radixkv.server.process.logs import configure_logging

if TYPE_CHECKING:
    from radixkv.server.keeper.keeper_registry import Keeper

log = logging.getLogger("radixkv.keeper")

MAX_CONNECTIONS = 128
IDLE_SECONDS = 5.0  # a new connection's first frame must be whole within this (`--idle-timeout`)
FRAME_TIMEOUT_SECONDS = 10.0  # a frame once begun must arrive whole within this; a reply must leave within it
_POLL_SECONDS = 0.2  # how soon the loop sees stop()
_UNIX_PATH_MAX = 107


@dataclasses.dataclass(slots=True, eq=False, kw_only=True)
class _Connection:
    """One peer: its bytes not yet framed, when it connected or last sent a whole frame, and since when a frame
    has been arriving (None: none begun)."""

    sock: socket.socket
    conn_id: int
    active_at: float
    spoke: bool = False  # sent a whole frame at least once
    buffer: bytearray = dataclasses.field(default_factory=bytearray)
    frame_since: float | None = None


class KeeperServer:
    """The socket in front of a `Keeper`: accept, check the peer, answer frames until the peer goes."""

    def __init__(self, keeper: Keeper, path: Path, idle_seconds: float = IDLE_SECONDS) -> None:
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise ValueError(f"--state-dir: the socket path {path} is longer than {_UNIX_PATH_MAX} bytes")
        self.keeper = keeper
        self.path = path
        self.idle_seconds = idle_seconds
        self._stopping = False
        self._next_conn = 0
        self._connections: dict[int, _Connection] = {}
        path.unlink(missing_ok=True)  # left by a dead keeper; we hold the lock, so nobody else serves it
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window in which others may connect
        try:
            self._listener.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._listener.listen(MAX_CONNECTIONS)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)

    def serve_forever(self) -> None:
        while not self._stopping:
            accept = False
            for key, _ in self._selector.select(_POLL_SECONDS):
                if key.fileobj is self._listener:
                    accept = True
                else:
                    self._readable(key.data)
            self._expire(time.monotonic())
            if accept:  # after the peers already connected were answered
                self._accept()
        for conn in list(self._connections.values()):
            self._close(conn)

    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self._selector.close()
        self._listener.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors: the peers already connected are served on
                log.warning("accept failed", extra={"error": str(e)})
                return
            uid = peer_uid(sock)
            if not trusted_uid(uid):
                _refuse(sock, KeeperError("PERMISSION_DENIED", f"peer uid {uid} is not the keeper's"))
                continue
            if len(self._connections) >= MAX_CONNECTIONS and not self._make_room():
                _refuse(sock, KeeperError("TOO_MANY", f"the keeper serves {MAX_CONNECTIONS} connections at most"))
                continue
            sock.settimeout(FRAME_TIMEOUT_SECONDS)  # for replies; reads happen only when the selector says so
            self._next_conn += 1
            conn = _Connection(sock=sock, conn_id=self._next_conn, active_at=time.monotonic())
            self._connections[conn.conn_id] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            log.debug("connected", extra={"conn": conn.conn_id})

    def _make_room(self) -> bool:
        """Drop the longest-idle connection that holds no pool (one that never spoke first); False if all hold."""
        idle = [c for c in self._connections.values() if not self.keeper.holds(c.conn_id)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: (c.spoke, c.active_at))
        self._drop(oldest, KeeperError("TOO_MANY", f"{MAX_CONNECTIONS} connections: the longest idle one goes"))
        return True

    def _readable(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(MAX_FRAME_BYTES + 4)
        except OSError as e:
            log.info("connection failed", extra={"conn": conn.conn_id, "error": str(e)})
            self._close(conn)
            return
        if not data:  # the peer went; inside a frame, it may still read why
            if conn.buffer:
                received = len(conn.buffer)
                self._drop(conn, FrameError("BAD_FRAME", f"stream ended inside a frame ({received} bytes of it)"))
            else:
                self._close(conn)
            return
        conn.buffer += data
        try:
            while (body := take_frame(conn.buffer)) is not None:
                conn.active_at, conn.spoke = time.monotonic(), True
                self._answer(conn, body)
        except FrameError as e:  # a bad length: the stream cannot be resynchronised
            self._drop(conn, e)
            return
        except OSError as e:  # the reply could not be sent (the peer went, or stopped reading)
            log.info("connection failed", extra={"conn": conn.conn_id, "error": str(e)})
            self._close(conn)
            return
        conn.frame_since = (conn.frame_since or time.monotonic()) if conn.buffer else None

    def _expire(self, now: float) -> None:
        for conn in list(self._connections.values()):
            if conn.frame_since is not None and now - conn.frame_since > FRAME_TIMEOUT_SECONDS:
                self._drop(conn, KeeperError("BAD_FRAME", f"frame not complete within {FRAME_TIMEOUT_SECONDS} s"))
            elif not conn.spoke and now - conn.active_at > self.idle_seconds:
                self._drop(conn, KeeperError("IDLE", f"no request within {self.idle_seconds} s of connecting"))

    def _answer(self, conn: _Connection, body: bytes) -> None:
        try:
            reply = self._dispatch(conn.conn_id, parse_request(body))
        except KeeperError as e:
            reply = error_reply(e)
        except Exception as e:  # an answer for every frame: a keeper bug must not take the memory down with it
            log.exception("request failed", extra={"conn": conn.conn_id})
            reply = error_reply(KeeperError("INTERNAL", f"{type(e).__name__}: {e}"))
        send_frame(conn.sock, reply)

    def _dispatch(self, conn_id: int, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "hello":
            return self.keeper.hello()
        if op == "list":
            return self.keeper.list_pools()
        if op == "create_or_attach":
            return self.keeper.create_or_attach(
                conn_id, request["pool"], request["layout"], request["device"], request["tier"]
            )
        assert op == "release", f"keeper_protocol.REQUEST_KEYS has an op the keeper does not serve: {op}"
        return self.keeper.release(conn_id, request["pool"])

    def _drop(self, conn: _Connection, error: KeeperError) -> None:
        """End a connection with an error reply saying why."""
        log.info("dropped", extra={"conn": conn.conn_id, "reason": error.reason})
        conn.sock.settimeout(0.5)  # a peer that does not read is not waited for
        self._close(conn, error)

    def _close(self, conn: _Connection, error: KeeperError | None = None) -> None:
        del self._connections[conn.conn_id]
        self._selector.unregister(conn.sock)
        self.keeper.disconnect(conn.conn_id)
        if error is None:
            conn.sock.close()
        else:
            _refuse(conn.sock, error)


def _refuse(conn: socket.socket, error: KeeperError) -> None:
    try:
        send_frame(conn, error_reply(error))
    except OSError:
        pass
    conn.close()


def run(state_dir: Path, announce: IO[str] | None = None, idle_seconds: float = IDLE_SECONDS) -> None:
    """Keep pools for servers until SIGTERM/SIGINT. Raises RuntimeError when another keeper holds `state_dir`."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    lock = open(state_dir / LOCK_NAME, "a+")  # noqa: SIM115 -- held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError(f"another keeper is running on {state_dir}") from None
    from radixkv.server.keeper.keeper_registry import Keeper  # torch: only a keeper that keeps needs it (not --check)

    keeper = Keeper(state_dir)
    server = KeeperServer(keeper, socket_path(state_dir), idle_seconds)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: server.stop())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # detached from the terminal that started the server
    info = {"socket": str(server.path), "incarnation": keeper.incarnation, "pid": os.getpid()}
    log.info("keeping", extra={**info, "stale_segments_removed": keeper.num_stale_segments})
    if announce is not None:
        print(json.dumps({"event": "keeping", **info, "state_dir": str(state_dir)}), file=announce, flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
        keeper.close()
        log.info("stopped")


def ask(state_dir: Path, request: dict[str, Any]) -> int:
    """One request to the keeper on `state_dir` from the command line (`--check`, `--list`, `--release`): prints
    the reply; the exit status is 0 when the keeper answered ok, else 1."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(str(socket_path(state_dir)))
            send_frame(sock, request)
            body = recv_frame(sock, 60)
    except (OSError, KeeperError) as e:
        print(f"radixkv keeper: no keeper answers on {socket_path(state_dir)}: {e}", file=sys.stderr)
        return 1
    if body is None:
        print(f"radixkv keeper: the keeper on {socket_path(state_dir)} closed the connection", file=sys.stderr)
        return 1
    print(body.decode())
    return 0 if json.loads(body).get("ok") is True else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`radixkv keeper --state-dir DIR`: 0 after SIGTERM, 1 when it cannot keep (another keeper, a bad dir),
    2 when torch (the server extra) is missing."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["keeper"]:
        args = args[1:]
    parser = argparse.ArgumentParser(
        prog="radixkv keeper",
        description="Own the pools' memory so radixkv servers can restart without losing it (see README: the keeper).",
    )
    parser.add_argument("--state-dir", required=True, type=Path, help="socket, state file and snapshots live here")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=IDLE_SECONDS,
        metavar="SECONDS",
        help=f"drop a connection that sends no request within this of connecting (default {IDLE_SECONDS:g})",
    )
    instead = parser.add_mutually_exclusive_group()
    instead.add_argument(
        "--check",
        action="store_true",
        help="do not keep: ask the keeper on --state-dir for hello, print it, exit 0 if it answered (a probe)",
    )
    instead.add_argument("--list", action="store_true", help="do not keep: print the pools the keeper holds")
    instead.add_argument(
        "--release",
        metavar="POOL",
        help="do not keep: free POOL's memory (its cache is lost; the next server creates it afresh, any layout)",
    )
    ns = parser.parse_args(args)
    if not ns.idle_timeout > 0:
        parser.error(f"--idle-timeout must be > 0, got {ns.idle_timeout}")
    if ns.check or ns.list or ns.release:
        op = {"op": "hello"} if ns.check else {"op": "list"} if ns.list else {"op": "release", "pool": ns.release}
        return ask(ns.state_dir, op)
    configure_logging(ns.log_level)
    try:
        run(ns.state_dir.absolute(), sys.stdout, ns.idle_timeout)
    except ModuleNotFoundError as e:
        print(f"radixkv keeper: needs the {e.name} package: {install_hint('server')}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ValueError) as e:
        print(f"radixkv keeper: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
