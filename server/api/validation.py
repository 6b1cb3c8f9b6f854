"""The shared pieces of the OpenAI request models (server.api.protocol, server.api.chat_messages): the strict base
model, the two pydantic error types of our own with the helpers that raise them, and the string check every text
field goes through.

Our own errors use two pydantic error types, ``unsupported_parameter`` (a parameter the server cannot honour exactly)
and ``invalid_value``, whose messages are complete sentences; the HTTP layer (server.api.errors) reports them with the
offending field as the OpenAI ``param``. A string must not contain NUL or a lone surrogate (neither survives
tokenization).
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

UNSUPPORTED = "unsupported_parameter"
INVALID = "invalid_value"
OWN_ERROR_TYPES = frozenset({UNSUPPORTED, INVALID})


def _unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, f"Unsupported value for `{field}`: {why}.")


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError(INVALID, message)


def _field_error(field: str, message: str, value: Any) -> ValidationError:
    """An `invalid_value` error located at `field`, for checks made after every field is validated (a model
    validator's own errors have no location)."""
    return ValidationError.from_exception_data(
        "request", [InitErrorDetails(type=_invalid(message), loc=(field,), input=value)])


def _clean_text(value: str, what: str = "Strings") -> str:
    if "\x00" in value:
        raise _invalid(f"{what} must not contain NUL characters.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, e.g. from a JSON "\ud800" escape
        raise _invalid(f"{what} must be valid Unicode (no lone surrogates).") from None
    return value


SafeStr = Annotated[str, AfterValidator(_clean_text)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
