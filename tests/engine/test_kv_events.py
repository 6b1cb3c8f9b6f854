"""KV-cache events (server.engine.kv_events) in vLLM's wire format over real ZMQ sockets: a subscriber receives
``BlockStored`` for a prompt's full blocks (hashes equal to an independent recomputation of the stated function),
``BlockRemoved`` when its slot is evicted, ``AllBlocksCleared`` when an engine starts; the replay socket returns
every batch in order; a full queue drops and counts instead of waiting, and a subscriber that reads nothing never
holds the publisher up."""
from __future__ import annotations

import hashlib
import struct
import time

import msgspec
import pytest
import zmq

from server.config import ConfigError, config_from_dict
from server.engine import Engine
from server.engine.kv_events import (AllBlocksCleared, BlockLedger, BlockRemoved, BlockStored, EventPublisher,
                                     KVEventBatch, KVEventsConfig, block_hashes)

BS = 16


def expected_hash(parent: int | None, namespace: str, tokens: list[int]) -> int:
    """The stated function, written out again: sha256(parent (8 bytes) || namespace || 0 || tokens as uint32 LE)."""
    head = hashlib.sha256(b"specserve-kv-events-1").digest()[:8] if parent is None else parent.to_bytes(8, "big")
    data = head + namespace.encode() + b"\x00" + b"".join(struct.pack("<I", t) for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def test_block_hashes_are_the_stated_function():
    tokens = list(range(1000, 1000 + 2 * BS + 5))
    h = block_hashes("", tokens, BS)
    assert len(h) == 2  # full blocks only
    assert h[0] == expected_hash(None, "", tokens[:BS])
    assert h[1] == expected_hash(h[0], "", tokens[BS:2 * BS])
    assert block_hashes("key-a", tokens, BS)[0] != h[0]  # another cache partition: other blocks
    assert block_hashes("", [0] + tokens[1:], BS)[1] != h[1]  # a block's hash names its whole prefix


def test_the_ledger_stores_a_shared_block_once_and_removes_it_with_its_last_holder():
    led = BlockLedger(BS)
    a = list(range(3 * BS))
    b = a[:2 * BS] + list(range(500, 500 + BS))  # shares two blocks with a
    h_a, h_b = block_hashes("", a, BS), block_hashes("", b, BS)
    (stored,) = led.set(0, "", a)
    assert stored.block_hashes == h_a and stored.parent_block_hash is None and stored.token_ids == a
    (only_new,) = led.set(1, "", b)
    assert only_new.block_hashes == h_b[2:] and only_new.parent_block_hash == h_a[1]
    assert only_new.token_ids == b[2 * BS:]
    assert led.clear(0) == [BlockRemoved([h_a[2]])]  # the shared two stay: slot 1 holds them
    assert led.clear(1) == [BlockRemoved(h_b)]
    led.set(2, "", a)
    swapped = led.set(2, "", b)  # the slot now holds another sequence: a's last block goes, b's comes
    assert swapped == [BlockRemoved([h_a[2]]), BlockStored(h_b[2:], h_a[1], b[2 * BS:], BS)]
    led.set(2, "", a)
    grown = led.set(2, "", a + list(range(700, 700 + BS)))  # the slot's sequence grew: one block more
    assert [type(e) for e in grown] == [BlockStored] and grown[0].parent_block_hash == h_a[2]


def test_the_config_is_checked():
    with pytest.raises(ConfigError, match="unknown keys .'port'."):
        config_from_dict({"server": {"kv_events": {"port": 5557}}})
    with pytest.raises(ConfigError, match="block_size must be an int >= 1"):
        config_from_dict({"server": {"kv_events": {"block_size": 0}}})
    assert config_from_dict({"server": {"kv_events": {}}}).server.kv_events == {}


def _replay(endpoint: str, start: int = 0) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher keeps from ``start`` on, through its replay socket (as vLLM's subscriber asks)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart([b"", start.to_bytes(8, "big")])
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    out = []
    try:
        while s.poll(5000):
            _, seq, payload = s.recv_multipart()
            if not payload:
                return out
            out.append((int.from_bytes(seq, "big"), dec.decode(payload)))
        raise AssertionError("no end of replay")
    finally:
        s.close()


def _events(batches) -> list:
    return [e for _, b in batches for e in b.events]


def test_an_engine_publishes_its_blocks_as_they_are_cached_and_evicted(target32, fp32_config):
    cfg = config_from_dict({"model": {"dtype": "float32", "device": "cpu"},
                            "cache": {"num_slots": 2, "max_seq_len": 512},
                            "server": {"kv_events": {"endpoint": "tcp://127.0.0.1:*", "topic": "kv",
                                                     "replay_endpoint": "tcp://127.0.0.1:*", "block_size": BS}}})
    engine = Engine(cfg, target=target32)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(engine.events.endpoint)
    try:
        deadline = time.monotonic() + 10
        while not _events(_replay(engine.events.replay_endpoint)):  # the engine's first batch has gone out
            assert time.monotonic() < deadline
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ drops what a PUB sends before it does)
        prompts = [list(range(2000 + 100 * i, 2000 + 100 * i + 2 * BS + 7)) for i in range(3)]
        outs = [engine.generate(p, None, 12).token_ids for p in prompts]
        deadline = time.monotonic() + 10
        while engine.events.sent_events < 1 + 2 * 3 + 1 and time.monotonic() < deadline:  # at least so many
            time.sleep(0.01)
        batches = _replay(engine.events.replay_endpoint)
        assert [s for s, _ in batches] == list(range(len(batches)))  # every batch kept, in order
        events = _events(batches)
        assert events[0] == AllBlocksCleared()
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        for e in stored:  # every stored block: its hash from its parent, its tokens and the default partition
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                assert h == expected_hash(parent, "", e.token_ids[i * BS:(i + 1) * BS]) and e.block_size == BS
                parent = h
            assert e.medium == "GPU"  # vLLM's name for the engine's own cache, on a CPU too
        by_hash = {h: e.token_ids[i * BS:(i + 1) * BS] for e in stored for i, h in enumerate(e.block_hashes)}
        for p, out in zip(prompts, outs):
            seq = p + out
            for n, h in enumerate(block_hashes("", seq[:-1], BS)):  # the committed rows (the last token has none)
                assert by_hash[h] == seq[n * BS:(n + 1) * BS]
        # two slots for three sequences: the first one's slot was evicted, its blocks removed, and only those
        first = block_hashes("", (prompts[0] + outs[0])[:-1], BS)
        assert set(removed) == set(first) and len(removed) == len(first)
        # the subscriber received the same batches, in order, after it joined
        got, dec = [], msgspec.msgpack.Decoder(KVEventBatch)
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            got.append((int.from_bytes(seq, "big"), dec.decode(payload)))
        assert got and got == batches[-len(got):]
        assert engine.events.dropped == 0
    finally:
        sub.close()
        engine.close()


def test_a_full_queue_drops_and_counts_and_a_silent_subscriber_never_blocks():
    pub = EventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"), queue_events=4, start=False)
    try:
        pub.publish([AllBlocksCleared()] * 10)  # no thread draining it: the queue fills, publish returns anyway
        assert pub.dropped == 6
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        time.sleep(0.3)
        block = BlockStored(list(range(64)), None, list(range(64 * BS)), BS)
        for _ in range(5000):  # far past both sockets' high-water marks; the subscriber reads nothing
            pub._send([block])
        assert pub.sent == 5000
        sub.close()
    finally:
        pub.close()


def test_the_wire_format_is_vllms():
    """A batch is the positional [ts, events, data_parallel_rank]; each event a map tagged by its class name under
    "type" with vLLM's field names (what vLLM sends and its router's kv_aware policy reads: a positional event is
    refused there as "KV event must be a tagged map")."""
    batch = KVEventBatch(1.5, [BlockStored([7, 8], None, list(range(2 * BS)), BS, medium="GPU"), BlockRemoved([7]),
                               AllBlocksCleared()])
    ts, events, *rank = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert ts == 1.5 and rank in ([], [None])
    assert events == [{"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
                       "token_ids": list(range(2 * BS)), "block_size": BS, "lora_id": None, "medium": "GPU",
                       "lora_name": None},
                      {"type": "BlockRemoved", "block_hashes": [7], "medium": None}, {"type": "AllBlocksCleared"}]
