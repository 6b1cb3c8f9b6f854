"""Log probabilities, echo and the shaping fields through the API: token strings and bytes (every id of the real
tokenizer), the entries each response or chunk carries (held back with text the detokenizer or a stop string holds,
none past a stop), OpenAI's chat and completions shapes, echo and `max_tokens` 0, -inf as -9999.0; then real servers
with the official `openai` client (and LangChain's `ChatOpenAI`).

The shaping tests run the real app against a scripted worker that answers with the real tokenizer's ids, so the
partial UTF-8 characters of byte-level BPE are exercised.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from langchain_openai import ChatOpenAI
from openai import OpenAI

from server.api.app import ServerState, create_app
from server.api.logprobs import LOGPROB_FLOOR, TokenText
from server.config import config_from_dict
from server.metrics import Metrics
from server.worker import messages as m
from tests.server.conftest import ServerProcess, wait_balanced

MODEL = "scripted"
VOCAB = 49152
REPLY = " Hi 😀 there, naïve 中文!"  # an emoji and CJK characters split across byte-level tokens


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


# -- a scripted worker -------------------------------------------------------------------------------------------
def logprob_of(token: int, position: int) -> float:
    """The scripted log probability of `token` generated at `position`: distinct and < 0."""
    return -0.01 - ((token * 7 + position) % 97) / 10


def entry(token: int, position: int, k: int) -> m.Logprob:
    """The chosen token is the most likely, then ids above it, each 1 less likely."""
    lp = logprob_of(token, position)
    return m.Logprob(lp, [((token + j) % VOCAB, lp - j) for j in range(k)])


class ScriptWorker:
    """`WorkerClient`'s interface to the routes: answers each Generate at once with scripted Tokens messages (the
    ids of `messages`, one message each; the last finishes with `finish`), each token's log probability from
    `entry`, and the prompt's on the first message when asked. An abort is answered with Aborted."""

    def __init__(self, messages: list[list[int]], finish: str = "length", entry_of=entry):
        self.ready = m.Ready(MODEL, "none", 512, 4, VOCAB, "cpu", "float32")
        self.alive, self.dead, self.in_flight = True, False, 0
        self.messages, self.finish, self.entry_of = messages, finish, entry_of
        self.generates: list[m.Generate] = []
        self.aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue] = {}

    def attach(self, loop):
        pass

    def submit(self, req: m.Generate) -> asyncio.Queue:
        self.generates.append(req)
        q = self._queues[req.request_id] = asyncio.Queue()
        prompt = None
        if req.prompt_logprobs is not None:
            prompt = [None] + [self.entry_of(t, -i, req.prompt_logprobs) for i, t in enumerate(req.prompt_ids[1:])]
        messages = self.messages if req.max_tokens else [[]]
        position = 0
        for i, ids in enumerate(messages):
            lps = [] if req.logprobs is None else [self.entry_of(t, position + j, req.logprobs)
                                                   for j, t in enumerate(ids)]
            position += len(ids)
            last = i == len(messages) - 1
            q.put_nowait(m.Tokens(req.request_id, ids, finish_reason=self.finish if last else None,
                                  usage={"drafter": "none"} if last else None, logprobs=lps,
                                  prompt_logprobs=prompt if i == 0 else None))
        return q

    def abort(self, request_id: str, final: bool = False) -> None:
        self.aborts.append(request_id)
        if final:
            self._queues[request_id].put_nowait(m.Aborted(request_id, {"drafter": "none"}))


def make_client(worker: ScriptWorker, tokenizer) -> TestClient:
    cfg = config_from_dict({"cache": {"num_slots": 4, "max_seq_len": 512}})
    state = ServerState(cfg=cfg, worker=worker, tokenizer=tokenizer, metrics=Metrics(MODEL, "none"),
                        model_name=MODEL, stop_token_ids=[2], api_key=None, created=0)
    return TestClient(create_app(state), raise_server_exceptions=False)


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""
    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constants)


def call(client: TestClient, path: str, body: dict, stream: bool = False):
    """The response body, or the list of SSE events when streaming (checked to end with [DONE])."""
    r = client.post(path, json={"model": MODEL, **body, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        return strict_json(r.text)
    lines = [ln for ln in r.text.split("\n") if ln]
    assert lines[-1] == "data: [DONE]"
    return [strict_json(ln[6:]) for ln in lines[:-1]]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for n in sizes:
        out.append(ids[i:i + n])
        i += n
    return out + ([ids[i:]] if i < len(ids) else [])


@pytest.fixture(scope="module")
def reply_ids(tokenizer) -> list[int]:
    ids = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 10
    return ids


def chunk_entries(events: list[dict]) -> list[tuple[str, list]]:
    """(text, logprobs content) of every chat chunk that carries either."""
    out = []
    for e in events:
        for c in e["choices"]:
            if c["logprobs"] is not None:
                out.append((c["delta"].get("content", ""), c["logprobs"]["content"]))
    return out


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


# -- completions: shape, echo, max_tokens 0 ----------------------------------------------------------------------
def check_offsets(text: str, lp: dict) -> None:
    """Each token's text_offset is where its text starts in `text`: the characters its predecessors completed."""
    done = b""
    for token, offset, tb in zip(lp["tokens"], lp["text_offset"], lp["_bytes"]):
        assert offset == len(done.decode("utf-8", errors="ignore")), (token, offset)
        done += tb
    assert done.decode("utf-8") == text


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_shape_and_offsets(tokenizer, texts, reply_ids, stream):
    worker = ScriptWorker(split(reply_ids, [2, 1, 3, 50]))
    with make_client(worker, tokenizer) as c:
        out = call(c, "/v1/completions", {"prompt": "x", "max_tokens": 30, "logprobs": 2}, stream=stream)
    if stream:
        choices = [e["choices"][0] for e in out if e["choices"]]
        text = "".join(ch["text"] for ch in choices)
        parts = [ch["logprobs"] for ch in choices if ch["logprobs"] is not None]
        lp = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        done, so_far = 0, b""
        for ch in choices:  # a chunk's tokens end in its text (as in the chat test)
            done += len(ch["logprobs"]["tokens"]) if ch["logprobs"] else 0
            so_far += ch["text"].encode()
            sent = b"".join(texts.bytes(t) for t in reply_ids[:done])
            assert so_far.startswith(sent) and len(so_far) - len(sent) < 4, ch
    else:
        text, lp = out["choices"][0]["text"], out["choices"][0]["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert text == REPLY
    assert lp["tokens"] == [texts.text(t) for t in reply_ids]
    assert lp["token_logprobs"] == [logprob_of(t, i) for i, t in enumerate(reply_ids)]
    for i, (t, top) in enumerate(zip(reply_ids, lp["top_logprobs"])):
        # the 2 most likely (the chosen token is the first here), keyed by their strings
        want = {}
        for j in range(2):
            want.setdefault(texts.text((t + j) % VOCAB), logprob_of(t, i) - j)
        assert top == want
    check_offsets(text, {**lp, "_bytes": [texts.bytes(t) for t in reply_ids]})


def test_completion_logprobs_0_lists_the_chosen_token_only(tokenizer, texts, reply_ids):
    """`logprobs: 0`: no alternatives, but the chosen token's own entry (OpenAI returns up to logprobs + 1)."""
    worker = ScriptWorker([reply_ids[:4]])
    with make_client(worker, tokenizer) as c:
        lp = call(c, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logprobs": 0})["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{texts.text(t): logprob_of(t, i)} for i, t in enumerate(reply_ids[:4])]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["Say 😀 now", [5, 0, 10813, 242, 218, 2878]], ids=["text", "ids"])
def test_echo_puts_the_prompt_and_its_entries_first(tokenizer, texts, reply_ids, prompt, stream):
    ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    echoed = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)
    worker = ScriptWorker(split(reply_ids, [1, 1, 1, 50]))
    with make_client(worker, tokenizer) as c:
        out = call(c, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "logprobs": 1, "echo": True,
                                          "stream_options": {"include_usage": True}} if stream else
                   {"prompt": prompt, "max_tokens": 30, "logprobs": 1, "echo": True}, stream=stream)
    if stream:
        choices = [e["choices"][0] for e in out if e["choices"]]
        text = "".join(ch["text"] for ch in choices)
        parts = [ch["logprobs"] for ch in choices if ch["logprobs"] is not None]
        assert choices[0]["text"].startswith(echoed) and len(parts[0]["tokens"]) >= len(ids)
        lp = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        usage, finish = out[-1]["usage"], [ch["finish_reason"] for ch in choices if ch["finish_reason"]]
    else:
        text, lp, usage = out["choices"][0]["text"], out["choices"][0]["logprobs"], out["usage"]
        finish = [out["choices"][0]["finish_reason"]]
    all_ids = ids + reply_ids
    assert text == echoed + REPLY and finish == ["length"]
    assert lp["tokens"] == [texts.text(t) for t in all_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == [logprob_of(t, -i) for i, t in enumerate(ids[1:])]
    assert lp["token_logprobs"][len(ids):] == [logprob_of(t, i) for i, t in enumerate(reply_ids)]
    assert all(isinstance(top, dict) and len(top) == 1 for top in lp["top_logprobs"][1:])
    check_offsets(text, {**lp, "_bytes": [texts.bytes(t) for t in all_ids]})
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), len(reply_ids))


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_zero_tokens_scores_the_prompt(tokenizer, texts, stream):
    """echo + max_tokens 0 + logprobs: the worker prefills and sends the prompt's entries; the reply is the prompt,
    finish_reason "length", no completion tokens."""
    prompt = "The cat sat on the mat."
    ids = tokenizer(prompt)["input_ids"]
    worker = ScriptWorker([[9, 9]])
    with make_client(worker, tokenizer) as c:
        body = {"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True}
        out = call(c, "/v1/completions", {**body, "stream_options": {"include_usage": True}} if stream else body,
                   stream=stream)
    if stream:
        choices = [e["choices"][0] for e in out if e["choices"]]
        text, usage = "".join(ch["text"] for ch in choices), out[-1]["usage"]
        lp = [ch["logprobs"] for ch in choices if ch["logprobs"] is not None]
        assert len(lp) == 1
        lp, finish = lp[0], [ch["finish_reason"] for ch in choices if ch["finish_reason"]]
    else:
        text, lp, usage = out["choices"][0]["text"], out["choices"][0]["logprobs"], out["usage"]
        finish = [out["choices"][0]["finish_reason"]]
    assert worker.generates[0].max_tokens == 0 and worker.generates[0].prompt_logprobs == 1
    assert text == prompt and finish == ["length"]
    assert lp["tokens"] == [texts.text(t) for t in ids] and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (len(ids), 0, len(ids))


def test_echo_with_zero_tokens_and_no_logprobs_needs_no_worker(tokenizer):
    worker = ScriptWorker([[9]])
    with make_client(worker, tokenizer) as c:
        out = call(c, "/v1/completions", {"prompt": "Just this.", "max_tokens": 0, "echo": True, "n": 2})
    assert worker.generates == []
    assert [(ch["text"], ch["finish_reason"], ch["logprobs"]) for ch in out["choices"]] == \
        [("Just this.", "length", None)] * 2
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0, "logprobs": True}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "logprobs": 1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": False}),
])
def test_zero_tokens_without_echo_is_400(tokenizer, path, body):
    worker = ScriptWorker([[9]])
    with make_client(worker, tokenizer) as c:
        r = c.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("max_tokens", "max_completion_tokens"), r.text
    assert worker.generates == []


# -- -inf and a broken worker --------------------------------------------------------------------------------------
def banned(token: int, position: int, k: int) -> m.Logprob:
    """processed mode with a banned token: -inf for the chosen one's neighbours, the chosen at a finite value."""
    return m.Logprob(-0.5, [(token, -0.5)] + [(token + j, float("-inf")) for j in range(1, k)])


@pytest.mark.parametrize("stream", [False, True])
def test_minus_infinity_is_minus_9999(tokenizer, reply_ids, stream):
    worker = ScriptWorker([reply_ids[:3]], entry_of=lambda t, p, k: m.Logprob(float("-inf"), banned(t, p, k).top))
    with make_client(worker, tokenizer) as c:
        chat = call(c, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, stream=stream)
        comp = call(c, "/v1/completions", {"prompt": "a b", "max_tokens": 3, "logprobs": 3, "echo": True},
                    stream=stream)  # strict_json: no -Infinity anywhere
    if stream:
        content = [e for _, es in chunk_entries(chat) for e in es]
        values = [v for ev in comp for ch in ev["choices"] if ch["logprobs"]
                  for v in ch["logprobs"]["token_logprobs"]]
    else:
        content = chat["choices"][0]["logprobs"]["content"]
        values = comp["choices"][0]["logprobs"]["token_logprobs"]
    assert [e["logprob"] for e in content] == [LOGPROB_FLOOR] * 3
    assert [[x["logprob"] for x in e["top_logprobs"]] for e in content] == [[-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR]] * 3
    assert values[0] is None and values[1:] == [LOGPROB_FLOOR] * (len(values) - 1)


def test_a_worker_sending_the_wrong_number_of_logprobs_is_a_clean_500(tokenizer, reply_ids):
    class Short(ScriptWorker):
        def submit(self, req):
            q = asyncio.Queue()
            q.put_nowait(m.Tokens(req.request_id, reply_ids[:3], finish_reason="length",
                                  logprobs=[entry(reply_ids[0], 0, 0)]))
            return q

    with make_client(Short([]), tokenizer) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, **CHAT, "logprobs": True})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text


# -- real servers --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(server):
    """The session's float32 server (speculative steps and plain decoding give the same logprobs to ~1e-6)."""
    return server


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key=live.api_key, max_retries=0, timeout=120)


SERVED = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "List three colors of the rainbow."}]


@pytest.mark.server
def test_e2e_chat_logprobs_streamed_equal_non_streamed(client):
    kw = dict(model=SERVED, messages=ASK, max_tokens=24, temperature=0, logprobs=True, top_logprobs=4)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = full.choices[0].logprobs.content
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(content) == full.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in content]
    for a, b in zip(content, streamed):
        assert a.bytes == b.bytes and abs(a.logprob - b.logprob) <= 1e-4
        assert len(a.top_logprobs) == 4 and {x.token for x in a.top_logprobs} == {x.token for x in b.top_logprobs}
        # greedy, raw logprobs: the chosen token is the most likely
        assert a.top_logprobs[0].token == a.token and a.top_logprobs[0].logprob == a.logprob
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    if full.choices[0].finish_reason == "length":
        assert b"".join(bytes(e.bytes) for e in content) == text.encode()


@pytest.mark.server
@pytest.mark.parametrize("extra", [{"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 2},
                                   {"logprobs": True, "top_logprobs": 21}])
def test_e2e_bad_top_logprobs_is_400(client, extra):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=2, **extra)
    assert info.value.body["param"] == "top_logprobs"


@pytest.mark.server
def test_e2e_echo_zero_tokens_scores_the_prompt(client, tokenizer):
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=SERVED, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    n = len(tokenizer(prompt)["input_ids"])
    assert c.text == prompt and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == n == r.usage.prompt_tokens and r.usage.completion_tokens == 0
    assert "".join(c.logprobs.tokens) == prompt
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(n)]
    # the last prompt token's logprob is the one a generation from the prompt before it gives that token
    head = prompt[:-len(c.logprobs.tokens[-1])]
    g = client.completions.create(model=SERVED, prompt=head, max_tokens=1, temperature=0, logprobs=5)
    top = g.choices[0].logprobs.top_logprobs[0]
    assert c.logprobs.tokens[-1] in top
    assert abs(top[c.logprobs.tokens[-1]] - c.logprobs.token_logprobs[-1]) <= 1e-3


@pytest.mark.server
def test_e2e_logit_bias_bans_a_repeated_token(client, tokenizer):
    prompt = "Repeat after me: hello hello hello hello hello hello"
    (t,) = tokenizer(" hello", add_special_tokens=False)["input_ids"]
    kw = dict(model=SERVED, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    free = client.completions.create(**kw).choices[0]
    assert free.logprobs.tokens.count(" hello") >= 4  # the model repeats it
    banned = client.completions.create(**kw, logit_bias={str(t): -100}).choices[0]
    assert " hello" not in banned.logprobs.tokens and banned.logprobs.tokens
    # the penalties reach the worker too: strong ones break the repetition as well
    for penalty in ({"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.5}}):
        penalized = client.completions.create(**kw, **penalty).choices[0]
        assert penalized.logprobs.tokens.count(" hello") < free.logprobs.tokens.count(" hello"), penalty


@pytest.mark.server
def test_e2e_sampled_tokens_match_their_top_entries(client):
    r = client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=24, temperature=1.0, seed=3,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and all(x.logprob <= 0 for x in e.top_logprobs)
        assert [x.logprob for x in e.top_logprobs] == sorted((x.logprob for x in e.top_logprobs), reverse=True)
        same = [x for x in e.top_logprobs if x.token == e.token and x.bytes == e.bytes]
        if same:
            assert abs(same[0].logprob - e.logprob) <= 1e-6


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_e2e_echo_usage_and_finish(client, tokenizer, stream):
    prompt = "def add(a, b):\n"
    n = len(tokenizer(prompt)["input_ids"])
    kw = dict(model=SERVED, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        r = client.completions.create(**kw)
        text, tokens, finish, usage = (r.choices[0].text, r.choices[0].logprobs.tokens, [r.choices[0].finish_reason],
                                       r.usage)
    assert text.startswith(prompt) and text == "".join(tokens)
    assert finish == ["length"] and usage.prompt_tokens == n and usage.completion_tokens == 5
    assert len(tokens) == n + 5


@pytest.mark.server
def test_e2e_processed_logprobs_of_cut_tokens_are_minus_9999(tmp_path_factory, target32):
    """`server.logprobs_mode: processed` with top_k 2: the tokens top-k cut off have probability 0 in the distribution
    sampled from, so the 3rd and 4th most likely are reported at -9999.0, in strictly valid JSON, streamed or not."""
    s = ServerProcess(tmp_path_factory.mktemp("processed"), num_slots=1, max_seq_len=512, dtype="float32",
                      server_options={"logprobs_mode": "processed"}).wait_ready()
    try:
        for stream in (False, True):
            body = {"model": SERVED, "messages": ASK, "max_tokens": 4, "temperature": 0.7, "top_k": 2, "seed": 1,
                    "logprobs": True, "top_logprobs": 4, "stream": stream}
            r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=s.headers, timeout=120)
            assert r.status_code == 200, r.text
            if stream:
                events = [strict_json(ln[6:]) for ln in r.text.split("\n") if ln and ln != "data: [DONE]"]
                content = [e for _, es in chunk_entries(events) for e in es]
            else:
                content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
            assert len(content) == 4, stream
            for e in content:
                tops = [x["logprob"] for x in e["top_logprobs"]]
                assert tops[2:] == [LOGPROB_FLOOR, LOGPROB_FLOOR] and all(LOGPROB_FLOOR < v <= 0 for v in tops[:2])
                assert e["logprob"] in tops[:2]
    finally:
        s.stop()


@pytest.mark.server
def test_e2e_langchain_chat_openai_logprobs(live):
    llm = ChatOpenAI(base_url=live.url + "/v1", api_key=live.api_key, model=SERVED, logprobs=True, max_tokens=8,
                     temperature=0, max_retries=0)
    r = llm.invoke("Name a color.")
    content = r.response_metadata["logprobs"]["content"]
    assert len(content) == r.response_metadata["token_usage"]["completion_tokens"] >= 1
    assert all(e["logprob"] <= 0 and isinstance(e["token"], str) for e in content)
    assert wait_balanced(live.url)
