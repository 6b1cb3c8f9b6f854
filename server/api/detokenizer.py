"""Streaming text out of token ids: incremental detokenization and stop-string matching.

Both are pure, synchronous and per-request; the API process owns one of each for every streamed choice.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turn token ids, arriving a few at a time, into text deltas.

    The concatenation of all :meth:`add` results and :meth:`finish` equals
    ``tokenizer.decode(all_ids, skip_special_tokens=...)`` for tokenizers whose decoding is local (byte-level BPE,
    SentencePiece), which covers the models we serve.

    Each call decodes only a short window of recent tokens, not the whole output: ``window`` starts at ``_start``
    and ``_emitted`` characters of its decoding have already been returned. The window keeps a few tokens of
    context before the new ones because some decoders render a token differently at the start of a sequence (a
    SentencePiece word marker loses its space there), so a window starting exactly at the new tokens would be wrong.

    A character split across tokens (byte-level BPE) decodes to U+FFFD until its last byte arrives, so trailing
    U+FFFD is held back; if the model really produced an invalid sequence at the very end, :meth:`finish` flushes it.
    """

    CONTEXT = 4  # tokens of context kept when the window slides
    SLIDE_AT = 16  # window length (tokens) from which it slides forward

    def __init__(self, tokenizer, skip_special_tokens: bool = True, keep: tuple[int, ...] = ()):
        """``keep``: special tokens whose text stays while the others are skipped (a tool-call trigger)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._keep = frozenset(keep)
        self._special = frozenset(special_ids(tokenizer)) - self._keep if self._keep else frozenset()
        # a fast tokenizer without transformers' space clean-up decodes straight through its Rust backend, which is
        # what tokenizer.decode calls after a few layers of argument handling (a third of this class's time per token)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = (backend.decode if backend is not None and callable(getattr(backend, "decode", None))
                                and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None)
        self._ids: list[int] = []
        self._start = 0  # index in _ids where the decode window begins
        self._emitted = 0  # characters of decode(_ids[_start:]) already returned
        self.holding = False  # whether the tokens so far end inside a character (its text is held back)

    def _decode(self, ids: list[int]) -> str:
        skip = self.skip_special_tokens
        if self._keep:  # the other special tokens dropped here, the kept ones decoded
            ids, skip = [i for i in ids if i not in self._special], False
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def add(self, token_ids: list[int]) -> str:
        """Append ``token_ids``; return the text that became final (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        text = self._decode(self._ids[self._start:])
        complete = text.rstrip(REPLACEMENT)
        self.holding = len(complete) < len(text)
        # The window's text before _emitted is stable: appending bytes only changes how the trailing incomplete
        # character decodes, and that part was never emitted.
        delta = complete[self._emitted:]
        self._emitted = max(self._emitted, len(complete))
        if len(complete) == len(text) and len(self._ids) - self._start >= self.SLIDE_AT:
            # Everything decoded is final: restart the window near the end. Its first tokens may decode to
            # garbage (a character cut in two), but only its length matters and later bytes cannot change it.
            self._start = len(self._ids) - self.CONTEXT
            self._emitted = len(self._decode(self._ids[self._start:]))
        return delta

    def finish(self) -> str:
        """The text still held back (an invalid byte sequence at the very end); call once, after the last add."""
        text = self._decode(self._ids[self._start:])
        delta = text[self._emitted:]
        self._emitted = len(text)
        self.holding = False
        return delta


def special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens: the named ones and every added token marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids |= {int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
            if getattr(t, "special", False)}
    return ids


class StopStringMatcher:
    """Cut a text stream at the first occurrence of any stop string, without ever emitting part of one.

    Text that might be the start of a stop string is held back until it is known not to be. The result does not
    depend on how the text is chunked: it is always the full text cut before the earliest-starting occurrence of
    any stop. So when one stop completes while a longer one that would start earlier is still possible, the
    matcher waits for more text before deciding.
    """

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(dict.fromkeys(stops))
        self._firsts = frozenset(s[0] for s in self.stops)
        self._held = ""
        self._offset = 0  # where `_held` starts in the whole text fed so far
        self.stopped = False
        self.end: int | None = None  # once stopped: the end of the stop string in the whole text fed

    def _pending_start(self, text: str, before: int) -> int:
        """The first index < ``before`` where ``text`` ends in a proper prefix of some stop, else ``before``."""
        longest = max(len(s) for s in self.stops)
        for i in range(max(0, len(text) - longest + 1), before):
            if text[i] in self._firsts:
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    return i
        return before

    def _first_match(self, text: str) -> int:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else -1

    def _stop_at(self, buf: str, match: int) -> None:
        # of the stops that start at `match`, the shortest is the one that completed first
        self.end = self._offset + match + min(len(s) for s in self.stops if buf.startswith(s, match))
        self._held, self.stopped = "", True

    def feed(self, text: str) -> tuple[str, bool]:
        """Add generated ``text``; return (text safe to emit now, whether a stop string was reached). After a stop,
        everything further is swallowed."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        match = self._first_match(buf)
        end = len(buf) if match < 0 else match
        hold = self._pending_start(buf, end)
        if match >= 0 and hold == match:  # nothing earlier can still turn into a stop
            self._stop_at(buf, match)
            return buf[:match], True
        self._held = buf[hold:]
        self._offset += hold
        return buf[:hold], False

    def finish(self) -> str:
        """The held-back text once generation ended; cut at a stop that completed while a longer, earlier-starting
        one was still possible (``stopped`` then becomes True)."""
        if self.stopped:
            return ""
        buf = self._held
        match = self._first_match(buf)
        if match >= 0:
            self._stop_at(buf, match)
            return buf[:match]
        self._held = ""
        self._offset += len(buf)
        return buf
