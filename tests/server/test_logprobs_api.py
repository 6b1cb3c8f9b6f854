"""Log probabilities and the shaping fields through the chat API: token strings and bytes (every id of the real
tokenizer), the entries each response or chunk carries (held back with text the detokenizer or a stop string holds,
none past a stop), one list per choice, OpenAI's chat shape, the shaping fields the worker gets and `logit_bias`
outside the vocabulary. The completions side is in test_logprobs_completions_api.py, the real servers in
test_logprobs_e2e.py.

The shaping tests run the real app against a scripted worker (tests/server/scripted.py) that answers with the real
tokenizer's ids, so the partial UTF-8 characters of byte-level BPE are exercised.
"""
from __future__ import annotations

import pytest

from server.api.logprobs import TokenText
from server.worker import messages as m
from tests.server.scripted import (CHAT, MODEL, REPLY, VOCAB, ScriptWorker, call, chunk_entries, logprob_of,
                                   make_client, split)


# -- token strings and bytes -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts(tokenizer) -> TokenText:
    return TokenText(tokenizer)


def test_every_token_id_bytes_decode_like_the_tokenizer(tokenizer, texts):
    """Each id alone, and the whole vocabulary as runs of consecutive ids: the tokens' bytes, concatenated and
    decoded, are the tokenizer's own decoding (U+FFFD where bytes do not form a character)."""
    vocab = len(tokenizer)
    assert vocab == VOCAB
    partial = 0
    for t in range(vocab):
        b = texts.bytes(t)
        assert b and texts.text(t) == tokenizer.decode([t], skip_special_tokens=False), t
        partial += "\ufffd" in texts.text(t)
    assert partial > 100  # byte-level BPE: many tokens hold part of a character
    for start in range(0, vocab, 512):
        ids = list(range(start, min(start + 512, vocab)))
        joined = b"".join(texts.bytes(t) for t in ids).decode("utf-8", errors="replace")
        assert joined == tokenizer.decode(ids, skip_special_tokens=False), start


@pytest.mark.parametrize("text", [REPLY, "😀😀🎉", "Ünïcödé — ∑ 𝔘 ﷺ", " \t\n  x", "<|im_end|> after a special"])
def test_token_bytes_rebuild_the_utf8_text(tokenizer, texts, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(texts.bytes(t) for t in ids) == text.encode("utf-8")


def test_a_partial_character_has_exact_bytes(tokenizer, texts):
    ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1 and all(texts.text(t) == "\ufffd" for t in ids)
    assert [list(texts.bytes(t)) for t in ids] == [[0xF0, 0x9F], [0x98], [0x80]]


# -- chat completions: the entries and their chunks --------------------------------------------------------------
@pytest.fixture(scope="module")
def reply_ids(tokenizer) -> list[int]:
    ids = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 10
    return ids


@pytest.mark.parametrize("sizes", [[1] * 40, [3, 1, 4, 1, 5], [100]], ids=["one-per-step", "mixed", "one-message"])
def test_chat_entries_go_out_with_their_text(tokenizer, texts, reply_ids, sizes):
    """Non-streamed: one entry per token, in OpenAI's shape. Streamed: the same entries, each in the chunk whose text
    completes its token (the bytes of a chunk's entries are exactly its text's), however the tokens arrive."""
    worker = ScriptWorker(split(reply_ids, sizes))
    with make_client(worker, tokenizer) as c:
        full = call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3})
        events = call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, stream=True)
    choice = full["choices"][0]
    assert choice["message"]["content"] == REPLY and full["usage"]["completion_tokens"] == len(reply_ids)
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None and len(content) == len(reply_ids)
    for pos, (t, e) in enumerate(zip(reply_ids, content)):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["token"] == texts.text(t) and bytes(e["bytes"]) == texts.bytes(t)
        assert e["logprob"] == pytest.approx(logprob_of(t, pos), abs=0)
        assert [x["token"] for x in e["top_logprobs"]] == [texts.text((t + j) % VOCAB) for j in range(3)]
        assert [x["logprob"] for x in e["top_logprobs"]] == [e["logprob"] - j for j in range(3)]
        assert all(set(x) == {"token", "logprob", "bytes"} for x in e["top_logprobs"])
    assert b"".join(bytes(e["bytes"]) for e in content) == REPLY.encode()

    streamed = chunk_entries(events)
    assert [e for _, es in streamed for e in es] == content
    assert_never_ahead(streamed)
    finish = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["logprobs"] is None
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["choices"][0]["logprobs"] is None


def test_a_split_character_waits_for_its_last_byte(tokenizer, reply_ids):
    """Streamed one token per step: " 😀" is two tokens, " " and the emoji's first three bytes, then its last byte.
    The space goes out at once, but the first token's entry waits for the second and goes out with the emoji."""
    assert len(tokenizer(" 😀", add_special_tokens=False)["input_ids"]) == 2
    worker = ScriptWorker([[t] for t in reply_ids])
    with make_client(worker, tokenizer) as c:
        streamed = chunk_entries(call(c, "/v1/chat/completions", {**CHAT, "logprobs": True}, stream=True))
    at = next(i for i, (text, _) in enumerate(streamed) if "😀" in text)
    assert [bytes(e["bytes"]) for e in streamed[at][1]] == [" 😀".encode()[:4], " 😀".encode()[4:]]
    assert streamed[at - 1] == (" ", [])
    assert streamed[at - 2][0] == " Hi" and [e["token"] for e in streamed[at - 2][1]] == [" Hi"]
    assert all(e["top_logprobs"] == [] for _, es in streamed for e in es)  # no top_logprobs: none listed


def assert_never_ahead(streamed: list[tuple[str, list]]) -> None:
    """A chunk carries the tokens whose last byte its text completes: the entries sent are never ahead of the text
    sent, and behind it only by a token that ends inside a character."""
    text, sent = b"", b""
    for piece, es in streamed:
        text += piece.encode()
        sent += b"".join(bytes(e["bytes"]) for e in es)
        assert text.startswith(sent) and len(text) - len(sent) < 4, (piece, es)


@pytest.mark.parametrize("sizes", [[1] * 40, [100]], ids=["one-per-step", "one-message"])
@pytest.mark.parametrize("stream", [False, True])
def test_no_entries_past_a_stop_string(tokenizer, texts, reply_ids, stream, sizes):
    """The token that completes a stop string is the last with an entry (its text is cut), even when later tokens
    arrived with it; completion_tokens counts the same tokens."""
    stop = "ere"  # inside " there"
    cut = next(i for i in range(1, len(reply_ids) + 1) if stop in tokenizer.decode(reply_ids[:i]))
    worker = ScriptWorker(split(reply_ids, sizes))
    with make_client(worker, tokenizer) as c:
        body = {**CHAT, "logprobs": True, "stop": [stop], "stream_options": {"include_usage": True}} if stream \
            else {**CHAT, "logprobs": True, "stop": [stop]}
        out = call(c, "/v1/chat/completions", body, stream=stream)
    if stream:
        pairs = chunk_entries(out)
        text, content = "".join(t for t, _ in pairs), [e for _, es in pairs for e in es]
        usage = out[-1]["usage"]
        assert_never_ahead(pairs[:-1])  # the last chunk: cut at the stop string, with its token's entry
    else:
        text, content, usage = (out["choices"][0]["message"]["content"], out["choices"][0]["logprobs"]["content"],
                                out["usage"])
    assert text == REPLY[:REPLY.index(stop)]
    assert [e["token"] for e in content] == [texts.text(t) for t in reply_ids[:cut]]
    assert usage["completion_tokens"] == cut


def test_text_held_for_a_possible_stop_string_holds_its_entries(tokenizer, reply_ids):
    """" there" might begin the stop string " there!" until "," arrives: its entry waits with its text."""
    worker = ScriptWorker([[t] for t in reply_ids])
    with make_client(worker, tokenizer) as c:
        pairs = chunk_entries(call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "stop": [" there!"]},
                                   stream=True))
    assert "".join(t for t, _ in pairs) == REPLY
    assert_never_ahead(pairs)
    assert [e["token"] for e in next(es for t, es in pairs if " there" in t)] == [" there", ","]


def test_each_choice_has_its_own_entries(tokenizer, texts, reply_ids):
    """n = 3, streamed (chunks interleaved, each naming its choice) or not: every choice lists its own tokens."""
    worker = ScriptWorker(split(reply_ids, [1, 2, 3, 50]))
    with make_client(worker, tokenizer) as c:
        full = call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "n": 3})
        events = call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "n": 3}, stream=True)
    want = [texts.text(t) for t in reply_ids]
    assert [[e["token"] for e in ch["logprobs"]["content"]] for ch in full["choices"]] == [want] * 3
    streamed = [[] for _ in range(3)]
    for e in events:
        for ch in e["choices"]:
            if ch["logprobs"] is not None:
                streamed[ch["index"]] += [x["token"] for x in ch["logprobs"]["content"]]
    assert streamed == [want] * 3


def test_chat_without_logprobs_has_null_logprobs(tokenizer, reply_ids):
    worker = ScriptWorker(split(reply_ids, [2, 2, 50]))
    with make_client(worker, tokenizer) as c:
        full = call(c, "/v1/chat/completions", CHAT)
        events = call(c, "/v1/chat/completions", {**CHAT, "logprobs": False}, stream=True)
    assert full["choices"][0]["logprobs"] is None
    assert all(ch["logprobs"] is None for e in events for ch in e["choices"])
    assert [g.logprobs for g in worker.generates] == [None, None]


def test_the_worker_gets_every_shaping_field(tokenizer, reply_ids):
    worker = ScriptWorker([reply_ids])
    with make_client(worker, tokenizer) as c:
        call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20, "min_p": 0.05,
                                         "presence_penalty": -2, "frequency_penalty": 1.5, "repetition_penalty": 1.1,
                                         "logit_bias": {"0": -100, "49151": 100, "17": 0.5}})
        call(c, "/v1/completions", {"prompt": "a b", "max_tokens": 2, "logprobs": 0})
        call(c, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 5, "echo": True})
        call(c, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "echo": True})
    chat, plain, echoed, echo_only = worker.generates
    assert (chat.min_p, chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (0.05, -2.0, 1.5,
                                                                                                     1.1)
    assert chat.logit_bias == {0: -100.0, 49151: 100.0, 17: 0.5}
    assert (chat.logprobs, chat.prompt_logprobs) == (20, None)
    assert (plain.logprobs, plain.prompt_logprobs, plain.logit_bias, plain.repetition_penalty) == (0, None, {}, 1.0)
    assert (echoed.logprobs, echoed.prompt_logprobs) == (5, 5)
    assert (echo_only.logprobs, echo_only.prompt_logprobs) == (None, None)
    # the wire carries them: a round trip through the worker's decoder keeps every field
    assert m.decode_to_worker(m.encode(chat)) == chat


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", {"prompt": "hi", "max_tokens": 2})])
@pytest.mark.parametrize("bias", [{"49152": 1}, {"1": 1, "999999": -1}, {"2147483647": 0}])
def test_logit_bias_outside_the_vocabulary_is_400(tokenizer, path, body, bias):
    worker = ScriptWorker([[5]])
    with make_client(worker, tokenizer) as c:
        r = c.post(path, json={"model": MODEL, **body, "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and str(VOCAB) in err["message"], err
    assert worker.generates == []
