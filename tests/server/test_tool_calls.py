"""Tool calling below the API: the reply parser and its streaming hold-back (calls and content however the text is
cut, finish reasons, stream deltas), the prompt rendering of tools and earlier calls (with and without a template
that knows tools), and the tool grammars (checked with the real tokenizer's matcher). The API side is in
test_structured_api.py, the real servers in test_structured_e2e.py.
"""
from __future__ import annotations

import json
import random

import pytest

from core.grammar import lark_grammar
from server.api.structured import ResponseFormat, ToolChoice
from server.api.tool_grammar import tool_grammar_lark
from server.api.tool_parser import ToolCallParser, ToolReply
from server.api.tools import TRIGGER, ToolPlan, render_messages, tools_prompt
from tests.server.tool_specs import ADD, NOARGS, TWO_CALLS, WEATHER, accepts, call_text


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
