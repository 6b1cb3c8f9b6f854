"""Structured outputs and tool calling through the API, against a scripted worker (tests/server/scripted.py; no
model): the grammar each choice's worker request gets, the request fields' validation (a 400 before any worker
time), and the reply shapes: tool calls streamed and not, legacy `functions`, plain content, a tool round trip's
prompt. The parser, rendering and grammars are in test_tool_calls.py, the real servers in test_structured_e2e.py.
"""
from __future__ import annotations

import json

import pytest

from tests.server.scripted import call, make_client, scripted
from tests.server.tool_specs import ADD, TWO_CALLS, WEATHER, call_text, merge_stream


# -- the API against a scripted worker ---------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is 3 + 4?"}]
TOOLS = [ADD.openai(), WEATHER.openai()]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("path, body, kind", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_object"}}, "json"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}}, "json"),
    ("/v1/completions", {"prompt": "A person:", "response_format": {"type": "json_object"}}, "json"),
    ("/v1/chat/completions", {"messages": ASK, "tools": TOOLS}, "lark"),
    ("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required"}, "lark"),
    ("/v1/chat/completions", {"messages": ASK, "functions": [ADD.openai()["function"]]}, "lark"),
    ("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}, None),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "text"}}, None),
    ("/v1/completions", {"prompt": "x", "response_format": None}, None),
], ids=["json_object", "json_schema", "completions", "auto", "required", "functions", "none", "text", "null"])
def test_the_worker_gets_the_grammar(tokenizer, path, body, kind):
    worker = scripted(tokenizer, "{}")
    with make_client(worker, tokenizer) as c:
        call(c, path, {**body, "max_tokens": 4, "n": 2})
    grammars = {g.grammar for g in worker.generates}
    assert len(worker.generates) == 2 and len(grammars) == 1  # every choice gets it
    (grammar,) = grammars
    if kind is None:
        assert grammar is None
    else:
        assert grammar is not None and ("%json" in grammar if kind == "lark" else "json_schema" in grammar)


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),  # valid, but not enforceable
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(?=a)b"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "add"}}] * 2}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "functions": [ADD.openai()["function"]]}, "functions"),
    ({"functions": [ADD.openai()["function"]], "function_call": {"name": "nope"}}, "function_call"),
    ({"messages": [{"role": "tool", "content": "7"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_fields_are_400_before_any_worker_time(tokenizer, body, param):
    worker = scripted(tokenizer, "{}")
    with make_client(worker, tokenizer) as c:
        r = c.post("/v1/chat/completions", json={"model": "scripted", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
    assert worker.generates == []


def test_completions_bad_response_format_is_400(tokenizer):
    worker = scripted(tokenizer, "{}")
    with make_client(worker, tokenizer) as c:
        r = c.post("/v1/completions", json={"model": "scripted", "prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}, "then": {}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


@pytest.mark.parametrize("sizes", [1, 4, 1000])
def test_tool_call_replies_streamed_and_not(tokenizer, sizes):
    worker = scripted(tokenizer, TWO_CALLS, sizes)
    body = {"messages": ASK, "tools": TOOLS, "n": 2, "max_tokens": 100, "logprobs": True}
    with make_client(worker, tokenizer) as c:
        full = call(c, "/v1/chat/completions", body)
        events = call(c, "/v1/chat/completions", body, stream=True)
    n_tokens = len(tokenizer(TWO_CALLS, add_special_tokens=False)["input_ids"])
    streamed = merge_stream(events)
    assert sorted(streamed) == [0, 1]
    ids = set()
    for ch in full["choices"]:
        msg = ch["message"]
        assert ch["finish_reason"] == "tool_calls" and msg["content"] == "Let me compute that."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
            ("add", {"a": 3, "b": 4}), ("get_weather", {"city": 'Paris "}" {', "unit": "c"})]
        ids |= {c["id"] for c in msg["tool_calls"]}
        assert len(ch["logprobs"]["content"]) == n_tokens  # every generated token's, calls included
        s = streamed[ch["index"]]
        assert s["finish"] == "tool_calls" and s["content"] == msg["content"]
        assert [(c["name"], c["arguments"]) for c in s["calls"].values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
        ids |= {c["id"] for c in s["calls"].values()}
    assert len(ids) == 8  # every call its own id
    lp = [e for ev in events for ch in ev["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert len(lp) == 2 * n_tokens
    # a finish chunk per choice, with an empty delta, after its last call piece
    finishes = [ch for ev in events for ch in ev["choices"] if ch["finish_reason"]]
    assert len(finishes) == 2 and all(ch["delta"] == {} for ch in finishes)


def test_legacy_functions_reply(tokenizer):
    worker = scripted(tokenizer, call_text("add", {"a": 1, "b": 2}), 2)
    body = {"messages": ASK, "functions": [ADD.openai()["function"]], "max_tokens": 100}
    with make_client(worker, tokenizer) as c:
        full = call(c, "/v1/chat/completions", body)
        events = call(c, "/v1/chat/completions", body, stream=True)
    ch = full["choices"][0]
    assert ch["finish_reason"] == "function_call" and ch["message"]["content"] is None
    assert ch["message"]["function_call"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert "tool_calls" not in ch["message"]
    s = merge_stream(events)[0]
    assert s["fc"] == ch["message"]["function_call"] and s["finish"] == "function_call" and not s["calls"]


def test_no_call_is_plain_content_and_none_is_not_parsed(tokenizer):
    text = "No tool needed " + call_text("add", {"a": 1, "b": 2})
    for choice, want_calls in (("auto", 1), ("none", 0)):
        worker = scripted(tokenizer, text)
        with make_client(worker, tokenizer) as c:
            ch = call(c, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": choice,
                                                  "max_tokens": 100})["choices"][0]
        assert len(ch["message"].get("tool_calls") or []) == want_calls
        assert ch["message"]["content"] == (text if choice == "none" else "No tool needed")
        assert ch["finish_reason"] == ("tool_calls" if want_calls else "stop")
        # tool_choice none: the prompt says nothing about tools
        prompt = tokenizer.decode(worker.generates[0].prompt_ids)
        assert ("<tools>" in prompt) == (choice == "auto")


def test_a_tool_round_trip_prompt(tokenizer):
    """An assistant turn with tool calls and null content, the tool results, and a developer message render into
    the prompt in the documented format."""
    worker = scripted(tokenizer, "It is 7.")
    history = [{"role": "developer", "content": "Be terse."}, *ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
               {"role": "tool", "tool_call_id": "call_9", "content": "7"}]
    with make_client(worker, tokenizer) as c:
        ch = call(c, "/v1/chat/completions", {"messages": history, "tools": TOOLS, "max_tokens": 20})["choices"][0]
    assert ch["message"] == {"role": "assistant", "content": "It is 7."} and ch["finish_reason"] == "stop"
    prompt = tokenizer.decode(worker.generates[0].prompt_ids)
    assert prompt.startswith("<|im_start|>system\nBe terse.\n\n# Tools")
    assert ("<|im_start|>assistant\n" + call_text("add", {"a": 3, "b": 4}) + "<|im_end|>\n<|im_start|>user\n"
            "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt
