"""Structured outputs and tool calling through the API: the reply parser and its streaming hold-back, the prompt
rendering of tools and earlier calls, the grammars (checked with the real tokenizer's matcher), the request fields'
validation, the reply shapes against a scripted worker, then real servers driven by the official `openai` client
and LangChain.
"""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field

from core.grammar import GrammarTokenizer, lark_grammar
from server.api.structured import ResponseFormat, ToolChoice, ToolSpec
from server.api.tool_grammar import tool_grammar_lark
from server.api.tool_parser import ToolCallParser, ToolReply
from server.api.tools import END, TRIGGER, ToolPlan, render_messages, tools_prompt
from tests.server.test_logprobs_api import ScriptWorker, call, make_client

ADD = ToolSpec("add", "Add two integers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                             "b": {"type": "integer"}},
                                            "required": ["a", "b"], "additionalProperties": False})
WEATHER = ToolSpec("get_weather", None, {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}, "required": ["city"],
                                                 "additionalProperties": False})
NOARGS = ToolSpec("now")


def call_text(name: str, args: dict) -> str:
    return f"{TRIGGER}\n{json.dumps({'name': name, 'arguments': args})}\n{END}"


# -- the reply parser --------------------------------------------------------------------------------------------
def parse(text: str, pieces: list[int] | None = None, single: bool = False):
    """(content, [(name, arguments)], events) of `text` fed whole, or cut at the `pieces` sizes."""
    p = ToolCallParser(single=single)
    events = []
    if pieces is None:
        events += p.feed(text)
    else:
        at = 0
        for n in pieces:
            events += p.feed(text[at:at + n])
            at += n
        events += p.feed(text[at:])
    events += p.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = {}
    for e in events:
        if e[0] == "call":
            calls[e[1]] = [e[3], ""]
        elif e[0] == "args":
            calls[e[1]][1] += e[2]
    assert [(c.name, c.arguments) for c in p.calls] == [tuple(v) for v in calls.values()]
    return content, [tuple(v) for v in calls.values()], events


TWO_CALLS = ("Let me compute that.\n" + call_text("add", {"a": 3, "b": 4}) + "\n"
             + call_text("get_weather", {"city": "Paris \"}\" {", "unit": "c"}))


def test_parser_content_then_calls():
    content, calls, _ = parse(TWO_CALLS)
    assert content == "Let me compute that."
    assert calls == [("add", '{"a": 3, "b": 4}'), ("get_weather", '{"city": "Paris \\"}\\" {", "unit": "c"}')]
    assert [json.loads(a) for _, a in calls] == [{"a": 3, "b": 4}, {"city": 'Paris "}" {', "unit": "c"}]


@pytest.mark.parametrize("seed", range(30))
def test_parser_gives_the_same_result_however_the_text_is_cut(seed):
    rng = random.Random(seed)
    cuts = [rng.randint(0, 4) for _ in range(len(TWO_CALLS))]
    assert parse(TWO_CALLS, cuts)[:2] == parse(TWO_CALLS)[:2]


def test_parser_holds_back_a_possible_trigger_and_trailing_whitespace():
    p = ToolCallParser()
    assert p.feed("Hello <tool") == [("content", "Hello")]  # " <tool" could begin the trigger
    assert p.feed("_ca") == []
    assert p.feed("r and more  ") == [("content", " <tool_car and more")]  # it did not: released, spaces held
    assert p.feed("\n") == []
    assert p.finish() == [("content", "  \n")]  # no call followed: the whitespace is content after all


def test_parser_streams_a_call_head_then_argument_pieces():
    p = ToolCallParser()
    assert p.feed('Sure.\n<tool_call>\n{"name": "ad') == [("content", "Sure.")]
    ev = p.feed('d", "arguments": ')
    assert len(ev) == 1 and ev[0][0] == "call" and ev[0][1] == 0 and ev[0][3] == "add"
    assert ev[0][2].startswith("call_") and len(ev[0][2]) == 29
    assert p.feed('{"a": 1') == [("args", 0, '{"a": 1')]
    assert p.feed(', "b": 2}') == [("args", 0, ', "b": 2}')]
    assert p.feed('}\n</tool_call>') == []  # the call's own closing brace and the end tag are not arguments
    assert p.finish() == []
    assert p.calls[0].arguments == '{"a": 1, "b": 2}'


def test_parser_keeps_a_call_cut_short_and_returns_a_broken_block_as_content():
    content, calls, _ = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert content == "" and calls == [("add", '{"a": 1')]
    content, calls, _ = parse("Hi <tool_call>\nnot json\n</tool_call> bye")
    assert calls == [] and content == "Hi <tool_call>\nnot json\n</tool_call> bye"
    content, calls, _ = parse("Hi <tool_call>\n{\"nam")  # cut before the name: content, as written
    assert calls == [] and content == "Hi <tool_call>\n{\"nam"


def test_parser_other_key_order_and_single_mode():
    text = '<tool_call>\n{"arguments": {"x": [1, {"y": 2}]}, "name": "f"}\n</tool_call>\n' + call_text("g", {})
    _, calls, _ = parse(text)
    assert [(n, json.loads(a)) for n, a in calls] == [("f", {"x": [1, {"y": 2}]}), ("g", {})]
    _, calls, _ = parse(text, single=True)
    assert [n for n, _ in calls] == ["f"]
    # text after the calls is not content
    content, calls, _ = parse("A" + call_text("g", {"k": "v"}) + " trailing words")
    assert content == "A" and calls == [("g", '{"k": "v"}')]


@pytest.mark.parametrize("mode, legacy, finish, want", [
    ("auto", False, "stop", "tool_calls"), ("required", False, "stop", "tool_calls"), ("named", False, "stop", "stop"),
    ("auto", False, "length", "length"), ("auto", True, "stop", "function_call"), ("named", True, "stop", "stop")])
def test_finish_reasons(mode, legacy, finish, want):
    plan = ToolPlan([ADD], ToolChoice(mode, "add" if mode == "named" else None), legacy=legacy)
    msg, reason = ToolReply(plan).message(call_text("add", {"a": 1, "b": 2}), finish)
    assert reason == want
    assert msg["content"] is None
    if legacy:
        assert msg["function_call"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and "tool_calls" not in msg
    else:
        (c,) = msg["tool_calls"]
        assert c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] == "add"
    msg, reason = ToolReply(plan).message("No call.", "stop")
    assert msg == {"role": "assistant", "content": "No call."} and reason == "stop"


def test_stream_deltas_merge_into_the_message():
    plan = ToolPlan([ADD, WEATHER], ToolChoice("auto"))
    reply = ToolReply(plan)
    pieces = []
    for i in range(0, len(TWO_CALLS), 3):
        pieces += reply.deltas(TWO_CALLS[i:i + 3])
    pieces += reply.deltas("", final=True)
    content = "".join(p.get("content", "") for p in pieces)
    calls: dict[int, dict] = {}
    for p in pieces:
        for tc in p.get("tool_calls", ()):
            if "id" in tc:  # a call's first delta: id, type, name and empty arguments
                assert tc["function"]["arguments"] == "" and tc["type"] == "function" and tc["index"] not in calls
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    msg, _ = ToolReply(plan).message(TWO_CALLS, "stop")
    assert content == msg["content"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]


# -- rendering ---------------------------------------------------------------------------------------------------
def messages(*items):
    from server.api.chat_messages import ChatMessage

    return [ChatMessage.model_validate(m) for m in items]


HISTORY = messages(
    {"role": "developer", "content": "Be terse."},
    {"role": "user", "content": "3+4? And the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"}]})


def test_render_without_tool_support_in_the_template():
    plan = ToolPlan([ADD, WEATHER], ToolChoice("auto"))
    out, tools = render_messages(HISTORY, plan, knows_tools=False)
    assert tools is None
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "Be terse.\n\n" + tools_prompt([ADD, WEATHER])
    assert json.dumps(ADD.openai()) in out[0]["content"] and TRIGGER in out[0]["content"]
    assert out[2]["content"] == (call_text("add", {"a": 3, "b": 4}) + "\n" + call_text("get_weather",
                                                                                          {"city": "Paris"}))
    assert out[3]["content"] == "<tool_response>\n7\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    # no system message: the tools get one of their own; tool_choice none: nothing about tools
    out, _ = render_messages(HISTORY[1:2], plan, knows_tools=False)
    assert out[0] == {"role": "system", "content": tools_prompt([ADD, WEATHER])}
    out, _ = render_messages(HISTORY, ToolPlan([ADD], ToolChoice("none")), knows_tools=False)
    assert out[0] == {"role": "system", "content": "Be terse."} and TRIGGER in out[2]["content"]


def test_render_for_a_template_that_knows_tools():
    plan = ToolPlan([ADD], ToolChoice("auto"))
    out, tools = render_messages(HISTORY, plan, knows_tools=True)
    assert tools == [ADD.openai()]
    assert out[0] == {"role": "system", "content": "Be terse."}
    assert out[2]["tool_calls"][0] == {"type": "function", "id": "call_1",
                                       "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}
    assert out[3] == {"role": "tool", "content": "7", "tool_call_id": "call_1"}


def test_a_template_that_knows_tools_gets_them(tokenizer):
    """A template reading `tools` is detected and gets them from encode_chat; the default model's does not."""
    from server.api.tools import template_knows_tools
    from server.tokenization import encode_chat

    assert not template_knows_tools(tokenizer)
    template = ("{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = template
    assert template_knows_tools(tok)
    out, tools = render_messages(HISTORY[:2], ToolPlan([ADD], ToolChoice("auto")), knows_tools=True)
    text = tok.decode(encode_chat(tok, out, tools))
    assert text.startswith("TOOL add\nsystem: Be terse.\nuser: 3+4?")


# -- grammars ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gtok(tokenizer, stops):
    return GrammarTokenizer(tokenizer, len(tokenizer), stops)


def accepts(gtok, tokenizer, grammar: str, text: str) -> tuple[bool, bool]:
    """(the grammar allows `text`, it is complete there)."""
    m = gtok.matcher(grammar)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if m.valid_prefix(ids) != len(ids):
        return False, False
    m.consume(ids)
    return True, m.accepting


def test_tool_grammars(gtok, tokenizer):
    one, two = call_text("add", {"a": 3, "b": 4}), call_text("get_weather", {"city": "Oslo"})
    tools = [ADD, WEATHER, NOARGS]

    def grammar(mode, parallel=True, answer=None):
        plan = ToolPlan(tools, ToolChoice(mode, "add" if mode == "named" else None), parallel=parallel)
        g = lark_grammar(tool_grammar_lark(plan, answer))
        gtok.validate(g)
        return g

    auto, auto1, req, req1, named = (grammar("auto"), grammar("auto", False), grammar("required"),
                                     grammar("required", False), grammar("named"))
    assert accepts(gtok, tokenizer, auto, "Just text.") == (True, True)
    assert accepts(gtok, tokenizer, auto, "Text " + one + "\n" + two) == (True, True)
    assert accepts(gtok, tokenizer, auto, "Text " + call_text("add", {"a": "x", "b": 4}))[0] is False
    assert accepts(gtok, tokenizer, auto, "Text " + call_text("nope", {}))[0] is False
    assert accepts(gtok, tokenizer, auto1, "Text " + one) == (True, True)
    assert accepts(gtok, tokenizer, auto1, "Text " + one + "\n")[0] is False  # one call, then the end
    assert accepts(gtok, tokenizer, req, "Text")[0] is False  # a call from the first token
    assert accepts(gtok, tokenizer, req, one + "\n" + two + "\n" + call_text("now", {})) == (True, True)
    assert accepts(gtok, tokenizer, req1, one + "\n")[0] is False
    assert accepts(gtok, tokenizer, named, one) == (True, True)
    assert accepts(gtok, tokenizer, named, two)[0] is False
    assert accepts(gtok, tokenizer, grammar("required"), call_text("now", {"x": 1}))[0] is False  # no arguments
    # auto with a JSON answer format: that JSON, or the calls
    ans = grammar("auto", answer=ResponseFormat("json_schema", {"type": "object", "properties": {
        "n": {"$ref": "#/$defs/N"}}, "required": ["n"], "$defs": {"N": {"type": "integer"}}}, "x"))
    assert accepts(gtok, tokenizer, ans, '{"n": 5}') == (True, True)
    assert accepts(gtok, tokenizer, ans, '{"n": "5"}')[0] is False
    assert accepts(gtok, tokenizer, ans, "free text")[0] is False
    assert accepts(gtok, tokenizer, ans, one) == (True, True)


def test_the_named_tool_is_forced(gtok, tokenizer):
    plan = ToolPlan([ADD, WEATHER], ToolChoice("named", "get_weather"))
    m = gtok.matcher(lark_grammar(tool_grammar_lark(plan)))
    assert tokenizer.decode(m.forced()).startswith(f'{TRIGGER}\n{{"name": "get_weather", "arguments": {{"city":')


# -- the API against a scripted worker ---------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is 3 + 4?"}]
TOOLS = [ADD.openai(), WEATHER.openai()]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def scripted(tokenizer, text: str, sizes: int = 3, finish: str = "stop") -> ScriptWorker:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ScriptWorker([ids[i:i + sizes] for i in range(0, len(ids), sizes)], finish=finish)


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


def merge_stream(events: list[dict]) -> dict[int, dict]:
    """Each choice's streamed chat deltas merged, as a client does: content, tool calls by index, finish."""
    out: dict[int, dict] = {}
    for e in events:
        for ch in e["choices"]:
            o = out.setdefault(ch["index"], {"content": "", "calls": {}, "finish": None, "fc": None})
            d = ch["delta"]
            o["content"] += d.get("content") or ""
            for tc in d.get("tool_calls") or ():
                if tc.get("id"):  # (a client's model of a fragment may list the absent fields as null)
                    o["calls"][tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                o["calls"][tc["index"]]["arguments"] += tc["function"]["arguments"]
            if d.get("function_call"):
                fc = o["fc"] = o["fc"] or {"name": "", "arguments": ""}
                fc["name"] += d["function_call"].get("name") or ""
                fc["arguments"] += d["function_call"]["arguments"]
            o["finish"] = ch["finish_reason"] or o["finish"]
    return out


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


# -- real servers --------------------------------------------------------------------------------------------------
SERVED = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def live(server):
    """The session's float32 server, with room for the tools prompt."""
    return server


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(live):
    return ChatOpenAI(base_url=live.url + "/v1", api_key=live.api_key, model=SERVED, temperature=0, max_tokens=40,
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
def test_e2e_fuzz_random_schemas(live, schema, as_tool, stream, seed):
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
    r = httpx.post(live.url + "/v1/chat/completions", json=body, headers=live.headers, timeout=120)
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
