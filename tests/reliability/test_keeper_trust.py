"""Issue 32's attacks on the keeper (items 7 and 8), against real processes: whom a server attaches to, and
idle peers that took every connection.

Another local user is uid 65534 (nobody), whose processes this suite starts by dropping root's
privileges (`setpriv`), so those tests run only as root. A server must not attach to a keeper another user runs, nor
use a state directory another user owns or others may write; the keeper answers only its own uid
(and root). Idle connections are dropped, and never keep a probe or a server from the keeper.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixkv.server.keeper.keeper_protocol import recv_frame, send_frame
from radixkv.server.process.spawn import KeeperProcess, ServerProcess, patient

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

NOBODY = 65534
POOL = "default:num_layers=1,num_kv_heads=1,head_dim=4,block_size=4,num_blocks=64,dtype=float16"

as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="starting another user's processes needs root"
)
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A directory another user can reach (pytest's own tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="radixkv-trust-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _nobodys_keeper(state_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """`radixkv keeper --state-dir state_dir` run as uid 65534; returns once it announced itself."""
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, NOBODY, NOBODY)
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [*AS_NOBODY, sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(state_dir)],
            stdout=subprocess.PIPE, stderr=err, cwd="/",
        )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, f"nobody's keeper did not announce itself: {log.read_text()[-2000:]}"
    assert json.loads(proc.stdout.readline())["event"] == "keeping", log.read_text()[-2000:]
    return proc


def _serve(log: Path, *keeper_flags: str) -> tuple[int | None, str]:
    """Start `radixkv serve` with these keeper flags: (its exit status, its stderr); None if it started serving
    (it attached), after which it is stopped."""
    command = [sys.executable, "-m", "radixkv.server.process.app", "serve", "--host", "127.0.0.1", "--port", "0",
               "--pool", POOL, *keeper_flags]  # fmt: skip
    with open(log, "wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the serving line, or nothing when it exits
    if line and json.loads(line).get("event") == "serving":
        proc.terminate()
        proc.wait(patient(120))
        proc.stdout.close()
        return None, log.read_text()
    proc.stdout.close()
    return proc.wait(patient(120)), log.read_text()


def _list_as_nobody(state_dir: Path) -> list[dict[str, object]]:
    """The pools nobody's keeper holds, asked by nobody."""
    result = subprocess.run(
        [*AS_NOBODY, sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(state_dir), "--list"],
        capture_output=True, cwd="/", timeout=patient(120), check=True,
    )  # fmt: skip
    pools: list[dict[str, object]] = json.loads(result.stdout)["pools"]
    return pools


def _refused_in_one_line(stderr: str, *words: str) -> str:
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("radixkv serve: "), stderr[-2000:]
    for word in words:
        assert word in last, last
    return last


# -- item 7: the server attaches only to its own user's keeper, in a private directory --------------------------------


@as_root
def test_a_server_refuses_a_state_dir_and_a_keeper_of_another_user(tmp: Path) -> None:
    state = tmp / "nobody"
    keeper = _nobodys_keeper(state, tmp / "keeper.log")
    try:
        # --state-dir on the other user's directory (the attack: it attached, and nobody read the K/V).
        status, stderr = _serve(tmp / "server1.log", "--state-dir", str(state))
        assert status == 1, "attached to another user's keeper"
        _refused_in_one_line(stderr, str(state), f"uid {NOBODY}")
        # --keeper through a path in our own private directory that leads to it: the peer's uid refuses it.
        ours = tmp / "ours"
        ours.mkdir(mode=0o700)
        (ours / "keeper.sock").symlink_to(state / "keeper.sock")
        status, stderr = _serve(tmp / "server2.log", "--keeper", str(ours / "keeper.sock"))
        assert status == 1, "attached to another user's keeper"
        _refused_in_one_line(stderr, f"uid {NOBODY}", "keeper")
        assert _list_as_nobody(state) == [], "the other user's keeper was handed a pool"
    finally:
        keeper.terminate()
        keeper.wait(patient(120))
        assert keeper.stdout is not None
        keeper.stdout.close()


@as_root
def test_a_server_refuses_a_state_dir_others_may_write(tmp: Path) -> None:
    state = tmp / "state"
    with KeeperProcess(state, log_path=tmp / "keeper.log") as keeper:
        os.chmod(state, 0o777)  # the keeper made it 0700; someone opened it up since
        status, stderr = _serve(tmp / "server.log", "--keeper", str(keeper.socket))
        assert status == 1, "attached through a directory others may write"
        _refused_in_one_line(stderr, str(state), "0777")
        os.chmod(state, 0o700)
        status, _ = _serve(tmp / "server-again.log", "--keeper", str(keeper.socket))
        assert status is None, "the keeper's own private directory is refused"


@as_root
def test_the_keeper_answers_no_other_user_even_when_its_socket_is_opened_up(tmp: Path) -> None:
    state = tmp / "state"
    with KeeperProcess(state, log_path=tmp / "keeper.log") as keeper:
        os.chmod(state, 0o755)
        os.chmod(keeper.socket, 0o666)  # the file modes no longer keep nobody out: the peer's uid must
        probe = (  # the keeper refuses on connect: its reply may come before the request is sent
            "import contextlib, socket, sys; from radixkv.server.keeper.keeper_protocol import recv_frame, send_frame\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "with contextlib.suppress(OSError): send_frame(s, {'op': 'hello'})\n"
            "print(recv_frame(s, 30).decode())"
        )
        result = subprocess.run(
            [*AS_NOBODY, sys.executable, "-c", probe, str(keeper.socket)], capture_output=True, text=True,
            timeout=120, cwd="/",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        reply = json.loads(result.stdout)
        assert reply["ok"] is False and reply["reason"] == "PERMISSION_DENIED", result
        assert f"uid {NOBODY}" in reply["message"]


# -- item 8: idle connections neither lock out the keeper's probe nor a server's attach ------------------------------


def _idle(path: Path, n: int) -> list[socket.socket]:
    """`n` connections that never send a byte."""
    conns = []
    for _ in range(n):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        conns.append(sock)
    return conns


def _still_open(sock: socket.socket) -> bool:
    """The keeper has neither closed this connection nor written to it."""
    sock.setblocking(False)
    try:
        return not sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def _check(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(state), "--check"],
        capture_output=True, text=True, timeout=patient(120),
    )  # fmt: skip


def test_idle_connections_lock_out_neither_the_probe_nor_a_server(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with KeeperProcess(state, log_path=tmp_path / "keeper.log", args=["--idle-timeout", "600"]) as keeper:
        idle = _idle(keeper.socket, 40)  # the attack: 32 were enough to lock everyone out for good
        try:
            check = _check(state)
            assert check.returncode == 0, check.stderr
            assert json.loads(check.stdout)["incarnation"] == keeper.incarnation
            with ServerProcess(["--pool", POOL], tmp_path / "server.log", keeper=keeper.socket) as server:
                assert server.announcement["keeper"]["pools"] == {"default": "fresh"}
                # Served while every idle connection was still there: nothing had to be dropped first.
                assert all(_still_open(sock) for sock in idle)
        finally:
            for sock in idle:
                sock.close()


def test_a_connection_that_never_asks_is_dropped_and_one_that_holds_a_pool_is_not(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with KeeperProcess(state, log_path=tmp_path / "keeper.log", args=["--idle-timeout", "0.5"]) as keeper:
        with ServerProcess(["--pool", POOL], tmp_path / "server.log", keeper=keeper.socket) as server:
            spoke = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            spoke.connect(str(keeper.socket))
            send_frame(spoke, {"op": "hello"})
            assert recv_frame(spoke, 30) is not None
            (silent,) = _idle(keeper.socket, 1)
            silent.settimeout(60)
            reply = recv_frame(silent, 60)  # the keeper's answer to silence, then the end of the connection
            assert reply is not None and json.loads(reply)["reason"] == "IDLE", reply
            assert silent.recv(1) == b""
            silent.close()
            assert _still_open(spoke), "a connection that asked something is not idle"
            spoke.close()
            listed = json.loads(_list(state).stdout)["pools"]
            assert [(p["pool"], p["held"]) for p in listed] == [("default", True)], "the server's hold was dropped"
            assert server.proc.poll() is None
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700


def _list(state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "radixkv.server.process.keeper", "--state-dir", str(state), "--list"],
        capture_output=True, text=True, timeout=patient(120), check=True,
    )  # fmt: skip
