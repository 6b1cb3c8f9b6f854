"""One request's life in the API process: submit token ids to the worker, turn the tokens that come back into
UTF-8-safe text deltas, cut at stop strings, and keep the request's metrics.

A request asks for `n` choices (`Choices`): n `Generation`s, one worker request each, with the same prompt and prefix
cache namespace (`cache_namespace`), so the worker prefills the prompt once and the later choices copy its rows.
`Choices.events()` yields `(index, Delta)` as any choice's text arrives, with the log probabilities of the tokens it
carries when the request asked for them; the routes shape them into OpenAI responses or SSE chunks. Whatever ends the
iteration (finish, client disconnect, error), the worker hears an abort for every choice it still holds. A stop
string ends its choice before the worker does: the text goes out at once, and `usage()` then waits (briefly) for the
worker's answer to the abort, which carries the choice's speculative stats.
"""
from __future__ import annotations

import asyncio
import bisect
import hashlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from server.api.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.api.errors import APIError
from server.metrics import Metrics
from server.worker import messages as m
from server.worker.process import WorkerClient, WorkerDied, new_request_id

# How long usage waits for the stats of a request cut by a stop string: the worker answers the abort before its
# next engine call, so within one step or prefill.
FINAL_STATS_TIMEOUT_S = 5.0
SPEC_USAGE_KEYS = ("drafter", "draft_tokens", "accepted_tokens", "verify_steps", "mean_accepted_length",
                   "mean_draft_length", "max_draft_length")
_INT64 = 2**64


def cache_namespace(api_key: str, cache_salt: str | None, prefix_caching: bool, request_id: str) -> str:
    """The prefix-cache partition a request's KV rows are looked up and cached under.

    With prefix caching on: the SHA-256 of the API key the client presented ("" for none; the key itself never
    leaves the API process), then the request's `cache_salt`. The digest has a fixed length, so any salt (one with
    ':' included) gives its own namespace. With prefix caching off: one namespace per HTTP request, so the n choices
    of a request share its prompt's rows and no two requests share anything."""
    if not prefix_caching:
        return f"request:{request_id}"
    digest = hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{digest}:{cache_salt or ''}"


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: `seed + index` (vLLM's convention), wrapped into int64 (the worker's wire type)."""
    if seed is None:
        return None
    return (seed + index + 2**63) % _INT64 - 2**63


class RequestClock:
    """Request-level latency of one HTTP request, shared by its choices: the time to first token is the first token
    of any choice, observed once; the end-to-end latency is observed once, when the request ends."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.t0 = time.perf_counter()
        self.first_token_at: float | None = None
        self.ended = False

    def first_token(self, now: float) -> None:
        """A choice's first token arrived at `now`: the request's TTFT if no choice had one yet."""
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.of(self.metrics.ttft).observe(now - self.t0)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.metrics.of(self.metrics.e2e).observe(time.perf_counter() - self.t0)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's entry in a reply's log probabilities."""

    token_id: int
    logprob: float | None  # None: the prompt's first token (nothing precedes it)
    top: list[tuple[int, float]] | None  # (id, log probability) of the most likely tokens there, most likely first
    offset: int  # where the token's text starts in the choice's text (an echoed prompt included)


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    # None when the request did not ask for log probabilities; else the entries of the tokens whose text ends in
    # this delta's text or before it (possibly none)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Generation:
    worker: WorkerClient
    tokenizer: object
    metrics: Metrics
    prompt_ids: list[int]
    sampling: dict            # from protocol.sampling_from; max_tokens already resolved to an int
    stop_token_ids: list[int]
    request_id: str = field(default_factory=lambda: new_request_id("req"))
    namespace: str | None = None  # the prefix-cache partition (cache_namespace)
    clock: RequestClock | None = None  # the request's, shared by its choices (`Choices`); None: one of its own
    echo: str | None = None  # the prompt's text, to start the choice's text with (completions' `echo`)
    completion_tokens: int = 0  # tokens whose text the reply returned (up to the one that completed a stop string)
    finish_reason: str | None = None
    spec_usage: dict | None = None
    _done: bool = False          # the worker no longer holds the request (or has been told to drop it)
    _stats_pending: bool = False  # stopped early: the worker's answer to the abort has the stats
    _prompt_only: bool = False  # no tokens and no prompt log probabilities asked: nothing for the worker to do

    def submit(self) -> None:
        """Hand the request to the worker (raises APIError 503 when the worker is gone)."""
        s = self.sampling
        if self.clock is None:
            self.clock = RequestClock(self.metrics)
        if s["max_tokens"] == 0 and s["prompt_logprobs"] is None:  # an echo of the prompt alone
            self._prompt_only = self._done = True
            return
        req = m.Generate(self.request_id, self.prompt_ids, s["max_tokens"], s["temperature"], s["top_p"],
                         s["top_k"], s["seed"], self.stop_token_ids, namespace=self.namespace, min_p=s["min_p"],
                         presence_penalty=s["presence_penalty"], frequency_penalty=s["frequency_penalty"],
                         repetition_penalty=s["repetition_penalty"], logit_bias=s["logit_bias"],
                         logprobs=s["logprobs"], prompt_logprobs=s["prompt_logprobs"], grammar=s.get("grammar"))
        try:
            self.queue = self.worker.submit(req)
        except WorkerDied:
            self._done = True
            raise APIError(503, "the model worker is not running", "server_error", None, "worker_unavailable")

    def close(self) -> None:
        """Tell the worker to drop the request if it still holds it (idempotent)."""
        if not self._done:
            self._done = True
            self.worker.abort(self.request_id)

    def _count_tokens(self, n: int, last: float | None) -> float:
        """Token metrics for `n` tokens that arrived now; returns the arrival time. The request's first token is
        its TTFT; the tokens that arrived with it, and every later one, an inter-token latency each (a later
        choice's first token is neither)."""
        mt = self.metrics
        now = time.perf_counter()
        if last is None:
            self.clock.first_token(now)
            for _ in range(n - 1):  # tokens that arrived with the first one cost nothing extra
                mt.of(mt.itl).observe(0.0)
        else:
            for _ in range(n):
                mt.of(mt.itl).observe((now - last) / n)
        mt.of(mt.generation_tokens).inc(n)
        return now

    async def deltas(self) -> AsyncIterator[Delta]:
        """The choice's text as it becomes final, cut at a stop string; an echoed prompt first.

        With log probabilities asked for, each token's entry goes out with the delta that carries the end of its
        text (the last of its bytes): text the detokenizer (a character split across tokens) or the stop matcher (a
        possible stop string) holds back holds its tokens' entries too, and tokens after the one that completed a
        stop string have none. The echoed prompt's entries go out with it."""
        want = self.sampling["logprobs"] is not None
        if self._prompt_only:
            self.finish_reason = "length"
            yield Delta(self.echo or "", "length")
            return
        detok = IncrementalDetokenizer(self.tokenizer, keep=self.sampling.get("keep_special", ()))
        stops = StopStringMatcher(self.sampling.get("stop") or [])
        ends: list[int] = []  # ends[i]: characters of text once token i (or its message, without stops) was decoded
        whole: list[bool] = []  # whole[i]: the bytes through token i end on a character boundary
        entries: list[TokenLogprob] = []  # every generated token's, when wanted
        prompt_entries: list[TokenLogprob] = []  # the echoed prompt's, until sent
        released = 0  # of `entries`, those sent
        sent = 0  # characters of generated text sent
        base = len(self.echo or "")  # generated text starts after the echoed prompt
        head = self.echo  # the echoed prompt, sent with the first message's text
        # one token at a time where a stop string or a log probability's text offset must be located to its token
        per_token = bool(stops.stops) or want

        def release(upto: int) -> list[TokenLogprob] | None:
            """The entries of the first `upto` generated tokens not sent yet, the prompt's before them."""
            nonlocal released, prompt_entries
            if not want:
                return None
            out = prompt_entries + entries[released:upto]
            prompt_entries, released = [], max(released, upto)
            return out

        last = None
        try:
            while True:
                msg = await self.queue.get()
                if isinstance(msg, m.Failed):
                    self._done = True
                    raise _failure(msg)
                if msg.token_ids:
                    last = self._count_tokens(len(msg.token_ids), last)
                text = ""
                if head is not None:
                    text, head = head, None
                    if want:
                        prompt_entries = self._prompt_entries(msg.prompt_logprobs)
                echoed = len(text)  # the echo is never matched against stop strings
                for group in ([[t] for t in msg.token_ids] if per_token else [msg.token_ids]):
                    if group:
                        piece = detok.add(group)
                        text += piece
                        ends.extend([(ends[-1] if ends else 0) + len(piece)] * len(group))
                        whole.extend([not detok.holding] * len(group))
                if want:
                    first = len(ends) - len(msg.token_ids)
                    for i, (t, lp) in enumerate(zip(msg.token_ids, _sized(msg.logprobs, len(msg.token_ids))),
                                                first):
                        entries.append(TokenLogprob(t, lp.logprob, list(lp.top), base + (ends[i - 1] if i else 0)))
                if msg.finish_reason:
                    self._done = True
                    self.spec_usage = msg.usage
                    tail = detok.finish()
                    text += tail
                    if ends:
                        ends[-1] += len(tail)
                out, stopped = stops.feed(text[echoed:])
                out = text[:echoed] + out
                if stopped:
                    self._stopped_early(stops.end, ends)
                    yield Delta(out, "stop", release(self.completion_tokens))
                    return
                if msg.finish_reason:
                    tail = stops.finish()  # may still complete a stop string that was waiting on a longer one
                    if stops.stopped:
                        self._stopped_early(stops.end, ends)
                    else:
                        self.completion_tokens = len(ends)
                        self.finish_reason = msg.finish_reason
                    yield Delta(out + tail, self.finish_reason, release(self.completion_tokens))
                    return
                sent += len(out) - echoed
                # the tokens whose text is all out, up to one that ends on a character boundary: one that ends inside
                # a character waits for the token that completes it
                upto = bisect.bisect_right(ends, sent)
                while upto > released and not whole[upto - 1]:
                    upto -= 1
                logprobs = release(upto)
                if out or logprobs:
                    yield Delta(out, None, logprobs)
        finally:
            self.close()

    def _prompt_entries(self, logprobs: list[m.Logprob | None] | None) -> list[TokenLogprob]:
        """The echoed prompt's entries; text offsets from decoding the prompt a token at a time, special tokens
        included (they are part of the echoed text)."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
        out, at = [], 0
        for t, lp in zip(self.prompt_ids, _sized(logprobs, len(self.prompt_ids))):
            out.append(TokenLogprob(t, None, None, at) if lp is None else
                       TokenLogprob(t, lp.logprob, list(lp.top), at))
            at += len(detok.add([t]))
        return out

    def _stopped_early(self, stop_end: int, ends: list[int]) -> None:
        """A stop string ending at character `stop_end` ended the request: count the tokens up to the one that
        completed it, and ask the worker to drop the request and send its stats (unless it already finished)."""
        self.finish_reason = "stop"
        self.completion_tokens = min(bisect.bisect_left(ends, stop_end) + 1, len(ends))
        if not self._done:
            self._done = True
            self._stats_pending = True
            self.worker.abort(self.request_id, final=True)

    async def _final_stats(self) -> None:
        """The stats of a request stopped early: from the worker's answer to the abort, or from its finishing
        message if it finished first. Tokens it generated past the stop are not part of the reply."""
        while True:
            msg = await self.queue.get()
            if isinstance(msg, m.Aborted) or (isinstance(msg, m.Tokens) and msg.finish_reason):
                self.spec_usage = msg.usage
                return
            if isinstance(msg, m.Failed):  # the worker died: no stats
                return

    async def usage(self) -> dict:
        """The OpenAI usage, with the speculative stats (call once the deltas are done)."""
        if self._stats_pending:
            self._stats_pending = False
            try:
                await asyncio.wait_for(self._final_stats(), FINAL_STATS_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        cached = (self.spec_usage or {}).get("cached_tokens") or 0
        u = {"prompt_tokens": len(self.prompt_ids), "completion_tokens": self.completion_tokens,
             "total_tokens": len(self.prompt_ids) + self.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": int(cached)}}
        if self.spec_usage:
            u.update({k: self.spec_usage.get(k) for k in SPEC_USAGE_KEYS})
        return u


def combine_usage(parts: list[dict]) -> dict:
    """One request's usage from its choices' (`Generation.usage`): the prompt counted once (its cached tokens the
    fewest any choice had), completion tokens summed; speculative stats summed (draft / accepted tokens, verify
    steps), the longest draft, and means over all the verify steps."""
    if len(parts) == 1:
        return parts[0]
    prompt = parts[0]["prompt_tokens"]
    completion = sum(p["completion_tokens"] for p in parts)
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
         "prompt_tokens_details": {"cached_tokens": min(p["prompt_tokens_details"]["cached_tokens"] for p in parts)}}
    spec = [p for p in parts if "verify_steps" in p]
    if spec:
        def total(key: str) -> int:
            return sum(p.get(key) or 0 for p in spec)

        steps = total("verify_steps")
        draft = total("draft_tokens")
        emitted = sum((p.get("mean_accepted_length") or 0) * (p.get("verify_steps") or 0) for p in spec)
        u.update({"drafter": spec[0].get("drafter"), "draft_tokens": draft,
                  "accepted_tokens": total("accepted_tokens"), "verify_steps": steps, "mean_accepted_length": round(emitted / steps, 4) if steps else 0.0,
                  "mean_draft_length": round(draft / steps, 4) if steps else 0.0,
                  "max_draft_length": max(p.get("max_draft_length") or 0 for p in spec)})
    return u


class Choices:
    """The n choices of one request: one `Generation` each (request ids `<request_id>-<i>`), the same prompt and
    prefix-cache namespace, choice i seeded `seed + i` when the request has a seed. Owns the request-level metrics:
    prompt tokens (counted once), TTFT and end-to-end latency."""

    def __init__(self, worker: WorkerClient, tokenizer, metrics: Metrics, prompt_ids: list[int], sampling: dict,
                 stop_token_ids: list[int], n: int = 1, namespace: str | None = None,
                 request_id: str | None = None, echo: str | None = None):
        self.request_id = request_id or new_request_id("req")
        self.metrics = metrics
        self.prompt_ids = prompt_ids
        self.clock = RequestClock(metrics)
        self.gens = [Generation(worker, tokenizer, metrics, prompt_ids,
                                {**sampling, "seed": choice_seed(sampling.get("seed"), i)}, stop_token_ids,
                                request_id=f"{self.request_id}-{i}", namespace=namespace, clock=self.clock,
                                echo=echo)
                     for i in range(n)]

    @property
    def n(self) -> int:
        return len(self.gens)

    def submit(self) -> None:
        """Hand every choice to the worker; if the worker is gone (APIError 503), drop those already sent."""
        try:
            for g in self.gens:
                g.submit()
        except APIError:
            self.close()
            raise
        self.metrics.of(self.metrics.prompt_tokens).inc(len(self.prompt_ids))

    def close(self) -> None:
        """The worker drops every choice it still holds (idempotent)."""
        for g in self.gens:
            g.close()

    async def events(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as the choices' text arrives, interleaved, until every choice has finished. A
        choice's error ends them all and is raised. However the iteration ends, the worker drops what it still
        holds and the request's latency is observed (close the iterator: `contextlib.aclosing`)."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for d in gen.deltas():
                    merged.put_nowait((i, d, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                merged.put_nowait((i, None, e))
            else:
                merged.put_nowait((i, None, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.gens)]
        running = len(tasks)
        try:
            while running:
                i, delta, error = await merged.get()
                if error is not None:
                    raise error
                if delta is None:
                    running -= 1
                else:
                    yield i, delta
        finally:
            # synchronous on purpose: a cancelled scope (client gone) cancels any await made here
            for t in tasks:
                t.cancel()
            self.close()
            self.clock.end()

    async def usage(self) -> dict:
        """The request's OpenAI usage (call once the events are done): `combine_usage` of the choices'."""
        return combine_usage(list(await asyncio.gather(*(g.usage() for g in self.gens))))


def _sized(logprobs: list | None, n: int) -> list:
    """The worker's log probabilities for `n` tokens, checked: one entry per token, or the reply would be wrong."""
    if logprobs is None or len(logprobs) != n:
        raise APIError(500, f"the worker sent {0 if logprobs is None else len(logprobs)} log probabilities for {n} "
                       "tokens", "server_error", None, "internal_error")
    return logprobs


def _failure(msg: m.Failed) -> APIError:
    if msg.kind == "overloaded":
        return APIError(503, "the server is overloaded: the waiting queue is full; retry later", "server_error",
                        None, "queue_full", headers={"Retry-After": "1"})
    if msg.kind == "server_error":
        return APIError(500, msg.message, "server_error", None, "internal_error")
    return APIError(400, msg.message, "invalid_request_error", None, None)
