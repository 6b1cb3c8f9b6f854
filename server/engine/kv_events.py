"""KV-cache events for prefix-aware routers, in vLLM's wire format (what llm-d's KV-cache indexer, NVIDIA Dynamo and
TensorRT-LLM's consumers read): which blocks of tokens this replica's cache holds, as they come and go.

A block is ``block_size`` consecutive tokens of a cached sequence, from position 0 on; only full blocks count. Its
hash chains its parent's (the block before it), so one hash names the whole prefix up to its end:

    h(block i) = first 8 bytes, big-endian, of sha256(parent || namespace || token ids)

where ``parent`` is h(block i - 1) as 8 big-endian bytes (``HASH_SEED`` for the first block), ``namespace`` the
cache partition as UTF-8 followed by a zero byte (the API key and ``cache_salt``: equal tokens in two partitions are
two blocks), and the token ids little-endian uint32. The result is an unsigned 64-bit int, the same on every machine
and across restarts (``block_hashes``).

The prefix cache (``server.engine.prefix_cache``) holds whole sequences per KV slot; ``BlockLedger`` turns what each
slot holds into block events with a reference count per hash, so a block several slots hold is stored once and
removed when the last of them lets it go: ``BlockStored`` (a run of new blocks of one sequence: their hashes, the
parent of the first, their token ids), ``BlockRemoved``, and ``AllBlocksCleared`` when the engine starts (a
restarted worker's cache is empty). A slot's entry counts from when the prefix cache indexes it, a running prompt
included (its rows are being computed; a request with the same prefix waits for them).

``EventPublisher`` sends them from a thread of the worker: each batch (``KVEventBatch``: time stamp, events) as the
ZMQ multipart message [topic, sequence number as 8 big-endian bytes, msgpack payload] on a PUB socket, and keeps the
last ``REPLAY_BATCHES`` for a ROUTER socket that answers a sequence number with every batch from it on, then an empty
payload. Publishing never blocks a step: the step hands events to a bounded queue (full: the events are dropped and
counted), and a PUB socket drops rather than waits for a slow subscriber.
"""
from __future__ import annotations

import hashlib
import queue
import struct
import threading
import time
from collections import Counter, deque
import msgspec

from server.config import KVEventsConfig

HASH_SEED = b"specserve-kv-events-1"  # the first block's parent in the hash chain (8 bytes of its sha256)
REPLAY_BATCHES = 10_000
QUEUE_EVENTS = 100_000


# Each event a map tagged by its class name under "type" (msgspec's tag=True), as vLLM sends them since it dropped
# positional events; the batch stays the positional [ts, events, data_parallel_rank] its consumers read.
class BlockStored(msgspec.Struct, gc=False, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, gc=False, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, gc=False, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _root() -> bytes:
    return hashlib.sha256(HASH_SEED).digest()[:8]


def block_hashes(namespace: str, tokens, block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` in cache partition ``namespace`` (module docstring)."""
    out, parent, ns = [], _root(), namespace.encode() + b"\0"
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start:start + block_size])
        parent = hashlib.sha256(parent + ns + block).digest()[:8]
        out.append(int.from_bytes(parent, "big"))
    return out


class BlockLedger:
    """The blocks each slot holds, counted per hash across slots; ``set`` / ``clear`` return the events the change
    makes (stored where a hash's count leaves 0, removed where it returns to 0)."""

    def __init__(self, block_size: int, medium: str | None = None):
        self.block_size, self.medium = block_size, medium
        self._slots: dict[int, list[int]] = {}
        self._refs: Counter[int] = Counter()

    def set(self, slot: int, namespace: str, tokens) -> list:
        """Slot ``slot`` now holds ``tokens`` (of partition ``namespace``), in place of what it held."""
        hashes = block_hashes(namespace, tokens, self.block_size)
        old = self._slots.get(slot, [])
        keep = 0  # the common leading blocks: unchanged
        while keep < min(len(old), len(hashes)) and old[keep] == hashes[keep]:
            keep += 1
        events = self._release(old[keep:])
        stored, runs = [], []  # runs of new hashes, each with the index of its first block
        for i in range(keep, len(hashes)):
            self._refs[hashes[i]] += 1
            if self._refs[hashes[i]] == 1:
                if runs and runs[-1][1] == i:
                    runs[-1][1] = i + 1
                else:
                    runs.append([i, i + 1])
        for a, b in runs:
            bs = self.block_size
            stored.append(BlockStored(hashes[a:b], hashes[a - 1] if a else None, list(tokens[a * bs:b * bs]), bs,
                                      None, self.medium))
        self._slots[slot] = hashes
        return events + stored

    def clear(self, slot: int) -> list:
        """Slot ``slot`` holds nothing any more."""
        return self._release(self._slots.pop(slot, []))

    def _release(self, hashes: list[int]) -> list:
        gone = []
        for h in hashes:
            self._refs[h] -= 1
            if self._refs[h] == 0:
                del self._refs[h]
                gone.append(h)
        return [BlockRemoved(gone, self.medium)] if gone else []


class EventPublisher:
    """Sends the ledger's events from a thread: ``publish`` never waits (a full queue drops and counts them)."""

    def __init__(self, cfg: KVEventsConfig, queue_events: int = QUEUE_EVENTS, start: bool = True):
        import zmq

        self.cfg = cfg
        self.dropped = 0       # events lost to a full queue
        self.sent = 0          # batches sent
        self.sent_events = 0   # events in them
        self._queue: queue.Queue = queue.Queue(maxsize=queue_events)
        self._replay: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._lock = threading.Lock()  # guards _replay (the thread appends, a replay request reads)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(cfg.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # as bound (a "*" port resolved)
        self._router, self.replay_endpoint = None, None
        if cfg.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(cfg.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        if start:
            self._thread.start()

    def publish(self, events: list) -> None:
        for e in events:
            try:
                self._queue.put_nowait(e)
            except queue.Full:
                self.dropped += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            events = []
            try:
                events.append(self._queue.get(timeout=0.005))
                while True:
                    events.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            if events:
                self._send(events)
            if self._router is not None and poller.poll(0):
                self._answer_replay()
        if self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=0)

    def _send(self, events: list) -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._replay.append((seq, payload))
        self._pub.send_multipart([self.cfg.topic.encode(), seq.to_bytes(8, "big"), payload])
        self.sent += 1
        self.sent_events += len(events)

    def _answer_replay(self) -> None:
        frames = self._router.recv_multipart()
        client, start = frames[0], int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
        with self._lock:
            batches = [(s, p) for s, p in self._replay if s >= start]
        for s, p in batches:
            self._router.send_multipart([client, b"", s.to_bytes(8, "big"), p])
        self._router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
