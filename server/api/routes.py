"""HTTP routes: chat and text completions (JSON or SSE), models, health, metrics."""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import aclosing
from typing import Annotated, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.api.errors import APIError, api_key_dependency, bearer_token
from server.api.generation import Choices, TokenLogprob, cache_namespace
from server.api.logprobs import chat_logprobs, completion_logprobs
from server.api.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, sampling_from)
from server.api.structured import FieldError, compile_checked, response_format_grammar
from server.api.tools import ToolPlan, ToolReply, tool_grammar_lark
from server.tokenization import ChatTemplateError, encode_chat, encode_text
from server.worker.process import new_request_id

router = APIRouter()
STUCK_S = 10.0  # /health: a worker this long inside one prefill or step (or this long silent) is unhealthy


def _state(request: Request):
    return request.app.state.s


async def _auth(request: Request) -> None:
    s = _state(request)
    await api_key_dependency(s.api_key)(request)


Auth = Annotated[None, Depends(_auth)]


def _check_model(s, model: str) -> None:
    if model != s.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{s.model_name}`.",
                       "invalid_request_error", "model", "model_not_found")


def _grammar(s, req, plan: ToolPlan | None) -> str | None:
    """The grammar the request's output must match (the tools' when they are active, else `response_format`'s;
    None: free text), compiled and checked against the model's tokenizer; what cannot be enforced is a 400 naming
    the field (each tool's schema checked on its own first, so the message names the tool)."""
    from core.grammar import json_schema_grammar, lark_grammar

    def check(param: str, what: str, build) -> str | None:
        try:
            return compile_checked(s.grammars, build, what)
        except FieldError as e:
            raise APIError(400, str(e), "invalid_request_error", param, "invalid_value") from None

    fmt = req.response_format
    grammar = check("response_format", "The JSON schema of `response_format`", lambda: response_format_grammar(fmt))
    if plan is None or not plan.active:
        return grammar
    field = "functions" if plan.legacy else "tools"
    for i, tool in enumerate(plan.tools):
        where = f"functions[{i}]" if plan.legacy else f"tools[{i}].function"
        check(field, f"The JSON schema `{where}.parameters`",
              lambda tool=tool: json_schema_grammar(tool.arguments_schema()))
    return check(field, f"The call grammar of `{field}`", lambda: lark_grammar(tool_grammar_lark(plan, fmt)))


def _prepare(s, request: Request, req, prompt_ids: list[int], echo: str | None = None,
             grammar: str | None = None) -> Choices:
    """Vocabulary and context checks, admission control, and submission of the request's n choices to the worker
    (`echo`: the prompt text each choice's text starts with; `grammar`: what the output must match). (No check for a
    draining server: on SIGTERM uvicorn closes the listening socket and every idle connection first, so no new
    request reaches a route.)"""
    choices = req.n
    slots = s.worker.ready.num_slots
    if choices > slots:
        raise APIError(400, f"`n` is {choices}, but this server runs at most {slots} sequences at once (its KV "
                       f"slots): ask for at most {slots} choices per request.", "invalid_request_error", "n",
                       "invalid_value")
    if not s.worker.alive:
        raise APIError(503, "the model worker is not running", "server_error", None, "worker_unavailable")
    sampling = sampling_from(req)
    vocab = s.worker.ready.vocab_size
    outside = sorted(t for t in sampling["logit_bias"] if t >= vocab)
    if outside:
        raise APIError(400, f"`logit_bias` names token {outside[0]}, outside this model's vocabulary [0, {vocab}).",
                       "invalid_request_error", "logit_bias", "invalid_value")
    ctx, n = s.cfg.cache.max_seq_len, len(prompt_ids)
    if n >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt has {n} tokens "
                       "(at least one must remain for the completion).", "invalid_request_error", "messages",
                       "context_length_exceeded")
    max_tokens = sampling["max_tokens"]
    if max_tokens is None:
        max_tokens = ctx - n
    elif n + max_tokens > ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens; you requested {n + max_tokens} "
                       f"tokens ({n} in the prompt, {max_tokens} for the completion).", "invalid_request_error",
                       "max_tokens", "context_length_exceeded")
    if s.worker.in_flight + choices > s.cfg.cache.num_slots + s.cfg.server.max_waiting:
        raise APIError(503, "the server is overloaded: the waiting queue is full; retry later", "server_error",
                       None, "queue_full", headers={"Retry-After": "1"})
    request_id = new_request_id("req")
    namespace = cache_namespace(bearer_token(request), req.cache_salt, s.cfg.cache.prefix_caching, request_id)
    group = Choices(s.worker, s.tokenizer, s.metrics, prompt_ids,
                    {**sampling, "max_tokens": max_tokens, "grammar": grammar},
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
    tool plan each choice's text is parsed into calls (server.api.tools)."""
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
    plan = req.tool_plan()
    grammar = await run_in_threadpool(_grammar, s, req, plan)
    messages, tools = req.template_messages(s.template_knows_tools)
    try:
        prompt_ids = await run_in_threadpool(encode_chat, s.tokenizer, messages, tools)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "invalid_request_error", "messages", None) from None
    return await _respond(request, req, _prepare(s, request, req, prompt_ids, grammar=grammar), chat=True,
                          plan=plan)


@router.post("/v1/completions", tags=["completions"])
async def completions(req: CompletionRequest, request: Request, _: Auth):
    s = _state(request)
    _check_model(s, req.model)
    if isinstance(req.prompt, str):
        prompt_ids = await run_in_threadpool(encode_text, s.tokenizer, req.prompt)
    else:
        prompt_ids = list(req.prompt)
        vocab = s.worker.ready.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "invalid_request_error", "prompt",
                           None)
    grammar = await run_in_threadpool(_grammar, s, req, None)
    echo = None
    if req.echo:  # the prompt as sent; token ids as they decode, special tokens included
        echo = req.prompt if isinstance(req.prompt, str) else s.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return await _respond(request, req, _prepare(s, request, req, prompt_ids, echo, grammar), chat=False)


@router.get("/v1/models", tags=["models"], response_model=ModelList)
async def models(request: Request, _: Auth):
    s = _state(request)
    return ModelList(data=[ModelCard(id=s.model_name, created=s.created)])


@router.get("/health", tags=["ops"])
async def health(request: Request):
    """200 while the worker is alive, answers a probe (its reader thread does, at once, even mid-prefill) and has not
    been inside one prefill or step for STUCK_S seconds or more; else 503."""
    s = _state(request)
    pong = await s.worker.ping(timeout=STUCK_S) if s.worker.alive else None
    if pong is not None and s.worker.alive and pong.busy_s < STUCK_S:
        return {"status": "ok", "worker": "alive", "worker_pid": s.worker.process.pid}
    state = ("dead" if s.worker.dead else "not answering" if pong is None
             else f"stuck in one prefill or step for {pong.busy_s:.0f} s")
    return JSONResponse({"status": "unhealthy", "worker": state}, status_code=503)


@router.get("/metrics", tags=["ops"])
async def metrics(request: Request):
    body, ctype = _state(request).metrics.render()
    return Response(body, media_type=ctype)
