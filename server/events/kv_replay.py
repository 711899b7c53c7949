"""Replay of missed KV-event batches, vLLM's ROUTER protocol, served off the publishing path.

A consumer (llm-d's subscriber, vLLM's example, a DEALER or REQ socket) sends `[b"", start_seq u64 BE]`;
the ROUTER sees `[identity, b"", start_seq]` and answers, exactly as `vllm/distributed/kv_events.py`
(`ZmqEventPublisher._service_replay`, vLLM 0.26-0.34), every buffered batch from `start_seq` as
`[identity, b"", topic, seq u64 BE, payload]`, then the end marker `[identity, b"", b"", -1 as i64 BE, b""]`.

Unlike vLLM, where the one publisher thread answers replays between batches (a flood of requests
holds live batches back), the replay socket has its own thread and reads the batches from
`ReplayBuffer`, a ring bounded in batches and in bytes that the publisher writes under a short lock.
Everything a peer can make this socket hold is bounded, in bytes and in aggregate:

- peers: at most `kv_events_max_replay_peers` connections at once (`kv_events_sockets.PeerGate`, consulted
  at each handshake: one more is refused and closed by ZMQ); each holds at most `RECV_HWM` requests of at most
  `MAX_FRAME_BYTES` a frame (a larger frame disconnects it), and what it held goes with it;
- replays: at most `max_replays` at once, one per peer, each at most `SEND_HWM` batches queued
  (`ROUTER_MANDATORY`, `NOBLOCK`), a batch at most `kv_events_max_batch_bytes`, and `SEND_BUFFER_BYTES` in
  the kernel; a peer that takes nothing for `STALL_SECONDS` loses its replay;
- waiting requests: one per peer (its others are dropped), the shortest replay served first;
- work: requests are read `_REQUESTS_PER_PASS` a pass, with a pause after a full one; a pass sends each
  replay at most `_BATCHES_PER_PASS` batches and `_BYTES_PER_PASS` bytes, round robin (fair share);
- time: a replay runs at most `kv_events_replay_seconds`, and once it has run `REPLAY_SLICE_SECONDS` a
  waiting peer preempts it (the longest-running first). A replay cut short ends with the end marker
  where the peer can take it: the consumer's gap check asks again from where it got to, so a slow reader
  finishes in slices and never keeps a slot from a router that needs a short replay.

A replay covers the batches buffered when it started (those after come live); if the ring drops one
before it is sent, the reply ends early with the end marker and the consumer's gap check asks again,
as it would after an overflow in vLLM.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time

import zmq

from radixkv.server.events.kv_events_sockets import PeerGate

log = logging.getLogger("radixkv.server.events.kv_replay")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's ZmqEventPublisher.END_SEQ
STALL_SECONDS = 5.0  # a peer whose high-water mark stays full this long loses its replay (llm-d gives up after 2 s)
SEND_HWM = 16  # batches queued to one peer at most: with kv_events_max_batch_bytes, its memory bound
RECV_HWM = 2  # requests queued from one peer at most (it has one replay at a time: more is waste)
MAX_FRAME_BYTES = 64  # a request's frames are 0 and 8 bytes; a peer sending a larger frame is disconnected
SEND_BUFFER_BYTES = 256 << 10  # the kernel's send buffer per peer (SO_SNDBUF): what a slow reader parks there
REPLAY_SLICE_SECONDS = 1.0  # a replay runs this long before a waiting peer may preempt it
_BATCHES_PER_PASS = 16  # per peer, before the next peer's turn (and the next read of requests)
_BYTES_PER_PASS = 1 << 20  # per peer and pass, at least one batch: a peer's share is in bytes, not batches
_REQUESTS_PER_PASS = 16  # read per pass, so a flood of requests cannot starve the replies
_FLOOD_PAUSE_SECONDS = 0.01  # after a pass that read its fill: requests beyond ~1,600/s wait in ZMQ's queues
_IDLE_POLL_MS = 50  # how soon a request is seen (and a stop) when nothing is being replayed
_BLOCKED_POLL_MS = 5  # the wait before retrying peers whose high-water mark is full


class ReplayBuffer:
    """The last batches by seq, at most `capacity` of them and `max_bytes` of payload (the oldest go first):
    written by the publisher thread, read by the replay thread."""

    def __init__(self, capacity: int, max_bytes: int = 64 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._payloads: dict[int, bytes] = {}
        self._first = 0  # the oldest seq held
        self._next = 0  # the seq the next batch will have
        self.num_bytes = 0  # of the payloads held: never above max_bytes
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        assert len(payload) <= self.max_bytes, "a batch is bounded below the ring (kv_events_max_batch_bytes)"
        with self._lock:
            assert seq == self._next, f"batches are appended in seq order: got {seq}, expected {self._next}"
            self._payloads[seq] = payload
            self._next = seq + 1
            self.num_bytes += len(payload)
            while self.num_bytes > self.max_bytes or self._next - self._first > self.capacity:
                self.num_bytes -= len(self._payloads.pop(self._first))
                self._first += 1

    def window(self) -> tuple[int, int]:
        """(the oldest seq held, the seq after the newest)."""
        with self._lock:
            return self._first, self._next

    def get(self, seq: int) -> bytes | None:
        """The payload of batch `seq`, or None once dropped (or not yet published)."""
        with self._lock:
            return self._payloads.get(seq)

    def check_invariants(self) -> None:
        with self._lock:
            assert self.num_bytes == sum(map(len, self._payloads.values())), "the ring's byte count drifted"
            assert self.num_bytes <= self.max_bytes, "the ring holds more bytes than its bound"
            assert list(self._payloads) == list(range(self._first, self._next)), "the ring holds a gap"


class _Replay:
    __slots__ = ("identity", "next_seq", "end_seq", "started", "last_progress", "sent")

    def __init__(self, identity: bytes, *, next_seq: int, end_seq: int, now: float) -> None:
        self.identity, self.next_seq, self.end_seq = identity, next_seq, end_seq
        self.started = self.last_progress = now
        self.sent: collections.deque[int] = collections.deque(maxlen=SEND_HWM)  # sizes of the last batches sent


class ReplayServer:
    """Answers replay requests on `socket` (a bound ROUTER) from its own thread; `start`, then `close`."""

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        buffer: ReplayBuffer,
        *,
        topic: bytes,
        max_replays: int,
        max_seconds: float = 30.0,
        gate: PeerGate | None = None,
    ) -> None:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises instead of silently dropping
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.RCVHWM, RECV_HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        socket.setsockopt(zmq.SNDBUF, SEND_BUFFER_BYTES)  # else autotuning parks megabytes per peer in the kernel
        self._socket = socket
        self._buffer = buffer
        self._topic = topic
        self._max_replays = max_replays
        self._max_seconds = max_seconds
        self.gate = gate
        self._max_waiting = gate.max_peers if gate is not None else max_replays
        self._active: dict[bytes, _Replay] = {}
        self._waiting: dict[bytes, int] = {}  # identity -> start seq, in order of arrival
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-replay", daemon=True)
        self.num_served = 0  # replays answered to the end marker
        self.num_dropped_requests = 0  # requests dropped: malformed, a peer's second, or past the waiting room
        self.num_dropped_peers = 0  # replays abandoned: the peer left or stalled
        self.num_preempted = 0  # replays ended early for a waiting peer, or past kv_events_replay_seconds
        self._reply_bytes = 0  # what the active replays may have queued (the replay thread writes it each pass)

    @property
    def num_queued_bytes(self) -> int:
        """At most what this socket holds for its peers now: the batches each replay may still have queued
        (its last `SEND_HWM`) and each connected peer's request queue. Back to 0 when the peers have gone."""
        replies = self._reply_bytes
        peers = self.gate.num_peers if self.gate is not None else 0
        return replies + peers * RECV_HWM * 2 * MAX_FRAME_BYTES

    @property
    def num_replays(self) -> int:
        return len(self._active)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.gate is not None:
            self.gate.close()
        self._socket.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            num_read = 0
            if self._socket.poll(0 if self._active else _IDLE_POLL_MS, zmq.POLLIN):
                num_read = self._read_requests()
            if self.gate is not None:
                self.gate.num_peers  # noqa: B018 (reads the monitor: closed connections leave the count)
            self._schedule(time.monotonic())
            progressed = bool(self._active) and self._send_pass()
            self._reply_bytes = sum(sum(r.sent) for r in self._active.values())
            if num_read == _REQUESTS_PER_PASS:
                self._stop.wait(_FLOOD_PAUSE_SECONDS)  # flooded: leave the rest queued for a while
            elif self._active and not progressed:
                self._socket.poll(_BLOCKED_POLL_MS, zmq.POLLIN)  # every peer is full: wait a little, or a request

    def _read_requests(self) -> int:
        """Up to a pass's requests; returns how many were read."""
        for num_read in range(_REQUESTS_PER_PASS):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return num_read
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.num_dropped_requests += 1
                log.debug("dropping a malformed replay request", extra={"num_frames": len(frames)})
                continue
            identity = frames[0]
            if identity in self._active or identity in self._waiting or len(self._waiting) >= self._max_waiting:
                self.num_dropped_requests += 1
                continue
            self._waiting[identity] = int.from_bytes(frames[2], "big")
        return _REQUESTS_PER_PASS

    def _schedule(self, now: float) -> None:
        """End replays past their time; give free slots to waiting peers, the shortest replay first (a router
        catching up on a few batches never waits behind full replays), preempting for each one a replay that has
        had its slice (the longest-running first)."""
        for replay in [r for r in self._active.values() if now - r.started > self._max_seconds]:
            self._cut(replay)
        while self._waiting:
            if len(self._active) >= self._max_replays:
                oldest = min(self._active.values(), key=lambda r: r.started)
                if now - oldest.started < REPLAY_SLICE_SECONDS:
                    return
                self._cut(oldest)
            first, end = self._buffer.window()
            # The latest start is the shortest replay (all end at `end`); `max` keeps the first of equals.
            identity = max(self._waiting, key=lambda i: max(self._waiting[i], first))
            start = self._waiting.pop(identity)
            self._active[identity] = _Replay(identity, next_seq=max(start, first), end_seq=end, now=now)

    def _cut(self, replay: _Replay) -> None:
        """End `replay` before its last batch: the end marker if the peer has room for it (else it times out and
        asks again, as it would after any lost reply)."""
        del self._active[replay.identity]
        self.num_preempted += 1
        try:
            self._socket.send_multipart((replay.identity, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError:  # full (Again) or gone (EHOSTUNREACH): nothing more is owed
            pass

    def _send_pass(self) -> bool:
        """One round over the active replays; True if any peer took anything."""
        progressed = False
        now = time.monotonic()
        for replay in list(self._active.values()):
            sent = self._send_some(replay)
            if sent:
                progressed = True
                replay.last_progress = now
            elif replay.identity in self._active and now - replay.last_progress > STALL_SECONDS:
                del self._active[replay.identity]
                self.num_dropped_peers += 1
        return progressed

    def _send_some(self, replay: _Replay) -> int:
        """Up to a pass's share to one peer, then its end marker once done; the number of messages sent."""
        sent = num_bytes = 0
        try:
            while sent < _BATCHES_PER_PASS and num_bytes < _BYTES_PER_PASS and replay.next_seq < replay.end_seq:
                payload = self._buffer.get(replay.next_seq)
                if payload is None:  # dropped from the ring meanwhile: end here, the consumer sees the gap
                    replay.end_seq = replay.next_seq
                    break
                seq = replay.next_seq.to_bytes(8, "big")
                self._socket.send_multipart((replay.identity, b"", self._topic, seq, payload), zmq.NOBLOCK)
                replay.sent.append(len(payload))
                replay.next_seq += 1
                sent += 1
                num_bytes += len(payload)
            if replay.next_seq >= replay.end_seq and sent < _BATCHES_PER_PASS and num_bytes < _BYTES_PER_PASS:
                self._socket.send_multipart((replay.identity, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                del self._active[replay.identity]
                self.num_served += 1
                sent += 1
        except zmq.Again:  # its high-water mark is full: its turn comes again
            pass
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            del self._active[replay.identity]  # the peer left
            self.num_dropped_peers += 1
        return sent
