"""OpenAI request validation, the mapping to sampling parameters, and the models list. (Completion responses are
plain dicts built by the routes: tests/server/test_openai_e2e.py checks them with the openai client.)"""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.api.protocol import ChatCompletionRequest, CompletionRequest, sampling_from
from server.api.responses import ModelCard, ModelList

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def error_of(build, **fields) -> tuple[str, str]:
    """(dotted location, error type) of the first validation error."""
    with pytest.raises(ValidationError) as info:
        build(**fields)
    err = info.value.errors()[0]
    return ".".join(str(p) for p in err["loc"]), err["type"]


# -- valid requests ----------------------------------------------------------------------------------------------
def test_chat_defaults_and_string_content():
    req = chat()
    assert req.messages[0].role == "user" and req.messages[0].content == "hi"
    assert (req.temperature, req.top_p, req.top_k, req.n, req.stream) == (1.0, 1.0, -1, 1, False)
    assert not req.include_usage
    assert req.template_messages() == ([{"role": "user", "content": "hi"}], None)


def test_chat_text_parts_are_joined():
    req = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": ""}])
    assert [m.content for m in req.messages] == ["be brief", "a\nb", ""]


def test_unknown_fields_ignored_and_null_means_default():
    req = chat(foo=1, metadata={"x": 1}, temperature=None, top_p=None, n=None, stream=None, top_k=None,
               logprobs=None, top_logprobs=None, presence_penalty=None, frequency_penalty=None, logit_bias=None,
               min_p=None, repetition_penalty=None, response_format={"type": "text"}, tools=[], tool_choice="none",
               user="u")
    assert (req.temperature, req.top_p, req.n, req.stream, req.top_k) == (1.0, 1.0, 1, False, -1)
    assert not hasattr(req, "foo")
    assert sampling_from(req) == sampling_from(chat())
    assert sampling_from(completion(logprobs=None, echo=None)) == sampling_from(completion())


def test_n_and_cache_salt():
    assert chat(n=128, cache_salt="x" * 256).n == 128
    req = completion(n=3, cache_salt="tenant:a")
    assert (req.n, req.cache_salt) == (3, "tenant:a")
    assert chat().cache_salt is None and chat(cache_salt=None).cache_salt is None
    assert sampling_from(req) == sampling_from(completion())  # neither is a sampling parameter


def test_ints_accepted_for_floats():
    assert chat(temperature=1, top_p=1).temperature == 1.0


def test_stream_options():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage
    assert not chat(stream=True).include_usage


@pytest.mark.parametrize("prompt, expected", [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 0], [1, 2, 0]), ([[5, 6]], [5, 6]),
])
def test_completion_prompts(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


def test_completion_neutral_extras_accepted():
    req = completion(echo=False, suffix=None, best_of=1, max_tokens=5)
    assert req.max_tokens == 5 and sampling_from(req) == sampling_from(completion(max_tokens=5))
    assert completion(suffix="").max_tokens is None


# Values at the documented bounds are accepted (and reach the worker as sent).
@pytest.mark.parametrize("field, value", [
    ("presence_penalty", -2), ("presence_penalty", 2.0), ("presence_penalty", 0), ("presence_penalty", -0.0),
    ("presence_penalty", 5e-324), ("frequency_penalty", -2.0), ("frequency_penalty", 2), ("frequency_penalty", -5e-324),
    ("min_p", 0), ("min_p", 1), ("min_p", 5e-324), ("min_p", 0.05),
    ("repetition_penalty", 1e-6), ("repetition_penalty", 1e6), ("repetition_penalty", 1), ("repetition_penalty", 1.3),
])
def test_shaping_bounds_accepted(field, value):
    for build in (chat, completion):
        assert sampling_from(build(**{field: value}))[field] == float(value)


@pytest.mark.parametrize("bias, expected", [
    ({}, {}),
    ({"0": 0}, {0: 0.0}),
    ({"12": -100, "2147483647": 100.0, "7": 5e-324, "9": -0.5}, {12: -100.0, 2147483647: 100.0, 7: 5e-324, 9: -0.5}),
    ({str(i): 1 for i in range(300)}, {i: 1.0 for i in range(300)}),
])
def test_logit_bias_accepted(bias, expected):
    got = sampling_from(completion(logit_bias=bias))["logit_bias"]
    assert got == expected and all(type(k) is int and type(v) is float for k, v in got.items())
    assert sampling_from(chat(logit_bias=bias))["logit_bias"] == expected


def test_logprob_fields_to_counts():
    """Chat: `logprobs` on, `top_logprobs` alternatives (none by default); completions: `logprobs` = alternatives,
    0 = the chosen token's alone, and with `echo` the same for the prompt."""
    def counts(req):
        s = sampling_from(req)
        return s["logprobs"], s["prompt_logprobs"]

    assert counts(chat()) == counts(chat(logprobs=False)) == (None, None)
    assert counts(chat(logprobs=True)) == counts(chat(logprobs=True, top_logprobs=None)) == (0, None)
    assert counts(chat(logprobs=True, top_logprobs=0)) == (0, None)
    assert counts(chat(logprobs=True, top_logprobs=20)) == (20, None)
    assert counts(completion()) == counts(completion(echo=True)) == (None, None)
    assert counts(completion(logprobs=0)) == (0, None)
    assert counts(completion(logprobs=5)) == (5, None)
    assert counts(completion(logprobs=2, echo=True)) == (2, 2)
    assert counts(completion(logprobs=0, echo=True)) == (0, 0)


def test_zero_tokens_only_with_echo():
    """Scoring a prompt (evaluation harnesses): echo, max_tokens 0 and logprobs on completions."""
    assert sampling_from(completion(echo=True, max_tokens=0, logprobs=1))["max_tokens"] == 0
    assert sampling_from(completion(echo=True, max_completion_tokens=0))["max_tokens"] == 0
    assert sampling_from(completion(echo=True, max_tokens=3))["max_tokens"] == 3


# -- sampling_from -----------------------------------------------------------------------------------------------
NEUTRAL_SHAPING = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                   "logit_bias": {}, "logprobs": None, "prompt_logprobs": None}


def test_sampling_from_defaults():
    assert sampling_from(chat()) == {"max_tokens": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                     "seed": None, "stop": [], "ignore_eos": False, **NEUTRAL_SHAPING}
    assert sampling_from(completion()) == sampling_from(chat())


def test_sampling_from_values():
    req = chat(max_completion_tokens=7, temperature=0, top_p=0.5, top_k=40, seed=-3, stop="\n\n")
    assert sampling_from(req) == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5, "top_k": 40, "seed": -3,
                                  "stop": ["\n\n"], "ignore_eos": False, **NEUTRAL_SHAPING}
    assert sampling_from(completion(max_tokens=9, stop=["a", "b"], top_k=0)) == {
        "max_tokens": 9, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": ["a", "b"],
        "ignore_eos": False, **NEUTRAL_SHAPING}
    assert sampling_from(chat(max_tokens=4, max_completion_tokens=4))["max_tokens"] == 4
    shaped = chat(min_p=0.1, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                  logit_bias={"5": -100, "6": 2.5}, logprobs=True, top_logprobs=3)
    assert sampling_from(shaped) == {**sampling_from(chat()), "min_p": 0.1, "presence_penalty": 0.5,
                                     "frequency_penalty": -1.0, "repetition_penalty": 1.2,
                                     "logit_bias": {5: -100.0, 6: 2.5}, "logprobs": 3}


# -- invalid requests name their field ---------------------------------------------------------------------------
@pytest.mark.parametrize("fields, loc", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "a\x00b"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\x00"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ({"model": 3}, "model"),
    ({"model": "m\x00"}, "model"),
    ({"user": "u\x00"}, "user"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.0}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": False}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": "a\x00"}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "2"}, "n"),
    ({"n": 2.0}, "n"),
    ({"n": True}, "n"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"cache_salt": ["s"]}, "cache_salt"),
    ({"cache_salt": False}, "cache_salt"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "s" * 257}, "cache_salt"),
    ({"cache_salt": "s\x00"}, "cache_salt"),
    ({"cache_salt": "\ud800"}, "cache_salt"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0, "echo": True}, "max_tokens"),  # echo is a completions field: chat ignores it
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": "true"}, "logprobs"),
    ({"logprobs": 0}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"presence_penalty": 2.0000000000000004}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 1.000001e6}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"min_p": -5e-324}, "min_p"),
    ({"min_p": 1.0000000000000002}, "min_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"min_p": False}, "min_p"),
    ({"logit_bias": {"12": 100.00000000000001}}, "logit_bias"),
    ({"logit_bias": {"12": -101}}, "logit_bias"),
    ({"logit_bias": {"12": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"12": float("inf")}}, "logit_bias"),
    ({"logit_bias": {"12": 10**400}}, "logit_bias"),
    ({"logit_bias": {"12": True}}, "logit_bias"),
    ({"logit_bias": {"12": "5"}}, "logit_bias"),
    ({"logit_bias": {"12": None}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(100_000)}}, "logit_bias"),
    ({"logit_bias": [[12, 5]]}, "logit_bias"),
    ({"logit_bias": "12:5"}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"1e3": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"+1": 1}}, "logit_bias"),
    ({"logit_bias": {"": 1}}, "logit_bias"),
    ({"logit_bias": {" 1": 1}}, "logit_bias"),
    ({"logit_bias": {"1 ": 1}}, "logit_bias"),
    ({"logit_bias": {"1\n": 1}}, "logit_bias"),
    ({"logit_bias": {"01": 1}}, "logit_bias"),
    ({"logit_bias": {"1_000": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0661": 1}}, "logit_bias"),  # ARABIC-INDIC DIGIT ONE: int() would take it
    ({"logit_bias": {"2147483648": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    # (a schema invalid against its metaschema is refused by the routes, off the event loop: test_admission.py)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"functions": [{"name": ""}]}, "functions"),
    ({"function_call": "maybe"}, "function_call"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
])
def test_chat_errors_name_the_field(fields, loc):
    where, kind = error_of(chat, **fields)
    assert where == loc
    assert loc not in ACCEPTED or kind != "unsupported_parameter"  # refused for its value only


# Fields the server takes (rejected only for a bad value, never as unsupported).
ACCEPTED = {"logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
            "logit_bias", "echo", "max_tokens", "max_completion_tokens", "response_format", "tools", "tool_choice",
            "functions", "function_call", "parallel_tool_calls"}


@pytest.mark.parametrize("fields, loc", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [1.0]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": "a\x00"}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"echo": "yes"}, "echo"),
    ({"echo": 1}, "echo"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
    ({"max_completion_tokens": 0, "echo": None}, "max_completion_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"max_tokens": 0, "max_completion_tokens": 1, "echo": True}, "max_completion_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"n": 129}, "n"),
    ({"n": -1}, "n"),
    ({"cache_salt": 1.5}, "cache_salt"),
    ({"cache_salt": {"salt": "x"}}, "cache_salt"),
    ({"top_p": float("nan")}, "top_p"),
])
def test_completion_errors_name_the_field(fields, loc):
    where, kind = error_of(completion, **fields)
    assert where == loc
    assert loc not in ACCEPTED or kind != "unsupported_parameter"


def test_unsupported_errors_have_their_own_type():
    assert error_of(completion, suffix="x") == ("suffix", "unsupported_parameter")
    assert error_of(completion, best_of=2) == ("best_of", "unsupported_parameter")
    assert error_of(chat, top_logprobs=1) == ("top_logprobs", "invalid_value")
    assert error_of(chat, max_tokens=0) == ("max_tokens", "invalid_value")
    assert error_of(chat, logit_bias={"-1": 0}) == ("logit_bias", "invalid_value")
    assert error_of(completion, prompt=["a", "b"]) == ("prompt", "unsupported_parameter")
    assert error_of(chat, stop="") == ("stop", "invalid_value")


def test_missing_required_fields():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({})
    assert {e["loc"][0] for e in info.value.errors()} == {"model", "messages"}


# -- responses ---------------------------------------------------------------------------------------------------
def test_model_list_shape():
    body = json.loads(ModelList(data=[ModelCard(id="smol")]).model_dump_json())
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "smol" and body["data"][0]["object"] == "model"
    assert body["data"][0]["owned_by"] == "specserve" and isinstance(body["data"][0]["created"], int)
