"""Issue 42's attacks on the KV-event path (items 6-10), one test each, against a real server process.

Each bounds bytes or work, not a count: the replay ring and every batch in bytes, nothing republished
for nothing, the replay socket's peers and what they hold, the replay slots' time, the event hub's
per-namespace state, and what a withheld tenant shows others. What the server holds is read from its
Prometheus endpoint (and /proc for RSS); waits are on events with generous bounds, never timings.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from radixkv.client import RadixKVClient
from radixkv.client.fleet.prefix_index import PrefixIndex
from radixkv.server.process.spawn import ServerProcess, patient
from tests.subscribers import connect_and_handshake

pytestmark = pytest.mark.slow  # runs first under `make test` (tests/conftest.py)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _pool(block_size: int, num_blocks: int, **keys: object) -> str:
    extra = "".join(f",{k}={v}" for k, v in keys.items())
    return (
        f"default:num_layers=1,num_kv_heads=1,head_dim=4,block_size={block_size},num_blocks={num_blocks},"
        f"dtype=float16,max_tokens_per_request=65536,kv_events_endpoint=tcp://127.0.0.1:0,"
        f"kv_events_replay_endpoint=tcp://127.0.0.1:0,kv_events_digest_endpoint=tcp://127.0.0.1:0{extra}"
    )


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Start a server with these flags and a metrics port (stopped when the test ends)."""
    started: list[ServerProcess] = []

    def run(*args: str) -> ServerProcess:
        proc = ServerProcess([*args, "--metrics-port", "0"], tmp_path / f"server{len(started)}.log")
        started.append(proc)
        return proc

    yield run
    for proc in started:
        assert proc.stop() == 0, proc.log_path.read_text()[-2000:]


def _tenants(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return str(path)


def metrics(server: ServerProcess) -> dict[str, float]:
    """The server's pool-level series by name (the "default" pool's, or unlabelled), counters without _total."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.announcement['metrics_port']}/metrics", timeout=60) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("pool", "default") == "default" and not sample.name.endswith("_created"):
                values[sample.name.removesuffix("_total")] = sample.value
    return values


def rss_bytes(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc")


def wait_until(predicate: Callable[[], bool], timeout: float = 120.0) -> bool:
    """Poll `predicate` until true or `patient(timeout)` seconds pass (the bound stretches on a loaded machine)."""
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _socket(kind: int, endpoint: str, handshake: bool = False, **options: int) -> zmq.Socket:
    """`handshake`: return once connected (tests/subscribers.py), so that the publisher's next batch reaches it."""
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        socket.setsockopt(getattr(zmq, name), value)
    if kind == zmq.SUB:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
    if handshake:
        connect_and_handshake(socket, endpoint)
    else:
        socket.connect(endpoint)
    return socket


def _drain(sub: zmq.Socket, wait_ms: int = 500) -> list[list[bytes]]:
    """Every message `sub` has, until it has been quiet for `wait_ms`."""
    messages = []
    while sub.poll(wait_ms):
        messages.append(sub.recv_multipart())
    return messages


def _write(client: RadixKVClient, tokens: list[int], namespace: str = "default") -> None:
    seq_id = client.open(tokens, namespace).seq_id
    client.commit([seq_id], [len(tokens)])
    client.release(seq_id)


# -- 6: the ring and each batch in bytes; nothing republished for nothing ----------------------------------------


def test_preempt_resume_cycles_republish_nothing_and_ring_and_batches_stay_within_their_bytes(
    start: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """A tenant over its cache share preempts and resumes one 2,000-block sequence 150 times: each preempt caches
    the blocks and its share evicts them again in the same call. Before: 2 batches a cycle, the whole prompt each
    time. Now: the blocks stored and removed in one call are published by neither event. Then another tenant's
    long prompts: every batch within kv_events_max_batch_bytes (a long prompt split into a chain), and the
    ring never over kv_events_buffer_bytes, whatever is published."""
    max_batch, ring_bound = 16 << 10, 96 << 10
    tenants = _tenants(
        tmp_path,
        '[tenants.a]\ntoken = "a-token-0000000000"\nmax_cached_blocks = 16\n'
        '[tenants.b]\ntoken = "b-token-0000000000"\n',
    )
    server = start(
        "--pool", _pool(16, 8192, kv_events_max_batch_bytes=max_batch, kv_events_buffer_bytes=ring_bound),
        "--auth-tokens", tenants, "--kv-events-insecure-publish-tenant-prompts",
    )  # fmt: skip
    kv = server.announcement["kv_events"]["default"]
    sub = _socket(zmq.SUB, kv["endpoint"], handshake=True, RCVHWM=0)
    try:
        with RadixKVClient(server.address, token="a-token-0000000000") as client:
            tokens = list(range(100_000, 132_000))  # 2,000 blocks; ids over 65,535: 5 bytes each on the wire
            seq_id = client.open(tokens, "chat").seq_id
            client.commit([seq_id], [len(tokens)])
            for _ in range(150):
                client.preempt([seq_id], "recompute")
                client.resume(seq_id)
                client.commit([seq_id], [client.num_tokens(seq_id)])
            client.release(seq_id, cache=False)
        cycles = _drain(sub)
        num_bytes = sum(len(m[2]) for m in cycles)
        assert len(cycles) <= 10, f"150 cycles published {len(cycles)} batches ({num_bytes} bytes)"
        assert metrics(server)["radixkv_kv_events_coalesced_blocks"] > 0

        seen_ring = []
        with RadixKVClient(server.address, token="b-token-0000000000") as client:
            for i in range(40):  # 40 x 1,000 blocks x ~90 bytes: 3.6 MB through a 96 KiB ring
                _write(client, [i * 100_000 + t for t in range(16_000)], "chat")
                seen_ring.append(metrics(server)["radixkv_kv_events_ring_bytes"])
        long = _drain(sub)
    finally:
        sub.close()
    assert all(len(m[2]) <= max_batch for m in cycles + long), "every batch within kv_events_max_batch_bytes"
    assert len(long) >= 40 * 5, "each 16,000-token prompt split into several batches"
    assert max(seen_ring) <= ring_bound and seen_ring[-1] > ring_bound / 2, seen_ring
    after = metrics(server)
    assert after["radixkv_kv_events_split_events"] >= 40 and after["radixkv_kv_events_refused_events"] == 0
    dealer = _socket(zmq.DEALER, kv["replay_endpoint"])
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(60_000), "the replay ends with its marker"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            replayed.append(len(frames[3]))
    finally:
        dealer.close()
    assert 0 < sum(replayed) <= ring_bound, "a replay from 0 gets what the ring holds: the newest, within its bytes"


# -- 7: the replay socket's peers ----------------------------------------------------------------------------------


def test_replay_peers_are_capped_and_what_they_hold_goes_with_them(start: Callable[..., ServerProcess]) -> None:
    """1,000 anonymous connections, each sending 1,000 9-byte requests and reading nothing. Before: every one admitted,
    ~1,000 requests queued each (RSS grew by hundreds of MiB and stayed). Now: at most kv_events_max_replay_peers
    connections (the rest refused at the handshake), two requests queued each; when they leave, the peer count and
    the queued bytes go back to 0 and a consumer gets its whole replay."""
    max_peers = 32
    server = start("--pool", _pool(4, 256, kv_events_max_replay_peers=max_peers))
    kv = server.announcement["kv_events"]["default"]
    with RadixKVClient(server.address) as client:
        for i in range(20):
            _write(client, [i * 1000 + t for t in range(9)])
    rss_before = rss_bytes(server)
    flood: list[zmq.Socket] = []
    try:
        for _ in range(1000):
            # A slow reconnect keeps the refused ones' retries off this 2-core box's CPU; the cap is what is tested.
            dealer = _socket(zmq.DEALER, kv["replay_endpoint"], RECONNECT_IVL=2000, SNDHWM=1000)
            for _ in range(1000):
                try:
                    dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"x"], zmq.NOBLOCK)  # 9 bytes, malformed
                except zmq.Again:
                    break
            flood.append(dealer)
        assert wait_until(lambda: metrics(server)["radixkv_kv_replay_refused_peers"] >= 1000 - max_peers)
        during = metrics(server)
        rss_during = rss_bytes(server)
        assert during["radixkv_kv_replay_peers"] <= 2 * max_peers, during  # and those being refused right now
        assert during["radixkv_kv_replay_queued_bytes"] <= 2 * max_peers * 2 * 64 + (1 << 20)
    finally:
        for dealer in flood:
            dealer.close()
    assert wait_until(lambda: metrics(server)["radixkv_kv_replay_peers"] == 0), "closed connections leave the count"
    assert metrics(server)["radixkv_kv_replay_queued_bytes"] == 0
    assert rss_during - rss_before < 64 << 20, f"RSS grew {(rss_during - rss_before) >> 20} MiB under the flood"
    consumer = _socket(zmq.DEALER, kv["replay_endpoint"])
    try:
        consumer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert consumer.poll(60_000), "a consumer is admitted once the flood has gone"
            frames = consumer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        consumer.close()
    assert seqs and seqs == list(range(seqs[0], seqs[-1] + 1)) and seqs[0] == 0


def test_subscribers_of_each_pub_socket_are_capped(start: Callable[..., ServerProcess]) -> None:
    """The same class on the PUB sockets: each queues up to 1,000 batches per subscriber, so their number is bounded
    too (kv_events_max_subscribers): 4 subscribers connected under a cap of 4, 36 more are refused however they
    retry, and a subscriber within the cap reads every batch."""
    server = start("--pool", _pool(4, 256, kv_events_max_subscribers=4))
    kv = server.announcement["kv_events"]["default"]
    # Four connect first, each handshake done before the next; then 36 more, refused however they retry. (Forty at
    # once on a loaded machine can all be refused: each handshake of a storm counts the others not yet closed.)
    subs = [_socket(zmq.SUB, kv["endpoint"], handshake=True, RECONNECT_IVL=2000) for _ in range(4)]
    subs += [_socket(zmq.SUB, kv["endpoint"], RECONNECT_IVL=2000) for _ in range(36)]
    try:
        assert wait_until(lambda: metrics(server)["radixkv_kv_events_refused_subscribers"] >= 36)
        assert metrics(server)["radixkv_kv_events_subscribers"] <= 8  # 4, and those being refused right now
        poller = zmq.Poller()
        for sub in subs:
            poller.register(sub, zmq.POLLIN)
        received: set[zmq.Socket] = set()
        with RadixKVClient(server.address) as client:
            # PUB drops a batch sent before a subscription reached it: a new prompt each try until one arrives
            for attempt in range(10):
                _write(client, [100 * attempt + t for t in range(1, 6)])
                received |= {sock for sock, _ in poller.poll(int(patient(5_000)))}
                if received:
                    break
        assert 1 <= len(received) <= 4, f"{len(received)} subscribers got a batch"
    finally:
        for sub in subs:
            sub.close()
    assert wait_until(lambda: metrics(server)["radixkv_kv_events_subscribers"] == 0)


# -- 8: slow, steady readers ---------------------------------------------------------------------------------------


class _SlowReaders:
    """40 peers that each read about 60 batches (~500 KB) a second, steadily (never silent long enough to be dropped
    as stalled), and ask for the whole ring every 2 s whatever they are reading: a request always waiting."""

    def __init__(self, endpoint: str, num_readers: int = 40) -> None:
        self.readers = [_socket(zmq.DEALER, endpoint, RCVHWM=16, RCVBUF=1 << 14) for _ in range(num_readers)]
        self.num_batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _SlowReaders:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        for reader in self.readers:
            reader.close()

    def _run(self) -> None:
        now = time.monotonic()
        asked = [now - 2.0 + 2.0 * i / len(self.readers) for i in range(len(self.readers))]  # spread over the 2 s
        while not self._stop.wait(0.05):
            now = time.monotonic()
            for i, reader in enumerate(self.readers):
                if now - asked[i] > 2.0:
                    asked[i] = now
                    reader.send_multipart([b"", (0).to_bytes(8, "big")])
                for _ in range(3):  # 3 every 50 ms
                    if not reader.poll(0):
                        break
                    if reader.recv_multipart()[2] != END_SEQ:
                        self.num_batches += 1


def test_a_router_replays_while_slow_steady_readers_want_every_slot(start: Callable[..., ServerProcess]) -> None:
    """40 readers, each steadily taking ~60 batches a second, ask again and again for the whole ring (~1,500 batches
    of ~8 KB); a router asks 16 times for the last few. Before: the slow readers' requests took every slot as soon
    as one freed (a reply that makes progress is never dropped) and the router's requests were dropped. Now: a
    waiting peer preempts a replay that has had its slice, the shortest replay goes first, and the router's 16
    replays all complete."""
    server = start("--pool", _pool(4, 512))
    kv = server.announcement["kv_events"]["default"]
    with RadixKVClient(server.address) as client:
        for i in range(1500):  # 275 blocks each in a 512-block pool: each evicts the one before (a removal, a store)
            _write(client, [i * 10_000 + t for t in range(1_100)])
    sub = _socket(zmq.DEALER, kv["replay_endpoint"])
    try:  # where the stream is: the last seq of a replay from far ahead ends at the newest batch
        sub.send_multipart([b"", (1_200).to_bytes(8, "big")])
        seqs = []
        while (frames := sub.recv_multipart())[2] != END_SEQ:
            seqs.append(int.from_bytes(frames[2], "big"))
    finally:
        sub.close()
    last = seqs[-1]
    assert last >= 1_200, "about 1,500 batches in the ring"
    with _SlowReaders(kv["replay_endpoint"]) as readers:
        assert wait_until(lambda: readers.num_batches >= 500), "the slow readers are being served"
        num_read = readers.num_batches
        router = _socket(zmq.DEALER, kv["replay_endpoint"])
        completed = 0
        try:
            deadline = time.monotonic() + patient(120)
            while completed < 16 and time.monotonic() < deadline:
                router.send_multipart([b"", (last - 5).to_bytes(8, "big")])
                while router.poll(2000):  # llm-d waits 2 s for a reply, then asks again
                    if router.recv_multipart()[2] == END_SEQ:
                        completed += 1
                        break
        finally:
            router.close()
        assert readers.num_batches > num_read, "the slow readers were served all along"
    assert completed == 16, f"the router completed {completed} of 16 replays beside 40 slow readers"


# -- 9: per-namespace event state goes with the namespace ----------------------------------------------------------


def test_event_counters_go_with_their_namespaces(start: Callable[..., ServerProcess]) -> None:
    """500 namespaces come and go (each caches a prompt, later evicted). Before: the hub kept a counter for every
    name ever used. Now: only namespaces with cached blocks have one, back to baseline once they are evicted; a
    router's index following the stream sees no gap where a namespace emptied and filled again."""
    server = start("--pool", _pool(4, 64))
    baseline = metrics(server)["radixkv_event_namespaces"]
    index = PrefixIndex()
    with RadixKVClient(server.address) as client:
        stream = client.watch_events(include_snapshot=True)
        batches = iter(stream.batches())
        assert index.apply(next(batches)).name == "APPLIED"
        applied: list[str] = []

        def follow() -> None:
            for batch in batches:
                applied.append(index.apply(batch).name)

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        try:
            for i in range(500):
                _write(client, [i, i + 1, i + 2, i + 3, i + 4], f"tenantless-{i % 250}")  # each name twice
            assert metrics(server)["radixkv_event_namespaces"] <= 64, "at most one per namespace with a cached block"
            flush = client.open(list(range(1_000_000, 1_000_240)), "flush").seq_id  # 60 of 64 blocks: evicts
            client.release(flush, cache=False)
            assert metrics(server)["radixkv_event_namespaces"] <= baseline + 4
            verified = client.verify()
            assert wait_until(lambda: index.digest == verified.digest, 60), "the index follows the stream"
        finally:
            stream.cancel()
            follower.join(timeout=60)
    assert index.num_resyncs == 0 and "GAP" not in applied and "DIVERGED" not in applied


# -- 10: a withheld tenant shows nowhere ---------------------------------------------------------------------------


def test_a_withheld_tenants_activity_moves_no_count_another_tenant_reads(
    start: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """globex is withheld from the stream. Before: its activity moved the digest stream's num_events and acme's
    Verify and WatchEvents seq. Now: only published events count; acme's counts move by acme's events alone."""
    tenants = _tenants(
        tmp_path,
        '[tenants.acme]\ntoken = "acme-token-00000000"\n'
        '[tenants.globex]\ntoken = "globex-token-0000000"\npublish_kv_events = false\n',
    )
    server = start("--pool", _pool(4, 256), "--auth-tokens", tenants, "--kv-events-insecure-publish-tenant-prompts")
    digests = _socket(zmq.SUB, server.announcement["kv_events"]["default"]["digest_endpoint"], True, RCVHWM=0)
    try:
        with (
            RadixKVClient(server.address, token="acme-token-00000000") as acme,
            RadixKVClient(server.address, token="globex-token-0000000") as globex,
        ):
            watch = acme.watch_events()
            batches = iter(watch.batches())
            _write(acme, [1, 2, 3, 4, 5], "chat")
            first = next(batches)
            proofs = [msgpack.unpackb(m[2])[3] for m in _drain(digests)]
            seq_before, num_events_before = acme.verify().seq, proofs[-1]["num_events"]
            assert first.seq == seq_before == 1
            for i in range(30):
                _write(globex, [100 + i, 101, 102, 103, 104, 105], "chat")
            assert not _drain(digests), "nothing of a withheld tenant reaches the digest stream"
            assert acme.verify().seq == seq_before, "another tenant's activity does not move acme's Verify seq"
            _write(acme, [1, 2, 3, 4, 5, 6, 7, 8, 9], "chat")
            after = next(batches)
            proofs = [msgpack.unpackb(m[2])[3] for m in _drain(digests)]
            assert after.seq == seq_before + 1, "acme's WatchEvents seq moved by its own event only"
            assert acme.verify().seq == seq_before + 1
            assert proofs[-1]["num_events"] == num_events_before + 1, "the digest stream counts published events"
            watch.cancel()
    finally:
        digests.close()
