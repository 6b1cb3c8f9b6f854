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
    Arguments follow each function's ``parameters`` schema, with the compact separators of ``core.grammar``.
    """
    if not plan.active:
        return None
    tools = plan.tools
    if plan.choice.mode == "named":
        tools = [t for t in tools if t.name == plan.choice.name]
    rules = [f"body: {' | '.join(f'body_{i}' for i in range(len(tools)))}"]
    for i, t in enumerate(tools):
        head = '{"name": ' + dumps(t.name) + ', "arguments": '
        rules.append(f"body_{i}: {_lit(head)} args_{i} {_lit('}')}")
        rules.append(f"args_{i}: {json_schema_lark(t.arguments_schema())}")
    call = f'{_lit(TRIGGER + chr(10))} body {_lit(chr(10) + END)}'
    more = "" if plan.single else f' ({_lit(chr(10))} call)* {_lit(chr(10))}?'
    if plan.choice.mode in ("named", "required"):
        start = [f"start: call{more}"]
    elif answer is not None and answer.constrained:
        schema = None if answer.type == "json_object" else answer.schema
        start = [f"start: answer | call{more}",
                 f"answer: {json_schema_lark(schema)}"]
    else:
        start = [f"start: TEXT | first{more}",
                 f"first_hd[lazy]: TEXT {_lit(TRIGGER)}",
                 f'first: first_hd {_lit(chr(10))} body {_lit(chr(10) + END)}',
                 "TEXT: /(.|\\n)*/"]
    return "\n".join(["%llguidance {}", *start, f"call: {call}", *rules]) + "\n"
