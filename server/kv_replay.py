"""Replay of missed KV-event batches, vLLM's ROUTER protocol, served off the publishing path.

A consumer (llm-d's subscriber, vLLM's example, a DEALER or REQ socket) sends `[b"", start_seq u64 BE]`;
the ROUTER sees `[identity, b"", start_seq]` and answers, exactly as `vllm/distributed/kv_events.py`
(`ZmqEventPublisher._service_replay`, vLLM 0.26-0.34), every buffered batch from `start_seq` as
`[identity, b"", topic, seq u64 BE, payload]`, then the end marker `[identity, b"", b"", -1 as i64 BE, b""]`.

Unlike vLLM, where the one publisher thread answers replays between batches (a flood of requests
holds live batches back), the replay socket has its own thread and reads the batches from
`ReplayBuffer`, a ring the publisher writes under a short lock. A replay is bounded, so no peer can
slow live publishing or grow memory without bound:

- a peer (ZMQ routing identity) has at most one replay in flight; its other requests are dropped;
- at most `max_replays` peers are served at once; requests beyond are dropped (the consumer's own
  timeout retries them: llm-d waits 2 s per attempt);
- requests are read at most `_REQUESTS_PER_PASS` a pass, with a pause after a full one, so a flood
  costs this thread a bounded share of the CPU (and the GIL): the rest waits in each peer's bounded
  receive queue (`RCVHWM`) and then in TCP, which stops the sender at no cost to the server;
- a reply is sent without blocking (`ROUTER_MANDATORY`, `NOBLOCK`) up to the peer's send high-water
  mark (`SEND_HWM` batches), a few batches per peer per pass, round robin; a peer that takes nothing
  for `STALL_SECONDS` is dropped. So a peer costs at most `SEND_HWM` queued batches, whatever it asks,
  and the publisher thread never waits for any of it.

A replay covers the batches buffered when it was asked for (those after come live); if the ring
overwrites one before it is sent, the reply ends early with the end marker and the consumer's gap
check asks again, as it would after an overflow in vLLM.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import zmq

log = logging.getLogger("radixkv.server.kv_replay")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's ZmqEventPublisher.END_SEQ
STALL_SECONDS = 5.0  # a peer whose high-water mark stays full this long loses its replay (llm-d gives up after 2 s)
SEND_HWM = 100  # batches queued to one peer at most: its memory bound (100 batches of up to 1024 events)
_BATCHES_PER_PASS = 16  # per peer, before the next peer's turn (and the next read of requests)
_REQUESTS_PER_PASS = 16  # read per pass, so a flood of requests cannot starve the replies
_FLOOD_PAUSE_SECONDS = 0.01  # after a pass that read its fill: requests beyond ~1,600/s wait in ZMQ's queues
_IDLE_POLL_MS = 50  # how soon a request is seen (and a stop) when nothing is being replayed
_BLOCKED_POLL_MS = 5  # the wait before retrying peers whose high-water mark is full


class ReplayBuffer:
    """The last `capacity` batches by seq: written by the publisher thread, read by the replay thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: list[tuple[int, bytes] | None] = [None] * capacity
        self._next = 0  # the seq the next batch will have
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            assert seq == self._next, f"batches are appended in seq order: got {seq}, expected {self._next}"
            self._slots[seq % self.capacity] = (seq, payload)
            self._next = seq + 1

    def window(self) -> tuple[int, int]:
        """(the oldest seq held, the seq after the newest)."""
        with self._lock:
            return max(0, self._next - self.capacity), self._next

    def get(self, seq: int) -> bytes | None:
        """The payload of batch `seq`, or None once overwritten (or not yet published)."""
        with self._lock:
            entry = self._slots[seq % self.capacity]
        return entry[1] if entry is not None and entry[0] == seq else None


class _Replay:
    __slots__ = ("identity", "next_seq", "end_seq", "last_progress")

    def __init__(self, identity: bytes, next_seq: int, end_seq: int) -> None:
        self.identity, self.next_seq, self.end_seq = identity, next_seq, end_seq
        self.last_progress = time.monotonic()


class ReplayServer:
    """Answers replay requests on `socket` (a bound ROUTER) from its own thread; `start`, then `close`."""

    def __init__(self, socket: zmq.Socket[bytes], buffer: ReplayBuffer, topic: bytes, max_replays: int) -> None:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises instead of silently dropping
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.RCVHWM, 1000)  # requests queued per peer at most
        self._socket = socket
        self._buffer = buffer
        self._topic = topic
        self._max_replays = max_replays
        self._active: dict[bytes, _Replay] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-replay", daemon=True)
        self.num_served = 0  # replays answered to the end marker
        self.num_dropped_requests = 0  # requests dropped: malformed, a peer's second, or past max_replays
        self.num_dropped_peers = 0  # replays abandoned: the peer left or stalled

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._socket.close(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            num_read = 0
            if self._socket.poll(0 if self._active else _IDLE_POLL_MS, zmq.POLLIN):
                num_read = self._read_requests()
            progressed = bool(self._active) and self._send_pass()
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
            if identity in self._active or len(self._active) >= self._max_replays:
                self.num_dropped_requests += 1
                continue
            first, end = self._buffer.window()
            start = int.from_bytes(frames[2], "big")
            self._active[identity] = _Replay(identity, max(start, first), end)
        return _REQUESTS_PER_PASS

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
        """Up to a pass's batches to one peer, then its end marker once done; the number of messages sent."""
        sent = 0
        try:
            while sent < _BATCHES_PER_PASS and replay.next_seq < replay.end_seq:
                payload = self._buffer.get(replay.next_seq)
                if payload is None:  # overwritten meanwhile: end here, the consumer sees the gap
                    replay.end_seq = replay.next_seq
                    break
                seq = replay.next_seq.to_bytes(8, "big")
                self._socket.send_multipart((replay.identity, b"", self._topic, seq, payload), zmq.NOBLOCK)
                replay.next_seq += 1
                sent += 1
            if replay.next_seq >= replay.end_seq and sent < _BATCHES_PER_PASS:
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
