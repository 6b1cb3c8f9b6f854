"""Log probabilities in OpenAI's response shapes, and the token strings and bytes they name.

A token is reported by its own bytes (what it adds to the output) and their text. Byte-level BPE splits a character
across tokens, so a token may hold part of one: its ``bytes`` are still exact, and its ``token`` string shows U+FFFD
for the incomplete part, as OpenAI's does; the bytes of a reply's tokens, concatenated, are the UTF-8 of its text.

OpenAI reports a token of probability 0 (log probability -inf, which JSON cannot carry) as -9999.0; so do we, for
anything below that floor.
"""
from __future__ import annotations

import json

from server.api.generation import TokenLogprob

LOGPROB_FLOOR = -9999.0


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the others (control
    characters, space, ...) for the characters from U+0100 on, in byte order. Byte-level BPE vocabularies spell
    their tokens in it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF = _byte_alphabet()


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer decodes with the byte-level decoder alone (GPT-2, Llama 3, SmolLM2, Qwen)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and json.loads(decoder.__getstate__()).get("type") == "ByteLevel"


class TokenText:
    """A token id's bytes and text. Byte-level BPE: the token's spelling mapped back through the byte alphabet, and
    an added token's (special or not) content as UTF-8, since those are decoded verbatim. Other tokenizers: the id
    decoded alone, exact for tokens that hold whole characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._token_bytes(token_id)
        return b

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self._byte_level:
            spelling = self.tokenizer.convert_ids_to_tokens(token_id)
            if all(c in _BYTE_OF for c in spelling):
                return bytes(_BYTE_OF[c] for c in spelling)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _value(logprob: float) -> float:
    """A log probability as JSON can carry it: -inf (and NaN, which compares false) at the floor."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _chat_token(texts: TokenText, token_id: int, logprob: float) -> dict:
    return {"token": texts.text(token_id), "logprob": _value(logprob), "bytes": list(texts.bytes(token_id))}


def chat_logprobs(entries: list[TokenLogprob], texts: TokenText) -> dict:
    """A chat choice's (or chunk's) ``logprobs``: ``content``, one object per token with its ``top_logprobs``."""
    return {"content": [{**_chat_token(texts, e.token_id, e.logprob),
                         "top_logprobs": [_chat_token(texts, t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def _top(texts: TokenText, e: TokenLogprob) -> dict[str, float] | None:
    """A completions ``top_logprobs`` entry: the most likely tokens' strings and log probabilities, then the chosen
    token's if it is not among them (OpenAI returns up to ``logprobs`` + 1). Tokens with the same string keep the
    likelier one's value."""
    if e.top is None:
        return None
    out: dict[str, float] = {}
    for t, lp in [*e.top, (e.token_id, e.logprob)]:
        out.setdefault(texts.text(t), _value(lp))
    return out


def completion_logprobs(entries: list[TokenLogprob], texts: TokenText) -> dict:
    """A text completion choice's (or chunk's) ``logprobs``: parallel lists, ``text_offset`` in the choice's text."""
    return {"tokens": [texts.text(e.token_id) for e in entries],
            "token_logprobs": [None if e.logprob is None else _value(e.logprob) for e in entries],
            "top_logprobs": [_top(texts, e) for e in entries],
            "text_offset": [e.offset for e in entries]}
