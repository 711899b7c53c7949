"""A `radixkv serve` child process with one CPU pool in shared memory, for the length of a `with` block.

The demo (and its tests) talk to a real server in another process, as an orchestrator would: the
pool's memory belongs to that process, and the worker here maps it.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from types import TracebackType

from radixkv.layout import PoolLayout

POOL_NAME = "default"


class ServerProcess:
    """Starts the server on a free port of 127.0.0.1; `__enter__` returns its address once it serves."""

    def __init__(self, layout: PoolLayout, start_timeout: float = 60.0) -> None:
        self.layout = layout
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[str] | None = None

    @property
    def pool_flag(self) -> str:
        fields = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")
        return f"{POOL_NAME}:" + ",".join(f"{f}={getattr(self.layout, f)}" for f in fields) + ",device=cpu"

    def __enter__(self) -> str:
        command = [sys.executable, "-m", "radixkv.server.app", "--pool", self.pool_flag, "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            port = self._wait_for_port()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return f"127.0.0.1:{port}"

    def _wait_for_port(self) -> int:
        """Read the server's announcement line, `{"event": "serving", "port": P, ...}`."""
        assert self._process is not None and self._process.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self._process.stdout], [], [], left)
            if not ready:
                break
            line = self._process.stdout.readline()
            if not line:
                raise RuntimeError(f"radixkv server exited with status {self._process.wait()} before serving")
            message = json.loads(line)
            if message.get("event") == "serving":
                return int(message["port"])
        raise TimeoutError(f"radixkv server did not announce its port within {self.start_timeout} s")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """SIGTERM: the server drains and frees its shared memory; a server that hangs is killed."""
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
