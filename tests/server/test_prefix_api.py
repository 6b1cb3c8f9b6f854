"""The API side of prefix caching and of `n` choices per request: `cache_salt` and `n` validation, the prefix-cache
namespace (API key digest + salt, or one per request with the cache off), n choices submitted as n worker requests
and shaped into one response (JSON or interleaved SSE), `usage.prompt_tokens_details.cached_tokens`, the prefix-cache
metrics; then the official `openai` client against real servers.

The shaping tests run the real app against a scripted worker (no model): each request's tokens are a function of its
seed, so a choice's text names the worker request it came from.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from server.api.app import ServerState, create_app
from server.api.generation import cache_namespace, choice_seed, combine_usage
from server.config import config_from_dict
from server.metrics import Metrics
from server.worker import messages as m
from tests.server.conftest import metric, scrape, wait_balanced

KEY = "sk-client-one"
MODEL = "fake-model"
PROMPT = [5, 6, 7, 8]
STEP_S = 0.003
SPEC = {"drafter": "ngram", "draft_tokens": 6, "accepted_tokens": 3, "verify_steps": 3, "mean_accepted_length": 2.0,
        "mean_draft_length": 2.0, "max_draft_length": 4}


# -- a scripted worker -------------------------------------------------------------------------------------------
class FakeTokenizer:
    """One character per token: id t decodes to chr(ord('a') + t % 26)."""

    eos_token_id = None
    chat_template = "{{ messages | map(attribute='content') | join }}"  # what apply_chat_template below renders

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 26 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(msg["content"] for msg in messages)


def tokens_for(req: m.Generate) -> list[int]:
    """The scripted output of a worker request: its seed's digits as letters, then 'z's, `max_tokens` in all."""
    head = [int(d) for d in str(abs(req.seed))] if req.seed is not None else []
    return (head + [25] * req.max_tokens)[:req.max_tokens]


class FakeWorker:
    """`WorkerClient`'s interface to the routes: records every message and answers each Generate with one token per
    step of STEP_S seconds (so the choices of one request interleave, as a batched step's tokens do), then a finish
    carrying usage."""

    def __init__(self, num_slots: int = 4, fail: set[int] = frozenset(), script=tokens_for, cached_tokens: int = 2,
                 usage_of=None):
        self.ready = m.Ready(MODEL, "ngram", 512, num_slots, 1000, "cpu", "float32")
        self.alive, self.dead = True, False
        self.generates: list[m.Generate] = []
        self.aborts: list[str] = []
        self.extra_in_flight = 0
        self.fail = fail  # choice indices (of every request) that fail instead of generating
        self.script = script
        self.cached_tokens = cached_tokens
        self.usage_of = usage_of or (lambda i: {**SPEC, "cached_tokens": self.cached_tokens})
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []

    def attach(self, loop):
        pass

    @property
    def in_flight(self) -> int:
        return len(self._queues) + self.extra_in_flight

    def submit(self, req: m.Generate) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        self.generates.append(req)
        self._tasks.append(asyncio.get_running_loop().create_task(self._run(req, len(self.generates) - 1)))
        return q

    def _put(self, rid: str, msg, last: bool = False) -> None:
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(msg)
            if last:
                self._queues.pop(rid, None)

    async def _run(self, req: m.Generate, i: int) -> None:
        await asyncio.sleep(0)
        if int(req.request_id.rsplit("-", 1)[1]) in self.fail:
            self._put(req.request_id, m.Failed(req.request_id, "scripted failure"), last=True)
            return
        toks = self.script(req)
        for k, t in enumerate(toks):
            if req.request_id in self.aborts:
                return
            last = k == len(toks) - 1
            self._put(req.request_id, m.Tokens(req.request_id, [t], finish_reason="length" if last else None,
                                               usage=self.usage_of(i) if last else None), last=last)
            await asyncio.sleep(STEP_S)

    def abort(self, request_id: str, final: bool = False) -> None:
        self.aborts.append(request_id)
        if final:
            i = next(k for k, g in enumerate(self.generates) if g.request_id == request_id)
            self._put(request_id, m.Aborted(request_id, usage=self.usage_of(i)), last=True)
        else:
            self._queues.pop(request_id, None)


def make_client(worker: FakeWorker, prefix_caching: bool = True, api_key: str | None = KEY,
                max_waiting: int = 4) -> TestClient:
    cfg = config_from_dict({"cache": {"num_slots": worker.ready.num_slots, "max_seq_len": 512,
                                      "prefix_caching": prefix_caching}, "server": {"max_waiting": max_waiting}})
    state = ServerState(cfg=cfg, worker=worker, tokenizer=FakeTokenizer(), metrics=Metrics(MODEL, "ngram"),
                        model_name=MODEL, stop_token_ids=[], api_key=api_key, created=0)
    return TestClient(create_app(state), raise_server_exceptions=False)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(client: TestClient, path: str, body: dict, key: str = KEY):
    return client.post(path, json={"model": MODEL, **body}, headers=auth(key))


def sse_events(resp) -> list:
    lines = [ln for ln in resp.text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def letters(toks: list[int]) -> str:
    return FakeTokenizer().decode(toks)


# -- validation ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, extra", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                         ("/v1/completions", {"prompt": PROMPT})])
@pytest.mark.parametrize("field, value", [
    ("cache_salt", 5), ("cache_salt", ["a"]), ("cache_salt", {"a": 1}), ("cache_salt", True), ("cache_salt", ""),
    ("cache_salt", "x" * 257), ("cache_salt", "a\x00b"),
    ("n", 0), ("n", 129), ("n", -1), ("n", "2"), ("n", 2.0), ("n", True), ("n", 5),  # 5 > the 4 KV slots
])
def test_invalid_cache_salt_and_n_are_400_naming_the_field(path, extra, field, value):
    worker = FakeWorker(num_slots=4)
    with make_client(worker) as c:
        r = post(c, path, {**extra, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert worker.generates == []  # nothing reached the worker


def test_n_over_the_kv_slots_names_them():
    with make_client(FakeWorker(num_slots=3)) as c:
        err = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 4}).json()["error"]
        assert err["param"] == "n" and "3" in err["message"] and "slots" in err["message"], err
        assert post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3}).status_code == 200


def test_valid_cache_salt_and_n_accepted():
    with make_client(FakeWorker(num_slots=128)) as c:
        for body in ({"cache_salt": "s"}, {"cache_salt": "x" * 256}, {"cache_salt": "a:b\u00e9"}, {"cache_salt": None},
                     {"n": None}, {"n": 128}):
            r = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **body})
            assert r.status_code == 200, (body, r.text)


def test_admission_counts_every_choice():
    """The waiting queue has room for 1 more worker request: n=1 is admitted, n=2 is a 503."""
    worker = FakeWorker(num_slots=4)
    worker.extra_in_flight = 4 + 4 - 1  # slots + max_waiting - 1
    with make_client(worker) as c:
        r = post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "n": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert worker.generates == []
        assert post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).status_code == 200


# -- namespaces ------------------------------------------------------------------------------------------------------
def test_namespace_partitions_by_key_and_salt():
    ns = cache_namespace
    assert ns("k1", None, True, "req-1") == ns("k1", None, True, "req-2")  # not per request
    assert ns("k1", "s", True, "r") == ns("k1", "s", True, "r")
    distinct = {ns("k1", None, True, "r"), ns("k2", None, True, "r"), ns("", None, True, "r"),
                ns("k1", "s", True, "r"), ns("k1", "t", True, "r"), ns("k2", "s", True, "r"),
                # a ':' in the key or the salt cannot make two (key, salt) pairs collide
                ns("a", "b:c", True, "r"), ns("a:b", "c", True, "r"), ns("a", ":b", True, "r")}
    assert len(distinct) == 9
    assert all("k1" not in n and "k2" not in n for n in distinct)  # the key itself is never sent


def test_namespace_with_the_cache_off_is_per_request():
    a, b = cache_namespace("k", "s", False, "req-1"), cache_namespace("k", "s", False, "req-2")
    assert a != b
    assert cache_namespace("k", None, False, "req-1") == a  # neither key nor salt matter
    assert a != cache_namespace("k", "s", True, "req-1")


def test_routes_send_the_presented_keys_namespace():
    worker = FakeWorker()
    with make_client(worker, api_key=None) as c:  # no key configured: any presented key is accepted
        for key, salt in (("k1", None), ("k1", None), ("k2", None), ("k1", "s"), ("k1", "s"), ("", None)):
            body = {"prompt": PROMPT, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
            headers = auth(key) if key else {}
            assert c.post("/v1/completions", json={"model": MODEL, **body}, headers=headers).status_code == 200
    got = [g.namespace for g in worker.generates]
    assert got == [cache_namespace(k, s, True, "") for k, s in (("k1", None), ("k1", None), ("k2", None),
                                                                ("k1", "s"), ("k1", "s"), ("", None))]
    assert got[0] == got[1] and got[3] == got[4] and len({got[0], got[2], got[3], got[5]}) == 4


def test_cache_off_namespace_is_shared_by_the_choices_only():
    worker = FakeWorker()
    with make_client(worker, prefix_caching=False) as c:
        for _ in range(2):
            assert post(c, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "n": 2}).status_code == 200
    a, b, c2, d = (g.namespace for g in worker.generates)
    assert a == b and c2 == d and a != c2
    assert a.startswith("request:") and KEY not in a


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


# -- metrics -----------------------------------------------------------------------------------------------------------
def test_prefix_cache_metrics_fold_in_the_cumulative_counts():
    mt = Metrics("m", "d")

    def values():
        from prometheus_client.parser import text_string_to_metric_families
        return {s.name: s.value for f in text_string_to_metric_families(mt.render()[0].decode()) for s in f.samples}

    v = values()  # exported from the start, at zero
    for name in ("specserve_prefix_cache_queries_total", "specserve_prefix_cache_hits_total",
                 "specserve_prefix_cache_evictions_total", "specserve_kv_cache_cached_usage_ratio",
                 "specserve_kv_cache_usage_ratio"):
        assert v[name] == 0, name
    mt.on_worker_message(m.Status(1, 0, 0.25, kv_cached_usage=0.5, prefix_queries=100, prefix_hits=40,
                                  prefix_evictions=1))
    mt.on_worker_message(m.Status(0, 0, 0.0, kv_cached_usage=0.75, prefix_queries=100, prefix_hits=40,
                                  prefix_evictions=1))  # unchanged counts add nothing
    mt.on_worker_message(m.Status(2, 1, 0.5, kv_cached_usage=0.125, prefix_queries=130, prefix_hits=60,
                                  prefix_evictions=3))
    v = values()
    assert v["specserve_prefix_cache_queries_total"] == 130 and v["specserve_prefix_cache_hits_total"] == 60
    assert v["specserve_prefix_cache_evictions_total"] == 3
    assert v["specserve_kv_cache_usage_ratio"] == 0.5 and v["specserve_kv_cache_cached_usage_ratio"] == 0.125


# -- real servers, the official client ---------------------------------------------------------------------------------
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


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


# The prefix cache itself (the worker's side): a repeated prompt reuses the cached rows within its namespace only,
# on the session's server without an API key (`open_server`, tests/conftest.py).


def _cached(server_url: str, key: str, messages, **kw) -> tuple[int, int]:
    client = OpenAI(base_url=server_url + "/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=2,
                                       temperature=0, **kw)
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens


def _long_prompt() -> list[dict]:
    return [{"role": "user", "content": f"Note {uuid.uuid4().hex}: summarize the history of the bicycle in detail, "
                                        "from the draisine to modern carbon frames."}]


@pytest.mark.server
def test_e2e_repeated_prompt_hits_the_cache(open_server):
    msgs, salt = _long_prompt(), uuid.uuid4().hex  # a salt nobody used: nothing is cached under it yet
    first, prompt = _cached(open_server.url, "key-a", msgs, extra_body={"cache_salt": salt})
    again, _ = _cached(open_server.url, "key-a", msgs, extra_body={"cache_salt": salt})
    assert first == 0
    assert 0 < again <= prompt
    other_salt, _ = _cached(open_server.url, "key-a", msgs, extra_body={"cache_salt": uuid.uuid4().hex})
    assert other_salt == 0
    same_salt, _ = _cached(open_server.url, "key-a", msgs, extra_body={"cache_salt": salt})
    assert same_salt > 0


@pytest.mark.server
def test_e2e_the_cache_is_per_api_key(open_server):
    msgs = _long_prompt()
    keys = [f"key-{uuid.uuid4().hex}" for _ in range(2)]  # fresh keys: fresh namespaces
    assert _cached(open_server.url, keys[0], msgs)[0] == 0
    assert _cached(open_server.url, keys[0], msgs)[0] > 0
    assert _cached(open_server.url, keys[1], msgs)[0] == 0


@pytest.mark.server
def test_e2e_prefix_cache_metrics_move(open_server):
    before = scrape(open_server.url)
    msgs, key = _long_prompt(), f"key-{uuid.uuid4().hex}"
    _cached(open_server.url, key, msgs)
    cached, _ = _cached(open_server.url, key, msgs)
    assert wait_balanced(open_server.url)
    after = scrape(open_server.url)

    def moved(name: str) -> float:
        return metric(after, name) - metric(before, name)

    queried, hits = moved("specserve_prefix_cache_queries_total"), moved("specserve_prefix_cache_hits_total")
    assert queried > 0 and hits >= cached > 0
    assert metric(after, "specserve_kv_cache_cached_usage_ratio") > 0  # the finished requests' rows stay cached
