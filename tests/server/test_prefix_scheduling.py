"""Prefix caching in the worker's scheduler, on the real default model (float32): requests that arrive together with
a long shared prompt prefix prefill it once and return their solo outputs; a source aborted while another request
waits for it is harmless; idle cached slots never keep a request from running."""
from __future__ import annotations

import dataclasses

import pytest

from core.sampling import SamplingParams
from server.config import config_from_dict
from server.engine import Engine
from server.tokenization import encode_chat, stop_token_ids
from server.worker import messages as m
from server.worker.scheduler import PREFIX_WAIT_ROWS, Scheduler
from tests.server.test_batching import Client, run, submit

SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain English, citing no sources." for i in range(60))
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]


@pytest.fixture(scope="module")
def cfg():
    return config_from_dict({"model": {"dtype": "float32", "device": "cpu"},
                             "cache": {"num_slots": 3, "max_seq_len": 1536}})


@pytest.fixture(scope="module")
def target(cfg):
    from server.engine import load_target

    return load_target(cfg, progress=False)  # its RoPE tables cover the longer context


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [encode_chat(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
           for q in QUESTIONS]
    shared = 0
    while all(p[shared] == ids[0][shared] for p in ids):
        shared += 1
    assert shared > 1000, shared
    return ids, shared


@pytest.fixture(scope="module")
def stops(tokenizer, target):
    return stop_token_ids(tokenizer, target.args.eos_token_ids)


def _solo(cfg, target, prompts, stops, sampling=None, n=8):
    off = Engine(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, prefix_caching=False)), target=target)
    return [off.generate(p, sampling, n, stops).token_ids for p in prompts]


class Recorder(Client):
    def __init__(self):
        super().__init__()
        self.prefilled = 0

    def send(self, msg) -> None:
        super().send(msg)
        if isinstance(msg, m.Step):
            self.prefilled += msg.prefill_tokens


def test_requests_sharing_a_long_prefix_prefill_it_once(cfg, target, prompts, stops):
    ids, shared = prompts
    want = _solo(cfg, target, ids, stops)
    engine = Engine(cfg, target=target)
    client = Recorder()
    sched = Scheduler(engine, client.send, max_waiting=8, max_step_tokens=256)
    for i, p in enumerate(ids):
        submit(sched, str(i), p, 8, stops, namespace="tenant")
    run(sched, client)
    assert [client.tokens[str(i)] for i in range(3)] == want
    cached = [client.done[str(i)].usage["cached_tokens"] for i in range(3)]
    # the others waited for the first one's prefill to come within PREFIX_WAIT_ROWS of the shared prefix
    assert cached[0] == 0 and min(cached[1:]) > shared - PREFIX_WAIT_ROWS, cached
    assert client.prefilled == sum(map(len, ids)) - sum(cached)  # the prefix once


def test_n_seeded_copies_equal_their_solo_runs(cfg, target, prompts, stops):
    """What `n = 3, seed = s` sends: three requests with seeds s, s+1, s+2 in one namespace."""
    ids, _ = prompts
    p = ids[0]
    want = [_solo(cfg, target, [p], stops, SamplingParams(temperature=1.0, seed=40 + i))[0] for i in range(3)]
    engine = Engine(cfg, target=target)
    client = Recorder()
    sched = Scheduler(engine, client.send, max_waiting=8, max_step_tokens=256)
    for i in range(3):
        submit(sched, str(i), p, 8, stops, namespace="request:x", temperature=1.0, seed=40 + i)
    run(sched, client)
    assert [client.tokens[str(i)] for i in range(3)] == want
    assert [client.done[str(i)].usage["cached_tokens"] for i in range(3)] == [0, len(p) - 1, len(p) - 1]
    assert client.prefilled == len(p) + 2  # the prompt once, then each copy's last prompt token


def test_a_source_aborted_while_another_waits_is_harmless(cfg, target, prompts, stops):
    ids, _ = prompts
    want = _solo(cfg, target, ids[1:2], stops)
    engine = Engine(cfg, target=target)
    client = Recorder()
    sched = Scheduler(engine, client.send, max_waiting=8, max_step_tokens=64)
    submit(sched, "a", ids[0], 8, stops)
    submit(sched, "b", ids[1], 8, stops)
    sched.tick()  # a prefills its first chunk; b waits for the shared prefix
    assert "a" in sched.running and "b" in sched.waiting
    sched.handle(m.Abort("a"))
    run(sched, client)
    assert client.tokens["b"] == want[0] and client.done["b"].finish_reason is not None
    assert isinstance(client.done["a"], m.Aborted)
    assert 0 < client.done["b"].usage["cached_tokens"] < len(ids[1]) - 1  # a's committed chunk, nothing more


def test_idle_cached_slots_never_block_a_request(cfg, target, tokenizer, stops):
    """Three slots full of idle cached prefixes, then more distinct requests than slots at once: all run."""
    engine = Engine(cfg, target=target)
    client = Recorder()
    sched = Scheduler(engine, client.send, max_waiting=8, max_step_tokens=256)
    texts = ["Say hi.", "Say bye.", "Say yes.", "Say no.", "Say maybe.", "Say why."]
    for i, t in enumerate(texts[:3]):
        submit(sched, f"w{i}", tokenizer.encode(f"{i} {t}"), 2, stops)
    run(sched, client)
    assert len(engine.prefix.idle) == 3 and engine.slots_available == 3
    for i, t in enumerate(texts):
        submit(sched, str(i), tokenizer.encode(f"{t} {i}"), 2, stops)
    run(sched, client)
    assert all(isinstance(client.done[str(i)], m.Tokens) for i in range(len(texts)))
    assert engine.prefix.evictions >= 3
