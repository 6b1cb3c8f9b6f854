"""HTTP routes: chat and text completions (JSON or SSE), models, health, metrics.

A completion request is admitted in this order, so that a server that will refuse it spends nothing on it: the API
key and the body's size (middleware and dependency), the request model's validation (cheap shape checks, schema size
and depth caps), then the cheap checks against this server (`n` against the KV slots, the worker alive, `logit_bias`
ids, `ignore_eos`, an explicit `max_tokens` against `server.max_request_tokens`) and the queue-full check, and only
then the work: schema validation, grammar compilation, the chat template and tokenization, in a thread pool of their
own (`PrepPool`, a few threads and a bound on the jobs it holds; when it is full the request gets the same 503 as a
full waiting queue). A request being prepared counts against the waiting queue until it is submitted, so a burst
cannot all pass the queue-full check before any of it reaches the worker.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Annotated, Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.api.auth import caller_partition
from server.api.errors import APIError
from server.api.generation import Choices, TokenLogprob, cache_namespace
from server.api.logprobs import chat_logprobs, completion_logprobs
from server.api.protocol import ChatCompletionRequest, CompletionRequest, sampling_from
from server.api.responses import ModelCard, ModelList
from server.api.structured import RESPONSE_SCHEMA, FieldError, check_schema, compile_checked, response_format_grammar
from server.api.tool_grammar import tool_grammar_lark
from server.api.tool_parser import ToolReply
from server.api.tools import ToolPlan
from server.tokenization import ChatTemplateError, encode_chat, encode_text
from server.worker.process import new_request_id

router = APIRouter()
STUCK_S = 10.0  # /health: a worker this long inside one prefill or step (or this long silent) is unhealthy
PREP_THREADS = 2  # threads that tokenize, render chat templates and compile grammars for admitted requests
PREP_MAX_JOBS = 128  # requests the preparation pool holds at once, queued or running; beyond: 503 queue_full


def _queue_full() -> APIError:
    return APIError(503, "the server is overloaded: the waiting queue is full; retry later", "server_error",
                    None, "queue_full", headers={"Retry-After": "1"})


class PrepPool:
    """The work of preparing admitted requests (JSON schema validation, grammar compilation, chat templates,
    tokenization), off the event loop on a few threads of its own, with a bound on the jobs it holds (queued or
    running): beyond it a request is refused with 503 `queue_full`, as a full waiting queue refuses it. `reserved`
    counts the choices of admitted requests not yet submitted to the worker (the queue-full check counts them)."""

    def __init__(self, threads: int = PREP_THREADS, max_jobs: int = PREP_MAX_JOBS):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="specserve-prepare")
        self.max_jobs = max_jobs
        self.reserved = 0  # event loop only
        self._jobs = 0  # queued or running; released from the thread that finishes a job
        self._lock = threading.Lock()

    def _release(self, _future=None) -> None:
        with self._lock:
            self._jobs -= 1

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)`` on the pool (its exceptions raised here); APIError 503 when the pool is full. A job whose
        caller goes away before it starts is dropped; one already running finishes and still holds its place."""
        with self._lock:
            if self._jobs >= self.max_jobs:
                raise _queue_full()
            self._jobs += 1
        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(self._release)  # before wrap_future's: the place is free when the caller resumes
        return await asyncio.wrap_future(future)


def _prep_pool(request: Request) -> PrepPool:
    """The app's preparation pool (made on first use)."""
    state = request.app.state
    pool = getattr(state, "prep", None)
    if pool is None:
        pool = state.prep = PrepPool()
    return pool


def _state(request: Request):
    return request.app.state.s


async def _auth(request: Request) -> None:
    """The API key check (server.api.auth); the caller's prefix-cache partition goes on the request's state."""
    request.state.cache_partition = caller_partition(_state(request).api_keys, request)


Auth = Annotated[None, Depends(_auth)]


def _check_model(s, model: str) -> None:
    if model != s.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{s.model_name}`.",
                       "invalid_request_error", "model", "model_not_found")


def _grammar(s, req, plan: ToolPlan | None) -> str | None:
    """The grammar the request's output must match (the tools' when they are active, else `response_format`'s;
    None: free text), its schemas validated against their metaschema, compiled and checked against the model's
    tokenizer; what cannot be enforced is a 400 naming the field (each tool's schema checked on its own first, so the
    message names the tool). Runs in the preparation pool."""
    from core.grammar import json_schema_grammar, lark_grammar

    def refuse(param: str, e: FieldError) -> APIError:
        return APIError(400, str(e), "invalid_request_error", param, "invalid_value")

    def check(param: str, what: str, build) -> str | None:
        try:
            return compile_checked(s.grammars, build, what)
        except FieldError as e:
            raise refuse(param, e) from None

    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        try:
            check_schema(fmt.schema, RESPONSE_SCHEMA)
        except FieldError as e:
            raise refuse("response_format", e) from None
    field = "functions" if plan is not None and plan.legacy else "tools"
    tools = plan.tools if plan is not None else []
    for i, tool in enumerate(tools):  # every tool's, as the request model checked them before (active or not)
        if tool.parameters is not None:
            where = f"functions[{i}]" if plan.legacy else f"tools[{i}].function"
            try:
                check_schema(tool.parameters, f"`{where}.parameters`")
            except FieldError as e:
                raise refuse(field, e) from None
    grammar = check("response_format", "The JSON schema of `response_format`", lambda: response_format_grammar(fmt))
    if plan is None or not plan.active:
        return grammar
    for i, tool in enumerate(plan.tools):
        where = f"functions[{i}]" if plan.legacy else f"tools[{i}].function"
        check(field, f"The JSON schema `{where}.parameters`",
              lambda tool=tool: json_schema_grammar(tool.arguments_schema()))
    return check(field, f"The call grammar of `{field}`", lambda: lark_grammar(tool_grammar_lark(plan, fmt)))


def _check_request_tokens(s, choices: int, max_tokens: int, default: bool) -> None:
    """`n` x `max_tokens` at most `server.max_request_tokens` (`default`: max_tokens is the rest of the context, the
    request sent none). Over it: a 400 naming `max_tokens` when one choice alone is over, else `n`."""
    ceiling = s.cfg.server.max_request_tokens
    if ceiling is None or choices * max_tokens <= ceiling:
        return
    why = " (`max_tokens` defaults to the rest of the context)" if default else ""
    if choices == 1:
        asked = f"`max_tokens` is {max_tokens}{why}"
    else:
        asked = f"`n` x `max_tokens` is {choices} x {max_tokens} = {choices * max_tokens} tokens{why}"
    raise APIError(400, f"{asked}, above this server's limit of {ceiling} tokens per request "
                   f"(`server.max_request_tokens`): ask for fewer choices or a smaller `max_tokens`.",
                   "invalid_request_error", "n" if choices > 1 and max_tokens <= ceiling else "max_tokens",
                   "invalid_value")


def _admit(s, pool: PrepPool, req) -> dict:
    """The checks that cost nothing, then the queue-full check, before any work is spent on the request; returns
    its sampling parameters. Requests in the preparation pool count against the queue (`pool.reserved`)."""
    choices = req.n
    slots = s.worker.ready.num_slots
    if choices > slots:
        raise APIError(400, f"`n` is {choices}, but this server runs at most {slots} sequences at once (its KV "
                       f"slots): ask for at most {slots} choices per request.", "invalid_request_error", "n",
                       "invalid_value")
    if not s.worker.alive:
        raise APIError(503, "the model worker is restarting; retry shortly" if s.worker.restarting else
                       "the model worker is not running", "server_error", None, "worker_unavailable",
                       headers={"Retry-After": "5"} if s.worker.restarting else None)
    sampling = sampling_from(req)
    vocab = s.worker.ready.vocab_size
    outside = sorted(t for t in sampling["logit_bias"] if t >= vocab)
    if outside:
        raise APIError(400, f"`logit_bias` names token {outside[0]}, outside this model's vocabulary [0, {vocab}).",
                       "invalid_request_error", "logit_bias", "invalid_value")
    if sampling["ignore_eos"] and not s.cfg.server.allow_ignore_eos:
        raise APIError(400, "`ignore_eos` is not enabled on this server: generating past end-of-sequence is for "
                       "benchmarks, and needs the server started with `server.allow_ignore_eos: true`.",
                       "invalid_request_error", "ignore_eos", "unsupported_parameter")
    if sampling["max_tokens"] is not None:
        _check_request_tokens(s, choices, sampling["max_tokens"], default=False)
    if s.worker.in_flight + pool.reserved + choices > s.cfg.cache.num_slots + s.cfg.server.max_waiting:
        raise _queue_full()
    return sampling


async def _prepare(s, request: Request, req, prepare: Callable[[], tuple[list[int], str | None, str | None]],
                   keep_special: tuple[int, ...] = ()) -> Choices:
    """Admit the request (`_admit`), run `prepare()` -> (prompt ids, grammar, echo) in the preparation pool, then
    the context checks and submission of its n choices to the worker (`echo`: the prompt text each choice's text
    starts with; `grammar`: what the output must match). (No check for a draining server: on SIGTERM uvicorn closes
    the listening socket and every idle connection first, so no new request reaches a route.)"""
    pool = _prep_pool(request)
    sampling = _admit(s, pool, req)
    choices = req.n
    pool.reserved += choices
    try:
        prompt_ids, grammar, echo = await pool.run(prepare)
        return _submit(s, request, req, sampling, prompt_ids, echo, grammar, keep_special)
    finally:
        pool.reserved -= choices


def _submit(s, request: Request, req, sampling: dict, prompt_ids: list[int], echo: str | None,
            grammar: str | None, keep_special: tuple[int, ...] = ()) -> Choices:
    """Context checks and submission of the request's n choices to the worker (``keep_special``: special tokens
    the replies' text keeps, ``ToolPlan.kept_tokens``)."""
    choices = req.n
    ctx, n = s.cfg.cache.max_seq_len, len(prompt_ids)
    if n >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt has {n} tokens "
                       "(at least one must remain for the completion).", "invalid_request_error", "messages",
                       "context_length_exceeded")
    max_tokens = sampling["max_tokens"]
    if max_tokens is None:
        max_tokens = ctx - n
        _check_request_tokens(s, choices, max_tokens, default=True)
    elif n + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens; you requested {n + max_tokens} "
                       f"tokens ({n} in the prompt, {max_tokens} for the completion).", "invalid_request_error",
                       "max_tokens", "context_length_exceeded")
    request_id = new_request_id("req")
    namespace = cache_namespace(request.state.cache_partition, req.cache_salt, s.cfg.cache.prefix_caching, request_id)
    group = Choices(s.worker, s.tokenizer, s.metrics, prompt_ids,
                    {**sampling, "max_tokens": max_tokens, "grammar": grammar, "keep_special": keep_special},
                    [] if sampling.get("ignore_eos") else s.stop_token_ids, n=choices, namespace=namespace,
                    request_id=request_id, echo=echo)
    group.submit()
    return group


async def _collect(request: Request, group: Choices) -> tuple[list[str], list[list[TokenLogprob]], dict] | None:
    """Run a non-streaming request to the end: (each choice's text, each choice's log probability entries, usage);
    None if the client went away (every choice is aborted)."""
    async def consume() -> tuple[list[str], list[list[TokenLogprob]], dict]:
        texts: list[list[str]] = [[] for _ in range(group.n)]
        entries: list[list[TokenLogprob]] = [[] for _ in range(group.n)]
        async with aclosing(group.events()) as events:
            async for i, d in events:
                texts[i].append(d.text)
                entries[i].extend(d.logprobs or ())
        return ["".join(t) for t in texts], entries, await group.usage()

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(consume()), asyncio.create_task(disconnected())
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        watch.cancel()
        return work.result()
    work.cancel()
    request.scope["state"]["outcome"] = "aborted"
    try:
        await work
    except asyncio.CancelledError:
        pass
    return None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _stream(request: Request, group: Choices, chunk: Callable[..., dict], include_usage: bool,
            first: dict | None, replies: list[ToolReply] | None = None) -> StreamingResponse:
    """SSE: optional role chunks (one per choice), the choices' text deltas interleaved as they arrive (with the log
    probabilities of the tokens whose text they complete) and a finish chunk per choice (each chunk names its
    choice's `index`), an optional usage chunk, then [DONE]. With tools (`replies`, one per choice), each choice's
    text goes through its parser: content, then each call's first delta (id, name) and its argument pieces; the log
    probabilities ride on the last delta a piece of text made (or on an empty content delta).

    An error after the stream started goes out as a final `data: {"error": ...}` event, without [DONE].
    """
    state = request.scope["state"]

    async def events() -> AsyncIterator[str]:
        state["outcome"] = "aborted"  # until the stream ends on its own
        try:
            if first is not None:
                for i in range(group.n):
                    yield _sse(chunk(i, first, None))
            async with aclosing(group.events()) as deltas:
                async for i, d in deltas:
                    if replies is not None:
                        pieces = replies[i].deltas(d.text, final=d.finish_reason is not None)
                        if d.logprobs and not pieces:
                            pieces = [{"content": ""}]
                        for k, piece in enumerate(pieces):
                            yield _sse(chunk(i, piece, None, d.logprobs if k == len(pieces) - 1 else None))
                        if d.finish_reason:
                            yield _sse(chunk(i, {}, replies[i].finish_reason(d.finish_reason)))
                        continue
                    if d.text or d.logprobs:
                        yield _sse(chunk(i, {"content": d.text} if first is not None else d.text, None, d.logprobs))
                    if d.finish_reason:
                        yield _sse(chunk(i, {} if first is not None else "", d.finish_reason))
            if include_usage:
                yield _sse(chunk(0, None, None, usage=await group.usage()))
            yield "data: [DONE]\n\n"
            state["outcome"] = "completed"
        except APIError as e:
            state["outcome"] = "client_error" if e.status < 500 else "server_error"
            yield _sse(e.to_body())

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _respond(request: Request, req, group: Choices, chat: bool, plan: ToolPlan | None = None):
    """The OpenAI response for a submitted request: SSE chunks when streaming, else one JSON body. With an active
    tool plan each choice's text is parsed into calls (server.api.tool_parser)."""
    s = _state(request)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + group.request_id.split("-", 1)[1],
            "created": int(time.time()), "model": s.model_name}
    piece_key = "delta" if chat else "text"
    with_logprobs = group.gens[0].sampling["logprobs"] is not None
    shape_logprobs = chat_logprobs if chat else completion_logprobs

    def logprobs(entries: list[TokenLogprob] | None) -> dict | None:
        # None for a chunk without tokens (role, finish, usage), and whenever they were not asked for
        return shape_logprobs(entries, s.token_text) if with_logprobs and entries is not None else None

    def chunk(index, piece, finish, entries=None, usage=None) -> dict:
        # piece: a delta dict (chat) or a text (completions); None for the closing usage-only chunk
        choices = [] if piece is None else [{"index": index, piece_key: piece, "finish_reason": finish,
                                             "logprobs": logprobs(entries)}]
        out = {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": choices}
        if req.include_usage:
            out["usage"] = usage
        return out

    replies = [ToolReply(plan) for _ in range(group.n)] if chat and plan is not None and plan.active else None
    if req.stream:
        return _stream(request, group, chunk, req.include_usage,
                       first={"role": "assistant", "content": ""} if chat else None, replies=replies)
    result = await _collect(request, group)
    if result is None:
        return Response(status_code=499)  # nobody is listening; the outcome is already "aborted"
    texts, entries, usage = result
    choices = []
    for i, (text, gen) in enumerate(zip(texts, group.gens)):
        choice = {"index": i, "finish_reason": gen.finish_reason, "logprobs": logprobs(entries[i])}
        if replies is not None:
            choice["message"], choice["finish_reason"] = replies[i].message(text, gen.finish_reason)
        else:
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        choices.append(choice)
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": usage}


@router.post("/v1/chat/completions", tags=["completions"])
async def chat_completions(req: ChatCompletionRequest, request: Request, _: Auth):
    s = _state(request)
    _check_model(s, req.model)
    plan = req.tool_plan(s.call_syntax)

    def prepare() -> tuple[list[int], str | None, None]:
        grammar = _grammar(s, req, plan)
        messages, tools = req.template_messages(s.template_knows_tools)
        try:
            return encode_chat(s.tokenizer, messages, tools), grammar, None
        except ChatTemplateError as e:
            raise APIError(400, str(e), "invalid_request_error", "messages", None) from None

    keep = plan.kept_tokens if plan is not None else ()
    return await _respond(request, req, await _prepare(s, request, req, prepare, keep), chat=True, plan=plan)


@router.post("/v1/completions", tags=["completions"])
async def completions(req: CompletionRequest, request: Request, _: Auth):
    s = _state(request)
    _check_model(s, req.model)

    def prepare() -> tuple[list[int], str | None, str | None]:
        if isinstance(req.prompt, str):
            prompt_ids = encode_text(s.tokenizer, req.prompt)
        else:
            prompt_ids = list(req.prompt)
            vocab = s.worker.ready.vocab_size
            if any(t >= vocab for t in prompt_ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "invalid_request_error", "prompt",
                               None)
        grammar = _grammar(s, req, None)
        echo = None
        if req.echo:  # the prompt as sent; token ids as they decode, special tokens included
            echo = (req.prompt if isinstance(req.prompt, str)
                    else s.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return prompt_ids, grammar, echo

    return await _respond(request, req, await _prepare(s, request, req, prepare), chat=False)


@router.get("/v1/models", tags=["models"], response_model=ModelList)
async def models(request: Request, _: Auth):
    s = _state(request)
    return ModelList(data=[ModelCard(id=s.model_name, created=s.created)])


@router.get("/health", tags=["ops"])
async def health(request: Request):
    """200 while the worker is alive, answers a probe (its reader thread does, at once, even mid-prefill), has not
    been inside one prefill or step for STUCK_S seconds or more, and its engine is not failing every step
    (`server.unhealthy_after_failed_steps` in a row); else 503 naming the state."""
    s = _state(request)
    w = s.worker
    pong = await w.ping(timeout=STUCK_S) if w.alive else None
    if pong is not None and w.alive and pong.busy_s < STUCK_S and not w.failing:
        return {"status": "ok", "worker": "alive", "worker_pid": w.process.pid}
    state = ("restarting" if w.restarting else "dead" if w.dead else "not answering" if pong is None
             else f"failing: {w.failed_steps} steps in a row failed in the engine" if w.failing
             else f"stuck in one prefill or step for {pong.busy_s:.0f} s")
    return JSONResponse({"status": "unhealthy", "worker": state}, status_code=503)


@router.get("/metrics", tags=["ops"])
async def metrics(request: Request):
    body, ctype = _state(request).metrics.render()
    return Response(body, media_type=ctype)
