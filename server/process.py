"""`radixkv serve` as a child process: the one way the tests, the demo and the benchmarks start a server.

The child binds 127.0.0.1 (port 0, i.e. a free one, unless the arguments give `--port`) and announces
itself with one JSON line on stdout, `{"event": "serving", "port": P, "metrics_port": M, "kv_events": {...}}`;
the constructor returns once that line is read, so `address` is ready to dial. Standard library only:
importing this module loads neither torch nor grpc.
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

    `log_path` receives the server's stderr (its JSON log); without one, stderr is inherited.
    """

    def __init__(self, args: Sequence[str], log_path: Path | None = None, timeout: float = 60.0) -> None:
        port = [] if "--port" in args else ["--port", "0"]
        command = [sys.executable, "-m", "radixkv.server.app", "serve", "--host", "127.0.0.1", *port, *args]
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
