"""The server's side of the keeper: attach pools, hold them for the process's life, notice if the keeper dies.

Whom it attaches to: the keeper holds the K/V of every prompt and receives the shutdown snapshot, so
a server attaches only when the socket's directory belongs to its own uid (or root) and no group or
other user may write it, and the process answering on the socket runs as its own uid (or root,
SO_PEERCRED); otherwise it refuses with KeeperError("UNTRUSTED") naming what is wrong, and `serve`
exits 1 with that line.

One connection per server. It stays open while the server lives: the keeper takes its end as the
server's hold on the pools it attached, and the server takes an end of stream on it as the keeper's death.
What a server does when the keeper dies (README, "The keeper"): it keeps serving, since its own mapping
keeps the pages of a CPU pool alive until it exits, but the pool is no longer restart-safe: the memory goes
with this server, so nothing may be snapshotted for a successor. (CUDA memory dies with the keeper's CUDA
context, so a CUDA server stops instead: see `radixkv.server.process.app`.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from radixkv.memory.layout import PoolLayout
from radixkv.memory.pool_handle import PoolHandle
from radixkv.server.keeper.keeper_protocol import (
    LOCK_NAME,
    KeeperError,
    check_private_dir,
    decode_object,
    peer_uid,
    recv_frame,
    send_frame,
    socket_path,
    trusted_uid,
)

log = logging.getLogger("radixkv.server")

REPLY_TIMEOUT_SECONDS = 60.0  # a large pool takes a while to allocate
SPAWN_TIMEOUT_SECONDS = 60.0
KEEPER_LOG = "keeper.log"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KeeperAttachment:
    """A pool's memory as the keeper handed it over, and whether it is new."""

    pool: str
    handle: PoolHandle
    fresh: bool  # created by this attach (zeros): nothing from a previous server is in it
    incarnation: str  # the keeper's id, new at each keeper start
    generation: int  # 1 on the attach that created the memory, one more per later attach
    snapshot_dir: Path


class KeeperClient:
    """A connection to a keeper's socket. Requests are serialised; `lost` is set once the keeper is gone.

    Raises KeeperError("UNTRUSTED") for a socket whose directory or keeper is not this user's (module docstring).
    """

    def __init__(self, path: str | Path, timeout: float = REPLY_TIMEOUT_SECONDS) -> None:
        self.path = Path(path)
        check_private_dir(self.path.parent)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(str(self.path))
            uid = peer_uid(self._sock)
            if not trusted_uid(uid):
                raise KeeperError(
                    "UNTRUSTED", f"the keeper on {self.path} runs as uid {uid}, not as uid {os.getuid()} or root"
                )
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(timeout)
        self._lock = threading.Lock()
        self.lost = threading.Event()
        self._closed = False
        self.info = self.request({"op": "hello"})
        self.incarnation: str = self.info["incarnation"]
        self.snapshot_dir = Path(self.info["snapshot_dir"])

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request, return its reply. Raises KeeperError (the keeper refused) or OSError (it is gone)."""
        with self._lock:
            send_frame(self._sock, message)
            body = recv_frame(self._sock, self._sock.gettimeout())
        if body is None:
            self.lost.set()
            raise ConnectionError(f"the keeper at {self.path} closed the connection")
        reply = decode_object(body)
        if reply.get("ok") is not True:
            raise KeeperError(str(reply.get("reason", "UNKNOWN")), str(reply.get("message", reply)))
        return reply

    def list_pools(self) -> list[dict[str, Any]]:
        pools: list[dict[str, Any]] = self.request({"op": "list"})["pools"]
        return pools

    def create_or_attach(
        self, pool: str, layout: PoolLayout, device: str, busy_timeout: float = 30.0, tier: str = "device"
    ) -> KeeperAttachment:
        """The memory of a pool's `tier` ("device", or "host": its host tier, on "cpu"); while another server still
        holds it (it is stopping), retry up to `busy_timeout` s.

        Raises:
            KeeperError: LAYOUT_MISMATCH (names the fields), POOL_BUSY past the timeout, NO_MEMORY, ...
        """
        layout_fields = dataclasses.asdict(layout)
        message = {"op": "create_or_attach", "pool": pool, "layout": layout_fields, "device": device, "tier": tier}
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                reply = self.request(message)
                break
            except KeeperError as e:
                if e.reason != "POOL_BUSY" or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return KeeperAttachment(
            pool=pool,
            handle=PoolHandle.from_dict(reply["handle"]),
            fresh=bool(reply["fresh"]),
            incarnation=str(reply["incarnation"]),
            generation=int(reply["generation"]),
            snapshot_dir=self.snapshot_dir,
        )

    def release(self, pool: str) -> None:
        self.request({"op": "release", "pool": pool})

    def watch(self) -> threading.Thread:
        """Start a thread that sets `lost` (and logs) when the keeper's end of the connection closes."""
        thread = threading.Thread(target=self._watch, name="radixkv-keeper-watch", daemon=True)
        thread.start()
        return thread

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._sock, select.POLLRDHUP | select.POLLHUP)  # the peer's close, not its replies
        while not self._closed and not self.lost.is_set():
            try:
                events = poller.poll(500)
            except (OSError, ValueError):
                return
            if self._closed:
                return
            if any(flags & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, flags in events):
                self.lost.set()
                log.error(
                    "keeper lost: serving on from this process's mapping, but the pools are no longer restart-safe",
                    extra={"keeper_socket": str(self.path), "incarnation": self.incarnation},
                )

    def close(self) -> None:
        """End the connection: the keeper keeps the pools, retained, for the next server."""
        self._closed = True
        self._sock.close()


def connect_or_spawn(state_dir: str | Path, timeout: float = SPAWN_TIMEOUT_SECONDS) -> KeeperClient:
    """Attach to the keeper on `state_dir`, starting one first (detached: its own session, so it outlives this
    server) if none listens there. Raises RuntimeError when none answers within `timeout` s."""
    state_dir = Path(state_dir).absolute()
    path = socket_path(state_dir)
    if state_dir.exists():
        check_private_dir(state_dir)  # before anything of ours (a keeper, its memory) goes in
    try:
        return KeeperClient(path)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(state_dir)
    with open(state_dir / KEEPER_LOG, "ab") as keeper_log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(state_dir)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=keeper_log,
            start_new_session=True,
            close_fds=True,
        )
    log.info("keeper started", extra={"state_dir": str(state_dir), "keeper_pid": proc.pid})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return KeeperClient(path)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        if proc.poll() not in (None, 0) and not _locked_by_another(state_dir):
            raise RuntimeError(f"the keeper exited ({proc.returncode}); see {state_dir / KEEPER_LOG}")
        time.sleep(0.05)
    raise RuntimeError(f"no keeper answered on {path} within {timeout} s; see {state_dir / KEEPER_LOG}")


def _locked_by_another(state_dir: Path) -> bool:
    """Whether a keeper holds `state_dir` (one started at the same moment as ours, which then lost the race)."""
    import fcntl

    try:
        fd = os.open(state_dir / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
