"""The chat conversation as the client sends it (pydantic v2): one turn (``ChatMessage``), its content taken as one
string, and the calls an earlier assistant turn made (``ToolCall``, ``FunctionCall``), validated as strictly as the
requests that carry them (server.api.protocol).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.api.validation import UNSUPPORTED, SafeStr, _clean_text, _field_error, _invalid, _Request


def _text_content(v: Any) -> str:
    """Message content as one string: a string, or a list of text parts joined with a newline."""
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


def _arguments_text(v: Any) -> Any:
    """A call's `arguments`: a JSON string (OpenAI's shape); an object is taken as its JSON text."""
    if isinstance(v, dict):
        return json.dumps(v, ensure_ascii=False)
    return v


class FunctionCall(_Request):
    name: SafeStr
    arguments: SafeStr

    @field_validator("arguments", mode="before")
    @classmethod
    def _object_as_text(cls, v: Any) -> Any:
        return _arguments_text(v)


class ToolCall(_Request):
    """An earlier assistant turn's call, as the client sends it back."""

    id: SafeStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One turn. ``content`` may arrive as a string or a list of text parts; it is stored as one string (parts
    joined with a newline) because the chat template only takes text. An assistant turn may carry ``tool_calls``
    (or a legacy ``function_call``) with null content; a ``tool`` turn answers one call (``tool_call_id``), a legacy
    ``function`` turn one function (``name``); ``developer`` is a system turn."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | None = Field(default=None, validate_default=True)
    name: SafeStr | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    tool_call_id: SafeStr | None = Field(default=None, validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _content_text(cls, v: Any, info: ValidationInfo) -> str | None:
        if v is None:
            if info.data.get("role", "assistant") == "assistant":  # an assistant turn that only calls tools
                return None
            raise PydanticCustomError("missing", "Field required")
        return _text_content(v)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_turn_needs_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("role") == "tool":
            raise _invalid("A `tool` message needs the `tool_call_id` of the call it answers.")
        return v

    @model_validator(mode="after")
    def _calls_from_the_assistant(self) -> "ChatMessage":
        if (self.tool_calls or self.function_call is not None) and self.role != "assistant":
            raise _field_error("tool_calls" if self.tool_calls else "function_call",
                               "Only an `assistant` message may carry `tool_calls` or `function_call`.", None)
        if self.role == "function" and self.name is None:
            raise _field_error("name", "A `function` message needs the `name` of the function.", None)
        return self
