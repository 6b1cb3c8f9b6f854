"""Grammar-constrained decoding: the grammar engine behind a small interface.

A request's grammar (from ``response_format`` or ``tools``) is a grammar string of the engine we use, llguidance
(https://github.com/guidance-ai/llguidance): JSON schemas, Lark-like grammars and regexes compile to it in the API
process (:func:`json_schema_grammar`, :func:`lark_grammar`, :func:`regex_grammar`), where
:meth:`GrammarTokenizer.validate` turns an unsupported or invalid one into a clean error before any worker time. The
worker builds one :class:`GrammarTokenizer` for the model and a :class:`Matcher` per request.

A :class:`Matcher` holds the committed state of one request: which tokens may come next (:meth:`Matcher.allowed`),
the tokens the grammar forces (:meth:`Matcher.forced`), whether it may end (:attr:`Matcher.accepting`) or must
(:attr:`Matcher.stopped`). A tree row is masked with the matcher advanced along the drafted path to that row and
rolled back after (:meth:`Matcher.allowed_after`), so the committed state only ever holds committed tokens.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any

import torch

# Compact JSON with the separators models write (", " and ": "): no free whitespace (a small model can loop on
# newlines inside a flexible-whitespace object), and more of the output is forced, so more of it is free drafts.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (or JSON schema) the engine cannot compile."""


def _llg():
    import llguidance

    return llguidance


def _schema_object(schema: dict[str, Any] | bool | None) -> dict[str, Any]:
    """A JSON schema as an object: None is any JSON object (``response_format: json_object``), true anything, false
    nothing."""
    if schema is None:
        return {"type": "object"}
    if isinstance(schema, bool):
        return {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object or a boolean")
    return schema


# Keywords whose value is a schema, a list of schemas, or a name -> schema map (JSON Schema 2020-12 and draft 7).
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def strict_schema(schema: Any) -> Any:
    """``schema`` with every object that declares ``properties`` closed to the ones it declares (``additionalProperties:
    false``) unless it says itself what else it takes (``additionalProperties``, ``patternProperties``,
    ``unevaluatedProperties``): the grammar backends of other servers read schemas this way, and a model otherwise
    fills an object with keys copied from the schema. An object without ``properties`` (``{"type": "object"}``) stays
    free-form, and so do the branches of an ``allOf`` (each would refuse the others' properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA:
        if k in out:
            out[k] = strict_schema(out[k])
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [strict_schema(x) for x in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: strict_schema(x) for name, x in out[k].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict_schema(out["additionalProperties"])
    if isinstance(out.get("allOf"), list):  # closed as a whole where it declares properties itself, not per branch
        out["allOf"] = [_strict_inside(x) for x in out["allOf"]]
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYWORDS) and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _strict_inside(schema: Any) -> Any:
    """An ``allOf`` branch: its own top level left open, what it nests made strict."""
    if not isinstance(schema, dict):
        return schema
    closed = strict_schema(schema)
    if "additionalProperties" not in schema and closed.get("additionalProperties") is False:
        del closed["additionalProperties"]
    return closed


def json_schema_grammar(schema: dict[str, Any] | bool | None = None) -> str:
    """A JSON schema (None: any JSON object, as ``response_format: json_object``) -> a grammar string. Compact
    separators (``JSON_OPTIONS``) unless the schema's own ``x-guidance`` says otherwise; objects closed to their
    declared properties (``strict_schema``)."""
    schema = strict_schema(_schema_object(schema))
    try:
        return _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def response_format_grammar(response_format: dict[str, Any] | None) -> tuple[str | None, dict | None]:
    """An OpenAI ``response_format`` -> (grammar string or None for ``text``, the JSON schema the output must
    validate against, or None)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return json_schema_grammar(None), {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema", {})
        return json_schema_grammar(schema), schema
    raise GrammarError(f"unknown response_format type {kind!r} (text, json_object, json_schema)")


def json_schema_lark(schema: dict[str, Any] | bool | None = None) -> str:
    """A JSON schema (None, booleans: as :func:`json_schema_grammar`) as a Lark ``%json`` item (to embed in a larger
    grammar), with the compact separators, strict as there."""
    schema = strict_schema(_schema_object(schema))
    schema["x-guidance"] = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(schema)


def lark_grammar(lark: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(lark)


def regex_grammar(regex: str) -> str:
    return _llg().LLMatcher.grammar_from_regex(regex)


class GrammarTokenizer:
    """The model's tokenizer as the grammar engine sees it (built once: ~0.4 s for a 49k vocabulary), and the
    end-of-sequence ids a grammar allows only in an accepting state."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...]):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.lltok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids)

    def validate(self, grammar: str) -> None:
        """Raise GrammarError (with the engine's message) where the grammar does not compile."""
        is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")

    def matcher(self, grammar: str) -> "Matcher":
        m = _llg().LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return Matcher(m, self.vocab_size, self.eos_token_ids)


class Matcher:
    """One request's grammar state: the committed tokens consumed, nothing else (tree rows roll back).

    A drafted path may hold an end-of-sequence token (allowed where the grammar accepts): nothing after it is valid
    (:meth:`valid_prefix`), nothing is forced after it, and the row after it, which the acceptance walk may read for a
    bonus token the engine drops at the end of sequence, allows end of sequence only."""

    def __init__(self, m, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...] = ()):
        self._m, self.vocab_size = m, vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._words = (vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int32)

    def fork(self) -> "Matcher":
        return Matcher(self._m.deep_copy(), self.vocab_size, self.eos_token_ids)

    def consume(self, tokens: list[int]) -> None:
        """Commit tokens; each must be allowed (the engine only commits tokens chosen under the mask)."""
        if tokens and not self._m.consume_tokens(list(tokens)):
            raise GrammarError(f"token outside the grammar was committed: {self._m.get_error()}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar allows in a row from the committed state (nothing is consumed)."""
        tokens = list(tokens)
        end = self._end(tokens)
        if end is not None:  # nothing follows an end of sequence
            tokens = tokens[:end + 1]
        return self._m.validate_tokens(tokens) if tokens else 0

    def _end(self, tokens: list[int]) -> int | None:
        """The index of the first end-of-sequence token in ``tokens``, or None."""
        return next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)

    @contextmanager
    def _after(self, path: list[int]):
        """The matcher advanced along ``path`` (no end of sequence in it) for the block, rolled back after; yields
        whether the grammar allows the whole path."""
        k = self._m.try_consume_tokens(path) if path else 0
        try:
            yield k == len(path)
        finally:
            if k:
                self._m.rollback(k)

    def allowed(self, path: list[int] = ()) -> torch.Tensor:
        """[V] bool: the tokens allowed after the committed tokens plus ``path`` (which must be allowed)."""
        path = list(path)
        end = self._end(path)
        if end is not None:  # the row after an end of sequence: its token is never emitted
            if self.valid_prefix(path[:end + 1]) != end + 1:
                raise GrammarError("a drafted path outside the grammar was read")
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[list(self.eos_token_ids)] = True
            return mask
        with self._after(path) as ok:
            if not ok:
                raise GrammarError("a drafted path outside the grammar was read")
            mask = torch.zeros(self._words, dtype=torch.int32)
            self._m.unsafe_compute_mask_ptr(mask.data_ptr(), self._words * 4)
        return ((mask[:, None] >> self._bits) & 1).bool().flatten()[:self.vocab_size]

    def forced(self, path: list[int] = ()) -> list[int]:
        """The tokens the grammar forces after the committed tokens plus ``path`` (canonical tokenization of the
        forced bytes; empty where more than one continuation is allowed, or ``path`` leaves the grammar)."""
        path = list(path)
        if self._end(path) is not None:
            return []
        with self._after(path) as ok:
            return list(self._m.compute_ff_tokens()) if ok else []

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (end of sequence is allowed)."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing but end of sequence can follow: the output is complete."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()
