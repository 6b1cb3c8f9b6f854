"""Tool calling in the API process: the plan a request's tools make and the tools rendered into the prompt; the
grammar that constrains the calls is ``server.api.tool_grammar``, and the generated text is parsed back into
OpenAI's ``tool_calls`` (or legacy ``function_call``), streamed or not, by ``server.api.tool_parser``.

The call format (``CallSyntax``) is the model's own, read from its chat template: Llama 3.x templates (which render
tools as JSON and calls as ``{"name": ..., "parameters": ...}``) get Llama 3's JSON calls, the whole reply one call::

    {"name": "NAME", "parameters": {...}}

every other model (Hermes, Qwen 2.5 / 3, SmolLM, a template without tools) the Hermes / Qwen blocks::

    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>

one block per call, blocks separated by a newline. For a chat template that knows no tools, the tool schemas go into
the system message (:func:`tools_prompt`, merged with the conversation's own system message or placed first), an
earlier assistant turn's calls are rendered as its text in the same format, and tool results as a user turn of
``<tool_response>...</tool_response>`` blocks (consecutive results in one turn).

The reply's ``content`` is the text before the first call, trailing whitespace removed (null when empty); text
between or after calls is not returned. Streamed, text that could still begin ``<tool_call>`` is held back, as stop
strings are.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, replace
from typing import Any

from server.api.detokenizer import special_ids
from server.api.structured import ToolChoice, ToolSpec, dumps

TRIGGER = "<tool_call>"
END = "</tool_call>"
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes its calls: ``name`` as vLLM's tool parsers call it; ``args_key`` the key of the arguments
    object; ``at_start``: a reply that calls is nothing but its calls, which begin at its first character (no
    trigger text: the JSON object's opening brace decides); ``parallel``: several calls in one reply.

    ``trigger`` opens the calls (Hermes: each call); a list syntax (``opening`` set: Mistral's ``[TOOL_CALLS] [``)
    writes its calls as one JSON list after it; a named syntax (``args_marker`` set: Mistral's v11 tokenizers,
    ``[TOOL_CALLS]name[ARGS]{...}``) writes each call as the trigger, the function's name, the marker and the
    arguments' JSON, calls back to back. ``trigger_id`` / ``args_marker_id``: the token the trigger / marker is, where
    the tokenizer has it as one special token (the grammar then names the token, and the reply's text keeps it).
    ``id_length``: the call ids' length where the template demands one (Mistral's: 9 letters or digits), else
    OpenAI's ``call_`` + 24."""

    name: str
    args_key: str = "arguments"
    at_start: bool = False
    parallel: bool = True
    trigger: str = "<tool_call>"
    opening: str = ""
    trigger_id: int | None = None
    id_length: int | None = None
    args_marker: str = ""
    args_marker_id: int | None = None

    def new_call_id(self) -> str:
        if self.id_length is not None:
            return "".join(secrets.choice(_ID_ALPHABET) for _ in range(self.id_length))
        return new_call_id()


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


HERMES = CallSyntax("hermes")
LLAMA3_JSON = CallSyntax("llama3_json", args_key="parameters", at_start=True, parallel=False, trigger="")
MISTRAL = CallSyntax("mistral", trigger="[TOOL_CALLS]", opening=" [", id_length=9)
MISTRAL_V11 = CallSyntax("mistral", trigger="[TOOL_CALLS]", id_length=9, args_marker="[ARGS]")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the functions, the choice, whether calls may come several at a time, and
    whether it came in the legacy ``functions`` shape (the reply is then one ``function_call``)."""

    tools: list[ToolSpec]
    choice: ToolChoice
    parallel: bool = True
    legacy: bool = False
    syntax: CallSyntax = HERMES

    @property
    def active(self) -> bool:
        """Whether the model is told about the tools and its reply parsed for calls (`tool_choice` not 'none')."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def single(self) -> bool:
        """At most one call: `parallel_tool_calls` false, a named function, the legacy shape, or a call syntax of
        one call per reply."""
        return not self.parallel or self.legacy or self.choice.mode == "named" or not self.syntax.parallel

    @property
    def kept_tokens(self) -> tuple[int, ...]:
        """Special tokens the reply's text keeps: the call trigger and the arguments' marker where they are tokens
        (Mistral's [TOOL_CALLS] and [ARGS])."""
        ids = (self.syntax.trigger_id, self.syntax.args_marker_id) if self.active else ()
        return tuple(i for i in ids if i is not None)

    def finish_reason(self, finish: str | None, calls: int) -> str | None:
        """OpenAI's finish reason: 'tool_calls' ('function_call' in the legacy shape) when the model ended on its
        own after calling, except for a named function ('stop', as OpenAI answers)."""
        if finish != "stop" or not calls or self.choice.mode == "named":
            return finish
        return "function_call" if self.legacy else "tool_calls"


# -- the prompt --------------------------------------------------------------------------------------------------
def _template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def template_knows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools itself (it reads a `tools` variable)."""
    template = _template(tokenizer)
    return template is not None and re.search(r"\btools\b", template) is not None


def template_call_syntax(tokenizer) -> CallSyntax:
    """The call syntax the model was trained on, as its chat template writes calls: a Mistral template (calls after
    ``[TOOL_CALLS]``) -> ``MISTRAL_V11`` where each call's name comes before ``[ARGS]``, else ``MISTRAL`` (with the
    template's own spacing before the list), with the token ids of the trigger and marker where they are special
    tokens; a Llama 3.x template (header tokens, calls rendered with a ``"parameters"`` key,
    no ``<tool_call>`` blocks) -> ``LLAMA3_JSON``; any other -> ``HERMES`` (also what the system message describes
    where the template knows no tools)."""
    template = _template(tokenizer)
    if template is None or not template_knows_tools(tokenizer) or "<tool_call>" in template:
        return HERMES
    if MISTRAL.trigger in template:
        specials = special_ids(tokenizer)

        def token(text: str) -> int | None:
            tid = tokenizer.convert_tokens_to_ids(text)
            return int(tid) if tid is not None and tid in specials else None

        if MISTRAL_V11.args_marker in template:
            return replace(MISTRAL_V11, trigger_id=token(MISTRAL_V11.trigger),
                           args_marker_id=token(MISTRAL_V11.args_marker))
        return replace(MISTRAL, opening=" [" if MISTRAL.trigger + " [" in template else "[",
                       trigger_id=token(MISTRAL.trigger))
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES


def tools_prompt(tools: list[ToolSpec]) -> str:
    """The system-message text that describes the tools and the call format, for templates that know no tools."""
    lines = "\n".join(dumps(t.openai()) for t in tools)
    return ("# Tools\n\n"
            "You can call the following functions. Their signatures, as JSON schemas, are inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> "
            "tags, one block per call:\n"
            f'{TRIGGER}\n{{"name": "FUNCTION_NAME", "arguments": {{ARGUMENTS}}}}\n{END}')


def _arguments_value(arguments: str) -> Any:
    """A call's arguments (a JSON string in OpenAI's messages) as the JSON value to render; text that is not JSON
    stays a string."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def render_call(name: str, arguments: str) -> str:
    return f"{TRIGGER}\n{dumps({'name': name, 'arguments': _arguments_value(arguments)})}\n{END}"


def render_messages(messages: list, plan: ToolPlan | None, knows_tools: bool) -> tuple[list[dict], list | None]:
    """(messages for ``apply_chat_template``, its ``tools`` argument or None) for a chat request's messages
    (``chat_messages.ChatMessage``). ``developer`` is a system message; the rest as the module docstring says."""
    tools = plan.tools if plan is not None and plan.active else []
    out: list[dict] = []
    for msg in messages:
        role, content = msg.role, msg.content or ""
        calls = [(c.function.name, c.function.arguments, c.id) for c in msg.tool_calls or ()]
        if msg.function_call is not None:
            calls.append((msg.function_call.name, msg.function_call.arguments, None))
        if role == "developer":
            role = "system"
        if knows_tools:
            item: dict[str, Any] = {"role": "tool" if role == "function" else role, "content": content}
            if calls:
                item["tool_calls"] = [{"type": "function", **({"id": i} if i else {}),
                                       "function": {"name": n, "arguments": _arguments_value(a)}}
                                      for n, a, i in calls]
            if role in ("tool", "function"):
                if msg.tool_call_id is not None:
                    item["tool_call_id"] = msg.tool_call_id
                if msg.name is not None:
                    item["name"] = msg.name
            out.append(item)
            continue
        if role in ("tool", "function"):
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_responses": True})
            continue
        if calls:
            content = "\n".join(([content] if content else []) + [render_call(n, a) for n, a, _ in calls])
        out.append({"role": role, "content": content})
    for item in out:
        item.pop("_responses", None)
    if knows_tools:
        return out, [t.openai() for t in tools] if tools else None
    if tools:
        text = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None
