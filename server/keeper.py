"""`radixkv keeper`: the process that owns the pools' memory, so a server can stop and the cache stays.

Its only surface is a Unix socket in the state directory (the directory 0700, the socket 0600, and every
peer's uid checked), speaking `keeper_protocol` frames; one thread per connection, at most
MAX_CONNECTIONS. SIGTERM or SIGINT frees the memory and exits 0. On start it prints one JSON line to
stdout, `{"event": "keeping", "socket": ..., "incarnation": ..., "pid": ...}`; logs go to stderr.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from radixkv.server.keeper_protocol import (
    LOCK_NAME,
    FrameError,
    KeeperError,
    error_reply,
    parse_request,
    recv_frame,
    send_frame,
    socket_path,
)
from radixkv.server.logs import configure_logging

if TYPE_CHECKING:
    from radixkv.server.keeper_registry import Keeper

log = logging.getLogger("radixkv.keeper")

MAX_CONNECTIONS = 32
FRAME_TIMEOUT_SECONDS = 10.0  # a frame once begun must arrive whole within this
_UNIX_PATH_MAX = 107


class KeeperServer:
    """The socket in front of a `Keeper`: accept, check the peer, answer frames until the peer goes."""

    def __init__(self, keeper: Keeper, path: Path) -> None:
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise ValueError(f"--state-dir: the socket path {path} is longer than {_UNIX_PATH_MAX} bytes")
        self.keeper = keeper
        self.path = path
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._next_conn = 0
        path.unlink(missing_ok=True)  # left by a dead keeper; we hold the lock, so nobody else serves it
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window in which others may connect
        try:
            self._listener.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._listener.listen(MAX_CONNECTIONS)
        self._listener.settimeout(0.2)  # so serve_forever sees stop() promptly

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            conn.settimeout(None)
            if not self._slots.acquire(blocking=False):
                _refuse(conn, KeeperError("TOO_MANY", f"the keeper serves {MAX_CONNECTIONS} connections at most"))
                continue
            self._next_conn += 1
            threading.Thread(target=self._serve, args=(conn, self._next_conn), daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._listener.close()
        self.path.unlink(missing_ok=True)

    def _serve(self, conn: socket.socket, conn_id: int) -> None:
        try:
            uid, pid = _peer(conn)
            if uid not in (os.getuid(), 0):
                _refuse(conn, KeeperError("PERMISSION_DENIED", f"peer uid {uid} is not the keeper's"))
                return
            log.debug("connected", extra={"conn": conn_id, "peer_pid": pid})
            while self._answer(conn, conn_id):
                pass
        except OSError as e:
            log.info("connection failed", extra={"conn": conn_id, "error": str(e)})
        finally:
            self.keeper.disconnect(conn_id)
            conn.close()
            self._slots.release()

    def _answer(self, conn: socket.socket, conn_id: int) -> bool:
        """Answer one frame; False when the connection is over (peer gone, or a frame it cannot resync from)."""
        try:
            body = recv_frame(conn, FRAME_TIMEOUT_SECONDS)
        except FrameError as e:
            _refuse(conn, e)
            return False
        except TimeoutError:
            _refuse(conn, KeeperError("BAD_FRAME", f"frame not complete within {FRAME_TIMEOUT_SECONDS} s"))
            return False
        if body is None:
            return False
        try:
            reply = self._dispatch(conn_id, parse_request(body))
        except KeeperError as e:
            reply = error_reply(e)
        except Exception as e:  # an answer for every frame: a keeper bug must not take the memory down with it
            log.exception("request failed", extra={"conn": conn_id})
            reply = error_reply(KeeperError("INTERNAL", f"{type(e).__name__}: {e}"))
        send_frame(conn, reply)
        return True

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


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(uid, pid) of the process at the other end (SO_PEERCRED, Linux)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return uid, pid


def _refuse(conn: socket.socket, error: KeeperError) -> None:
    try:
        send_frame(conn, error_reply(error))
    except OSError:
        pass
    conn.close()


def run(state_dir: Path, announce: IO[str] | None = None) -> None:
    """Keep pools for servers until SIGTERM/SIGINT. Raises RuntimeError when another keeper holds `state_dir`."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    lock = open(state_dir / LOCK_NAME, "a+")  # noqa: SIM115 -- held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RuntimeError(f"another keeper is running on {state_dir}") from None
    from radixkv.server.keeper_registry import Keeper  # torch: only a keeper that keeps needs it (not --check)

    keeper = Keeper(state_dir)
    server = KeeperServer(keeper, socket_path(state_dir))
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
    if ns.check or ns.list or ns.release:
        op = {"op": "hello"} if ns.check else {"op": "list"} if ns.list else {"op": "release", "pool": ns.release}
        return ask(ns.state_dir, op)
    configure_logging(ns.log_level)
    try:
        run(ns.state_dir.absolute(), sys.stdout)
    except ModuleNotFoundError as e:
        print(f"radixkv keeper: needs the {e.name} package: pip install 'radixkv[server]'", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ValueError) as e:
        print(f"radixkv keeper: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
