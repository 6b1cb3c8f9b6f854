"""Property-based fuzz of request bodies: whatever a client sends, the server never answers 500."""
from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False),
                    st.text(max_size=12))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                          max_size=3), max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                 "content": st.one_of(st.text(max_size=20), json_values)})
# max_tokens is always present and small (or invalid): a valid body without it would generate to the context end.
small_max_tokens = st.one_of(st.integers(-3, 4), st.text(max_size=3), st.booleans(), st.floats(-1, 4))
chat_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=8)), "max_tokens": small_max_tokens},
    optional={"messages": st.one_of(st.lists(message, max_size=3), json_values),
              "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), json_values),
              "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), json_values),
              "top_k": st.one_of(st.integers(-3, 100), json_values),
              "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), json_values),
              "seed": st.one_of(st.integers(-2**70, 2**70), json_values),
              "stream": st.one_of(st.booleans(), json_values),
              "n": st.one_of(st.integers(-1, 3), json_values), "extra_field": json_values})
completion_body = st.fixed_dictionaries(
    {"model": st.just("SmolLM2-135M-Instruct"),
     "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=6), json_values),
     "max_tokens": small_max_tokens},
    optional={"echo": json_values, "best_of": json_values, "suffix": json_values})


def _check(server, path, body):
    r = httpx.post(server.url + path, content=json.dumps(body), headers={**server.headers,
                   "Content-Type": "application/json"}, timeout=120)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=chat_body)
def test_fuzz_chat(server, body):
    _check(server, "/v1/chat/completions", body)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=completion_body)
def test_fuzz_completions(server, body):
    _check(server, "/v1/completions", body)
