"""Every message that crosses between the API process and the worker process, and nothing else.

Small typed structs encoded with msgpack (msgspec): the worker decodes only these shapes, never a pickle, so no byte
a client sent can run code on the other side. The API process has already turned the client's JSON into token ids
and numbers before anything is sent.
"""
from __future__ import annotations

import msgspec


# -- API process -> worker ---------------------------------------------------------------------------------------
class Generate(msgspec.Struct, tag="generate", frozen=True):
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    # The prefix-cache partition (API key and cache_salt): a request reuses only KV rows cached under the same
    # namespace. None: the engine's default partition (the API process always sends one).
    namespace: str | None = None
    # Shaping (core.sampling.SamplingParams): min_p, the OpenAI penalties over generated tokens, vLLM's repetition
    # penalty over prompt and generated tokens, and token id -> bias.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    # Log probabilities: None = off; k >= 0 = each generated token's (`logprobs`), or each prompt token's after the
    # first (`prompt_logprobs`), with the k most likely alternatives at that position.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A grammar string (core.grammar: a compiled JSON schema, Lark grammar or regex) the output must match; the
    # API process compiled and validated it. None: unconstrained.
    grammar: str | None = None


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """Drop the request (client gone, or a stop string matched); the worker answers with `Aborted` if it held it."""

    request_id: str


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    """Finish the running and waiting requests, then exit."""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Health probe; the worker's reader thread answers at once, even in the middle of a prefill or a step."""

    request_id: str


# -- worker -> API process ---------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", frozen=True):
    model_id: str
    drafter: str
    max_seq_len: int
    num_slots: int
    vocab_size: int
    device: str
    dtype: str


class StepStats(msgspec.Struct, frozen=True):
    """Speculation figures of one verify step, for the metrics."""

    draft_tokens: int
    accepted_tokens: int  # draft tokens accepted (bonus excluded)


class Logprob(msgspec.Struct, array_like=True, frozen=True):
    """One position's log probabilities: the token's, and the `top` most likely tokens there, most likely first, as
    (token id, logprob) pairs."""

    logprob: float
    top: list[tuple[int, float]] = []


class Tokens(msgspec.Struct, tag="tokens", frozen=True):
    """Tokens emitted for one request by prefill or by one or more verify steps."""

    request_id: str
    token_ids: list[int]
    steps: list[StepStats] = []
    finish_reason: str | None = None  # "stop" | "length" once the request is done
    usage: dict[str, float | int | str] | None = None  # final speculative stats, with the finish
    logprobs: list[Logprob] = []  # one per token of `token_ids` when the request asked for logprobs
    # with the request's first message when it asked for prompt logprobs: one per prompt token, None for the first
    prompt_logprobs: list[Logprob | None] | None = None


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """The worker could not run a request (bad input it detected, or an engine fault)."""

    request_id: str
    message: str
    kind: str = "invalid_request_error"  # or "server_error", or "overloaded" (queue full)


class Aborted(msgspec.Struct, tag="aborted", frozen=True):
    """The answer to an `Abort` of a request the worker held: its speculative stats so far (None if it was still
    waiting). A request the worker had already finished gets no answer: its finishing `Tokens` went out before."""

    request_id: str
    usage: dict[str, float | int | str] | None = None


class Pong(msgspec.Struct, tag="pong", frozen=True):
    request_id: str
    busy_s: float = 0.0  # how long the scheduler has been inside its current prefill or step (0: between two)
    failed_steps: int = 0  # consecutive steps that failed in the engine as a whole (0 after a step that ran)


class Status(msgspec.Struct, tag="status", frozen=True):
    """Scheduler gauges, sent whenever they change."""

    running: int
    waiting: int
    kv_usage: float             # fraction of the KV token capacity held by running sequences
    kv_cached_usage: float = 0.0  # fraction held by idle prefix-cache slots (evictable at any time)
    # prefix cache, cumulative since start: prompt tokens looked up, of them found cached, slots evicted
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_evictions: int = 0
    failed_steps: int = 0  # as in Pong


class Step(msgspec.Struct, tag="step", frozen=True):
    """One batched target forward: what the draft budget and the token budget put in it."""

    sequences: int       # sequences that took a speculative step
    rows: int            # rows of the forward: tree rows (roots included) + prompt-chunk tokens
    draft_rows: int      # draft tokens verified (rows past the roots)
    prefill_tokens: int  # prompt tokens prefilled
    seconds: float


ToWorker = Generate | Abort | Shutdown | Ping
FromWorker = Ready | Tokens | Failed | Aborted | Status | Pong | Step

_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    return _from_worker.decode(data)
