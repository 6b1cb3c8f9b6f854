"""OpenAI request validation, the mapping to sampling parameters, and the models list. (Completion responses are
plain dicts built by the routes: tests/server/test_openai_e2e.py checks them with the openai client.)"""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, sampling_from

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
    assert req.template_messages() == [{"role": "user", "content": "hi"}]


def test_chat_text_parts_are_joined():
    req = chat(messages=[{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": ""}])
    assert [m.content for m in req.messages] == ["be brief", "a\nb", ""]


def test_unknown_fields_ignored_and_null_means_default():
    req = chat(foo=1, metadata={"x": 1}, temperature=None, top_p=None, n=None, stream=None, top_k=None,
               logprobs=False, top_logprobs=None, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
               response_format={"type": "text"}, tools=[], tool_choice="none", user="u")
    assert (req.temperature, req.top_p, req.n, req.stream, req.top_k) == (1.0, 1.0, 1, False, -1)
    assert not hasattr(req, "foo")


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
    req = completion(echo=False, suffix=None, best_of=1, logprobs=0, max_tokens=5)
    assert req.max_tokens == 5


# -- sampling_from -----------------------------------------------------------------------------------------------
def test_sampling_from_defaults():
    assert sampling_from(chat()) == {"max_tokens": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                     "seed": None, "stop": [], "ignore_eos": False}


def test_sampling_from_values():
    req = chat(max_completion_tokens=7, temperature=0, top_p=0.5, top_k=40, seed=-3, stop="\n\n")
    assert sampling_from(req) == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.5, "top_k": 40, "seed": -3,
                                  "stop": ["\n\n"], "ignore_eos": False}
    assert sampling_from(completion(max_tokens=9, stop=["a", "b"], top_k=0)) == {
        "max_tokens": 9, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": ["a", "b"], "ignore_eos": False}
    assert sampling_from(chat(max_tokens=4, max_completion_tokens=4))["max_tokens"] == 4


# -- invalid requests name their field ---------------------------------------------------------------------------
@pytest.mark.parametrize("fields, loc", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
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
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"logit_bias": {"12": 5}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_chat_errors_name_the_field(fields, loc):
    assert error_of(chat, **fields)[0] == loc


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
    ({"echo": True}, "echo"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 2}, "logprobs"),
    ({"n": 129}, "n"),
    ({"n": -1}, "n"),
    ({"cache_salt": 1.5}, "cache_salt"),
    ({"cache_salt": {"salt": "x"}}, "cache_salt"),
    ({"top_p": float("nan")}, "top_p"),
])
def test_completion_errors_name_the_field(fields, loc):
    assert error_of(completion, **fields)[0] == loc


def test_unsupported_errors_have_their_own_type():
    assert error_of(chat, logprobs=True) == ("logprobs", "unsupported_parameter")
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
