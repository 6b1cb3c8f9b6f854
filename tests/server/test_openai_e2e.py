"""The official `openai` client against a real server on loopback (default model, ngram drafter)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

from tests.server.conftest import metric, scrape, wait_balanced

pytestmark = pytest.mark.server

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, model):
    assert model == "SmolLM2-135M-Instruct"


def test_chat_non_streaming(client, model):
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra
    assert extra["drafter"] == "ngram" and extra["verify_steps"] >= 1 and extra["mean_accepted_length"] >= 1.0
    assert extra["mean_draft_length"] == round(extra["draft_tokens"] / extra["verify_steps"], 4)
    assert extra["mean_draft_length"] <= extra["max_draft_length"] <= 63


def test_chat_streaming_matches_non_streaming(client, model):
    full = client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=model, messages=HELLO, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.model_extra["drafter"] == "ngram"


def test_stream_ends_with_done_raw_sse(server, model):
    body = {"model": model, "messages": HELLO, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_text_completions_string_and_token_ids(client, model):
    r = client.completions.create(model=model, prompt="def add(a, b):\n", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    ids = [755, 1045, 30, 84, 28, 275, 2730]  # token ids are accepted as the prompt
    r2 = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert r2.usage.prompt_tokens == len(ids)
    s = client.completions.create(model=model, prompt="def add(a, b):\n", max_tokens=10, temperature=0,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text


def test_stop_strings_never_leak(client, model):
    base = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count from 1 to 20."}],
                                          max_tokens=60, temperature=0).choices[0].message.content
    assert len(base) > 12
    stop = base[8:12]  # a stop string somewhere inside the natural output
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count from 1 to 20."}],
                                           max_tokens=60, temperature=0, stop=[stop, "zzzz"], stream=stream)
        if stream:
            parts = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            finish = [c.choices[0].finish_reason for c in parts if c.choices and c.choices[0].finish_reason][0]
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert stop not in text and base.startswith(text) and finish == "stop"
        assert text == base[:base.index(stop)]


SPEC_FIELDS = ("drafter", "draft_tokens", "accepted_tokens", "verify_steps", "mean_accepted_length",
               "mean_draft_length", "max_draft_length")


def test_stop_string_usage_counts_the_returned_tokens_and_carries_spec_stats(client, model, tokenizer):
    msgs = [{"role": "user", "content": "Count from 1 to 20."}]
    kw = dict(model=model, messages=msgs, temperature=0)
    base = client.chat.completions.create(max_tokens=40, **kw).choices[0].message.content
    stop = base[8:12]
    assert stop in base and len(base) > 20

    # Greedy outputs of different lengths share their prefix, so the token that completes the stop string is the
    # k-th for the smallest max_tokens k whose text contains it: guess k by re-tokenizing the text, check the guess
    # with k and k - 1 tokens, and fall back to a binary search.
    def has_stop(k: int) -> bool:
        return stop in client.chat.completions.create(max_tokens=k, **kw).choices[0].message.content

    ids = tokenizer(base, add_special_tokens=False)["input_ids"]
    k = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
    if not (has_stop(k) and (k == 1 or not has_stop(k - 1))):
        lo, hi = 1, 40
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
        k = lo
    for stream in (False, True):
        r = client.chat.completions.create(max_tokens=40, stop=[stop], stream=stream,
                                           **({"stream_options": {"include_usage": True}} if stream else {}), **kw)
        if stream:
            parts = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            usage = parts[-1].usage
            assert parts[-2].choices[0].finish_reason == "stop"
        else:
            text, usage = r.choices[0].message.content, r.usage
            assert r.choices[0].finish_reason == "stop"
        assert text == base[:base.index(stop)]
        assert usage.completion_tokens == k, (stream, usage)
        assert usage.total_tokens == usage.prompt_tokens + k
        extra = usage.model_extra
        assert set(SPEC_FIELDS) <= set(extra), (stream, extra)
        assert extra["drafter"] == "ngram" and extra["verify_steps"] >= 1 and extra["mean_accepted_length"] >= 1.0
        assert 0 <= extra["accepted_tokens"] <= extra["draft_tokens"]


def test_seed_reproducibility(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20,
              temperature=1.0, top_p=0.95)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b and a != c


def test_concurrent_async_streams_all_progress(server, model):
    """Concurrent streams interleave: each has received text before any other has finished (a server that runs
    requests one after the other would finish the first before the others start)."""
    loop_time = None

    async def run():
        nonlocal loop_time
        loop_time = asyncio.get_running_loop().time
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)

        async def one(i):
            s = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Write a poem number {i}."}], max_tokens=24,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            arrivals = []  # loop time of each chunk with text
            async for c in s:
                if c.choices and c.choices[0].delta.content:
                    arrivals.append(loop_time())
            return arrivals, loop_time()

        results = await asyncio.gather(*(one(i) for i in range(4)))
        await client.close()
        return results

    results = asyncio.run(run())
    first_end = min(end for _, end in results)
    for arrivals, _ in results:
        assert arrivals, results
        # several chunks of every stream arrive before the first stream ends: steps alternate between requests
        assert sum(t <= first_end for t in arrivals) >= 2, results
    assert wait_balanced(server.url)


def test_metrics_move_and_balance(server, client, model):
    wait_balanced(server.url)
    before = scrape(server.url)
    client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0)
    wait_balanced(server.url)
    after = scrape(server.url)
    for name in ("specserve_requests_received_total", "specserve_generation_tokens_total",
                 "specserve_prompt_tokens_total", "specserve_spec_verify_steps_total", "specserve_spec_draft_length_count",
                 "specserve_time_to_first_token_seconds_count", "specserve_request_latency_seconds_count"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "specserve_requests_total", outcome="completed") == \
        metric(before, "specserve_requests_total", outcome="completed") + 1
    # one drafted-length observation per verify step, summing to the draft tokens
    for hist, counter in (("specserve_spec_draft_length_count", "specserve_spec_verify_steps_total"),
                          ("specserve_spec_draft_length_sum", "specserve_spec_draft_tokens_total")):
        assert metric(after, hist) - metric(before, hist) == metric(after, counter) - metric(before, counter)
    assert wait_balanced(server.url)
    assert metric(after, "specserve_requests_waiting") == 0
    assert {lb for (n, lb) in after if n == "specserve_requests_running"} == \
        {frozenset({("model", model), ("drafter", "ngram")})}
