"""The scripted worker of the API tests that need no model (test_prefix_api.py, test_n_choices_api.py,
test_admission.py, test_api_keys.py): `FakeTokenizer` (one character per token), `FakeWorker`, which answers each
request with one token per step (a function of its seed, `tokens_for`, so a choice's text names the worker request it
came from) and records every message, and `make_client`, which serves the real app against them; `post`, `auth`,
`sse_events` and `letters` read and write the requests."""
from __future__ import annotations

import asyncio
import json

from fastapi.testclient import TestClient

from server.api.app import ServerState, create_app
from server.config import config_from_dict
from server.metrics import Metrics
from server.worker import messages as m

KEY = "sk-client-one"
MODEL = "fake-model"
PROMPT = [5, 6, 7, 8]
STEP_S = 0.003
SPEC = {"drafter": "ngram", "draft_tokens": 6, "accepted_tokens": 3, "verify_steps": 3, "mean_accepted_length": 2.0,
        "mean_draft_length": 2.0, "max_draft_length": 4}


class FakeTokenizer:
    """One character per token: id t decodes to chr(ord('a') + t % 26)."""

    eos_token_id = None
    chat_template = "{{ messages | map(attribute='content') | join }}"  # what apply_chat_template below renders

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 26 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "".join(msg["content"] for msg in messages)


def tokens_for(req: m.Generate) -> list[int]:
    """The scripted output of a worker request: its seed's digits as letters, then 'z's, `max_tokens` in all."""
    head = [int(d) for d in str(abs(req.seed))] if req.seed is not None else []
    return (head + [25] * req.max_tokens)[:req.max_tokens]


class FakeWorker:
    """`WorkerClient`'s interface to the routes: records every message and answers each Generate with one token per
    step of STEP_S seconds (so the choices of one request interleave, as a batched step's tokens do), then a finish
    carrying usage."""

    def __init__(self, num_slots: int = 4, fail: set[int] = frozenset(), script=tokens_for, cached_tokens: int = 2,
                 usage_of=None):
        self.ready = m.Ready(MODEL, "ngram", 512, num_slots, 1000, "cpu", "float32")
        self.alive, self.dead = True, False
        self.generates: list[m.Generate] = []
        self.aborts: list[str] = []
        self.extra_in_flight = 0
        self.fail = fail  # choice indices (of every request) that fail instead of generating
        self.script = script
        self.cached_tokens = cached_tokens
        self.usage_of = usage_of or (lambda i: {**SPEC, "cached_tokens": self.cached_tokens})
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []

    def attach(self, loop):
        pass

    @property
    def in_flight(self) -> int:
        return len(self._queues) + self.extra_in_flight

    def submit(self, req: m.Generate) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = q
        self.generates.append(req)
        self._tasks.append(asyncio.get_running_loop().create_task(self._run(req, len(self.generates) - 1)))
        return q

    def _put(self, rid: str, msg, last: bool = False) -> None:
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(msg)
            if last:
                self._queues.pop(rid, None)

    async def _run(self, req: m.Generate, i: int) -> None:
        await asyncio.sleep(0)
        if int(req.request_id.rsplit("-", 1)[1]) in self.fail:
            self._put(req.request_id, m.Failed(req.request_id, "scripted failure"), last=True)
            return
        toks = self.script(req)
        for k, t in enumerate(toks):
            if req.request_id in self.aborts:
                return
            last = k == len(toks) - 1
            self._put(req.request_id, m.Tokens(req.request_id, [t], finish_reason="length" if last else None,
                                               usage=self.usage_of(i) if last else None), last=last)
            await asyncio.sleep(STEP_S)

    def abort(self, request_id: str, final: bool = False) -> None:
        self.aborts.append(request_id)
        if final:
            i = next(k for k, g in enumerate(self.generates) if g.request_id == request_id)
            self._put(request_id, m.Aborted(request_id, usage=self.usage_of(i)), last=True)
        else:
            self._queues.pop(request_id, None)


def make_client(worker: FakeWorker, prefix_caching: bool = True, api_key: str | None = KEY,
                max_waiting: int = 4) -> TestClient:
    cfg = config_from_dict({"cache": {"num_slots": worker.ready.num_slots, "max_seq_len": 512,
                                      "prefix_caching": prefix_caching}, "server": {"max_waiting": max_waiting}})
    state = ServerState(cfg=cfg, worker=worker, tokenizer=FakeTokenizer(), metrics=Metrics(MODEL, "ngram"),
                        model_name=MODEL, stop_token_ids=[], api_key=api_key, created=0)
    return TestClient(create_app(state), raise_server_exceptions=False)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(client: TestClient, path: str, body: dict, key: str = KEY):
    return client.post(path, json={"model": MODEL, **body}, headers=auth(key))


def sse_events(resp) -> list:
    lines = [ln for ln in resp.text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def letters(toks: list[int]) -> str:
    return FakeTokenizer().decode(toks)
