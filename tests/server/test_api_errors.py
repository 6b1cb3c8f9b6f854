"""Bad input gets a clear OpenAI-format error with the right status, type and param, and loses nothing."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import wait_balanced

pytestmark = pytest.mark.server

MSG = [{"role": "user", "content": "hi"}]


def post(server, path, body=None, content=None, headers=None):
    h = {**server.headers, **(headers or {})}
    if content is None:
        content = json.dumps(body)
        h.setdefault("Content-Type", "application/json")
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def check(r: httpx.Response, status: int, type_: str, param=..., code=...):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == type_, err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


CHAT_CASES = [
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 3.0}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "a\u0000b"}]}, "messages.0.content"),
    ({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MSG, "n": 129}, "n"),
    ({"messages": MSG, "n": 5}, "n"),  # more choices than the server's 4 KV slots
    ({"messages": MSG, "cache_salt": 7}, "cache_salt"),
    ({"messages": MSG, "logprobs": 1}, "logprobs"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": MSG, "frequency_penalty": True}, "frequency_penalty"),
    ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": MSG, "min_p": 1.5}, "min_p"),
    ({"messages": MSG, "logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"49152": 1}}, "logit_bias"),  # the model's vocabulary ends at 49151
    ({"messages": MSG, "max_tokens": 0, "echo": True}, "max_tokens"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MSG, "seed": "x"}, "seed"),
]


@pytest.mark.parametrize("body,param", CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_chat_validation_errors(server, body, param):
    err = check(post(server, "/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", **body}), 400,
                "invalid_request_error")
    assert err["param"] == param or err["param"].startswith(param), err


def test_completion_validation_errors(server):
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "x", "echo": 1}, "echo"),
                        ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
                        ({"prompt": "x", "logprobs": 6}, "logprobs"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                        ({"prompt": "x", "best_of": 2}, "best_of"),
                        ({"prompt": "x", "logit_bias": {"49152": 0}}, "logit_bias")]:
        err = check(post(server, "/v1/completions", {"model": "SmolLM2-135M-Instruct", **body}), 400,
                    "invalid_request_error")
        assert err["param"].startswith(param), err
    err = check(post(server, "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": [1, 10**7]}), 400,
                "invalid_request_error", param="prompt")


def test_malformed_bodies(server):
    check(post(server, "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={
        "Content-Type": "application/json"}), 400, "invalid_request_error")
    check(post(server, "/v1/chat/completions", content=b'{"model": "\xff\xfe", "messages": []}', headers={
        "Content-Type": "application/json"}), 400, "invalid_request_error")
    check(post(server, "/v1/chat/completions", content=b'[1, 2]', headers={"Content-Type": "application/json"}),
          400, "invalid_request_error")
    nan = b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    check(post(server, "/v1/chat/completions", content=nan, headers={"Content-Type": "application/json"}), 400,
          "invalid_request_error")
    check(post(server, "/v1/chat/completions", {"messages": MSG}), 400, "invalid_request_error", param="model")


def test_unknown_model_is_404(server):
    check(post(server, "/v1/chat/completions", {"model": "gpt-17", "messages": MSG}), 404, "invalid_request_error",
          param="model", code="model_not_found")


def test_context_length(server):
    long = " ".join(["word"] * 1400)  # > 1024 tokens, the session server's context
    check(post(server, "/v1/chat/completions", {"model": "SmolLM2-135M-Instruct",
                                                 "messages": [{"role": "user", "content": long}]}),
          400, "invalid_request_error", code="context_length_exceeded")
    check(post(server, "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": "hello", "max_tokens": 1100}),
          400, "invalid_request_error", param="max_tokens", code="context_length_exceeded")


def test_oversized_body_is_413(server):
    big = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    check(post(server, "/v1/chat/completions", big), 413, "invalid_request_error")


def test_api_key_required(server):
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": MSG})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(server.url + "/v1/chat/completions", content=body,
                       headers={"Content-Type": "application/json", **headers}, timeout=30)
        check(r, 401, "authentication_error")
    check(httpx.get(server.url + "/v1/models", timeout=30), 401, "authentication_error")


def test_unknown_route_is_openai_404(server):
    r = httpx.get(server.url + "/v1/nope", headers=server.headers, timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_errors_are_counted_and_balance(server):
    assert wait_balanced(server.url)


def test_openapi_docs_served(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/completions" in spec["paths"]
    assert httpx.get(server.url + "/docs", timeout=30).status_code == 200


def test_queue_full_is_503_with_retry_after(make_server):
    s = make_server(num_slots=1, max_waiting=0)
    body = {"model": "SmolLM2-135M-Instruct", "messages": MSG, "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=s.headers, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep a reference: a collected line iterator closes the stream (a disconnect)
        next(lines)  # the first request holds the only slot
        r2 = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False}, headers=s.headers,
                        timeout=60)
        check(r2, 503, "server_error", code="queue_full")
        assert r2.headers["retry-after"]
