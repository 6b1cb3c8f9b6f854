"""Structured outputs and tools in the API process: the request fields' shapes (``response_format``, ``tools``,
``tool_choice``, legacy ``functions`` / ``function_call``), their JSON schemas checked, and the grammar a request
sends to the worker, compiled and validated here so that an unsupported schema is a 400 before any worker time.

The field parsers raise :class:`FieldError` with a complete sentence; ``protocol.py`` turns it into a 400 naming the
field. They run inside the request model's validators, on the event loop, so they check only what is cheap: the
fields' shapes and each JSON schema's size and depth (:func:`check_schema_limits`: at most ``MAX_SCHEMA_DEPTH`` levels
and ``MAX_SCHEMA_BYTES`` of JSON, work bounded by those caps whatever the body holds). A schema's validation against
its metaschema (:func:`check_schema`) and the grammar compilation run later, in the routes' preparation pool, once the
request has been admitted. Grammars are checked against the model's tokenizer as the grammar engine sees it
(``core.grammar``), built once per server by :class:`GrammarCompiler`.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from json.encoder import encode_basestring as _encode_string

from core.grammar import GrammarError, GrammarTokenizer
from core.grammar import response_format_grammar as core_response_format_grammar

NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function and json_schema names
MAX_TOOLS = 128  # OpenAI's limit
RESPONSE_TYPES = ("text", "json_object", "json_schema")
# Caps on each JSON schema a request carries (`response_format`'s, each tool's `parameters`): nesting depth in JSON
# objects and arrays (the schema itself is level 1) and the size of its compact JSON text in UTF-8 bytes.
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_BYTES = 64 * 1024


class FieldError(ValueError):
    """A request field with a value the server cannot use (the message is a complete sentence)."""


@dataclass(frozen=True)
class ResponseFormat:
    type: str                 # "text" | "json_object" | "json_schema"
    schema: Any = None        # json_schema: the schema (a dict or a boolean); None otherwise
    name: str | None = None   # json_schema: its name

    @property
    def constrained(self) -> bool:
        return self.type != "text"


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call."""

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None

    def openai(self) -> dict:
        """The tool as OpenAI's request spells it (the shape chat templates take)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.arguments_schema()
        return {"type": "function", "function": fn}

    def arguments_schema(self) -> dict:
        """The schema its arguments must match: ``parameters``, or an empty object for a function without any."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


@dataclass(frozen=True)
class ToolChoice:
    mode: str               # "none" | "auto" | "required" | "named"
    name: str | None = None  # named: the function


# -- field parsers -----------------------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _json_bytes(value: Any) -> int:
    """The UTF-8 size of a scalar's JSON text."""
    if isinstance(value, str):
        return len(_encode_string(value).encode("utf-8", "surrogatepass"))
    if value is None or isinstance(value, bool):
        return {None: 4, True: 4, False: 5}[value]
    if type(value) is int:
        return len(str(value))
    return len(repr(value))  # a float as json writes it (Infinity and NaN within a byte or two)


def check_schema_limits(schema: Any, what: str) -> None:
    """A JSON schema must be an object (or a boolean) nested at most MAX_SCHEMA_DEPTH levels deep (objects and arrays,
    the schema itself level 1) whose compact JSON text has at most MAX_SCHEMA_BYTES bytes. The walk stops at the first
    cap it passes, so its cost is bounded by the caps, not by the request body."""
    if not isinstance(schema, (dict, bool)):
        raise FieldError(f"{what} must be a JSON schema (an object); got {_type_name(schema)}.")
    size, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise FieldError(f"{what} is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays); "
                                 f"this server accepts JSON schemas of at most {MAX_SCHEMA_DEPTH} levels.")
            size += 1 + max(len(value), 1)  # brackets, and the commas between items: checked before the items
            if size <= MAX_SCHEMA_BYTES:
                if isinstance(value, dict):
                    for key, item in value.items():
                        size += _json_bytes(key) + 1  # "key":
                        stack.append((item, depth + 1))
                else:
                    stack.extend((item, depth + 1) for item in value)
        else:
            size += _json_bytes(value)
        if size > MAX_SCHEMA_BYTES:
            raise FieldError(f"{what} is larger than {MAX_SCHEMA_BYTES // 1024} KiB as JSON; this server accepts "
                             f"JSON schemas of at most {MAX_SCHEMA_BYTES // 1024} KiB ({MAX_SCHEMA_BYTES} bytes) each.")


def check_schema(schema: Any, what: str) -> None:
    """A JSON schema must be an object (or a boolean) valid against its metaschema (JSON Schema 2020-12 unless its
    ``$schema`` names another draft). Costly for a large schema: the routes run it in their preparation pool, after
    admission, on a schema that passed :func:`check_schema_limits`."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise FieldError(f"{what} must be a JSON schema (an object); got {_type_name(schema)}.")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise FieldError(f"{what} is not a valid JSON schema: {_short(e.message)}"
                         + (f" (at `{where}`)." if where else ".")) from None
    except RecursionError:
        raise FieldError(f"{what} is nested too deeply.") from None


def check_text(value: Any, what: str) -> None:
    """Every string in a JSON value (keys included) must survive the prompt and the tokenizer: no NUL, no lone
    surrogate."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            if "\x00" in v:
                raise FieldError(f"{what} must not contain NUL characters.")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise FieldError(f"{what} must be valid Unicode (no lone surrogates).") from None


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


RESPONSE_SCHEMA = "`response_format.json_schema.schema`"


def parse_response_format(v: Any) -> ResponseFormat | None:
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise FieldError("`response_format` must be an object with a string `type`.")
    kind = v["type"]
    if kind not in RESPONSE_TYPES:
        raise FieldError(f"`response_format.type` must be one of {', '.join(map(repr, RESPONSE_TYPES))}; "
                         f"got {_short(repr(kind), 40)}.")
    if kind != "json_schema":
        check_text(v, "`response_format`")
        return ResponseFormat(kind)
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError("`response_format` of type 'json_schema' needs a `json_schema` object with `name` and "
                         "`schema`.")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise FieldError("`response_format.json_schema.name` must be 1 to 64 letters, digits, '_' or '-'.")
    for key, kinds in (("strict", (bool, type(None))), ("description", (str, type(None)))):
        if not isinstance(spec.get(key), kinds):
            raise FieldError(f"`response_format.json_schema.{key}` has the wrong type "
                             f"({_type_name(spec.get(key))}).")
    schema = spec.get("schema", {})
    check_schema_limits(schema, RESPONSE_SCHEMA)
    check_text(v, "`response_format`")
    return ResponseFormat("json_schema", schema, name)


def _parse_function(fn: Any, where: str) -> ToolSpec:
    if not isinstance(fn, dict):
        raise FieldError(f"`{where}` must be an object with a `name`.")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise FieldError(f"`{where}.name` must be 1 to 64 letters, digits, '_' or '-'; got "
                         f"{_short(repr(name), 80)}.")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise FieldError(f"`{where}.description` must be a string.")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError(f"`{where}.strict` must be a boolean.")
    params = fn.get("parameters")
    if params is not None:
        check_schema_limits(params, f"`{where}.parameters`")
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise FieldError(f"`{where}.parameters` must be a JSON schema of type 'object' (the arguments "
                             "object).")
    return ToolSpec(name, description, params, strict)


def _parse_list(v: Any, field: str, noun: str, parse_item) -> list[ToolSpec] | None:
    """A list of at most MAX_TOOLS functions (``parse_item(i, item)`` each), their names unique."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise FieldError(f"`{field}` must be a list of {noun}.")
    if len(v) > MAX_TOOLS:
        raise FieldError(f"`{field}` accepts at most {MAX_TOOLS} {noun}; it has {len(v)}.")
    out = [parse_item(i, item) for i, item in enumerate(v)]  # each schema's caps before any walk over them all
    check_text(v, f"`{field}`")
    seen = set()
    for spec in out:
        if spec.name in seen:
            raise FieldError(f"`{field}` names the function '{spec.name}' more than once.")
        seen.add(spec.name)
    return out


def _parse_tool(i: int, tool: Any) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise FieldError(f"`tools[{i}]` must be an object of type 'function' (the only tool type this server runs).")
    return _parse_function(tool.get("function"), f"tools[{i}].function")


def parse_tools(v: Any) -> list[ToolSpec] | None:
    return _parse_list(v, "tools", "tools", _parse_tool)


def parse_functions(v: Any) -> list[ToolSpec] | None:
    """Legacy ``functions``: a list of function objects."""
    return _parse_list(v, "functions", "functions", lambda i, fn: _parse_function(fn, f"functions[{i}]"))


def parse_tool_choice(v: Any) -> ToolChoice | None:
    if v is None:
        return None
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise FieldError(f"`tool_choice` must be 'none', 'auto', 'required' or a named function; got "
                             f"{_short(repr(v), 40)}.")
        return ToolChoice(v)
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str):
        return ToolChoice("named", v["function"]["name"])
    raise FieldError("`tool_choice` must be 'none', 'auto', 'required' or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}.")


def parse_function_call(v: Any) -> ToolChoice | None:
    """Legacy ``function_call``: 'none', 'auto' or {"name": ...}."""
    if v is None:
        return None
    if v in ("none", "auto"):
        return ToolChoice(v)
    if isinstance(v, dict) and isinstance(v.get("name"), str):
        return ToolChoice("named", v["name"])
    raise FieldError("`function_call` must be 'none', 'auto' or {\"name\": ...}.")


# -- grammars ----------------------------------------------------------------------------------------------------
class GrammarCompiler:
    """Checks grammar strings against the model's tokenizer (the grammar engine's view of it, built once: about
    0.4 s for a 49k vocabulary) and remembers the verdicts of recent grammars (by digest, so large schemas cost no
    memory), so a conversation's repeated tools or schema cost one check."""

    CACHE_SIZE = 256

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._args = (hf_tokenizer, vocab_size, list(eos_token_ids))
        self._tokenizer: GrammarTokenizer | None = None
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # digest -> None (valid) or the error

    @property
    def tokenizer(self) -> GrammarTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = GrammarTokenizer(*self._args)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Raise GrammarError (the engine's message) where ``grammar`` does not compile for this model."""
        key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                error = self._verdicts[key]
                if error is not None:
                    raise GrammarError(error)
                return
        tok = self.tokenizer
        try:
            tok.validate(grammar)
            error = None
        except GrammarError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - whatever the engine raised, the grammar is what the client sent
            error = f"{type(e).__name__}: {e}"
        except BaseException as e:  # a Rust panic surfaces as pyo3's PanicException, a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = f"the grammar engine failed on it ({_short(str(e), 120)})"
        if error is not None:
            error = _short(error, 1000)
        with self._lock:
            self._verdicts[key] = error
            while len(self._verdicts) > self.CACHE_SIZE:
                self._verdicts.popitem(last=False)
        if error is not None:
            raise GrammarError(error)


def response_format_grammar(fmt: ResponseFormat | None) -> str | None:
    """The grammar of a response format (None: free text), as ``core.grammar`` compiles OpenAI's. Raises
    GrammarError."""
    if fmt is None or not fmt.constrained:
        return None
    return core_response_format_grammar({"type": fmt.type, "json_schema": {"schema": fmt.schema}})[0]


def compile_checked(compiler: GrammarCompiler, build, what: str) -> str | None:
    """``build()`` -> a grammar string checked by ``compiler``; any failure -> FieldError naming ``what``."""
    try:
        grammar = build()
        if grammar is not None:
            compiler.check(grammar)
        return grammar
    except FieldError:
        raise
    except (GrammarError, ValueError, TypeError, RecursionError) as e:
        raise FieldError(f"{what} cannot be enforced: {_short(str(e))}") from None
    except BaseException as e:  # a Rust panic in the grammar engine (pyo3's PanicException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise FieldError(f"{what} cannot be enforced: the grammar engine failed on it ({_short(str(e), 120)})") \
            from None


def dumps(value: Any) -> str:
    """JSON as the models write it and the grammars force it: ", " and ": " separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)
