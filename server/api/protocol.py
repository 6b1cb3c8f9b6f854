"""OpenAI request shapes (pydantic v2) and the mapping from a request to internal sampling parameters.

Requests are validated strictly: numbers are never coerced from strings or booleans, floats must be finite, and no
string may contain NUL or a lone surrogate (neither survives tokenization). A parameter the server cannot honour
exactly is rejected with an error naming it rather than silently dropped, since dropping it would change the result
the client asked for; unknown extra fields are ignored, as OpenAI's own server does. An explicit ``null`` for a
sampling knob means "the default", which is how the OpenAI API documents them.

Every validation error raised here carries the offending field in its location, so the HTTP layer can report it as
the OpenAI ``param``. Our own errors use two pydantic error types, ``unsupported_parameter`` and ``invalid_value``,
whose messages are complete sentences.

The chat turns a request carries are in server.api.chat_messages, the strict base model, the error types and the
string check in server.api.validation, the response of /v1/models in server.api.responses.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Callable

from pydantic import StrictBool, AfterValidator, Field, ValidationInfo, field_validator, model_validator

from server.api.chat_messages import ChatMessage
from server.api.structured import (FieldError, ToolChoice, parse_function_call, parse_functions,
                                   parse_response_format, parse_tool_choice, parse_tools)
from server.api.tools import HERMES, CallSyntax, ToolPlan, render_messages
from server.api.validation import SafeStr, _clean_text, _field_error, _invalid, _Request, _unsupported

MAX_STOPS = 4
MAX_STOP_CHARS = 256
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds travel to the worker as msgpack int64
MAX_N = 128  # choices per request, OpenAI's limit (the server's KV slots may set a lower one: routes.py)
MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
MAX_TOP_LOGPROBS = 20  # chat `top_logprobs`, OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # completions `logprobs`, OpenAI's limit
# A repetition penalty divides (or multiplies) a logit by the factor: 1e6 either way already saturates any logit, and
# much further float32 breaks down (5e-324 is 0 there: a division by zero, infinite logits).
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")  # a canonical decimal id, at most 10 digits (int32)

# Fields accepted only at a value that leaves the result unchanged: name -> (is that value, why not otherwise).
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v is None or v == 1, "only best_of=1 is accepted"),
    "suffix": (lambda v: v is None or v == "", "insertion is not implemented"),
}

# The structured-output and tool fields, each with its parser (server.api.structured).
_STRUCTURED = {"response_format": parse_response_format, "tools": parse_tools, "functions": parse_functions,
               "tool_choice": parse_tool_choice, "function_call": parse_function_call}


def _structured(v: Any, info: ValidationInfo) -> Any:
    """A structured-output or tool field through its parser; its errors name the field."""
    try:
        return _STRUCTURED[info.field_name](v)
    except FieldError as e:
        raise _invalid(str(e)) from None


CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS), AfterValidator(_clean_text)]
TokenLimit = Annotated[int, Field(ge=0, le=INT32_MAX)]  # 0 only with completions' echo: _SamplingRequest._limits
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class StreamOptions(_Request):
    include_usage: bool = False

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v


class _SamplingRequest(_Request):
    """The fields chat and text completions share."""

    model: SafeStr
    max_tokens: TokenLimit | None = None
    max_completion_tokens: TokenLimit | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = -1  # extension: -1 or 0 = off
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.0  # extension (as in vLLM)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # extension (as in vLLM), over prompt and generated tokens
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                               allow_inf_nan=False)] = 1.0
    logit_bias: dict[int, float] = {}
    ignore_eos: StrictBool = False  # extension (as in vLLM): keep generating past end-of-sequence, for benchmarks
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: SafeStr | None = None
    # extension (as in vLLM): requests reuse cached prompt KV only with requests of the same API key and salt
    cache_salt: CacheSalt | None = None

    @field_validator("temperature", "top_p", "top_k", "n", "stream", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_biases(cls, v: Any) -> Any:
        """Token id strings ("123": JSON object keys are strings) to numbers in [-100, 100]. Keys are canonical
        decimals, so no two spell the same id; whether an id is inside the vocabulary the route checks."""
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise _invalid("`logit_bias` must be an object mapping token ids to numbers.")
        if len(v) > MAX_LOGIT_BIAS:
            raise _invalid(f"`logit_bias` accepts at most {MAX_LOGIT_BIAS} tokens; it has {len(v)}.")
        biases = {}
        for key, bias in v.items():
            shown = repr(key)[:24]
            if not isinstance(key, str) or not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
                raise _invalid(f"`logit_bias` keys must be token ids written as decimal integers (\"123\"); got "
                               f"{shown}.")
            if type(bias) not in (int, float) or not -100 <= bias <= 100:  # NaN compares false
                raise _invalid(f"`logit_bias` values must be numbers from -100 to 100; token {key} has "
                               f"{repr(bias)[:24]}.")
            biases[int(key)] = float(bias)
        return biases

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

    @model_validator(mode="after")
    def _limits(self) -> "_SamplingRequest":
        """A limit of 0 tokens asks for no completion: only completions' `echo` makes that a request (it scores
        the prompt, with `logprobs`)."""
        for name in ("max_tokens", "max_completion_tokens"):
            if getattr(self, name) == 0 and not self._prompt_only_allowed():
                raise _field_error(name, f"`{name}` must be at least 1 (0 is accepted only by completions with "
                                   "`echo`, to return the prompt and its log probabilities).", 0)
        return self

    def _prompt_only_allowed(self) -> bool:
        """Whether a limit of 0 tokens is a request (completions' `echo`)."""
        return False

    @model_validator(mode="after")
    def _no_stop_with_a_grammar(self) -> "_SamplingRequest":
        """Stop strings are matched on the generated text, grammar-constrained or not: one could cut a JSON answer
        or a tool call short and return it as finished. So `stop` is refused with any output a grammar constrains
        (under tool_choice 'auto' too, where a call may follow free text); the grammar ends such output itself."""
        if self.stop:
            what = self._grammar_fields()
            if what is not None:
                raise _field_error("stop", f"`stop` cannot be used with {what}: a stop string could cut the "
                                   "grammar-constrained output short and return it as finished. Send the request "
                                   "without `stop` (the output ends when the grammar is complete).", self.stop)
        return self

    def _grammar_fields(self) -> str | None:
        """The fields whose grammar constrains the output, in words (None: free text)."""
        fmt = getattr(self, "response_format", None)
        if fmt is not None and fmt.constrained:
            return f"`response_format` of type '{fmt.type}'"
        return None

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
    logprobs: bool = False  # each generated token's log probability
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # and the k most likely there
    response_format: Any = None  # structured.ResponseFormat once validated
    tools: Any = None  # list[structured.ToolSpec]
    tool_choice: Any = None  # structured.ToolChoice
    parallel_tool_calls: bool = True
    functions: Any = None  # legacy: list[structured.ToolSpec]
    function_call: Any = None  # legacy: structured.ToolChoice

    @field_validator(*_STRUCTURED)
    @classmethod
    def _structured_fields(cls, v: Any, info: ValidationInfo) -> Any:
        return _structured(v, info)

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _null_is_true(cls, v: Any) -> Any:
        return True if v is None else v

    @model_validator(mode="after")
    def _tool_fields_agree(self) -> "ChatCompletionRequest":
        """`tools` with `tool_choice`, or legacy `functions` with `function_call`, not a mix; a named function must be
        one of them, and 'required' or a named one needs tools."""
        if self.functions is not None and self.tools is not None:
            raise _field_error("functions", "Send `tools` or the legacy `functions`, not both.", None)
        if self.function_call is not None and self.tool_choice is not None:
            raise _field_error("function_call", "Send `tool_choice` or the legacy `function_call`, not both.", None)
        if self.tools is not None and self.function_call is not None:
            raise _field_error("function_call", "With `tools`, send `tool_choice` (`function_call` goes with the "
                               "legacy `functions`).", None)
        legacy = self.functions is not None or (self.tools is None and self.function_call is not None)
        field = "function_call" if legacy else "tool_choice"
        tools = (self.functions if legacy else self.tools) or []
        choice = self.function_call if legacy else self.tool_choice
        if choice is not None and choice.mode in ("required", "named") and not tools:
            raise _field_error(field, f"`{field}` asks for a function call, but the request has no "
                               f"{'functions' if legacy else 'tools'}.", None)
        if choice is not None and choice.mode == "named" and choice.name not in {t.name for t in tools}:
            raise _field_error(field, f"`{field}` names the function '{choice.name[:64]}', which is not among the "
                               f"request's {'functions' if legacy else 'tools'}.", None)
        return self

    def _grammar_fields(self) -> str | None:
        plan = self.tool_plan()
        if plan is not None and plan.active:
            return ("`functions` (unless `function_call` is 'none')" if plan.legacy
                    else "`tools` (unless `tool_choice` is 'none')")
        return super()._grammar_fields()

    def tool_plan(self, syntax: CallSyntax = HERMES) -> ToolPlan | None:
        """The request's tools as one plan (legacy `functions` mapped onto tools) in the model's call ``syntax``, or
        None without any."""
        legacy = self.functions is not None
        tools = self.functions if legacy else self.tools
        if not tools:
            return None
        choice = (self.function_call if legacy else self.tool_choice) or ToolChoice("auto")
        return ToolPlan(list(tools), choice, parallel=self.parallel_tool_calls and not legacy, legacy=legacy,
                        syntax=syntax)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("logprobs") is False:  # absent from data: `logprobs` failed itself
            raise _invalid("`top_logprobs` needs `logprobs` set to true.")
        return v

    def template_messages(self, knows_tools: bool = False) -> tuple[list[dict], list[dict] | None]:
        """(the conversation as plain dicts, the ``tools`` argument) for ``tokenizer.apply_chat_template``: tools
        and earlier calls rendered as ``tools.render_messages`` says."""
        return render_messages(self.messages, self.tool_plan(), knows_tools)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt`` is a string or token ids; a batch of one (``["text"]`` or
    ``[[ids]]``) is unwrapped, larger batches are rejected."""

    prompt: str | list[int]
    # each generated token's log probability and the k most likely tokens there (0: the token's alone); with
    # `echo`, each prompt token's too
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False  # the reply's text starts with the prompt
    suffix: Any = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    response_format: Any = None  # extension (as in vLLM): structured.ResponseFormat once validated

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any, info: ValidationInfo) -> Any:
        return _structured(v, info)

    @field_validator("echo", mode="before")
    @classmethod
    def _null_is_false(cls, v: Any) -> Any:
        return False if v is None else v

    def _prompt_only_allowed(self) -> bool:
        return self.echo

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
    off, ``max_tokens`` None means "until a stop or the context limit". ``logprobs`` is how many of the most likely
    tokens to return beside each generated token's own log probability (None: none at all); ``prompt_logprobs`` the
    same for each prompt token (completions with ``echo``)."""
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    return {
        "max_tokens": req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        "temperature": float(req.temperature),
        "top_p": float(req.top_p),
        "top_k": max(req.top_k, 0),
        "min_p": float(req.min_p),
        "presence_penalty": float(req.presence_penalty),
        "frequency_penalty": float(req.frequency_penalty),
        "repetition_penalty": float(req.repetition_penalty),
        "logit_bias": dict(req.logit_bias),
        "seed": req.seed,
        "stop": stop,
        "ignore_eos": bool(req.ignore_eos),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
