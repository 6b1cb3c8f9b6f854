"""OpenAI request shapes and the models list (pydantic v2), and the mapping from a request to internal sampling
parameters.

Requests are validated strictly: numbers are never coerced from strings or booleans, floats must be finite, and no
string may contain NUL or a lone surrogate (neither survives tokenization). A parameter the server cannot honour
exactly is rejected with an error naming it rather than silently dropped, since dropping it would change the result
the client asked for; unknown extra fields are ignored, as OpenAI's own server does. An explicit ``null`` for a
sampling knob means "the default", which is how the OpenAI API documents them.

Every validation error raised here carries the offending field in its location, so the HTTP layer can report it as
the OpenAI ``param``. Our own errors use two pydantic error types, ``unsupported_parameter`` and ``invalid_value``,
whose messages are complete sentences.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Callable, Literal

from pydantic import StrictBool, AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

MAX_STOPS = 4
MAX_STOP_CHARS = 256
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds travel to the worker as msgpack int64
MAX_N = 128  # choices per request, OpenAI's limit (the server's KV slots may set a lower one: routes.py)
MAX_CACHE_SALT_CHARS = 256

UNSUPPORTED = "unsupported_parameter"
INVALID = "invalid_value"
OWN_ERROR_TYPES = frozenset({UNSUPPORTED, INVALID})


def _unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, f"Unsupported value for `{field}`: {why}.")


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError(INVALID, message)


def _clean_text(value: str, what: str = "Strings") -> str:
    if "\x00" in value:
        raise _invalid(f"{what} must not contain NUL characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a JSON "\ud800" escape
        raise _invalid(f"{what} must be valid Unicode (no lone surrogates).") from None
    return value


_NO_TOOLS = "this server does not implement tool or function calling"
# Fields accepted only at a value that leaves the result unchanged: name -> (is that value, why not otherwise).
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logprobs": (lambda v: not v, "log probabilities are not returned"),
    "top_logprobs": (lambda v: v is None, "log probabilities are not returned"),
    "tools": (lambda v: v is None or v == [], _NO_TOOLS),
    "functions": (lambda v: v is None or v == [], _NO_TOOLS),
    "tool_choice": (lambda v: v is None or v == "none", _NO_TOOLS),
    "function_call": (lambda v: v is None or v == "none", _NO_TOOLS),
    "presence_penalty": (lambda v: not v, "only 0 is accepted"),
    "frequency_penalty": (lambda v: not v, "only 0 is accepted"),
    "logit_bias": (lambda v: not v, "only an empty map is accepted"),
    "best_of": (lambda v: v is None or v == 1, "only best_of=1 is accepted"),
    "echo": (lambda v: not v, "the prompt is not echoed"),
    "suffix": (lambda v: v is None or v == "", "insertion is not implemented"),
}

SafeStr = Annotated[str, AfterValidator(_clean_text)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS), AfterValidator(_clean_text)]
PositiveInt32 = Annotated[int, Field(ge=1, le=INT32_MAX)]


# -- requests ----------------------------------------------------------------------------------------------------
class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v


class ChatMessage(_Request):
    """One turn. ``content`` may arrive as a string or a list of text parts; it is stored as one string (parts
    joined with a newline) because the chat template only takes text."""

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _content_text(cls, v: Any) -> str:
        if isinstance(v, str):
            return _clean_text(v, "Message content")
        if not isinstance(v, list):
            raise _invalid("Message content must be a string or a list of text parts.")
        texts = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = repr(part.get("type"))[:40] if isinstance(part, dict) else type(part).__name__
                raise PydanticCustomError(UNSUPPORTED, f"Content part {i} has type {kind}: only 'text' parts are "
                                          "supported by this server.")
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"Content part {i} needs a string `text`.")
            texts.append(_clean_text(text, "Message content"))
        return "\n".join(texts)


class _SamplingRequest(_Request):
    """The fields chat and text completions share."""

    model: SafeStr
    max_tokens: PositiveInt32 | None = None
    max_completion_tokens: PositiveInt32 | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = -1  # extension: -1 or 0 = off
    ignore_eos: StrictBool = False  # extension (as in vLLM): keep generating past end-of-sequence, for benchmarks
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: SafeStr | None = None
    # extension (as in vLLM): requests reuse cached prompt KV only with requests of the same API key and salt
    cache_salt: CacheSalt | None = None
    # Accepted only at their neutral values (see _NEUTRAL).
    logprobs: Any = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("temperature", "top_p", "top_k", "n", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and v != other:
            raise _invalid("`max_tokens` and `max_completion_tokens` disagree; send only one of them.")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, v: Any) -> Any:
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise _invalid("`stop` must be a string or a list of strings.")
        if len(items) > MAX_STOPS:
            raise _invalid(f"`stop` accepts at most {MAX_STOPS} strings.")
        for s in items:
            if not s or len(s) > MAX_STOP_CHARS:
                raise _invalid(f"Each stop string must have 1 to {MAX_STOP_CHARS} characters.")
            _clean_text(s, "Stop strings")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and info.data.get("stream") is not True:
            raise _invalid("`stream_options` is only allowed when `stream` is true.")
        return v

    @field_validator(*_NEUTRAL, check_fields=False)
    @classmethod
    def _neutral_only(cls, v: Any, info: ValidationInfo) -> Any:
        is_neutral, why = _NEUTRAL[info.field_name]
        if not is_neutral(v):
            raise _unsupported(info.field_name, why)
        return v

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, dict) or not isinstance(v.get("type"), str):
            raise _invalid("`response_format` must be an object with a string `type`.")
        if v["type"] != "text":
            raise _unsupported("response_format", "only type 'text' is accepted")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation as plain dicts, ready for ``tokenizer.apply_chat_template``."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt`` is a string or token ids; a batch of one (``["text"]`` or
    ``[[ids]]``) is unwrapped, larger batches are rejected."""

    prompt: str | list[int]
    echo: Any = None
    suffix: Any = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise _unsupported("prompt", "this server takes one prompt per request, not a batch")
            v = v[0]
        if isinstance(v, str):
            if not v:
                raise _invalid("`prompt` must not be empty.")
            return _clean_text(v, "The prompt")
        if not isinstance(v, list) or not v:
            raise _invalid("`prompt` must be a non-empty string or a non-empty list of token ids.")
        if not all(type(t) is int and 0 <= t <= INT32_MAX for t in v):
            raise _invalid("Token ids in `prompt` must be integers >= 0.")
        return v


def sampling_from(req: _SamplingRequest) -> dict[str, Any]:
    """The internal sampling parameters of a validated request. ``temperature`` 0 means greedy, ``top_k`` 0 means
    off, ``max_tokens`` None means "until a stop or the context limit"."""
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return {
        "max_tokens": req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        "temperature": float(req.temperature),
        "top_p": float(req.top_p),
        "top_k": max(req.top_k, 0),
        "seed": req.seed,
        "stop": stop,
        "ignore_eos": bool(req.ignore_eos),
    }


# -- responses ---------------------------------------------------------------------------------------------------
# Completions and chunks are built as plain dicts in routes.py (the e2e tests parse them with the openai client);
# only /v1/models uses a response model, which also documents it in the OpenAPI schema.
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
