"""The grammar a reply under a tool plan must match (``server.api.tools``: the call format)."""
from __future__ import annotations

import json

from core.grammar import json_schema_lark
from server.api.structured import ResponseFormat, dumps
from server.api.tools import END, TRIGGER, ToolPlan


def _lit(text: str) -> str:
    return json.dumps(text)


def tool_grammar_lark(plan: ToolPlan, answer: ResponseFormat | None = None) -> str | None:
    """The Lark grammar (llguidance's dialect) of a reply under ``plan``; None when the tools constrain nothing.

    - named: exactly one call of that function, from the first token (the name is forced);
    - required: one call of any tool, then (parallel) more, each after a newline;
    - auto: free text until ``<tool_call>`` appears (a lazy trigger), then the call as above; or, with a JSON
      ``answer`` format, either that JSON or the calls from the first token.
    In Llama 3's JSON syntax (``plan.syntax.at_start``) a call is the whole reply and has no tags: under auto the
    reply is one call or text that does not begin with ``{``. In Mistral's (``plan.syntax.opening``) the calls are
    one JSON list after ``[TOOL_CALLS]`` (the special token itself where the tokenizer has it), text before it
    under auto; in its v11 form (``plan.syntax.args_marker``) each call is ``[TOOL_CALLS]NAME[ARGS]{...}``, calls
    back to back.
    Arguments follow each function's ``parameters`` schema, with the compact separators of ``core.grammar``.
    """
    if not plan.active:
        return None
    tools = plan.tools
    if plan.choice.mode == "named":
        tools = [t for t in tools if t.name == plan.choice.name]
    rules = [f"body: {' | '.join(f'body_{i}' for i in range(len(tools)))}"]
    syntax = plan.syntax
    # the rule of a JSON answer format (auto: that JSON, or the calls from the first token), if the request has one
    answer_rule = None
    if plan.choice.mode == "auto" and answer is not None and answer.constrained:
        answer_rule = f"answer: {json_schema_lark(None if answer.type == 'json_object' else answer.schema)}"
    for i, t in enumerate(tools):
        head = '{"name": ' + dumps(t.name) + f', "{syntax.args_key}": '
        rules.append(f"body_{i}: {_lit(head)} args_{i} {_lit('}')}")
        rules.append(f"args_{i}: {json_schema_lark(t.arguments_schema())}")
    if syntax.at_start:
        if plan.choice.mode in ("named", "required"):
            start = ["start: body"]
        elif answer_rule is not None:
            # the answer and a call both begin with "{": llguidance tells two JSON grammars apart, not a JSON
            # grammar and a literal, so each call is a JSON schema here (its keys in order: name, then arguments)
            start = ["start: answer | call", answer_rule,
                     f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}",
                     *(f"call_{i}: {json_schema_lark(call_schema(t.name, syntax.args_key, t.arguments_schema()))}"
                       for i, t in enumerate(tools))]
            rules = []
        else:
            start = ["start: TEXT | body", "TEXT: /\\s*([^\\s{](.|\\n)*)?/"]
        return "\n".join(["%llguidance {}", *start, *rules]) + "\n"
    if syntax.args_marker:  # each call: trigger, name, marker, arguments (Mistral's v11 tokenizers)
        return _named_calls_lark(plan, tools, answer_rule)
    if syntax.opening:  # calls as one JSON list after the trigger (Mistral)
        trigger = _token_or_text(syntax.trigger, syntax.trigger_id)
        more = "" if plan.single else f" ({_lit(', ')} body)*"
        calls = f"{_lit(syntax.opening)} body{more} {_lit(']')}"
        if plan.choice.mode in ("named", "required"):
            start = [f"start: {trigger} {calls}"]
        elif answer_rule is not None:
            start = [f"start: answer | {trigger} {calls}", answer_rule]
        elif syntax.trigger_id is not None:  # a special token ends the text by itself (it is no terminal's)
            start = [f"start: TEXT | TEXT {trigger} {calls}", "TEXT: /(.|\\n)*/"]
        else:
            start = ["start: TEXT | first", f"first_hd[lazy]: TEXT {trigger}", f"first: first_hd {calls}",
                     "TEXT: /(.|\\n)*/"]
        return "\n".join(["%llguidance {}", *start, *rules]) + "\n"
    call = f'{_lit(TRIGGER + chr(10))} body {_lit(chr(10) + END)}'
    more = "" if plan.single else f' ({_lit(chr(10))} call)* {_lit(chr(10))}?'
    if plan.choice.mode in ("named", "required"):
        start = [f"start: call{more}"]
    elif answer_rule is not None:
        start = [f"start: answer | call{more}", answer_rule]
    else:
        start = [f"start: TEXT | first{more}",
                 f"first_hd[lazy]: TEXT {_lit(TRIGGER)}",
                 f'first: first_hd {_lit(chr(10))} body {_lit(chr(10) + END)}',
                 "TEXT: /(.|\\n)*/"]
    return "\n".join(["%llguidance {}", *start, f"call: {call}", *rules]) + "\n"


def _token_or_text(text: str, token_id: int | None) -> str:
    """A grammar item for ``text``: the special token itself where it is one (llguidance's ``<[id]>``)."""
    return f"<[{token_id}]>" if token_id is not None else _lit(text)


def _named_calls_lark(plan: ToolPlan, tools: list, answer_rule: str | None) -> str:
    """``tool_grammar_lark`` for a syntax whose calls are ``TRIGGER NAME MARKER ARGUMENTS``, back to back."""
    syntax = plan.syntax
    trigger = _token_or_text(syntax.trigger, syntax.trigger_id)
    marker = _token_or_text(syntax.args_marker, syntax.args_marker_id)
    rules = [f"after: {' | '.join(f'after_{i}' for i in range(len(tools)))}", f"call: {trigger} after"]
    for i, t in enumerate(tools):
        rules.append(f"after_{i}: {_lit(t.name)} {marker} args_{i}")
        rules.append(f"args_{i}: {json_schema_lark(t.arguments_schema())}")
    more = "" if plan.single else " call*"
    if plan.choice.mode in ("named", "required"):
        start = [f"start: call{more}"]
    elif answer_rule is not None:
        start = [f"start: answer | call{more}", answer_rule]
    elif syntax.trigger_id is not None:  # a special token ends the text by itself (it is no terminal's)
        start = [f"start: TEXT | TEXT call{more}", "TEXT: /(.|\\n)*/"]
    else:
        start = [f"start: TEXT | first{more}", f"first_hd[lazy]: TEXT {trigger}", "first: first_hd after",
                 "TEXT: /(.|\\n)*/"]
    return "\n".join(["%llguidance {}", *start, *rules]) + "\n"


def call_schema(name: str, key: str, arguments: dict) -> dict:
    """The JSON schema of a call object ``{"name": name, key: arguments}``: the arguments' schema nested under
    ``properties.<key>``, its ``$defs`` / ``definitions`` moved to the root and every other root-relative ``$ref``
    re-pointed, so each reference still names what it named."""
    args = dict(arguments)
    defs = {k: args.pop(k) for k in ("$defs", "definitions") if k in args}
    base = f"#/properties/{key}"

    def repoint(x):
        if isinstance(x, dict):
            out = {k: repoint(v) for k, v in x.items()}
            ref = x.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
                out["$ref"] = base + ref[1:]
            return out
        if isinstance(x, list):
            return [repoint(v) for v in x]
        return x

    return {"type": "object", "properties": {"name": {"const": name}, key: repoint(args)},
            "required": ["name", key], "additionalProperties": False, **repoint(defs)}
