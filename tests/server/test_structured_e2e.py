"""Structured outputs and tool calling on real servers, driven by the official `openai` client and LangChain:
`parse`, `with_structured_output`, `bind_tools` (invoke, stream, a round trip), every `tool_choice`, streamed calls
equal to non-streamed ones per choice, bad tools and formats as a 400; then a fuzz of random schemas, which compile
and hold, or are a clean 400.

The tests share the session's float32 server (`server`, tests/server/conftest.py).
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server.tool_specs import ADD, WEATHER, merge_stream


# -- real servers --------------------------------------------------------------------------------------------------
SERVED = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def llm(server):
    return ChatOpenAI(base_url=server.url + "/v1", api_key=server.api_key, model=SERVED, temperature=0, max_tokens=40,
                      max_retries=0, timeout=120)


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=150)


TOM = "Tom is 30 years old. Tell me about him."  # nothing asks for JSON: only the grammar makes it so
TOM_JSON = "Tom is 30 years old. Reply in JSON with his name and age."  # json_mode: the keys come from the prompt
JSON_START = '{["-0123456789tfn'  # how a JSON text cut short can begin


def valid(schema: dict, text: str):
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.server
def test_e2e_parse_fills_parsed(client):
    r = client.chat.completions.parse(model=SERVED, messages=[{"role": "user", "content": TOM}],
                                      response_format=Person, max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "stop" and isinstance(c.message.parsed, Person)
    valid(Person.model_json_schema(), c.message.content)


@pytest.mark.server
@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_e2e_langchain_with_structured_output(llm, method):
    r = llm.with_structured_output(Person, method=method, include_raw=True).invoke(
        TOM_JSON if method == "json_mode" else TOM)
    assert r["parsing_error"] is None and isinstance(r["parsed"], Person), r
    raw = r["raw"]
    if method == "function_calling":  # a named tool: the call, finish_reason stop (as OpenAI answers)
        assert [c["name"] for c in raw.tool_calls] == ["Person"] and raw.response_metadata["finish_reason"] == "stop"
    else:
        assert raw.response_metadata["finish_reason"] == "stop" and not raw.tool_calls
        valid(Person.model_json_schema() if method == "json_schema" else {"type": "object"}, raw.content)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.mark.server
def test_e2e_langchain_bind_tools_invoke_stream_and_round_trip(llm):
    bound = llm.bind_tools([add, get_weather], tool_choice="any", parallel_tool_calls=False)
    ask = "What is 3 + 4?"
    r = bound.invoke(ask)
    assert len(r.tool_calls) == 1 and r.response_metadata["finish_reason"] == "tool_calls"
    (c,) = r.tool_calls
    assert c["name"] in ("add", "get_weather") and isinstance(c["args"], dict) and c["id"].startswith("call_")
    jsonschema.validate(c["args"], (add if c["name"] == "add" else get_weather).tool_call_schema.model_json_schema())
    merged = None
    for chunk in bound.stream(ask):
        merged = chunk if merged is None else merged + chunk
    assert [(x["name"], x["args"]) for x in merged.tool_calls] == [(c["name"], c["args"])]  # greedy: the same call
    assert merged.response_metadata["finish_reason"] == "tool_calls"
    # the call and its result sent back: the model answers (here, with no call: tool_choice none)
    final = llm.bind_tools([add, get_weather], tool_choice="none").invoke(
        [HumanMessage(ask), r, ToolMessage(content="7", tool_call_id=c["id"])])
    assert isinstance(final.content, str) and final.content and not final.tool_calls


WEATHER_TOOLS = [ADD.openai(), WEATHER.openai()]
SCHEMAS = {"add": ADD.parameters, "get_weather": WEATHER.parameters}
RAIN = [{"role": "user", "content": "Will it rain in Oslo today?"}]


@pytest.mark.server
@pytest.mark.parametrize("choice, parallel, max_tokens", [
    ({"type": "function", "function": {"name": "get_weather"}}, True, 60), ("required", False, 60),
    ("none", True, 12), ("auto", True, 12)])
def test_e2e_tool_choice(client, choice, parallel, max_tokens):
    r = client.chat.completions.create(model=SERVED, messages=RAIN, tools=WEATHER_TOOLS, tool_choice=choice,
                                       parallel_tool_calls=parallel, max_tokens=max_tokens, temperature=0)
    c = r.choices[0]
    calls = c.message.tool_calls or []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        if c.finish_reason != "length":
            valid(SCHEMAS[call.function.name], call.function.arguments)
    if isinstance(choice, dict):
        assert c.finish_reason == "stop" and [x.function.name for x in calls] == ["get_weather"]
        assert c.message.content is None
    elif choice == "required":
        assert c.finish_reason == "tool_calls" and len(calls) == 1 and c.message.content is None
    elif choice == "none":
        assert not calls and c.message.content
    elif calls:  # auto: the model may answer or call
        assert c.finish_reason in ("tool_calls", "length")


@pytest.mark.server
def test_e2e_streamed_calls_equal_non_streamed_per_choice(client):
    kw = dict(model=SERVED, messages=RAIN, tools=WEATHER_TOOLS, tool_choice="required", parallel_tool_calls=False,
              n=2, max_tokens=50, temperature=0.8, seed=5)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    merged = merge_stream([c.model_dump() for c in chunks])
    for ch in full.choices:
        s = merged[ch.index]
        assert s["finish"] == ch.finish_reason
        assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [
            (c.function.name, c.function.arguments) for c in ch.message.tool_calls]
        assert ch.message.tool_calls and s["content"] == (ch.message.content or "")
        if ch.finish_reason == "tool_calls":
            for c in ch.message.tool_calls:
                valid(SCHEMAS[c.function.name], c.function.arguments)


@pytest.mark.server
@pytest.mark.parametrize("extra, param", [
    ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}},
     "response_format")])
def test_e2e_bad_tools_and_formats_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=RAIN, max_tokens=4, **extra)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


# -- fuzz: random schemas compile and hold, or are a clean 400 ---------------------------------------------------
BROKEN = [{"type": "array", "uniqueItems": True}, {"not": {}}, {"oneOf": [{"type": "integer"}, {"type": "string"}]},
          {"type": "strin"}, {"minimum": "x"}, {"type": "string", "minLength": 3, "maxLength": 1}, {"$ref": "#/nope"},
          {"type": "string", "pattern": "(?=a)"}, {"type": "string", "pattern": "["}, {"if": {}, "then": {}},
          {"type": "object", "required": ["x"], "additionalProperties": False}, False]
scalar_values = st.one_of(st.integers(-5, 5), st.text("ab ", max_size=3), st.booleans(), st.none())
leaf_schemas = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span}, st.integers(-50, 50),
              st.integers(0, 100)),
    st.sampled_from([{"type": "number", "minimum": -10, "maximum": 10}, {"type": "boolean"}, {"type": "null"},
                     {"type": ["string", "null"], "maxLength": 4}, {}, True, {"type": "integer", "multipleOf": 3},
                     {"type": "string", "pattern": "^[a-c]{1,3}$"}, {"type": "string", "format": "date"}]),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda vals: {"enum": vals}, st.lists(scalar_values, min_size=1, max_size=3)),
    st.builds(lambda v: {"const": v}, scalar_values),
    st.sampled_from(BROKEN))


def _containers(children):
    return st.one_of(
        st.builds(lambda props, req, extra: {"type": "object", "properties": props,
                                             "required": [k for k, r in zip(props, req) if r],
                                             "additionalProperties": extra},
                  st.dictionaries(st.sampled_from(["a", "b", "id", "x y", "ü"]), children, max_size=3),
                  st.lists(st.booleans(), min_size=3, max_size=3), st.booleans()),
        st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                  children, st.integers(0, 2), st.integers(0, 2)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children))


# at the top (where "#/$defs/..." resolves), sometimes a definition referenced twice
random_schemas = st.one_of(
    st.recursive(leaf_schemas, _containers, max_leaves=5),
    st.builds(lambda a, b: {"$defs": {"d": a}, "type": "object", "required": ["r"],
                            "properties": {"r": {"$ref": "#/$defs/d"}, "s": {"anyOf": [b, {"$ref": "#/$defs/d"}]}}},
              st.recursive(leaf_schemas, _containers, max_leaves=3), leaf_schemas))


@pytest.mark.server
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=random_schemas, as_tool=st.booleans(), stream=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_e2e_fuzz_random_schemas(server, schema, as_tool, stream, seed):
    """A random schema, as a response format or as a named tool's argument (wrapped in an object), streamed or
    not: a 400 naming the field, or output that parses and validates whenever the model finished on its own."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Say hello."}],  # free text: no JSON
            "max_tokens": 32, "temperature": 1.0, "seed": seed, "stream": stream}
    if as_tool:
        params = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
        if isinstance(schema, dict) and "$defs" in schema:  # where "#/$defs/..." still resolves
            params["$defs"] = schema["$defs"]
        body |= {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                 "tool_choice": {"type": "function", "function": {"name": "f"}}}
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    assert r.status_code in (200, 400), (schema, r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == ("tools" if as_tool else "response_format"), r.text
        return
    if stream:
        events = [json.loads(ln[6:]) for ln in r.text.split("\n") if ln.startswith("data: {")]
        assert not any("error" in e for e in events), r.text
        s = merge_stream(events)[0]
        finish, content = s["finish"], s["content"]
        args = [c["arguments"] for c in s["calls"].values()]
    else:
        ch = r.json()["choices"][0]
        finish, content = ch["finish_reason"], ch["message"]["content"]
        args = [c["function"]["arguments"] for c in ch["message"].get("tool_calls") or ()]
    if as_tool:  # the call is forced from the first token: there even when cut short
        assert len(args) == 1 and not content, (schema, r.text)
        text, schema = args[0], params
    else:
        text = content
    if finish == "stop":
        valid(schema if isinstance(schema, dict) else {}, text)
    else:
        assert text[:1] in JSON_START, (schema, r.text)
