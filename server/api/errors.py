"""OpenAI-shaped errors for every failure the HTTP layer can produce, and body-size limiting (API keys:
``server.api.auth``).

Every error response has the body ``{"error": {"message", "type", "param", "code"}}``. The ``type`` strings follow
OpenAI's:

- ``invalid_request_error``: the client must change the request (400, 404, 405, 413, and any other 4xx);
- ``authentication_error``: missing or wrong API key (401);
- ``permission_error``: 403;
- ``rate_limit_error``: 429;
- ``server_error``: our fault or temporary (500; 503 when the waiting queue is full, code ``queue_full`` with a
  ``Retry-After``, or when the worker is not running, code ``worker_unavailable``).

``param`` names the offending request field as a dotted path (``messages.0.content``) or is null; ``code`` is a
short machine-readable reason (``invalid_json``, ``invalid_api_key``, ``request_too_large``, ...) or null.
Validation failures are always 400, never FastAPI's 422.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.validation import OWN_ERROR_TYPES

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


def default_type(status: int) -> str:
    """The OpenAI error ``type`` for an HTTP status."""
    if status >= 500:
        return SERVER_ERROR
    return {401: AUTHENTICATION, 403: PERMISSION, 429: RATE_LIMIT}.get(status, INVALID_REQUEST)


class APIError(Exception):
    """An error to send to the client as-is: raise it anywhere below a route and the handler renders it.

    ``type`` defaults to :func:`default_type` of ``status``; ``headers`` go on the response (``Retry-After``)."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or default_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body(), status_code=self.status, headers=self.headers or None)


# -- exception handlers ------------------------------------------------------------------------------------------
def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def validation_error(errors: list[dict[str, Any]], content_type: str | None = None) -> APIError:
    """Turn FastAPI/pydantic validation errors into one 400 naming the first offending field."""
    if not errors:
        return APIError(400, "The request is invalid.")
    first = errors[0]
    loc, etype, msg = tuple(first.get("loc") or ()), first.get("type", ""), str(first.get("msg", "Invalid value"))
    if etype == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "syntax error")
        where = f" at position {loc[1]}" if len(loc) > 1 else ""
        return APIError(400, f"The request body is not valid JSON ({detail}{where}).", code="invalid_json")
    # FastAPI prefixes the source ("body", "query", ...); the rest is the field's path within it.
    path = loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "cookie") else loc
    more = f" ({len(errors) - 1} more problem(s) in the request.)" if len(errors) > 1 else ""
    if not path:  # the body as a whole: absent, or not an object
        if etype in OWN_ERROR_TYPES:
            return APIError(400, msg + more, code=etype)
        if etype == "missing":
            return APIError(400, "The request needs a JSON object body.", code="invalid_body")
        hint = "" if _is_json(content_type) else " sent with `Content-Type: application/json`"
        return APIError(400, f"The request body must be a JSON object{hint}.", code="invalid_body")
    param = ".".join(str(p) for p in path)
    if etype in OWN_ERROR_TYPES:
        return APIError(400, msg + more, param=param, code=etype)
    if etype == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.{more}", param=param,
                        code="missing_required_parameter")
    code = "invalid_type" if etype.endswith("_type") or etype.endswith("_parsing") else "invalid_value"
    return APIError(400, f"Invalid value for '{param}': {msg}.{more}", param=param, code=code)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(list(exc.errors()), request.headers.get("content-type")).to_response()


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.to_response()


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        err = APIError(404, f"Invalid URL ({request.method} {request.url.path}).", code="not_found")
    elif status == 405:
        err = APIError(405, f"Method {request.method} is not allowed for {request.url.path}.",
                       code="method_not_allowed")
    elif status == 400 and exc.__cause__ is not None:
        # FastAPI raises a bare 400 when json.loads fails on something other than syntax: a body that is not
        # UTF-8, or nesting deep enough to exhaust the recursion limit.
        err = APIError(400, "The request body could not be parsed as UTF-8 JSON.", code="invalid_json")
    else:
        err = APIError(status, str(exc.detail))
    err.headers.update(exc.headers or {})
    return err.to_response()


class _InternalErrorMiddleware:
    """Anything no handler took becomes a 500 with a generic OpenAI body (the traceback goes to the log, not the
    client). A pure ASGI middleware rather than an ``Exception`` handler, which Starlette re-raises after
    responding, so every failure would be logged twice."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:  # too late for an error response: let the server drop the connection
                raise
            await send_error(send, APIError(500, "The server had an error while processing your request.",
                                            code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` can produce an OpenAI error body. Call before the app starts serving."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_middleware(_InternalErrorMiddleware)


# -- raw ASGI helpers --------------------------------------------------------------------------------------------
async def send_error(send, err: APIError, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Send ``err`` as a complete response through an ASGI ``send``."""
    payload = json.dumps(err.to_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers + list(extra_headers)})
    await send({"type": "http.response.body", "body": payload})


class _BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """Reject request bodies over ``max_bytes`` with a 413, by ``Content-Length`` before reading anything, or by
    counting as a chunked body streams in.

    When a streamed body overflows, reading it raises inside the app, which may turn that into a response of its
    own (FastAPI makes it a 400); that response is dropped and the 413 sent in its place.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body exceeds the limit of {self.max_bytes} bytes.",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.strip().isdigit() and int(value) > self.max_bytes:
                return await send_error(send, self._too_large(), [(b"connection", b"close")])

        received, exceeded, started = 0, False, False

        async def limited_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if exceeded:  # the app reacting to the overflow; the 413 below replaces it
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not exceeded:
                raise
        if exceeded and not started:
            await send_error(send, self._too_large(), [(b"connection", b"close")])
