"""The API side of prefix caching: `cache_salt` and `n` validation, the prefix-cache namespace (API key digest +
salt, or one per request with the cache off), the prefix-cache metrics; then the prefix cache on the session's open
server, with the official `openai` client. The `n` choices per request are in test_n_choices_api.py.

The in-process tests run the real app against a scripted worker (tests/server/fake_worker.py; no model).
"""
from __future__ import annotations

import uuid

import pytest
from openai import OpenAI

from server.api.generation import cache_namespace
from server.metrics import Metrics
from server.worker import messages as m
from tests.server.conftest import metric, scrape, wait_balanced
from tests.server.fake_worker import KEY, MODEL, PROMPT, FakeWorker, auth, make_client, post


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


# -- real servers: the prefix cache ------------------------------------------------------------------------------
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
