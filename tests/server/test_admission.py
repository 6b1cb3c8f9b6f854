"""Admission of a request before any work is spent on it, and the limits on what one request may hold.

- order: cheap checks and the queue-full check come before tokenization, chat templates and grammar compilation,
  which run in a thread pool of their own whose bounded queue answers 503 `queue_full` when it is full; requests being
  prepared count against the waiting queue, so a burst cannot all pass the check before any is submitted;
- JSON schemas are capped in depth and size (a 400 naming the field), and their metaschema validation runs in that
  pool, not on the event loop;
- stop strings are refused with grammar-constrained output (`response_format` JSON, active tools);
- `ignore_eos` only on a server started with `server.allow_ignore_eos`, and `n` x `max_tokens` under
  `server.max_request_tokens`.

The HTTP-layer checks run the real app against the scripted worker of tests/server/fake_worker.py (no model); the
last test drives a real server with the official `openai` client.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from pydantic import ValidationError

from server.api.app import ServerState, create_app
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.routes import PrepPool
from server.api.structured import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
from server.config import ConfigError, config_from_dict
from server.metrics import Metrics
from tests.server.fake_worker import KEY, MODEL, PROMPT, FakeTokenizer, FakeWorker, auth

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}


class CountingTokenizer(FakeTokenizer):
    """FakeTokenizer that counts its calls; `gate` (when set) holds the first chat template until it is set."""

    def __init__(self):
        self.templates = self.encodes = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        self.templates += 1
        self.entered.set()
        if self.gate is not None and self.templates == 1:
            assert self.gate.wait(30)
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)

    def __call__(self, text, add_special_tokens=True):
        self.encodes += 1
        return super().__call__(text, add_special_tokens)


class CountingGrammars:
    """Stands in for the server's GrammarCompiler: accepts every grammar, counting them."""

    def __init__(self):
        self.checks = 0

    def check(self, grammar: str) -> None:
        self.checks += 1


def make_app(worker: FakeWorker, server: dict | None = None, max_seq_len: int = 512):
    cfg = config_from_dict({"cache": {"num_slots": worker.ready.num_slots, "max_seq_len": max_seq_len},
                            "server": {"max_waiting": 4, **(server or {})}})
    tok = CountingTokenizer()
    state = ServerState(cfg=cfg, worker=worker, tokenizer=tok, metrics=Metrics(MODEL, "ngram"), model_name=MODEL,
                        stop_token_ids=[3], api_key=KEY, created=0)
    state.grammars = CountingGrammars()
    return create_app(state), state, tok


def client_for(worker: FakeWorker, **kw) -> tuple[TestClient, ServerState, CountingTokenizer]:
    app, state, tok = make_app(worker, **kw)
    return TestClient(app, raise_server_exceptions=False), state, tok


def post(c: TestClient, body: dict, path: str = CHAT):
    return c.post(path, json={"model": MODEL, **body}, headers=auth())


def error(r, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def full(worker: FakeWorker) -> FakeWorker:
    worker.extra_in_flight = worker.ready.num_slots + 4  # every slot and the waiting queue (max_waiting 4)
    return worker


# -- the queue-full check comes first ------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    {"messages": MSG, "response_format": JSON_SCHEMA},
    {"messages": MSG, "tools": [ADD]},
    {"messages": MSG, "tools": [ADD], "tool_choice": "required"},
    {"messages": MSG},
], ids=["json_schema", "tools-auto", "tools-required", "plain"])
def test_a_full_queue_is_503_before_any_template_or_grammar(body):
    worker = full(FakeWorker())
    c, state, tok = client_for(worker)
    with c:
        r = post(c, {**body, "max_tokens": 2})
    err = error(r, 503, code="queue_full")
    assert r.headers["retry-after"] and err["type"] == "server_error"
    assert (tok.templates, tok.encodes, state.grammars.checks) == (0, 0, 0)
    assert worker.generates == []


def test_a_full_queue_is_503_before_the_prompt_is_tokenized():
    worker = full(FakeWorker())
    c, _, tok = client_for(worker)
    with c:
        error(post(c, {"prompt": "some text", "max_tokens": 2}, "/v1/completions"), 503, code="queue_full")
    assert tok.encodes == 0


@pytest.mark.parametrize("schema", [{"type": 5}, {"type": "object", "properties": {"a": {"minLength": "x"}}}])
def test_a_full_queue_is_503_before_the_schema_is_validated(schema):
    """Metaschema validation (jsonschema) is part of the work a full server does not do: it runs in the
    preparation pool, after the queue-full check."""
    c, state, _ = client_for(full(FakeWorker()))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with c:
        error(post(c, {"messages": MSG, "response_format": fmt, "max_tokens": 2}), 503, code="queue_full")


def test_schema_errors_still_name_the_field_when_there_is_room():
    c, _, _ = client_for(FakeWorker())
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"minLength": "x"}}}}}
    with c:
        err = error(post(c, {"messages": MSG, "response_format": bad, "max_tokens": 2}), 400, "response_format")
        assert "`response_format.json_schema.schema` is not a valid JSON schema" in err["message"], err
        err = error(post(c, {"messages": MSG, "tools": [ADD, tool], "max_tokens": 2}), 400, "tools")
        assert "`tools[1].function.parameters` is not a valid JSON schema" in err["message"], err


def test_schema_validation_is_off_the_event_loop():
    """The request model's validators (run on the event loop) no longer validate schemas against their metaschema:
    only their shape."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "response_format": fmt})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "tools": [tool]})


def post_while_first_is_held(app, tok, after: int = 0):
    """A chat request held inside its chat template (prepared, not yet submitted) and a second one sent meanwhile;
    then the first is let go and `after` more are sent -> (first, second, [the later ones])."""
    tok.gate = threading.Event()

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth()) as c:
            body = {"model": MODEL, "messages": MSG, "max_tokens": 2}
            first = asyncio.create_task(c.post(CHAT, json=body))
            for _ in range(3000):
                if tok.entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert tok.entered.is_set()
            second = await c.post(CHAT, json=body)
            tok.gate.set()
            return await first, second, [await c.post(CHAT, json=body) for _ in range(after)]

    return asyncio.run(scenario())


def test_requests_being_prepared_count_against_the_queue():
    """Room for one more request: the first is held in its chat template (prepared, not yet submitted); a second
    one arriving meanwhile is refused at once, and the first then runs."""
    worker = FakeWorker()
    worker.extra_in_flight = worker.ready.num_slots + 4 - 1
    app, _, tok = make_app(worker)
    first, second, _ = post_while_first_is_held(app, tok)
    error(second, 503, code="queue_full")
    assert first.status_code == 200, first.text
    assert len(worker.generates) == 1 and tok.templates == 1


def test_a_full_preparation_pool_is_503_queue_full():
    """The preparation pool has a bound of its own: with its one job slot taken, the next request is refused with
    the same 503 as a full waiting queue, though the queue has room."""
    worker = FakeWorker()
    app, _, tok = make_app(worker)
    app.state.prep = PrepPool(threads=1, max_jobs=1)
    first, second, (third,) = post_while_first_is_held(app, tok, after=1)
    error(second, 503, code="queue_full")
    assert second.headers["retry-after"]
    assert first.status_code == 200 and third.status_code == 200, (first.text, third.text)


# -- schema caps ---------------------------------------------------------------------------------------------------
def nested(depth: int) -> dict:
    """A schema whose JSON nests `depth` levels (objects and arrays counted, the schema itself level 1)."""
    schema: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema if depth % 2 else {"type": "array", "items": schema}


def depth_of(value) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


def test_the_nesting_helper():
    assert [depth_of(nested(d)) for d in (1, 2, 3, 32, 33)] == [1, 2, 3, 32, 33]


def big(size: int) -> dict:
    """An object schema whose compact JSON is at least `size` bytes."""
    return {"type": "object", "description": "x" * size}


@pytest.mark.parametrize("where", ["response_format", "tool", "function"])
def test_schemas_too_deep_or_too_large_are_400_naming_the_field(where):
    c, state, _ = client_for(FakeWorker(), max_seq_len=200_000)  # tools' schemas go into the prompt
    deep = {"type": "object", "properties": {"v": nested(MAX_SCHEMA_DEPTH - 1)}}  # 33 levels under the top
    large = big(MAX_SCHEMA_BYTES)

    def body(schema):
        if where == "response_format":
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        fn = {"name": "f", "parameters": schema}
        if where == "tool":
            return {"tools": [ADD, {"type": "function", "function": fn}]}
        return {"functions": [fn]}

    param, path = {"response_format": ("response_format", "`response_format.json_schema.schema`"),
                   "tool": ("tools", "`tools[1].function.parameters`"),
                   "function": ("functions", "`functions[0].parameters`")}[where]
    assert depth_of(deep) == MAX_SCHEMA_DEPTH + 1
    with c:
        err = error(post(c, {"messages": MSG, "max_tokens": 2, **body(deep)}), 400, param, "invalid_value")
        assert path in err["message"] and f"more than {MAX_SCHEMA_DEPTH} levels" in err["message"], err
        err = error(post(c, {"messages": MSG, "max_tokens": 2, **body(large)}), 400, param, "invalid_value")
        assert path in err["message"] and "64 KiB" in err["message"], err
        # at the limits: accepted
        at_depth = {"type": "object", "properties": {"v": nested(MAX_SCHEMA_DEPTH - 2)}}
        assert depth_of(at_depth) == MAX_SCHEMA_DEPTH
        r = post(c, {"messages": MSG, "max_tokens": 2, **body(at_depth)})
        assert r.status_code == 200, r.text
        under = big(MAX_SCHEMA_BYTES - 200)
        assert len(json.dumps(under, separators=(",", ":")).encode()) <= MAX_SCHEMA_BYTES
        r = post(c, {"messages": MSG, "max_tokens": 2, **body(under)})
        assert r.status_code == 200, r.text


def test_schema_caps_on_completions_and_in_multibyte_text():
    c, _, _ = client_for(FakeWorker())
    # 3 bytes a character in UTF-8: under the cap in characters, over it in bytes
    schema = {"type": "object", "description": "\u20ac" * (MAX_SCHEMA_BYTES // 3 + 10)}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with c:
        error(post(c, {"prompt": "x", "max_tokens": 2, "response_format": fmt}, "/v1/completions"), 400,
              "response_format")


def test_schema_depth_counts_arrays_too():
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH // 2):
        schema = {"anyOf": [schema]}  # two levels each: 33 in all (17 counting objects alone)
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert info.value.errors()[0]["loc"] == ("response_format",)


# -- stop strings and grammars -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, names", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": JSON_SCHEMA}, "response_format"),
    ({"tools": [ADD]}, "tools"),  # auto: free text, then a call the stop string could cut
    ({"tools": [ADD], "tool_choice": "required"}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tools"),
    ({"functions": [ADD["function"]]}, "functions"),
])
@pytest.mark.parametrize("stop", ["}", ["\n", "x"]])
def test_stop_with_a_grammar_is_400_naming_stop(fields, names, stop):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "stop": stop, **fields})
    err = info.value.errors()[0]
    assert err["loc"] == ("stop",) and err["type"] == "invalid_value", err
    assert f"`{names}`" in err["msg"]
    c, _, tok = client_for(FakeWorker())
    with c:
        err = error(post(c, {"messages": MSG, "max_tokens": 2, "stop": stop, **fields}), 400, "stop",
                    "invalid_value")
    assert "`stop`" in err["message"] and tok.templates == 0


def test_stop_with_a_completions_json_format_is_400():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "stop": ["}"],
                                          "response_format": {"type": "json_object"}})
    assert info.value.errors()[0]["loc"] == ("stop",)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "text"}},
    {"response_format": None},
    {"tools": [ADD], "tool_choice": "none"},  # the tools constrain nothing
    {"functions": [ADD["function"]], "function_call": "none"},
])
def test_stop_with_unconstrained_output_is_accepted(fields):
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "stop": ["}"], **fields}).stop


@pytest.mark.parametrize("stop", [None, []])
def test_no_stop_strings_with_a_grammar_are_accepted(stop):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, "stop": stop, "tools": [ADD],
                                                "response_format": {"type": "json_object"}})
    assert not req.stop


# -- ignore_eos and the per-request token ceiling ------------------------------------------------------------------
def test_ignore_eos_needs_the_server_flag():
    worker = FakeWorker()
    c, _, _ = client_for(worker)
    with c:
        err = error(post(c, {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}, "/v1/completions"), 400,
                    "ignore_eos", "unsupported_parameter")
        assert "server.allow_ignore_eos" in err["message"], err
        error(post(c, {"messages": MSG, "max_tokens": 2, "ignore_eos": True}), 400, "ignore_eos")
        assert post(c, {"messages": MSG, "max_tokens": 2, "ignore_eos": False}).status_code == 200
    assert len(worker.generates) == 1 and worker.generates[0].stop_token_ids == [3]
    worker = FakeWorker()
    c, _, _ = client_for(worker, server={"allow_ignore_eos": True})
    with c:
        assert post(c, {"messages": MSG, "max_tokens": 2, "ignore_eos": True}).status_code == 200
    assert worker.generates[0].stop_token_ids == []


def test_request_tokens_ceiling():
    """n x max_tokens at most `server.max_request_tokens`, max_tokens defaulting to the rest of the context."""
    worker = FakeWorker()
    c, _, _ = client_for(worker, server={"max_request_tokens": 100})
    with c:
        err = error(post(c, {"prompt": PROMPT, "max_tokens": 60, "n": 2}, "/v1/completions"), 400, "n",
                    "invalid_value")
        assert "2 x 60 = 120" in err["message"] and "100" in err["message"], err
        err = error(post(c, {"prompt": PROMPT, "max_tokens": 101}, "/v1/completions"), 400, "max_tokens")
        assert "101" in err["message"] and "100" in err["message"], err
        err = error(post(c, {"prompt": PROMPT}, "/v1/completions"), 400, "max_tokens")  # 512 - 4 by default
        assert "508" in err["message"] and "rest of the context" in err["message"], err
        err = error(post(c, {"prompt": PROMPT, "max_completion_tokens": 40, "n": 3}, "/v1/completions"), 400, "n")
        assert worker.generates == []
        assert post(c, {"prompt": PROMPT, "max_tokens": 50, "n": 2}, "/v1/completions").status_code == 200
        assert post(c, {"prompt": PROMPT, "max_tokens": 100}, "/v1/completions").status_code == 200
        assert post(c, {"messages": MSG, "max_tokens": 25, "n": 4}).status_code == 200
    assert len(worker.generates) == 2 + 1 + 4


def test_no_ceiling_by_default():
    worker = FakeWorker()
    c, _, _ = client_for(worker)
    with c:
        assert post(c, {"prompt": PROMPT, "n": 4, "max_tokens": 100}, "/v1/completions").status_code == 200
        assert post(c, {"prompt": PROMPT, "n": 2, "max_tokens": 4}, "/v1/completions").status_code == 200


def test_config_fields():
    cfg = config_from_dict({})
    assert cfg.server.allow_ignore_eos is False and cfg.server.max_request_tokens is None
    cfg = config_from_dict({"server": {"allow_ignore_eos": True, "max_request_tokens": 4096}})
    assert cfg.server.allow_ignore_eos is True and cfg.server.max_request_tokens == 4096
    for bad in ({"max_request_tokens": 0}, {"max_request_tokens": -5}, {"allow_ignore_eos": "yes"},
                {"max_request_tokens": 1.5}):
        with pytest.raises(ConfigError, match="server"):
            config_from_dict({"server": bad})


# -- a real server -------------------------------------------------------------------------------------------------
@pytest.mark.server
def test_e2e_stop_with_json_and_ignore_eos_without_the_flag(make_server):
    s = make_server(num_slots=1, max_waiting=0, server_options={"allow_ignore_eos": False})
    client = OpenAI(base_url=s.url + "/v1", api_key=s.api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MSG, max_tokens=4, stop=["}"],
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MSG, max_tokens=4, extra_body={"ignore_eos": True})
    assert info.value.body["param"] == "ignore_eos"
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=4,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
