"""The FastAPI app factory and the `specserve serve` process (API process + one worker process)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from server.api.auth import ApiKeys
from server.api.errors import BodySizeLimitMiddleware, install_error_handlers
from server.api.logprobs import TokenText
from server.api.structured import GrammarCompiler
from server.api.tools import CallSyntax, template_call_syntax, template_knows_tools
from server.config import EngineConfig
from server.metrics import Metrics
from server.worker.process import WorkerClient

log = logging.getLogger("specserve.api")
MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class ServerState:
    cfg: EngineConfig
    worker: WorkerClient
    tokenizer: object
    metrics: Metrics
    model_name: str
    stop_token_ids: list[int]
    api_key: str | ApiKeys | None  # the keys callers must present (a single key as a string); None: anyone
    created: int
    api_keys: ApiKeys | None = field(init=False)
    token_text: TokenText = field(init=False)  # token strings and bytes, for log probabilities
    # response_format and tool grammars checked against the model's tokenizer (built on first use; `serve` builds
    # it at startup)
    grammars: GrammarCompiler = field(init=False)
    template_knows_tools: bool = field(init=False)  # the chat template renders `tools` itself
    call_syntax: CallSyntax = field(init=False)  # how the model writes tool calls (its template's syntax)

    def __post_init__(self):
        self.api_keys = self.api_key if not isinstance(self.api_key, str) else ApiKeys.of([self.api_key])
        self.token_text = TokenText(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.worker.ready.vocab_size, self.stop_token_ids)
        self.template_knows_tools = template_knows_tools(self.tokenizer)
        self.call_syntax = template_call_syntax(self.tokenizer)


class OutcomeMiddleware:
    """Counts every generation request once: received, then exactly one outcome.

    A route that streams sets ``scope["state"]["outcome"]`` when the stream ends (completed / aborted / error); any
    other response is classified by its status code (4xx client error, 5xx server error).
    """

    PATHS = ("/v1/chat/completions", "/v1/completions")

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.PATHS or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        self.metrics.of(self.metrics.received).inc()
        scope.setdefault("state", {})
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            outcome = scope["state"].get("outcome")
            if outcome is None:
                code = status["code"]
                outcome = "completed" if code < 400 else "client_error" if code < 500 else "server_error"
            self.metrics.outcome(outcome)


def create_app(state: ServerState) -> FastAPI:
    from server.api.routes import router

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="specserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server with lossless speculative decoding")
    app.state.s = state
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(OutcomeMiddleware, metrics=state.metrics)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    return app


def serve(cfg: EngineConfig, host: str, port: int, api_keys: ApiKeys | None, drain_timeout: float = 30.0) -> int:
    """Run the API process until SIGTERM/SIGINT (exit 0 after draining), or until its worker died more often than
    ``server.worker_restarts`` allows (exit 1; the client restarts it within that budget)."""
    import uvicorn

    from core.ops import LlamaArgs
    from server.model_files import load_hf_config, load_tokenizer, resolve_model
    from server.tokenization import stop_token_ids
    from server.worker.process import freeze_startup_heap

    logging.basicConfig(level=logging.INFO, format="%(asctime)s api %(levelname)s %(message)s")
    # Convert the GGUF (first run only) here, before the worker starts, so the worker loads from the cache.
    resolved = resolve_model(cfg.model.source, cfg.model.cache_dir)
    tokenizer = load_tokenizer(resolved.hf_dir)
    args = LlamaArgs.from_hf(load_hf_config(resolved.hf_dir))
    args.check_context(cfg.cache.max_seq_len)  # before the worker loads anything
    server: uvicorn.Server | None = None

    def on_death():
        # Past the restart budget: in-flight requests have been failed; stop serving so Docker / Kubernetes restart
        # the container.
        if server is not None:
            asyncio.get_running_loop().call_later(0.5, lambda: setattr(server, "should_exit", True))

    worker = WorkerClient(cfg, on_death=on_death)
    ready = worker.start()
    log.info("worker ready: model %s, drafter %s, %s %s, %d slots x %d tokens", ready.model_id, ready.drafter,
             ready.device, ready.dtype, ready.num_slots, ready.max_seq_len)
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, num_slots=ready.num_slots))  # as sized
    metrics = Metrics(cfg.server.served_model_name or ready.model_id, ready.drafter)
    worker.add_listener(metrics.on_worker_message)
    worker.on_restart = metrics.worker_restarted
    state = ServerState(cfg=cfg, worker=worker, tokenizer=tokenizer, metrics=metrics,
                        model_name=cfg.server.served_model_name or ready.model_id,
                        stop_token_ids=list(stop_token_ids(tokenizer, args.eos_token_ids)), api_key=api_keys,
                        created=int(time.time()))
    state.grammars.tokenizer  # the grammar engine's view of the vocabulary, before the first request needs it
    app = create_app(state)
    freeze_startup_heap()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=drain_timeout, access_log=False))
    # uvicorn re-raises the signal that stopped it once it has drained; with these handlers in place that re-raise
    # is a no-op, so a drained SIGTERM ends in exit status 0 (the handlers uvicorn installs while serving win).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        worker.shutdown(timeout=drain_timeout)
    if worker.crashed:
        log.error("exiting with status 1: the worker process died and was not restarted")
        return 1
    return 0
