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
import os
import selectors
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

STOP_SECONDS = 120.0  # a graceful stop (drain, snapshot, free the pools) on an idle machine takes well under a second
START_SECONDS = 300.0  # a child's start: importing torch and grpc, building the pools


def patient(seconds: float) -> float:
    """A bound for a wait on an event, stretched on a loaded machine: `seconds` while no more processes are runnable
    than there are cores, else times the runnable processes per core (load 14 on 2 cores: 7x). RADIXKV_WAIT_SCALE
    multiplies it further. The one place the tests, the demo and the benchmarks scale their bounds: a wait ends when
    its event happens, so a generous bound costs nothing unless something is broken."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        load = 1.0
    return seconds * max(1.0, load) * float(os.environ.get("RADIXKV_WAIT_SCALE", "1"))


class _Announced:
    """A child that announces itself with one JSON line on stdout whose "event" is `event`; `stop()` is
    SIGTERM (a graceful stop), `kill()` SIGKILL. `log_path` receives its stderr; without one it is inherited."""

    def __init__(self, command: list[str], event: str, *, log_path: Path | None, timeout: float, log_mode: str) -> None:
        self.log_path = log_path
        self._log: IO[bytes] | None = open(log_path, log_mode) if log_path is not None else None  # noqa: SIM115
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log)
        self.pid = self.proc.pid
        try:
            self.announcement: dict[str, Any] = self._read_announcement(event, timeout)
        except BaseException:
            self.kill()
            raise

    def _read_announcement(self, event: str, timeout: float) -> dict[str, Any]:
        """The first stdout line, a JSON object whose "event" is `event`; errors carry the log's tail."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(bound := patient(timeout)):
                raise RuntimeError(f"{self.proc.args!r} did not announce itself within {bound:.0f} s{self._log_tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.proc.args!r} exited ({self.proc.wait()}) before {event}{self._log_tail()}")
        announcement: dict[str, Any] = json.loads(line)
        if announcement.get("event") != event:
            raise RuntimeError(f"{self.proc.args!r} announced {announcement!r}, expected the {event} event")
        return announcement

    def _log_tail(self) -> str:
        if self.log_path is None or self._log is None:
            return ""
        self._log.flush()
        return f"; log: {self.log_path.read_text()[-2000:]}"

    def stop(self, timeout: float = STOP_SECONDS) -> int:
        """SIGTERM, then SIGKILL if it has not exited in `patient(timeout)` s; the exit status (0 after a graceful
        stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(patient(timeout))
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

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ServerProcess(_Announced):
    """A running `python -m radixkv.server.process.app serve ARGS`; `stop()` (or leaving a `with` block) ends it
    (the server drains and frees its pools).

    `log_path` receives the server's stderr (its JSON log); without one, stderr is inherited. `keeper` (a
    socket) or `state_dir` take the pools' memory from a keeper (`--keeper`, `--state-dir`).
    """

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path | None = None,
        timeout: float = START_SECONDS,
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
            "radixkv.server.process.app",
            "serve",
            "--host",
            "127.0.0.1",
            *port,
            *keeper_flags,
            *args,
        ]
        super().__init__(command, "serving", log_path=log_path, timeout=timeout, log_mode="wb")
        self.port: int = int(self.announcement["port"])
        self.metrics_port: int | None = self.announcement.get("metrics_port")
        self.address = f"127.0.0.1:{self.port}"


class KeeperProcess(_Announced):
    """A running `python -m radixkv.server.process.keeper --state-dir DIR [ARGS]`: `stop()` is SIGTERM (it frees the
    memory),
    `kill()` is SIGKILL (the next keeper on DIR starts cold). `socket` is the path servers attach to."""

    def __init__(
        self,
        state_dir: str | Path,
        *,
        log_path: Path | None = None,
        timeout: float = START_SECONDS,
        args: Sequence[str] = (),
    ) -> None:
        command = [sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(state_dir), *args]
        super().__init__(command, "keeping", log_path=log_path, timeout=timeout, log_mode="ab")
        self.socket = Path(self.announcement["socket"])
        self.incarnation: str = self.announcement["incarnation"]
