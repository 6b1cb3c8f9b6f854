"""Tool calling in the API process: the tools rendered into the prompt, the grammar that constrains the calls, and
the generated text parsed back into OpenAI's ``tool_calls`` (or legacy ``function_call``), streamed or not.

The call format, for every model (a template that knows tools renders their descriptions its own way; the calls are
the same)::

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
from dataclasses import dataclass, field
from typing import Any

from core.grammar import json_schema_lark
from server.api.structured import ResponseFormat, ToolChoice, ToolSpec, dumps

TRIGGER = "<tool_call>"
END = "</tool_call>"
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: the functions, the choice, whether calls may come several at a time, and
    whether it came in the legacy ``functions`` shape (the reply is then one ``function_call``)."""

    tools: list[ToolSpec]
    choice: ToolChoice
    parallel: bool = True
    legacy: bool = False

    @property
    def active(self) -> bool:
        """Whether the model is told about the tools and its reply parsed for calls (`tool_choice` not 'none')."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def single(self) -> bool:
        """At most one call: `parallel_tool_calls` false, a named function, or the legacy shape."""
        return not self.parallel or self.legacy or self.choice.mode == "named"

    def finish_reason(self, finish: str | None, calls: int) -> str | None:
        """OpenAI's finish reason: 'tool_calls' ('function_call' in the legacy shape) when the model ended on its
        own after calling, except for a named function ('stop', as OpenAI answers)."""
        if finish != "stop" or not calls or self.choice.mode == "named":
            return finish
        return "function_call" if self.legacy else "tool_calls"


# -- the prompt --------------------------------------------------------------------------------------------------
def template_knows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools itself (it reads a `tools` variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


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
    (``protocol.ChatMessage``). ``developer`` is a system message; the rest as the module docstring says."""
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


# -- the grammar -------------------------------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text)


def tool_grammar_lark(plan: ToolPlan, answer: ResponseFormat | None = None) -> str | None:
    """The Lark grammar (llguidance's dialect) of a reply under ``plan``; None when the tools constrain nothing.

    - named: exactly one call of that function, from the first token (the name is forced);
    - required: one call of any tool, then (parallel) more, each after a newline;
    - auto: free text until ``<tool_call>`` appears (a lazy trigger), then the call as above; or, with a JSON
      ``answer`` format, either that JSON or the calls from the first token.
    Arguments follow each function's ``parameters`` schema, with the compact separators of ``core.grammar``.
    """
    if not plan.active:
        return None
    tools = plan.tools
    if plan.choice.mode == "named":
        tools = [t for t in tools if t.name == plan.choice.name]
    rules = [f"body: {' | '.join(f'body_{i}' for i in range(len(tools)))}"]
    for i, t in enumerate(tools):
        head = '{"name": ' + dumps(t.name) + ', "arguments": '
        rules.append(f"body_{i}: {_lit(head)} args_{i} {_lit('}')}")
        rules.append(f"args_{i}: {json_schema_lark(t.arguments_schema())}")
    call = f'{_lit(TRIGGER + chr(10))} body {_lit(chr(10) + END)}'
    more = "" if plan.single else f' ({_lit(chr(10))} call)* {_lit(chr(10))}?'
    if plan.choice.mode in ("named", "required"):
        start = [f"start: call{more}"]
    elif answer is not None and answer.constrained:
        schema = None if answer.type == "json_object" else answer.schema
        start = [f"start: answer | call{more}",
                 f"answer: {json_schema_lark(schema)}"]
    else:
        start = [f"start: TEXT | first{more}",
                 f"first_hd[lazy]: TEXT {_lit(TRIGGER)}",
                 f'first: first_hd {_lit(chr(10))} body {_lit(chr(10) + END)}',
                 "TEXT: /(.|\\n)*/"]
    return "\n".join(["%llguidance {}", *start, f"call: {call}", *rules]) + "\n"


# -- parsing the reply -------------------------------------------------------------------------------------------
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.S)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


class _ValueScanner:
    """Finds where one JSON value ends in text that arrives in pieces (strings, escapes and nesting tracked)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False  # the value's first character was seen
        self.scalar = False   # a number or literal: it ends at a delimiter
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all of them unless it ended inside)."""
        for i, ch in enumerate(text):
            if not self.started:
                self.started = True
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self.in_string = True
                else:
                    self.scalar = True
                continue
            if self.scalar:
                if ch in ",}] \t\r\n":
                    self.done = True
                    return i
                continue
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallParser:
    """Generated text -> events, incrementally: ``("content", text)``, ``("call", index, id, name)`` when a call's
    name is complete, ``("args", index, text)`` for each piece of its arguments (their JSON text as generated).

    Text before the first ``<tool_call>`` is content; a possible start of the trigger, and trailing whitespace, is
    held until the next text decides. A block whose head is not ``{"name": "...", "arguments": `` is parsed whole
    when it closes (any key order), and returned as content when it is no call and no call came before it. In
    ``single`` mode, blocks after the first call are ignored.
    """

    def __init__(self, single: bool = False):
        self.single = single
        self.calls: list[ParsedCall] = []
        self._phase = "content"  # content | head | args | tail | between | skip (a block past the one call)
        self._buf = ""           # content: held text; head / tail / between: unprocessed text of the block
        self._held_ws = ""       # the whitespace held before a trigger (content again if the block is no call)
        self._block = ""         # the current block's text since the trigger (for a block that is no call)
        self._scanner: _ValueScanner | None = None

    def feed(self, text: str) -> list[tuple]:
        events: list[tuple] = []
        self._buf += text
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple]:
        """The events of the held text once generation ended (a call cut short keeps what it has)."""
        events: list[tuple] = []
        if self._phase == "content":
            self._content(events, self._buf)
        elif self._phase == "head" and not self.calls:
            self._content(events, self._held_ws + TRIGGER + self._block)
        self._buf = ""
        self._phase = "between"
        return events

    # -- internals
    def _content(self, events: list[tuple], text: str) -> None:
        if text:
            if events and events[-1][0] == "content":
                events[-1] = ("content", events[-1][1] + text)
            else:
                events.append(("content", text))

    def _step(self, events: list[tuple]) -> bool:
        """Process what the buffer allows; True when the phase changed and there may be more to do."""
        buf = self._buf
        if self._phase in ("content", "between"):
            at = buf.find(TRIGGER)
            if at < 0:
                keep = _partial_suffix(buf, TRIGGER)
                if self._phase == "content":
                    out = buf[:len(buf) - keep]
                    stripped = out.rstrip()
                    self._content(events, stripped)
                    self._buf = out[len(stripped):] + buf[len(buf) - keep:]
                else:
                    self._buf = buf[len(buf) - keep:]
                return False
            if self._phase == "content":
                before = buf[:at]
                stripped = before.rstrip()
                self._content(events, stripped)
                self._held_ws = before[len(stripped):]
            self._buf, self._block, self._phase = buf[at + len(TRIGGER):], "", "head"
            if self.single and self.calls:
                self._phase = "skip"
            return True
        if self._phase == "skip":  # a block after the one call allowed: wait for its end, then ignore text
            at = buf.find(END)
            self._buf = "" if at < 0 else buf[at + len(END):]
            if at >= 0:
                self._phase = "between"
            return at >= 0
        if self._phase == "head":
            self._block += buf
            self._buf = ""
            m = _HEAD.match(self._block)
            if m is not None:
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = m.group(1)
                call = ParsedCall(new_call_id(), name)
                self.calls.append(call)
                events.append(("call", len(self.calls) - 1, call.id, name))
                self._phase, self._scanner = "args", _ValueScanner()
                self._buf = self._block[m.end():]
                return True
            at = self._block.find(END)
            if at >= 0:
                self._whole_block(events, self._block[:at])
                self._buf, self._block = self._block[at + len(END):], ""
                return True
            return False
        if self._phase == "args":
            if not self._scanner.started:  # whitespace before the value (the head matched before it came)
                buf = buf.lstrip()
                if not buf:
                    self._buf = ""
                    return False
            n = self._scanner.feed(buf)
            piece = buf[:n]
            if piece:
                self.calls[-1].arguments += piece
                if events and events[-1][0] == "args" and events[-1][1] == len(self.calls) - 1:
                    events[-1] = ("args", events[-1][1], events[-1][2] + piece)
                else:
                    events.append(("args", len(self.calls) - 1, piece))
            self._buf = buf[n:]
            if self._scanner.done:
                self._phase = "tail"
                return True
            return False
        if self._phase == "tail":  # the call's closing "}" and END
            at = buf.find(END)
            if at < 0:
                return False
            self._buf, self._phase = buf[at + len(END):], "between"
            return True
        return False

    def _whole_block(self, events: list[tuple], block: str) -> None:
        """A closed block without the expected head: a call if it is a JSON object with a string `name` (and
        `arguments`, an object or its JSON text), else content when no call came before it."""
        value = None
        try:
            value = json.loads(block)
        except (ValueError, RecursionError):
            pass
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            args = value.get("arguments", value.get("parameters", {}))
            args = args if isinstance(args, str) else dumps(args)
            call = ParsedCall(new_call_id(), value["name"], args)
            self.calls.append(call)
            events.append(("call", len(self.calls) - 1, call.id, call.name))
            if args:
                events.append(("args", len(self.calls) - 1, args))
            self._phase = "between"
            return
        if not self.calls:
            self._content(events, self._held_ws + TRIGGER + block + END)
            self._phase = "content"
        else:
            self._phase = "between"


def _partial_suffix(text: str, word: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``word``."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


# -- replies -----------------------------------------------------------------------------------------------------
@dataclass
class ToolReply:
    """One choice's reply under a tool plan: stream deltas as the text arrives, or the whole message."""

    plan: ToolPlan
    parser: ToolCallParser = field(init=False)

    def __post_init__(self):
        self.parser = ToolCallParser(single=self.plan.single)

    def deltas(self, text: str, final: bool = False) -> list[dict]:
        """The chat deltas (``content`` / ``tool_calls`` or legacy ``function_call`` pieces) for newly generated
        ``text``; ``final`` once generation ended. A call's first delta has its id, type, name and empty arguments;
        the argument text follows in pieces."""
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        out: list[dict] = []
        for ev in events:
            if ev[0] == "content":
                out.append({"content": ev[1]})
            elif ev[0] == "call":
                if self.plan.legacy:
                    if ev[1] == 0:
                        out.append({"function_call": {"name": ev[3], "arguments": ""}})
                else:
                    out.append({"tool_calls": [{"index": ev[1], "id": ev[2], "type": "function",
                                                "function": {"name": ev[3], "arguments": ""}}]})
            elif self.plan.legacy:
                if ev[1] == 0:
                    out.append({"function_call": {"arguments": ev[2]}})
            else:
                out.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
        return out

    @property
    def calls(self) -> list[ParsedCall]:
        return self.parser.calls[:1] if self.plan.legacy else self.parser.calls

    def finish_reason(self, finish: str | None) -> str | None:
        return self.plan.finish_reason(finish, len(self.calls))

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """(the whole assistant message, finish reason) for a choice's text."""
        content = "".join(d.get("content", "") for d in self.deltas(text, final=True))
        calls = self.calls
        msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else content)}
        if calls and self.plan.legacy:
            msg["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return msg, self.finish_reason(finish)
