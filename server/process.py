"""`radixkv serve` and `radixkv keeper` as child processes: the one way the tests, the demo and the benchmarks
start them.

The child binds 127.0.0.1 (port 0, i.e. a free one, unless the arguments give `--port`) and announces
itself with one JSON line on stdout, `{"event": "serving", "port": P, "metrics_port": M, "kv_events": {...}}`
(and `"keeper": {...}` when a keeper holds its pools); the constructor returns once that line is read, so
`address` is ready to dial. A keeper announces `{"event": "keeping", "socket": S, ...}` the same way.
Standard library only: importing this module loads neither torch nor grpc.
"""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class ServerProcess:
    """A running `python -m radixkv.server.app serve ARGS`; `stop()` (or leaving a `with` block) ends it.

    `log_path` receives the server's stderr (its JSON log); without one, stderr is inherited. `keeper` (a
    socket) or `state_dir` take the pools' memory from a keeper (`--keeper`, `--state-dir`).
    """

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path | None = None,
        timeout: float = 60.0,
        *,
        keeper: str | Path | None = None,
        state_dir: str | Path | None = None,
    ) -> None:
        port = [] if "--port" in args else ["--port", "0"]
        keeper_flags = [
            *(["--keeper", str(keeper)] if keeper else []),
            *(["--state-dir", str(state_dir)] if state_dir else []),
        ]
        command = [
            sys.executable,
            "-m",
            "radixkv.server.app",
            "serve",
            "--host",
            "127.0.0.1",
            *port,
            *keeper_flags,
            *args,
        ]
        self.log_path = log_path
        self._log: IO[bytes] | None = open(log_path, "wb") if log_path is not None else None  # noqa: SIM115
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log)
        try:
            self.announcement: dict[str, Any] = self._read_announcement(timeout)
        except BaseException:
            self.kill()
            raise
        self.port: int = int(self.announcement["port"])
        self.metrics_port: int | None = self.announcement.get("metrics_port")
        self.address = f"127.0.0.1:{self.port}"

    def _read_announcement(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise RuntimeError(f"radixkv server did not announce its port within {timeout} s{self._log_tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"radixkv server exited ({self.proc.wait()}) before serving{self._log_tail()}")
        announcement: dict[str, Any] = json.loads(line)
        if announcement.get("event") != "serving":
            raise RuntimeError(f"radixkv server announced {announcement!r}, expected the serving event")
        return announcement

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        if self._log is not None:
            self._log.flush()
        return f"; log: {self.log_path.read_text()[-2000:]}"

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (the server drains and frees its pools), then SIGKILL if it has not exited in `timeout` s.

        Returns the exit status (0 after a graceful stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no graceful stop, as a crashed pod."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class KeeperProcess:
    """A running `python -m radixkv.server.keeper --state-dir DIR`: `stop()` is SIGTERM (it frees the memory),
    `kill()` is SIGKILL (the next keeper on DIR starts cold). `socket` is the path servers attach to."""

    def __init__(self, state_dir: str | Path, log_path: Path | None = None, timeout: float = 60.0) -> None:
        command = [sys.executable, "-m", "radixkv.server.keeper", "--state-dir", str(state_dir)]
        self.log_path = log_path
        self._log: IO[bytes] | None = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log)
        try:
            self.announcement = _read_line(self.proc, timeout, "keeping", log_path, self._log)
        except BaseException:
            self.kill()
            raise
        self.socket = Path(self.announcement["socket"])
        self.incarnation: str = self.announcement["incarnation"]
        self.pid = self.proc.pid

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout` s; returns the exit status (0 after a graceful stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the keeper dies without freeing anything."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> KeeperProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _read_line(
    proc: subprocess.Popen[bytes], timeout: float, event: str, log_path: Path | None, log: IO[bytes] | None
) -> dict[str, Any]:
    """The child's announcement: its first stdout line, a JSON object whose "event" is `event`."""
    assert proc.stdout is not None
    tail = ""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        ready = selector.select(timeout)
    line = proc.stdout.readline() if ready else b""
    if log is not None and log_path is not None and not line:
        log.flush()
        tail = f"; log: {log_path.read_text()[-2000:]}"
    if not ready:
        raise RuntimeError(f"{proc.args!r} did not announce itself within {timeout} s{tail}")
    if not line:
        raise RuntimeError(f"{proc.args!r} exited ({proc.wait()}) before announcing itself{tail}")
    announcement: dict[str, Any] = json.loads(line)
    if announcement.get("event") != event:
        raise RuntimeError(f"{proc.args!r} announced {announcement!r}, expected the {event} event")
    return announcement
