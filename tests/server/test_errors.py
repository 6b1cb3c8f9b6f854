"""Every failure of a tiny app wired like the real one comes back as an OpenAI error body, never as a 422."""
from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.testclient import TestClient

from server.api.auth import ApiKeys, caller_partition
from server.api.errors import APIError, BodySizeLimitMiddleware, install_error_handlers
from server.api.protocol import ChatCompletionRequest

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}
LIMIT = 4096
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def require_key(keys: ApiKeys | None):
    """The routes' key check (server.api.routes._auth) as a dependency with fixed keys."""
    async def dependency(request: Request) -> None:
        request.state.cache_partition = caller_partition(keys, request)

    return dependency


def make_app(max_bytes: int = LIMIT) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_bytes)
    auth = [Depends(require_key(ApiKeys.of([KEY])))]

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(req: ChatCompletionRequest):
        return {"model": req.model, "n_messages": len(req.messages)}

    @app.get("/busy")
    async def busy():
        raise APIError(503, "The server is overloaded, retry soon.", code="queue_full", headers={"Retry-After": "7"})

    @app.get("/bad")
    async def bad():
        raise APIError(400, "nope", param="x", code="custom")

    @app.get("/crash")
    async def crash():
        raise RuntimeError("secret internal detail")

    return app


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(), raise_server_exceptions=False) as c:
        yield c


def assert_error(resp, status: int, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_ and err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_valid_request_passes(client):
    resp = client.post("/v1/chat/completions", json=GOOD, headers=AUTH)
    assert resp.status_code == 200 and resp.json() == {"model": "m", "n_messages": 1}


@pytest.mark.parametrize("body", [b"{not json", b'{"model": "m",}', b"", b'{"a": "\xff\xfe"}', b"\xff"])
def test_malformed_json_is_400(client, body):
    resp = client.post("/v1/chat/completions", content=body, headers={**AUTH, **JSON})
    err = assert_error(resp, 400)
    if body:
        assert err["code"] == "invalid_json"


def test_deep_nesting_is_400():
    depth = 200_000  # deeper than json's recursion limit
    with TestClient(make_app(max_bytes=10 * depth), raise_server_exceptions=False) as c:
        resp = c.post("/v1/chat/completions", content=b"[" * depth + b"]" * depth, headers={**AUTH, **JSON})
    assert_error(resp, 400, code="invalid_json")


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"42", b"null"])
def test_body_not_an_object_is_400(client, body):
    assert_error(client.post("/v1/chat/completions", content=body, headers={**AUTH, **JSON}), 400,
                 code="invalid_body")


def test_wrong_content_type_is_400(client):
    err = assert_error(client.post("/v1/chat/completions", content=json.dumps(GOOD).encode(),
                                   headers={**AUTH, "content-type": "text/plain"}), 400, code="invalid_body")
    assert "application/json" in err["message"]


@pytest.mark.parametrize("patch, param, code", [
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_value"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content",
     "unsupported_parameter"),
    ({"n": 129}, "n", "invalid_value"),
    ({"n": "2"}, "n", "invalid_type"),
    ({"cache_salt": 3}, "cache_salt", "invalid_type"),
    ({"cache_salt": ""}, "cache_salt", "invalid_value"),
    ({"logprobs": 1}, "logprobs", "invalid_type"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"min_p": "0.1"}, "min_p", "invalid_type"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "x"}}},
     "response_format", "invalid_value"),
    ({"stop": "}", "response_format": {"type": "json_object"}}, "stop", "invalid_value"),
    ({"stop": ["a"] * 5}, "stop", "invalid_value"),
    ({"model": None}, "model", None),
])
def test_wrong_field_is_400_with_param(client, patch, param, code):
    err = assert_error(client.post("/v1/chat/completions", json={**GOOD, **patch}, headers=AUTH), 400,
                       param=param, code=code)
    assert "secret" not in err["message"]


@pytest.mark.parametrize("field, raw", [("logit_bias", b'{"1": NaN}'), ("logit_bias", b'{"1": -Infinity}'),
                                        ("logit_bias", b'{"1": 1e999}'), ("presence_penalty", b"NaN"),
                                        ("frequency_penalty", b"Infinity"), ("repetition_penalty", b"1e999"),
                                        ("min_p", b"-Infinity")])
def test_non_finite_json_numbers_are_400_with_param(client, field, raw):
    """Python's JSON parser reads NaN, Infinity and overflowing literals as floats: they must not pass."""
    body = json.dumps(GOOD)[:-1].encode() + b', "' + field.encode() + b'": ' + raw + b"}"
    assert_error(client.post("/v1/chat/completions", content=body, headers={**AUTH, **JSON}), 400, param=field)


def test_missing_field_is_400_with_param(client):
    err = assert_error(client.post("/v1/chat/completions", json={"model": "m"}, headers=AUTH), 400,
                       param="messages", code="missing_required_parameter")
    assert "messages" in err["message"]


def test_never_422(client):
    bodies = [b"{", b"[]", b"{}", json.dumps({**GOOD, "top_p": 0}).encode(), json.dumps({"messages": 1}).encode(),
              json.dumps({**GOOD, "seed": 2**80}).encode(), b'{"model": NaN}']
    for body in bodies:
        assert client.post("/v1/chat/completions", content=body, headers={**AUTH, **JSON}).status_code == 400


def test_oversized_body_with_content_length_is_413(client):
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * (2 * LIMIT)}]}
    assert_error(client.post("/v1/chat/completions", json=big, headers=AUTH), 413, code="request_too_large")


def test_oversized_chunked_body_is_413(client):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    assert_error(client.post("/v1/chat/completions", content=chunks(), headers={**AUTH, **JSON}), 413,
                 code="request_too_large")


def _run_asgi(app, chunks: list[bytes]) -> list[dict]:
    """Drive ``app`` with a chunked request (no Content-Length) and collect what it sends."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked"),
                         (b"authorization", f"Bearer {KEY}".encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    asyncio.run(app(scope, receive, send))
    return sent


def test_streamed_body_counted_at_asgi_level():
    app = make_app(max_bytes=1000)
    sent = _run_asgi(app, [b" " * 600, b" " * 600])
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] == 413
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "request_too_large"
    ok = _run_asgi(app, [json.dumps(GOOD).encode()[:10], json.dumps(GOOD).encode()[10:]])
    assert [m["status"] for m in ok if m["type"] == "http.response.start"] == [200]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "}])
def test_bad_api_key_is_401(client, headers):
    resp = client.post("/v1/chat/completions", json=GOOD, headers=headers)
    assert_error(resp, 401, type_="authentication_error", code="invalid_api_key")


def test_no_key_configured_allows_everything():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/open", dependencies=[Depends(require_key(None))])
    async def open_route():
        return {"ok": True}

    with TestClient(app) as c:
        assert c.get("/open").json() == {"ok": True}
    with pytest.raises(ValueError):
        ApiKeys.of([""])


def test_unknown_route_is_404(client):
    assert_error(client.get("/v1/nothing"), 404, code="not_found")


def test_wrong_method_is_405(client):
    resp = client.get("/v1/chat/completions", headers=AUTH)
    assert_error(resp, 405)
    assert "POST" in resp.headers["allow"]


def test_api_error_503_has_retry_after(client):
    resp = client.get("/busy")
    err = assert_error(resp, 503, type_="server_error", code="queue_full")
    assert resp.headers["retry-after"] == "7" and "overloaded" in err["message"]


def test_api_error_passes_through(client):
    assert_error(client.get("/bad"), 400, param="x", code="custom")


def test_unhandled_exception_is_generic_500(client, caplog):
    resp = client.get("/crash")
    err = assert_error(resp, 500, type_="server_error")
    assert "secret" not in err["message"]
    assert "secret internal detail" in caplog.text  # the traceback is logged
