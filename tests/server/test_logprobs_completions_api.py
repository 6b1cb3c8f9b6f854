"""Log probabilities through the completions API: OpenAI's completions shape (tokens, token_logprobs,
top_logprobs, text_offset), `logprobs: 0`, echo (the prompt and its entries first) and `max_tokens` 0 (echo scores
the prompt; without echo, a 400); then -inf as -9999.0 in strictly valid JSON, chat and completions, and a worker
sending the wrong number of entries (a clean 500).

The tests run the real app against a scripted worker (tests/server/scripted.py) that answers with the real
tokenizer's ids, so the partial UTF-8 characters of byte-level BPE are exercised.
"""
from __future__ import annotations

import asyncio

import pytest

from server.api.logprobs import LOGPROB_FLOOR, TokenText
from server.worker import messages as m
from tests.server.scripted import (CHAT, MODEL, REPLY, VOCAB, ScriptWorker, call, chunk_entries, entry, logprob_of,
                                   make_client, split)


@pytest.fixture(scope="module")
def texts(tokenizer) -> TokenText:
    return TokenText(tokenizer)


@pytest.fixture(scope="module")
def reply_ids(tokenizer) -> list[int]:
    ids = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 10
    return ids


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
