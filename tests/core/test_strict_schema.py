"""JSON schemas are read strictly, as other servers' grammar backends read them: an object that declares its
properties takes no other key unless the schema allows more itself."""
from __future__ import annotations

import json

import pytest

from core.grammar import GrammarTokenizer, json_schema_grammar, json_schema_lark, lark_grammar, strict_schema

POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"]}


def test_objects_with_properties_are_closed_and_nothing_else_changes():
    nested = {"type": "object", "properties": {"p": POINT, "tags": {"type": "array", "items": POINT},
                                               "any": {"type": "object"}},
              "$defs": {"d": POINT}, "anyOf": [POINT, {"type": "null"}]}
    s = strict_schema(nested)
    assert s["additionalProperties"] is False
    assert s["properties"]["p"]["additionalProperties"] is False
    assert s["properties"]["tags"]["items"]["additionalProperties"] is False
    assert s["$defs"]["d"]["additionalProperties"] is False and s["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["any"]  # a free-form object stays free
    assert nested["properties"]["p"] == POINT and "additionalProperties" not in POINT  # the caller's is untouched
    for open_ in ({"additionalProperties": True}, {"additionalProperties": {"type": "string"}},
                  {"patternProperties": {"^z": {}}}, {"unevaluatedProperties": True}):
        assert strict_schema({**POINT, **open_}).get("additionalProperties") == open_.get("additionalProperties")
    both = strict_schema({"allOf": [POINT, {"properties": {"z": {"type": "string"}}}]})
    assert all("additionalProperties" not in b for b in both["allOf"]) and "additionalProperties" not in both


@pytest.fixture(scope="module")
def gt(tokenizer, target32, stops):
    return GrammarTokenizer(tokenizer, target32.args.vocab_size, stops)


def _accepts(gt, grammar: str, text: str, tokenizer) -> bool:
    """Whether the grammar lets the model write ``text`` (every one of its tokens)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return gt.matcher(grammar).valid_prefix(ids) == len(ids)


@pytest.mark.parametrize("kind", ["response_format", "tool"])
def test_an_undeclared_key_is_refused_unless_the_schema_allows_it(gt, tokenizer, kind):
    def grammar(schema):
        if kind == "response_format":
            return json_schema_grammar(schema)
        return lark_grammar(f"start: {json_schema_lark(schema)}")

    declared, extra = json.dumps({"x": 1, "y": 2}, separators=(", ", ": ")), '{"x": 1, "type": 2}'
    strict = grammar(POINT)
    assert _accepts(gt, strict, declared, tokenizer)
    assert not _accepts(gt, strict, extra, tokenizer)
    assert _accepts(gt, grammar({**POINT, "additionalProperties": True}), extra, tokenizer)
