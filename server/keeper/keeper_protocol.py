"""The keeper's wire: length-prefixed JSON frames on a Unix socket, checked field by field, never unpickled.

A frame is a 4-byte big-endian length N (1..MAX_FRAME_BYTES) and N bytes of a UTF-8 JSON object. A bad
length cannot be skipped safely, so it ends the connection after the error reply; a frame that parses
badly or names a wrong field gets an error reply and the connection goes on. Standard library only, so
the server and the keeper share it without either importing the other.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

VERSION = 1
SOCKET_NAME = "keeper.sock"  # in the state directory, beside LOCK_NAME (held by the live keeper)
LOCK_NAME = "keeper.lock"
MAX_FRAME_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")
_NAME_MAX = 128
TIERS = ("device", "host")  # a pool's KV memory, and its host tier (CPU memory evicted prefixes move to)
LAYOUT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype")
# op -> the keys its request must carry besides "op" (and no others)
REQUEST_KEYS: dict[str, tuple[str, ...]] = {
    "hello": (),
    "list": (),
    "create_or_attach": ("pool", "layout", "device", "tier"),
    "release": ("pool",),
}


def socket_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / SOCKET_NAME


class KeeperError(Exception):
    """A refused request: a stable `reason` and a message; the keeper replies with both, the client raises this."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class FrameError(KeeperError):
    """The stream itself is broken (bad length, closed mid-frame): the connection cannot go on."""


def trusted_uid(uid: int) -> bool:
    """Whether a process of `uid` may be on the other end of the keeper's socket, either way: this process's own
    user, or root (who can read either process's memory anyway)."""
    return uid in (os.getuid(), 0)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED, Linux)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def check_private_dir(path: Path) -> None:
    """Raises KeeperError("UNTRUSTED") unless `path` is a directory of a trusted uid that no group or other user may
    write: whoever may write it may put their own socket there, or read what is kept in it. One that does not exist
    raises FileNotFoundError (no keeper there)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise KeeperError("UNTRUSTED", f"keeper state directory {path} is not a directory")
    if not trusted_uid(st.st_uid):
        raise KeeperError(
            "UNTRUSTED", f"keeper state directory {path} is owned by uid {st.st_uid}, not by uid {os.getuid()} or root"
        )
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        why = f"has mode {mode:04o}: group or others may write it (the keeper makes it 0700)"
        raise KeeperError("UNTRUSTED", f"keeper state directory {path} {why}")


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError("BAD_FRAME", f"message of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_frame(sock: socket.socket, frame_timeout: float | None = None) -> bytes | None:
    """The next frame's body, or None on a clean end of stream between frames.

    Waits for a frame's first byte as the socket's own timeout says; once begun, the frame must be whole
    within `frame_timeout` seconds (TimeoutError otherwise), so a stalled peer cannot hold a reader forever.

    Raises:
        FrameError: a length out of range, or the stream ending inside a frame.
    """
    first = sock.recv(1)
    if not first:
        return None
    idle_timeout = sock.gettimeout()
    sock.settimeout(frame_timeout)
    try:
        header = first + _recv_exactly(sock, _LENGTH.size - 1)
        return _recv_exactly(sock, _frame_length(header))
    finally:
        sock.settimeout(idle_timeout)


def take_frame(buffer: bytearray) -> bytes | None:
    """The body of the first whole frame in `buffer`, removed from it; None while none is whole.

    Raises:
        FrameError: a length out of range.
    """
    if len(buffer) < _LENGTH.size:
        return None
    length = _frame_length(bytes(buffer[: _LENGTH.size]))
    if len(buffer) < _LENGTH.size + length:
        return None
    body = bytes(buffer[_LENGTH.size : _LENGTH.size + length])
    del buffer[: _LENGTH.size + length]
    return body


def _frame_length(header: bytes) -> int:
    (length,) = _LENGTH.unpack(header)
    if not 1 <= length <= MAX_FRAME_BYTES:
        raise FrameError("BAD_FRAME", f"frame length {length} outside 1..{MAX_FRAME_BYTES}")
    return int(length)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, received = [], 0
    while received < size:
        chunk = sock.recv(size - received)
        if not chunk:
            raise FrameError("BAD_FRAME", f"stream ended inside a frame ({received} of {size} bytes)")
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def decode_object(body: bytes) -> dict[str, Any]:
    """A frame body as a JSON object. Raises KeeperError("BAD_FRAME") for anything else."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise KeeperError("BAD_FRAME", f"not UTF-8 JSON: {e}") from None
    if not isinstance(message, dict):
        raise KeeperError("BAD_FRAME", f"expected a JSON object, got {type(message).__name__}")
    return message


def parse_request(body: bytes) -> dict[str, Any]:
    """A request, every field checked: op known, exactly its keys, each of the right type and range.

    Raises:
        KeeperError: BAD_FRAME (not a JSON object), UNKNOWN_OP, BAD_REQUEST (names the field).
    """
    request = decode_object(body)
    op = request.get("op")
    if not isinstance(op, str) or op not in REQUEST_KEYS:
        raise KeeperError("UNKNOWN_OP", f"op: expected one of {sorted(REQUEST_KEYS)}, got {op!r}")
    expected = {"op", *REQUEST_KEYS[op]}
    _exact_keys(request, expected, op)
    if "pool" in request:
        request["pool"] = check_pool_name(request["pool"])
    if "device" in request:
        request["device"] = _check_device(request["device"])
    if "tier" in request and request["tier"] not in TIERS:
        raise KeeperError("BAD_REQUEST", f"tier: expected one of {list(TIERS)}, got {request['tier']!r:.40}")
    if "layout" in request:
        request["layout"] = check_layout(request["layout"])
    return request


def check_pool_name(name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= _NAME_MAX or not name.isprintable():
        raise KeeperError("BAD_REQUEST", f"pool: expected 1..{_NAME_MAX} printable characters, got {name!r:.80}")
    return name


def check_layout(layout: object) -> dict[str, Any]:
    """The six layout fields, ints > 0 and a dtype string; the layout's own rules are checked by PoolLayout."""
    if not isinstance(layout, dict):
        raise KeeperError("BAD_REQUEST", f"layout: expected an object, got {type(layout).__name__}")
    _exact_keys(layout, set(LAYOUT_KEYS), "layout")
    for key in LAYOUT_KEYS[:-1]:
        value = layout[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**40:
            raise KeeperError("BAD_REQUEST", f"layout.{key}: expected a positive int, got {value!r:.40}")
    if not isinstance(layout["dtype"], str) or len(layout["dtype"]) > 32:
        raise KeeperError("BAD_REQUEST", f"layout.dtype: expected a dtype name, got {layout['dtype']!r:.40}")
    return layout


def _check_device(device: object) -> str:
    if device == "cpu":
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit() and len(device) <= 9:
        return device
    raise KeeperError("BAD_REQUEST", f"device: expected 'cpu' or 'cuda:N', got {device!r:.40}")


def _exact_keys(message: dict[str, Any], expected: set[str], what: str) -> None:
    missing, unknown = sorted(expected - set(message)), sorted(set(message) - expected)
    if missing or unknown:
        raise KeeperError("BAD_REQUEST", f"{what}: missing {missing}, unknown {[k[:40] for k in unknown][:8]}")


def error_reply(error: KeeperError) -> dict[str, Any]:
    return {"ok": False, "reason": error.reason, "message": error.message[:2000]}
