"""The API side of `n` choices per request: n choices submitted as n worker requests (seeds one apart) and shaped
into one response (JSON or interleaved SSE), stop strings and failures per choice, the usage of n choices
(`usage.prompt_tokens_details.cached_tokens` the least of them), the request metrics counted once; then the official
`openai` client against the session's server: n choices equal n seeded requests, streamed or not, and a disconnect
aborts every choice.

The in-process tests run the real app against a scripted worker (tests/server/fake_worker.py; no model): each
request's tokens are a function of its seed, so a choice's text names the worker request it came from.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest
from openai import OpenAI

from server.api.generation import cache_namespace, choice_seed, combine_usage
from tests.server.conftest import metric, scrape, wait_balanced
from tests.server.fake_worker import (KEY, PROMPT, SPEC, FakeWorker, letters, make_client, post, sse_events,
                                      tokens_for)


# -- n choices ---------------------------------------------------------------------------------------------------------
def test_choice_seeds():
    assert [choice_seed(10, i) for i in range(3)] == [10, 11, 12]
    assert choice_seed(None, 2) is None
    assert choice_seed(2**63 - 1, 1) == -(2**63)  # wraps within int64, the worker's wire type
    assert choice_seed(-5, 0) == -5


def test_n_choices_submit_n_requests_and_shape_one_response():
    worker = FakeWorker()
    with make_client(worker) as c:
        r = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "n": 3, "seed": 41, "temperature": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    gens = worker.generates
    assert len(gens) == 3 and len({g.request_id for g in gens}) == 3
    assert all(g.prompt_ids == PROMPT and g.max_tokens == 5 and g.temperature == 1.0 for g in gens)
    assert [g.seed for g in gens] == [41, 42, 43]
    assert len({g.namespace for g in gens}) == 1 and gens[0].namespace == cache_namespace(KEY, None, True, "")
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert [ch["text"] for ch in body["choices"]] == [letters(tokens_for(g)) for g in gens] == ["ebzzz", "eczzz",
                                                                                                 "edzzz"]
    assert all(ch["finish_reason"] == "length" for ch in body["choices"])
    u = body["usage"]
    assert u["prompt_tokens"] == len(PROMPT) and u["completion_tokens"] == 15 and u["total_tokens"] == 19
    assert u["prompt_tokens_details"] == {"cached_tokens": 2}
    assert (u["draft_tokens"], u["accepted_tokens"], u["verify_steps"], u["max_draft_length"]) == (18, 9, 9, 4)
    assert u["mean_accepted_length"] == 2.0 and u["mean_draft_length"] == 2.0 and u["drafter"] == "ngram"


def test_unseeded_choices_are_unseeded():
    worker = FakeWorker()
    with make_client(worker) as c:
        post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2})
    assert [g.seed for g in worker.generates] == [None, None]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_choices_interleave_with_their_index(chat):
    worker = FakeWorker()
    path, extra = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat
                   else ("/v1/completions", {"prompt": PROMPT}))
    with make_client(worker) as c:
        r = post(c, path, {**extra, "max_tokens": 4, "n": 3, "seed": 7, "stream": True,
                           "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = sse_events(r)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["prompt_tokens"] == worker.generates[0].prompt_ids.__len__()
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert all(len(ch["choices"]) == 1 for ch in chunks)
    order = [ch["choices"][0]["index"] for ch in chunks]
    if chat:
        assert order[:3] == [0, 1, 2]  # a role chunk per choice, first
        assert [ch["choices"][0]["delta"] for ch in chunks[:3]] == [{"role": "assistant", "content": ""}] * 3
        chunks = chunks[3:]
        order = order[3:]
    # interleaved as tokens arrive: another choice's chunk comes between choice 0's first and last
    first0, last0 = order.index(0), len(order) - 1 - order[::-1].index(0)
    assert any(i != 0 for i in order[first0:last0]), order
    texts, finishes = {}, {}
    for ch in chunks:
        choice = ch["choices"][0]
        piece = choice["delta"].get("content", "") if chat else choice["text"]
        texts[choice["index"]] = texts.get(choice["index"], "") + piece
        if choice["finish_reason"]:
            assert choice["index"] not in finishes
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {i: letters(tokens_for(g)) for i, g in enumerate(worker.generates)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert {ch["id"] for ch in events} == {events[0]["id"]}


def test_stop_strings_apply_per_choice():
    """Seeds 1, 2, 3 give 'bzzzzz', 'czzzzz', 'dzzzzz': the stop string 'cz' cuts only choice 1, whose worker request
    is aborted (its stats still count); the others run to max_tokens."""
    worker = FakeWorker()
    with make_client(worker) as c:
        body = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "n": 3, "seed": 1,
                                           "stop": ["cz"]}).json()
    assert [ch["text"] for ch in body["choices"]] == ["bzzzzz", "", "dzzzzz"]
    assert [ch["finish_reason"] for ch in body["choices"]] == ["length", "stop", "length"]
    assert body["usage"]["completion_tokens"] == 6 + 2 + 6
    assert body["usage"]["verify_steps"] == 9  # choice 1's stats came with the worker's answer to the abort
    assert worker.aborts == [worker.generates[1].request_id]


def test_a_failing_choice_fails_the_request_and_aborts_the_others():
    worker = FakeWorker(fail={1}, script=lambda req: [25] * req.max_tokens)
    with make_client(worker) as c:
        r = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 50, "n": 3})
        assert r.status_code == 400 and "scripted failure" in r.json()["error"]["message"], r.text
        s = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 50, "n": 3, "stream": True})
        assert s.status_code == 200 and '"error"' in s.text.strip().split("\n")[-1] and "[DONE]" not in s.text
    first, second = worker.generates[:3], worker.generates[3:]
    for gens in (first, second):
        assert set(worker.aborts) >= {gens[0].request_id, gens[2].request_id}
        assert gens[1].request_id not in worker.aborts  # the worker already dropped the failed one


def test_usage_of_n_choices():
    def part(completion, cached, spec):
        return {"prompt_tokens": 10, "completion_tokens": completion, "total_tokens": 10 + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, **spec}

    one = part(4, 3, SPEC)
    assert combine_usage([one]) is one
    a = part(4, 9, {**SPEC, "draft_tokens": 10, "accepted_tokens": 5, "verify_steps": 2, "mean_accepted_length": 3.5,
                    "mean_draft_length": 5.0, "max_draft_length": 6})
    b = part(6, 0, {**SPEC, "draft_tokens": 2, "accepted_tokens": 1, "verify_steps": 4, "mean_accepted_length": 1.25,
                    "mean_draft_length": 0.5, "max_draft_length": 1})
    u = combine_usage([a, b, part(0, 9, {})])  # a choice without stats (dropped before it ran) adds none
    assert u == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20,
                 "prompt_tokens_details": {"cached_tokens": 0}, "drafter": "ngram", "draft_tokens": 12,
                 "accepted_tokens": 6, "verify_steps": 6, "mean_accepted_length": 2.0, "mean_draft_length": 2.0,
                 "max_draft_length": 6}
    assert "verify_steps" not in combine_usage([part(1, 0, {}), part(2, 0, {})])


def test_cached_tokens_default_to_zero_when_the_worker_sends_none():
    worker = FakeWorker(usage_of=lambda i: dict(SPEC))
    with make_client(worker) as c:
        u = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()["usage"]
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cached_tokens_of_n_choices_is_the_least():
    worker = FakeWorker(usage_of=lambda i: {**SPEC, "cached_tokens": [4, 0, 3][i]})
    with make_client(worker) as c:
        u = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3}).json()["usage"]
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}


def test_request_metrics_count_the_prompt_and_latency_once():
    worker = FakeWorker()
    with make_client(worker) as c:
        assert post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 3}).status_code == 200
        text = c.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["specserve_prompt_tokens_total"] == len(PROMPT)
    assert samples["specserve_generation_tokens_total"] == 9
    assert samples["specserve_time_to_first_token_seconds_count"] == 1
    assert samples["specserve_request_latency_seconds_count"] == 1


# -- real servers, the official client ---------------------------------------------------------------------------------
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]


def _warm(client: OpenAI, **kw) -> None:
    """Cache the prompt's rows first, so that every request compared afterwards starts from the same cached prefix.
    (In bfloat16, the server's dtype here, prefilling the last prompt row after a cache hit and prefilling the whole
    prompt round differently, and a sampled token can flip: choice 0 of a cold request would be the odd one out.)"""
    kw = {**kw, "max_tokens": 1, "n": 1, "stream": False}
    kw.pop("stream_options", None)
    chat = "messages" in kw
    (client.chat.completions if chat else client.completions).create(**kw)


@pytest.mark.server
def test_e2e_n_choices_equal_n_seeded_requests(client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=STORY, max_tokens=12, temperature=1.0)
    _warm(client, **kw)
    r = client.chat.completions.create(n=3, seed=1234, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    singles = [client.chat.completions.create(seed=1234 + i, **kw) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert len(set(texts)) > 1  # the seeds differ, so do the choices
    assert [c.finish_reason for c in r.choices] == [s.choices[0].finish_reason for s in singles]
    u = r.usage
    assert u.prompt_tokens == singles[0].usage.prompt_tokens  # counted once
    assert u.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # the verify steps are summed over the choices; how many each took depends on the batch it ran in (the draft
    # gate weighs the batch's step cost), so only their bounds are fixed: each choice took at least one, and a step
    # emits at least one token
    assert 3 <= u.model_extra["verify_steps"] <= u.completion_tokens


@pytest.mark.server
def test_e2e_streamed_n_choices_equal_non_streamed(client):
    kw = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=99, n=3)
    _warm(client, **kw)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finishes = ["", "", ""], [[], [], []]
    for ch in chunks[:-1]:
        (c,) = ch.choices
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index].append(c.finish_reason)
    assert texts == [c.text for c in full.choices]
    assert finishes == [[c.finish_reason] for c in full.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.server
def test_e2e_disconnect_aborts_every_choice(server):
    assert wait_balanced(server.url)
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Write a very long essay."}],
            "stream": True, "ignore_eos": True, "n": 3}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers,
                      timeout=60) as r:
        lines = r.iter_lines()
        seen = set()
        for line in lines:  # until every choice has sent text: all three hold a slot
            if line.startswith("data: {"):
                (c,) = json.loads(line[6:])["choices"]
                if c["delta"].get("content"):
                    seen.add(c["index"])
            if len(seen) == 3:
                break
    # the request would run to the context end (~480 tokens per choice); every slot is free well before
    deadline = time.monotonic() + 15
    while metric(scrape(server.url), "specserve_requests_running") != 0:
        assert time.monotonic() < deadline, "the choices kept running after the client left"
        time.sleep(0.05)
    assert wait_balanced(server.url)
