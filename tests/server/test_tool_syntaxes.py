"""A model's own tool-call syntax: read from its chat template (``server.api.tools.template_call_syntax``), enforced
by the call grammar and parsed back, here Llama 3.x's JSON calls (``{"name": ..., "parameters": ...}``, the whole
reply) beside the Hermes / Qwen ``<tool_call>`` blocks the other tests cover (test_tool_calls.py). Through the API
with the openai SDK against a scripted worker (tests/server/scripted.py; no model)."""
from __future__ import annotations

import json
import random

import openai
import pytest

from core.grammar import GrammarTokenizer, lark_grammar
from server.api.structured import ResponseFormat, ToolChoice
from server.api.tool_grammar import tool_grammar_lark
from server.api.tool_parser import ToolCallParser
from server.api.tools import HERMES, LLAMA3_JSON, MISTRAL, ToolPlan, template_call_syntax
from tests.server.scripted import MODEL, ScriptWorker, make_client, scripted
from tests.server.tool_specs import ADD, NOARGS, WEATHER, accepts

# The parts of Llama 3.1's template that decide its tool syntax: header tokens, tools as JSON in the user turn, and
# earlier calls rendered as {"name": ..., "parameters": ...}.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "<|eot_id|>{%- endif %}"
    "{%- for m in messages %}{%- if m.tool_calls is defined and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{%- for tc in m.tool_calls %}"
    "{{ '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' }}{{ tc.function.arguments | tojson }}}"
    "{% endfor %}<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN_TEMPLATE = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
                 "</tools>\nFor each call return <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call>"
                 "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_call(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args})


@pytest.fixture(scope="module")
def llama_tok(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = LLAMA31_TEMPLATE
    return tok


def test_the_syntax_is_read_from_the_template(tokenizer, llama_tok):
    assert template_call_syntax(llama_tok) is LLAMA3_JSON
    assert template_call_syntax(tokenizer) is HERMES  # the embedded model's template knows no tools
    qwen = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    qwen.chat_template = QWEN_TEMPLATE
    assert template_call_syntax(qwen) is HERMES


# -- the parser --------------------------------------------------------------------------------------------------
def parse(text: str, cuts: list[int] | None = None):
    p = ToolCallParser(single=True, syntax=LLAMA3_JSON)
    events, at = [], 0
    for n in cuts or []:
        events += p.feed(text[at:at + n])
        at += n
    events += p.feed(text[at:]) + p.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return content, [(c.name, c.arguments) for c in p.calls]


CALL = llama_call("get_weather", {"city": "Paris \"}\" {", "unit": "c"})


@pytest.mark.parametrize("seed", range(12))
def test_a_llama_call_is_the_whole_reply_however_the_text_is_cut(seed):
    rng = random.Random(seed)
    cuts = [rng.randint(0, 4) for _ in range(len(CALL))]
    assert parse(CALL, cuts) == ("", [("get_weather", '{"city": "Paris \\"}\\" {", "unit": "c"}')])
    assert parse("\n " + CALL, cuts) == parse(CALL)  # blank lines before the call


@pytest.mark.parametrize("text", ["The weather is fine.", "  Text with {braces} later.  ", '{"n": 5}', "{ }", ""])
def test_any_other_reply_is_content(text):
    """As generated, blanks included (as a reply without calls is in the Hermes syntax)."""
    assert parse(text) == (text, [])
    assert parse(text, [1] * len(text)) == (text, [])


# -- the grammar -------------------------------------------------------------------------------------------------
def test_llama_call_grammars(gtok, tokenizer):
    def grammar(mode, answer=None):
        plan = ToolPlan([ADD, WEATHER, NOARGS], ToolChoice(mode, "add" if mode == "named" else None),
                        syntax=LLAMA3_JSON)
        g = lark_grammar(tool_grammar_lark(plan, answer))
        gtok.validate(g)
        return g

    one = llama_call("add", {"a": 3, "b": 4})
    auto, req, named = grammar("auto"), grammar("required"), grammar("named")
    assert accepts(gtok, tokenizer, auto, "Just text.") == (True, True)
    assert accepts(gtok, tokenizer, auto, one) == (True, True)
    assert accepts(gtok, tokenizer, auto, one + "\n" + one)[0] is False  # one call per reply
    assert accepts(gtok, tokenizer, auto, json.dumps({"name": "add", "arguments": {"a": 3, "b": 4}}))[0] is False
    assert accepts(gtok, tokenizer, auto, llama_call("add", {"a": "x", "b": 4}))[0] is False
    assert accepts(gtok, tokenizer, auto, " {")[0] is False  # a reply that begins with a brace is a call
    assert accepts(gtok, tokenizer, req, "Text")[0] is False
    assert accepts(gtok, tokenizer, req, llama_call("now", {})) == (True, True)
    assert accepts(gtok, tokenizer, named, one) == (True, True)
    assert accepts(gtok, tokenizer, named, llama_call("get_weather", {"city": "Oslo"}))[0] is False
    assert tokenizer.decode(gtok.matcher(named).forced()).startswith('{"name": "add", "parameters": {"a":')
    ans = grammar("auto", ResponseFormat("json_object", None, None))
    assert accepts(gtok, tokenizer, ans, '{"n": 5}') == (True, True)
    assert accepts(gtok, tokenizer, ans, one) == (True, True)


# -- through the API, with the openai SDK ------------------------------------------------------------------------
def sdk(worker: ScriptWorker, tok) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=make_client(worker, tok),
                         max_retries=0)


ASK = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [ADD.openai(), WEATHER.openai()]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_llama_call_through_the_openai_sdk(llama_tok, choice):
    text = llama_call("get_weather", {"city": "Oslo"})
    worker = scripted(llama_tok, text)
    client = sdk(worker, llama_tok)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert r.choices[0].message.content is None
    assert r.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
    grammar = worker.generates[0].grammar
    assert '\\"parameters\\": ' in grammar and "<tool_call>" not in grammar  # a lark string literal
    prompt = llama_tok.decode(worker.generates[0].prompt_ids)
    assert "Given the following functions" in prompt and '"name": "get_weather"' in prompt  # the template's own
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=40, stream=True)
    name, args, content = "", "", ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    assert (name, json.loads(args), content) == ("get_weather", {"city": "Oslo"}, "")


def test_a_text_reply_and_a_round_trip(llama_tok):
    worker = scripted(llama_tok, "It is sunny in Oslo.")
    client = sdk(worker, llama_tok)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40)
    assert r.choices[0].message.content == "It is sunny in Oslo." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    prompt = llama_tok.decode(worker.generates[0].prompt_ids)
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in prompt  # the earlier call, its own way
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny" in prompt


def test_with_a_json_answer_format_references_in_the_arguments_still_resolve(gtok, tokenizer):
    """A tool whose arguments use ``$defs`` and a root reference, beside a JSON answer: nested in the call's
    schema, each reference still names its own definition."""
    tree = {"type": "object", "properties": {"v": {"$ref": "#/$defs/N"}, "kids": {
        "type": "array", "items": {"$ref": "#"}, "maxItems": 2}}, "required": ["v"], "additionalProperties": False,
        "$defs": {"N": {"type": "integer"}}}
    from server.api.structured import ToolSpec

    plan = ToolPlan([ToolSpec("tree", None, tree)], ToolChoice("auto"), syntax=LLAMA3_JSON)
    g = lark_grammar(tool_grammar_lark(plan, ResponseFormat("json_schema", {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}, "x")))
    gtok.validate(g)
    ok = llama_call("tree", {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]})
    assert accepts(gtok, tokenizer, g, ok) == (True, True)
    assert accepts(gtok, tokenizer, g, llama_call("tree", {"v": 1, "kids": [{"v": "x"}]}))[0] is False
    assert accepts(gtok, tokenizer, g, '{"n": 5}') == (True, True)
    assert accepts(gtok, tokenizer, g, '{"m": 5}')[0] is False


# -- Mistral: [TOOL_CALLS] and a JSON list ------------------------------------------------------------------------
# The parts of Mistral 7B Instruct v0.3's template that decide its tool syntax: [AVAILABLE_TOOLS], calls after
# [TOOL_CALLS] as one JSON list whose ids must be 9 letters or digits, results in [TOOL_RESULTS].
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- if tools is not none and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.tool_calls is defined and m.tool_calls is not none %}[TOOL_CALLS] ["
    "{%- for tc in m.tool_calls %}{%- set out = tc.function | tojson %}{{- out[:-1] }}"
    "{%- if tc.id is not defined or tc.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- ', \"id\": \"' + tc.id + '\"}' }}{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": "
    "\"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def mistral_tok(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def mistral_calls(*calls) -> str:
    return "[TOOL_CALLS] [" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


def test_mistral_is_read_from_the_template(mistral_tok):
    syntax = template_call_syntax(mistral_tok)
    assert syntax.name == "mistral" and syntax.opening == " ["
    assert syntax.trigger_id == mistral_tok.convert_tokens_to_ids("[TOOL_CALLS]") >= len(mistral_tok) - 1


@pytest.mark.parametrize("seed", range(8))
def test_a_mistral_list_of_calls_however_the_text_is_cut(seed):
    text = "Checking. " + mistral_calls(("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Paris ]}\" {"}))
    rng = random.Random(seed)
    p = ToolCallParser(syntax=MISTRAL)
    events, at = [], 0
    for n in [rng.randint(0, 4) for _ in range(len(text))]:
        events += p.feed(text[at:at + n])
        at += n
    events += p.feed(text[at:]) + p.finish()
    assert "".join(e[1] for e in events if e[0] == "content") == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("add", {"a": 3, "b": 4}),
                                                                     ("get_weather", {"city": "Paris ]}\" {"})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in p.calls)  # as its template demands


def test_mistral_grammars_name_the_special_token(mistral_tok, stops):
    gt = GrammarTokenizer(mistral_tok, len(mistral_tok), stops)
    syntax = template_call_syntax(mistral_tok)

    def grammar(mode, parallel=True):
        plan = ToolPlan([ADD, WEATHER], ToolChoice(mode, "add" if mode == "named" else None), parallel=parallel,
                        syntax=syntax)
        g = lark_grammar(tool_grammar_lark(plan))
        gt.validate(g)
        return g

    two = mistral_calls(("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"}))
    auto, one_only, named = grammar("auto"), grammar("auto", parallel=False), grammar("named")
    assert accepts(gt, mistral_tok, auto, "Just text.") == (True, True)
    assert accepts(gt, mistral_tok, auto, "Text " + two) == (True, True)
    assert accepts(gt, mistral_tok, one_only, two)[0] is False
    assert accepts(gt, mistral_tok, one_only, mistral_calls(("add", {"a": 3, "b": 4}))) == (True, True)
    m = gt.matcher(named)
    assert m.forced()[0] == syntax.trigger_id  # the token itself, not its spelling in other tokens
    assert mistral_tok.decode(m.forced()).startswith('[TOOL_CALLS] [{"name": "add", "arguments": {"a":')


def test_mistral_calls_through_the_openai_sdk(mistral_tok):
    import msgspec

    text = mistral_calls(("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"}))
    worker = scripted(mistral_tok, text)
    worker.ready = msgspec.structs.replace(worker.ready, vocab_size=len(mistral_tok))
    client = sdk(worker, mistral_tok)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"})]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "7"},
                     {"role": "tool", "tool_call_id": calls[1].id, "content": "sunny"}]
    worker2 = scripted(mistral_tok, "7, and sunny.")
    worker2.ready = worker.ready
    r2 = sdk(worker2, mistral_tok).chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                           max_tokens=20)
    assert r2.choices[0].message.content == "7, and sunny."
    prompt = mistral_tok.decode(worker2.generates[0].prompt_ids)  # the template accepted the ids we made
    assert f'"id": "{calls[0].id}"' in prompt and f'"call_id": "{calls[1].id}"' in prompt


def test_mistral_grammar_where_the_trigger_is_plain_text(gtok, tokenizer):
    """A tokenizer without [TOOL_CALLS] as a token: the trigger is text, found by a lazy lexeme as <tool_call> is."""
    plan = ToolPlan([ADD], ToolChoice("auto"), syntax=MISTRAL)
    g = lark_grammar(tool_grammar_lark(plan))
    gtok.validate(g)
    assert accepts(gtok, tokenizer, g, "Text " + mistral_calls(("add", {"a": 3, "b": 4}))) == (True, True)
    assert accepts(gtok, tokenizer, g, "Text [TOOL_CALLS] no list")[0] is False


# -- Mistral's v11 tokenizers: [TOOL_CALLS]NAME[ARGS]{...} --------------------------------------------------------
# The parts of a v11 Mistral template (Mistral Small 3.x) that decide its tool syntax: each call as [TOOL_CALLS], the
# name, [ARGS] and the arguments' JSON, calls back to back; results in [TOOL_RESULTS].
MISTRAL_V11_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls is defined and m.tool_calls %}{%- for tc in m.tool_calls %}"
    "{%- set a = tc.function.arguments %}{%- if a is not string %}{%- set a = a | tojson %}{%- endif %}"
    "{{- '[TOOL_CALLS]' + tc.function.name + '[ARGS]' + a }}{%- endfor %}{{- eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}{{ eos_token }}{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def mistral11_tok(tokenizer):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tok.chat_template = MISTRAL_V11_TEMPLATE
    return tok


def v11_calls(*calls) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def test_mistral_v11_is_read_from_the_template(mistral11_tok):
    from server.api.tools import MISTRAL_V11

    syntax = template_call_syntax(mistral11_tok)
    assert (syntax.name, syntax.args_marker, syntax.opening) == ("mistral", "[ARGS]", "")
    assert syntax.trigger_id == mistral11_tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert syntax.args_marker_id == mistral11_tok.convert_tokens_to_ids("[ARGS]")
    assert ToolPlan([ADD], ToolChoice("auto"), syntax=syntax).kept_tokens == (syntax.trigger_id,
                                                                             syntax.args_marker_id)
    assert template_call_syntax(mistral11_tok) != MISTRAL and MISTRAL_V11.args_marker == "[ARGS]"


@pytest.mark.parametrize("seed", range(8))
def test_mistral_v11_calls_however_the_text_is_cut(seed):
    from server.api.tools import MISTRAL_V11

    text = "Checking. " + v11_calls(("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Paris [ARGS]}\" {"}))
    rng = random.Random(seed)
    for single in (False, True):
        p = ToolCallParser(single=single, syntax=MISTRAL_V11)
        events, at = [], 0
        for n in [rng.randint(0, 4) for _ in range(len(text))]:
            events += p.feed(text[at:at + n])
            at += n
        events += p.feed(text[at:]) + p.finish()
        assert "".join(e[1] for e in events if e[0] == "content") == "Checking."
        want = [("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Paris [ARGS]}\" {"})]
        assert [(c.name, json.loads(c.arguments)) for c in p.calls] == want[:1 if single else 2]
        assert all(len(c.id) == 9 and c.id.isalnum() for c in p.calls)
    p = ToolCallParser(syntax=MISTRAL_V11)  # a trigger with no call after it: the text as it came
    events = p.feed("Hi [TOOL_CALLS] no call") + p.finish()
    assert "".join(e[1] for e in events if e[0] == "content") == "Hi [TOOL_CALLS] no call" and not p.calls


def test_mistral_v11_grammars_name_the_special_tokens(mistral11_tok, stops):
    gt = GrammarTokenizer(mistral11_tok, len(mistral11_tok), stops)
    syntax = template_call_syntax(mistral11_tok)

    def grammar(mode, parallel=True):
        plan = ToolPlan([ADD, WEATHER], ToolChoice(mode, "add" if mode == "named" else None), parallel=parallel,
                        syntax=syntax)
        g = lark_grammar(tool_grammar_lark(plan))
        gt.validate(g)
        return g

    two = v11_calls(("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"}))
    auto, one_only, req, named = grammar("auto"), grammar("auto", parallel=False), grammar("required"), grammar("named")
    assert accepts(gt, mistral11_tok, auto, "Just text.") == (True, True)
    assert accepts(gt, mistral11_tok, auto, "Text " + two) == (True, True)
    assert accepts(gt, mistral11_tok, auto, v11_calls(("add", {"a": "x", "b": 4})))[0] is False
    assert accepts(gt, mistral11_tok, auto, v11_calls(("sub", {"a": 3, "b": 4})))[0] is False
    assert accepts(gt, mistral11_tok, one_only, two)[0] is False
    assert accepts(gt, mistral11_tok, req, "Text")[0] is False
    assert accepts(gt, mistral11_tok, req, two) == (True, True)
    forced = gt.matcher(named).forced()
    assert forced[0] == syntax.trigger_id and syntax.args_marker_id in forced  # the tokens, not their spelling
    assert mistral11_tok.decode(forced).startswith('[TOOL_CALLS]add[ARGS]{"a":')


def test_mistral_v11_calls_through_the_openai_sdk(mistral11_tok):
    import msgspec

    text = v11_calls(("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"}))
    worker = scripted(mistral11_tok, text)
    worker.ready = msgspec.structs.replace(worker.ready, vocab_size=len(mistral11_tok))
    client = sdk(worker, mistral11_tok)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"})]
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, stream=True)
    got: dict[int, list[str]] = {}
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                got.setdefault(tc.index, ["", ""])
                got[tc.index][0] += tc.function.name or ""
                got[tc.index][1] += tc.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in got.values()] == [("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"})]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "7"}]
    worker2 = scripted(mistral11_tok, "7.")
    worker2.ready = worker.ready
    sdk(worker2, mistral11_tok).chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=20)
    prompt = mistral11_tok.decode(worker2.generates[0].prompt_ids)
    assert '[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}' in prompt
    assert "[TOOL_RESULTS]7[/TOOL_RESULTS]" in prompt
