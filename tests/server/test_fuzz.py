"""Property-based fuzz of request bodies: whatever a client sends, the server never answers 500."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.server

# Floats at the edges: zeros of both signs, subnormals, float32 / float64 extremes, values next to the documented
# bounds (temperature [0, 2], top_p (0, 1], the engine's greedy cut-off 1e-5), huge ones and infinities (which JSON
# cannot carry: the body is then invalid).
EDGE_FLOATS = [0.0, -0.0, 5e-324, -5e-324, 1e-323, 2.2250738585072014e-308, 1e-300, 1e-45, 1e-38,
               1.1754943508222875e-38, 1e-30, 1e-10, 1e-7, 9.99e-6, 1e-5, 1.0000001e-5, 1e-3, 0.5,
               0.9999999999999999, 1.0, 1.0000000000000002, 1.9999999999999998, 2.0, 2.0000000000000004, 65504.0,
               3.4028234663852886e38, 1e300, 1e308, 1.7976931348623157e308, -1e-38, -1.0, -1e308,
               float("inf"), float("-inf")]
EDGE_INTS = [0, 1, -1, 2, 2**31 - 1, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64,
             10**30]
edge_numbers = st.one_of(st.sampled_from(EDGE_FLOATS), st.sampled_from(EDGE_INTS), st.floats(allow_nan=False),
                         st.floats(-1e-300, 1e-300), st.floats(min_value=1e300))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False),
                    st.text(max_size=12), edge_numbers)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                          max_size=3), max_leaves=8)
# Messages of every role, with the tool fields a conversation with tools carries (valid or not).
tool_call = st.fixed_dictionaries({"id": st.one_of(st.just("call_1"), json_values), "type": st.just("function"),
                                   "function": st.fixed_dictionaries({
                                       "name": st.one_of(st.just("add"), st.text(max_size=6)),
                                       "arguments": st.one_of(st.just('{"a": 1}'), st.text(max_size=8), json_values)})})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "function", ""]),
     "content": st.one_of(st.text(max_size=20), json_values)},
    optional={"tool_calls": st.one_of(st.lists(tool_call, max_size=2), json_values),
              "tool_call_id": st.one_of(st.text(max_size=6), json_values), "name": st.one_of(st.text(max_size=6),
                                                                                            json_values)})

# response_format and tools: plausible shapes (small schemas, some the grammar engine cannot enforce, one past the
# depth cap and one past the size cap) or any value.
DEEP = {"type": "string"}
for _ in range(40):
    DEEP = {"type": "array", "items": DEEP}
LARGE = {"type": "string", "description": "x" * 70_000}
schemas = st.one_of(st.sampled_from([{"type": "object"}, {"type": "integer", "maximum": 9}, {"enum": ["a", 1]},
                                     {"type": "array", "uniqueItems": True}, {"type": "strin"}, {"not": {}},
                                     {"$ref": "#/nope"}, {"type": "string", "pattern": "(?=x)"}, True, False, DEEP,
                                     LARGE]),
                    json_values)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                          optional={"json_schema": st.fixed_dictionaries(
                              {"name": st.one_of(st.just("s"), st.text(max_size=4)), "schema": schemas},
                              optional={"strict": json_values})}),
    json_values)
function = st.fixed_dictionaries({"name": st.one_of(st.sampled_from(["add", "f"]), st.text(max_size=5))},
                                 optional={"parameters": st.one_of(st.just({"type": "object", "properties": {
                                     "a": {"type": "integer"}}}), schemas), "description": json_values,
                                     "strict": json_values})
tools = st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]),
                                                  "function": function}), max_size=3), json_values)
tool_fields = {
    "response_format": response_format,
    "tools": tools,
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any"]),
                             st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                                 {"name": st.sampled_from(["add", "f", "g"])})}), json_values),
    "parallel_tool_calls": st.one_of(st.booleans(), json_values),
    "functions": st.one_of(st.lists(function, max_size=2), json_values),
    "function_call": st.one_of(st.sampled_from(["none", "auto"]), st.fixed_dictionaries(
        {"name": st.sampled_from(["add", "f"])}), json_values),
}


def numeric(*valid):
    """A numeric field: one of its own strategies, an edge number, or any JSON value."""
    return st.one_of(*valid, edge_numbers, json_values)


# logit_bias: ids in and out of the vocabulary (49152 tokens) and of int32, keys that are not canonical decimals,
# biases around the [-100, 100] bounds, and maps at and past the 300-entry limit.
bias_keys = st.one_of(st.integers(-3, 49160).map(str), st.sampled_from(
    ["", "1.5", "1e3", "abc", "+1", "-1", "01", " 1", "1 ", "49151", "49152", "2147483647", "2147483648", "\u0661"]),
    st.text(max_size=4))
bias_values = numeric(st.floats(-101, 101), st.integers(-101, 101), st.sampled_from([-100, 100, -100.0, 100.0]))
logit_bias = st.one_of(
    st.dictionaries(bias_keys, bias_values, max_size=5),
    st.builds(lambda n, v: {str(i): v for i in range(n)}, st.sampled_from([299, 300, 301, 5000]),
              st.sampled_from([-100, 0.5, 100.0, 101])))

# max_tokens is always present and small (or invalid): a valid body without it would generate to the context end.
# Its edge values are either invalid types or over the context (400), never a long generation.
small_max_tokens = st.one_of(st.integers(-3, 4), st.text(max_size=3), st.booleans(), st.floats(-1, 4),
                             st.sampled_from(EDGE_FLOATS), st.sampled_from([2**31 - 1, 2**31, 10**9, 2**63, -(2**63)]))
sampling_fields = {
    "temperature": numeric(st.floats(-1, 3, allow_nan=False), st.floats(0, 1e-4), st.floats(1.99, 2.01)),
    "top_p": numeric(st.floats(-0.5, 1.5, allow_nan=False), st.floats(0, 1e-4)),
    "top_k": numeric(st.integers(-3, 100)),
    "seed": numeric(st.integers(-2**70, 2**70)),
    "n": numeric(st.integers(-1, 5), st.sampled_from([128, 129])),  # the server has 4 KV slots
    "presence_penalty": numeric(st.floats(-2.5, 2.5), st.sampled_from([-2.0, 2.0])),
    "frequency_penalty": numeric(st.floats(-2.5, 2.5), st.sampled_from([-2.0, 2.0])),
    "repetition_penalty": numeric(st.floats(-1, 3), st.floats(0, 1e-5), st.sampled_from([1e-6, 1e6, 1.1e6])),
    "min_p": numeric(st.floats(-0.5, 1.5), st.floats(0, 1e-4), st.sampled_from([0.0, 1.0])),
    "logit_bias": st.one_of(logit_bias, json_values),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "cache_salt": st.one_of(st.text(max_size=12), st.text(min_size=250, max_size=260), json_values),
}
chat_body = st.fixed_dictionaries(
    {"model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=8)), "max_tokens": small_max_tokens},
    optional={"messages": st.one_of(st.lists(message, max_size=3), json_values),
              "max_completion_tokens": small_max_tokens, **sampling_fields,
              "logprobs": st.one_of(st.booleans(), json_values), "top_logprobs": numeric(st.integers(-1, 22)),
              "extra_field": json_values, **tool_fields})
completion_body = st.fixed_dictionaries(
    {"model": st.just("SmolLM2-135M-Instruct"),
     "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=6),
                         st.lists(st.sampled_from(EDGE_INTS), min_size=1, max_size=3), json_values),
     "max_tokens": small_max_tokens},
    optional={**sampling_fields, "logprobs": numeric(st.booleans(), st.integers(-1, 7)),
              "echo": st.one_of(st.booleans(), json_values), "best_of": numeric(st.integers(-1, 3)),
              "suffix": json_values, "response_format": response_format})


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


# Bodies valid but for one to three numeric fields, so the edge numbers that pass validation reach the engine.
NUMERIC_FIELDS = ("temperature", "top_p", "top_k", "seed", "n", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_p", "best_of", "logprobs", "max_tokens")
VALID_BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 2}


@st.composite
def numeric_body(draw):
    """With `echo` or not: with it, `max_tokens` 0 and `logprobs` score the prompt."""
    fields = draw(st.lists(st.sampled_from(NUMERIC_FIELDS), min_size=1, max_size=3, unique=True))
    return {**VALID_BODY, "echo": draw(st.booleans()), **{f: draw(edge_numbers) for f in fields}}


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=numeric_body())
def test_fuzz_numeric_edges(server, body):
    _check(server, "/v1/completions", body)


def test_every_numeric_field_at_every_edge_value(server):
    """Exhaustive over the edge lists (the fuzz above samples them): no field at any edge value gives a 5xx. One
    token each (the prefill samples it, through temperature / top-k / top-p) keeps the sweep fast."""
    failures = []
    with httpx.Client(headers={**server.headers, "Content-Type": "application/json"}, timeout=120) as c:
        for field in NUMERIC_FIELDS:
            for value in EDGE_FLOATS + EDGE_INTS:
                body = {**VALID_BODY, "max_tokens": 1, field: value}
                if field == "max_tokens" and isinstance(value, int) and 1 < value < 512:
                    continue  # a valid longer generation, not an edge
                r = c.post(server.url + "/v1/completions", content=json.dumps(body))
                if r.status_code >= 500 or (r.status_code >= 400 and "error" not in r.json()):
                    failures.append(f"{field}={value!r}: {r.status_code} {r.text[:120]}")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def greedy_text(server):
    r = httpx.post(server.url + "/v1/completions", json={**TINY_BODY, "temperature": 0}, headers=server.headers,
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


TINY_BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 6}


@pytest.mark.parametrize("field, value", [("temperature", 1e-38), ("temperature", 5e-324), ("temperature", 1e-300),
                                          ("temperature", 1e-6), ("top_p", 5e-324), ("top_p", 1e-300)])
def test_tiny_temperature_or_top_p_is_greedy(server, greedy_text, field, value):
    """Regressions: temperature 1e-38 overflowed logits / temperature to inf, and a top_p that rounds to 0 in float32
    dropped every token; both answered 500 ("probability tensor contains either inf, nan or element < 0"). A
    temperature that small is greedy decoding, and so is a top_p that small (it keeps only the most likely token)."""
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({**TINY_BODY, field: value}),
                   headers={**server.headers, "Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text
