"""Automatic prefix caching: the radix index against brute force, slots (adopt, copy, evict, pin), and outputs with a
hit equal to outputs with the cache off, token for token, for every registered drafter (float32, real model)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from core.sampling import SamplingParams
from drafters.base import create_drafter, drafter_names
from server.config import config_from_dict
from server.engine import Engine, NoFreeSlotError, load_engine
from server.engine.prefix_cache import RadixIndex
from core.tree import DraftTree


# -- the index ---------------------------------------------------------------------------------------------------
def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_radix_index_matches_brute_force():
    """Random inserts, replacements and removals over a 3-token vocabulary (many shared prefixes, splits and merges):
    every lookup gives the longest usable common prefix a brute-force scan finds, within the namespace."""
    rng = random.Random(0)
    index, entries = RadixIndex(), {}  # slot -> (namespace, tokens)
    usable = {}
    for it in range(3000):
        op = rng.random()
        slot = rng.randrange(12)
        if op < 0.45:
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            ns = rng.choice(["a", "b"])
            index.insert(ns, toks, slot)
            entries[slot] = (ns, toks)
            usable[slot] = rng.randrange(len(toks) + 1)
        elif op < 0.6 and slot in entries:
            index.remove(slot)
            del entries[slot]
        else:
            q = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            ns = rng.choice(["a", "b"])
            limit = rng.randrange(len(q) + 1)
            want = max([min(_lcp(t, q), usable[s], limit) for s, (n, t) in entries.items() if n == ns] + [0])
            got_slot, got = index.longest(ns, q, usable.__getitem__, limit)
            assert got == want, (it, q, entries)
            if got:
                assert entries[got_slot][0] == ns and min(_lcp(entries[got_slot][1], q), usable[got_slot]) >= got
            else:
                assert got_slot is None
        assert all(index.length(s) == len(t) for s, (_, t) in entries.items())
    for s in list(entries):
        index.remove(s)
    assert not index._roots and not index._where  # nothing left behind


# -- slots on a tiny model -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cfg(tiny_dir):
    return config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"},
                             "cache": {"num_slots": 2, "max_seq_len": 64}})


@pytest.fixture
def tiny(tiny_cfg):
    return load_engine(tiny_cfg)


def _run(engine, prompt, n=6, namespace=None, sampling=None):
    seq = engine.add(prompt, sampling, max_new_tokens=n, namespace=namespace)
    engine.prefill(seq)
    while seq.finish_reason is None:
        engine.step(seq)
    engine.release(seq)
    return seq


def test_eviction_is_least_recently_used(tiny):
    """Two slots, three prefixes: the third evicts the least recently used one, the others still hit."""
    a, b, c = [2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 4, 3]
    _run(tiny, a)
    _run(tiny, b)
    assert _run(tiny, a + [9]).cached_tokens == len(a)  # a is now the most recently used
    assert tiny.prefix.evictions == 0
    _run(tiny, c)  # evicts b
    assert tiny.prefix.evictions == 1
    assert _run(tiny, b + [2]).cached_tokens == 0
    assert _run(tiny, c + [2]).cached_tokens == len(c)


def test_a_running_source_is_pinned_and_copied(tiny):
    """A running sequence's prompt rows are copied, never taken; with every slot running, admission fails."""
    p = [2, 3, 4, 5, 6, 7, 8, 9]
    run = tiny.add(p, max_new_tokens=20)
    tiny.prefill(run)
    other = tiny.add(p + [10, 11])
    assert other.slot != run.slot and other.cached_tokens == len(p)
    assert tiny.pool.k[:, other.slot, :, :len(p)].equal(tiny.pool.k[:, run.slot, :, :len(p)])
    with pytest.raises(NoFreeSlotError):
        tiny.add([3, 3, 3])
    tiny.release(other)
    tiny.release(run)


def test_an_abort_mid_prefill_leaves_only_the_rows_prefilled(tiny):
    from server.engine import StepPlan

    p = list(range(2, 14)) * 3
    seq = tiny.add(p)
    tiny.run(StepPlan(prefill=[(seq, 16)]))
    tiny.release(seq)  # aborted after one chunk
    assert tiny.prefix.index.length(seq.slot) == 16
    assert _run(tiny, p).cached_tokens == 16


def test_namespaces_are_isolated(tiny):
    p = [2, 3, 4, 5, 6, 7, 8]
    _run(tiny, p, namespace="key1:salt")
    assert _run(tiny, p, namespace="key1:salt").cached_tokens == len(p) - 1
    assert _run(tiny, p, namespace="key2:salt").cached_tokens == 0
    assert _run(tiny, p, namespace="key1:other").cached_tokens == 0


def test_caching_off_keeps_nothing(tiny_cfg):
    engine = load_engine(_cache_off(tiny_cfg))
    p = [2, 3, 4, 5, 6, 7, 8]
    _run(engine, p)
    assert _run(engine, p).cached_tokens == 0 and engine.pool.slots_used == 0 and engine.prefix.hits == 0


# -- outputs with a hit equal outputs with the cache off (real model, float32) -------------------------------------
MAX_NEW = 16
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=7)}


def _cache_off(cfg):
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_caching=False))


def _cases(tokenizer, engine, stops):
    """(first turn, [(name, prompt)]): the same prompt again, the prompt plus a suffix, a second chat turn (the first
    turn's answer from plain decoding, as a chat client sends it back)."""
    from server.tokenization import encode_chat

    turn1 = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
    first = encode_chat(tokenizer, turn1)
    answer = engine.generate(first, None, MAX_NEW, stops).token_ids
    turn2 = turn1 + [{"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                     {"role": "user", "content": "Now make it ignore case."}]
    return first, [("again", first), ("suffix", first + tokenizer.encode(" Also add a docstring.")),
                   ("turn2", encode_chat(tokenizer, turn2))]


def _assert_hits_change_nothing(cfg, target, drafter, tokenizer, stops, samplings=SAMPLINGS):
    """Greedy and seeded: a request whose prefix is cached returns the tokens and speculative stats of the same
    request with the cache off, and the hit really happened."""
    on, off = Engine(cfg, drafter, target), Engine(_cache_off(cfg), drafter, target)
    first, todo = _cases(tokenizer, on, stops)  # the first turn's rows stay cached
    for label, sp in samplings.items():
        for case, prompt in todo:
            before = on.prefix.hits
            got = on.generate(prompt, sp, MAX_NEW, stops)
            want = off.generate(prompt, sp, MAX_NEW, stops)
            where = f"{drafter.name} {label} {case}"
            assert on.prefix.hits - before > len(first) // 2, f"{where}: no hit"
            assert got.token_ids == want.token_ids, f"{where}: {got.token_ids} != {want.token_ids}"
            assert got.stats.as_dict() == want.stats.as_dict(), where


@pytest.mark.parametrize("name", drafter_names())  # every registered drafter, so none can be added without this
def test_a_hit_changes_nothing_for_any_drafter(name, int4, tokenizer, stops):
    cfg, target = int4
    _assert_hits_change_nothing(cfg, target, create_drafter(name, target), tokenizer, stops)


@pytest.mark.parametrize("name", ["none", "glide-cape"])
def test_a_hit_changes_nothing_on_the_dense_target(name, fp32_config, target32, tokenizer, stops):
    """The unquantized float32 target (PyTorch's GEMMs and attention): a chain and a tree drafter."""
    _assert_hits_change_nothing(fp32_config, target32, create_drafter(name, target32), tokenizer, stops)


class _TruthChain:
    """Drafts the known plain continuation, eight tokens at a time: every draft is accepted."""

    name = "test-truth-chain"

    def __init__(self, prompt, continuation):
        self.prompt, self.continuation = prompt, continuation

    def prefill(self, seq):
        pass

    def propose(self, seq):
        done = len(seq.tokens) - len(self.prompt)
        return DraftTree.chain(seq.tokens[-1], self.continuation[done:done + 8])

    def observe(self, seq, result):
        pass

    def release(self, seq_id):
        pass


def test_rows_past_a_stop_are_not_cached(fp32_config, target32, tokenizer, stops):
    """A verify step can accept drafts past a stop token: their KV is written, but the tokens are not part of the
    output, so the cache keeps only the rows of the tokens the sequence holds, and a follow-up equals a miss."""
    from server.tokenization import encode_chat

    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Count from one to twenty in words."}])
    plain = Engine(fp32_config, target=target32).generate(prompt, None, 32, stops).token_ids
    stop = plain[4]
    engine = Engine(fp32_config, _TruthChain(prompt, plain), target32)
    seq = engine.add(prompt, max_new_tokens=32, stop_token_ids=[stop])
    engine.prefill(seq)
    while seq.finish_reason is None:
        engine.step(seq)
    assert seq.cache_len > len(seq.token_ids)  # rows past the stop were accepted and written
    engine.release(seq)
    assert engine.prefix.index.length(seq.slot) == len(seq.token_ids)
    follow = seq.token_ids + tokenizer.encode(" and more")
    off = Engine(_cache_off(fp32_config), target=target32)
    hit = Engine(fp32_config, target=target32)
    # the cache the oracle run left: its pool, prefix index and slots
    hit.prefix, hit.pool, hit.slots, hit.layout = engine.prefix, engine.pool, engine.slots, engine.layout
    out = hit.generate(follow, None, 16, stops)
    assert hit.prefix.hits >= len(seq.token_ids)
    assert out.token_ids == off.generate(follow, None, 16, stops).token_ids
