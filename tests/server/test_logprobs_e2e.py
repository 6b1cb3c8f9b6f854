"""Log probabilities on real servers, with the official `openai` client (and LangChain's `ChatOpenAI`): streamed
entries equal the non-streamed ones, bad `top_logprobs` is a 400, echo with `max_tokens` 0 scores the prompt,
`logit_bias` and the penalties reach the worker, sampled tokens match their top entries, echo's usage and finish,
and `server.logprobs_mode: processed` reports the tokens top-k cut off at -9999.0.

The tests share the session's float32 server (`server`, tests/server/conftest.py); the processed-mode test starts a
server of its own.
"""
from __future__ import annotations

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from server.api.logprobs import LOGPROB_FLOOR
from tests.server.conftest import ServerProcess, wait_balanced
from tests.server.scripted import chunk_entries, strict_json


# -- real servers --------------------------------------------------------------------------------------------------
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
def test_e2e_langchain_chat_openai_logprobs(server):
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=server.api_key, model=SERVED, logprobs=True, max_tokens=8,
                     temperature=0, max_retries=0)
    r = llm.invoke("Name a color.")
    content = r.response_metadata["logprobs"]["content"]
    assert len(content) == r.response_metadata["token_usage"]["completion_tokens"] >= 1
    assert all(e["logprob"] <= 0 and isinstance(e["token"], str) for e in content)
    assert wait_balanced(server.url)
