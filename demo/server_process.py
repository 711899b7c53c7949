"""A `radixkv serve` child process with one CPU pool in shared memory, for the length of a `with` block.

The demo (and its tests) talk to a real server in another process, as an orchestrator would: the
pool's memory belongs to that process, and the worker here maps it. Starting and stopping the
child is `radixkv.server.process.spawn.ServerProcess`'s job; this only shapes the pool.
"""

from __future__ import annotations

from types import TracebackType

from radixkv.memory.layout import PoolLayout
from radixkv.server.process import spawn as process

POOL_NAME = "default"


class ServerProcess:
    """Starts the server on a free port of 127.0.0.1; `__enter__` returns its address once it serves."""

    def __init__(
        self, layout: PoolLayout, start_timeout: float = process.START_SECONDS, *, host_num_blocks: int = 0
    ) -> None:
        """`host_num_blocks`: the pool's host tier, where evicted prefixes and swapped-out sequences go (0: none)."""
        self.layout = layout
        self.start_timeout = start_timeout
        self.host_num_blocks = host_num_blocks
        self._server: process.ServerProcess | None = None

    @property
    def pool_flag(self) -> str:
        fields = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")
        host = f",host_num_blocks={self.host_num_blocks}" if self.host_num_blocks else ""
        return f"{POOL_NAME}:" + ",".join(f"{f}={getattr(self.layout, f)}" for f in fields) + ",device=cpu" + host

    def __enter__(self) -> str:
        args = ["--pool", self.pool_flag, "--log-level", "warning"]
        self._server = process.ServerProcess(args, timeout=self.start_timeout)
        return self._server.address

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """SIGTERM: the server drains and frees its shared memory; a server that hangs is killed."""
        server, self._server = self._server, None
        if server is not None:
            server.stop()
