"""The tools and tool-call texts shared by the tool-calling tests (test_tool_calls.py, test_structured_api.py,
test_structured_e2e.py): `ADD`, `WEATHER` and `NOARGS`, `call_text` (a call as the model writes it), `TWO_CALLS`
(content, then two calls), and `merge_stream`, which merges each choice's streamed chat deltas as a client does."""
from __future__ import annotations

import json

from server.api.structured import ToolSpec
from server.api.tools import END, TRIGGER

ADD = ToolSpec("add", "Add two integers.", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                             "b": {"type": "integer"}},
                                            "required": ["a", "b"], "additionalProperties": False})
WEATHER = ToolSpec("get_weather", None, {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}, "required": ["city"],
                                                 "additionalProperties": False})
NOARGS = ToolSpec("now")


def call_text(name: str, args: dict) -> str:
    return f"{TRIGGER}\n{json.dumps({'name': name, 'arguments': args})}\n{END}"


TWO_CALLS = ("Let me compute that.\n" + call_text("add", {"a": 3, "b": 4}) + "\n"
             + call_text("get_weather", {"city": "Paris \"}\" {", "unit": "c"}))


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


def accepts(gtok, tokenizer, grammar: str, text: str) -> tuple[bool, bool]:
    """(the grammar allows `text`, it is complete there), with `gtok` a ``core.grammar.GrammarTokenizer``."""
    m = gtok.matcher(grammar)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if m.valid_prefix(ids) != len(ids):
        return False, False
    m.consume(ids)
    return True, m.accepting
