"""The scripted worker of the API tests that run the real app with the real tokenizer (test_logprobs_api.py,
test_logprobs_completions_api.py, test_structured_api.py; no model): `ScriptWorker` answers each request at once with
scripted token ids and log probabilities (`entry`, `logprob_of`), `make_client` serves the app against it, and `call`
posts a request and reads back the JSON body or the SSE events, strictly (`strict_json`: no NaN or Infinity).
`REPLY` is the text the tests script (`split` cuts its ids into worker messages), `CHAT` a chat request body, and
`chunk_entries` the (text, logprobs) of each streamed chat chunk, which the real-server tests use too.

The fixtures built on them (``texts``, ``reply_ids``) are defined in the test files that use them."""
from __future__ import annotations

import asyncio
import json

from fastapi.testclient import TestClient

from server.api.app import ServerState, create_app
from server.config import config_from_dict
from server.metrics import Metrics
from server.worker import messages as m

MODEL = "scripted"
VOCAB = 49152
REPLY = " Hi 😀 there, naïve 中文!"  # an emoji and CJK characters split across byte-level tokens


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


def scripted(tokenizer, text: str, sizes: int = 3, finish: str = "stop") -> ScriptWorker:
    """A worker that answers with ``text``'s ids, ``sizes`` per message."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ScriptWorker([ids[i:i + sizes] for i in range(0, len(ids), sizes)], finish=finish)


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


def chunk_entries(events: list[dict]) -> list[tuple[str, list]]:
    """(text, logprobs content) of every chat chunk that carries either."""
    out = []
    for e in events:
        for c in e["choices"]:
            if c["logprobs"] is not None:
                out.append((c["delta"].get("content", ""), c["logprobs"]["content"]))
    return out
