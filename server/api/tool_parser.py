"""A reply under a tool plan parsed back into OpenAI's ``tool_calls`` (or legacy ``function_call``): the streaming
parser (text that could still begin ``<tool_call>`` is held back, as stop strings are) and one choice's reply,
streamed as deltas or as the whole message (``server.api.tools``: the call format)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.api.structured import dumps
from server.api.tools import END, HERMES, TRIGGER, CallSyntax, ToolPlan


def _head(key: str) -> re.Pattern:
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + key + r'"\s*:\s*', re.S)


CANONICAL_HEAD = '{"name": "'  # how the call grammar begins a call object


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

    A named syntax (Mistral's v11 ``[TOOL_CALLS]NAME[ARGS]{...}``): the name is the text up to the marker, the call
    ends with its arguments' JSON value, and only a trigger starts another.

    A ``syntax`` whose calls are the whole reply (Llama 3's JSON, ``at_start``): a reply whose first non-blank
    character is ``{`` and that begins as the call grammar begins a call is one call (``{"name": ..., "parameters":
    ...}``); any other reply is content, all of it.
    """

    def __init__(self, single: bool = False, syntax: CallSyntax = HERMES):
        self.single = single
        self.syntax = syntax
        self._head_re = _head(syntax.args_key)
        self.calls: list[ParsedCall] = []
        # content | head | args | tail | between | skip (a block past the one call); Llama 3: text (a reply with no
        # call) | skip_all (after its call); a list syntax: open (before its "[") | after (between its calls)
        self._phase = "content"
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
        if self._phase in ("content", "text"):
            self._content(events, self._buf)
        elif self._phase in ("head", "open", "name") and not self.calls:
            self._content(events, self._held_ws + self.syntax.trigger + self._block + self._buf)
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
        if self._phase == "text" or (self._phase == "content" and self.syntax.at_start):
            return self._at_start_content(events)
        trigger = self.syntax.trigger
        if self._phase in ("content", "between"):
            at = buf.find(trigger)
            if at < 0:
                keep = _partial_suffix(buf, trigger)
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
            self._buf, self._block = buf[at + len(trigger):], ""
            self._phase = "open" if self.syntax.opening else "name" if self.syntax.args_marker else "head"
            if self.single and self.calls:
                self._phase = "skip_all" if self.syntax.args_marker else "skip"
            return True
        if self._phase == "name":  # a named syntax (Mistral v11): the function's name, up to the marker
            at = buf.find(self.syntax.args_marker)
            if at < 0:
                return False
            call = ParsedCall(self.syntax.new_call_id(), buf[:at].strip())
            self.calls.append(call)
            events.append(("call", len(self.calls) - 1, call.id, call.name))
            self._phase, self._scanner = "args", _ValueScanner()
            self._buf = buf[at + len(self.syntax.args_marker):]
            return True
        if self._phase == "open":  # a list syntax: blanks, then the list's "["
            rest = buf.lstrip()
            if not rest:
                return False
            if rest[0] == "[":
                self._buf, self._phase = rest[1:], "head"
            else:  # no list after the trigger: the text as it came
                self._content(events, self._held_ws + trigger + buf)
                self._buf, self._phase = "", "content"
            return True
        if self._phase == "after":  # a list syntax, after a call: ", " and the next call, or "]"
            rest = buf.lstrip()
            if not rest:
                return False
            if rest[0] == "," and not self.single:
                self._buf, self._block, self._phase = rest[1:], "", "head"
            else:
                self._buf, self._phase = "", "skip_all"
            return True
        if self._phase == "skip_all":  # after Llama 3's one call: nothing more is read
            self._buf = ""
            return False
        if self._phase == "skip":  # a block after the one call allowed: wait for its end, then ignore text
            at = buf.find(END)
            self._buf = "" if at < 0 else buf[at + len(END):]
            if at >= 0:
                self._phase = "between"
            return at >= 0
        if self._phase == "head":
            self._block += buf
            self._buf = ""
            if self.syntax.at_start and not self.calls and not _may_begin(self._block, CANONICAL_HEAD):
                self._phase, self._buf, self._block = "text", self._held_ws + self._block, ""
                return True
            m = self._head_re.match(self._block)
            if m is not None:
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = m.group(1)
                call = ParsedCall(self.syntax.new_call_id(), name)
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
            if self._scanner.done:  # a named syntax's call ends with its arguments
                self._phase = "between" if self.syntax.args_marker else "tail"
                return True
            return False
        if self._phase == "tail":  # the call's closing "}", and in the Hermes syntax END
            if self.syntax.trigger != TRIGGER:
                at = buf.find("}")
                if at < 0:
                    return False
                self._buf, self._phase = buf[at + 1:], ("after" if self.syntax.opening else "skip_all")
                return True
            at = buf.find(END)
            if at < 0:
                return False
            self._buf, self._phase = buf[at + len(END):], "between"
            return True
        return False

    def _at_start_content(self, events: list[tuple]) -> bool:
        """Content of a syntax whose calls are the whole reply: until the first non-blank character, hold; a ``{``
        opens the call; anything else makes the whole reply content (trailing whitespace held, as always)."""
        buf = self._buf
        if self._phase == "content":
            stripped = buf.lstrip()
            if not stripped:
                return False
            if stripped[0] == "{":
                self._held_ws, self._block = buf[:len(buf) - len(stripped)], ""
                self._buf, self._phase = stripped, "head"
                return True
            self._phase = "text"
        out = buf.rstrip()
        self._content(events, out)
        self._buf = buf[len(out):]
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
            call = ParsedCall(self.syntax.new_call_id(), value["name"], args)
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


def _may_begin(text: str, prefix: str) -> bool:
    """Whether ``text`` and ``prefix`` agree as far as both go."""
    n = min(len(text), len(prefix))
    return text[:n] == prefix[:n]


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
        self.parser = ToolCallParser(single=self.plan.single, syntax=self.plan.syntax)

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
