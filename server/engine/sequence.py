"""Per-sequence state: a request's tokens, KV slot, sampling and counters, and the read-only view drafters get."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.sampling import SamplingParams, Shaper
from core.tree import MAX_TREE_ROWS
from server.engine.kv_cache import KVCachePool


class RequestError(ValueError):
    """A request the engine cannot run (empty prompt, prompt over the context, bad token ids)."""


@dataclass
class SeqStats:
    draft_tokens: int = 0      # draft rows proposed (roots excluded)
    accepted_tokens: int = 0   # draft tokens accepted
    verify_steps: int = 0      # target forwards after prefill
    step_tokens: int = 0       # tokens emitted by verify steps (bonus included, after truncation)
    verify_seconds: float = 0.0  # wall time in the target's verify forwards (the offline benchmark's split)
    draft_seconds: float = 0.0   # wall time in the drafter's propose calls
    max_draft: int = 0           # the most draft rows of one step

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, bonus included (1.0 for plain decoding)."""
        return self.step_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_steps": self.verify_steps, "mean_accepted_length": round(self.mean_accepted_length, 4),
                "mean_draft_length": round(self.draft_tokens / self.verify_steps, 4) if self.verify_steps else 0.0,
                "max_draft_length": self.max_draft}


@dataclass
class Sequence:
    seq_id: int
    slot: int
    prompt_len: int
    token_ids: list[int]           # prompt + generated; the last one is the next root (its KV is not cached)
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    cache_len: int = 0
    finish_reason: str | None = None
    max_rows: int = MAX_TREE_ROWS  # the row budget of the tree being drafted (root included)
    cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache
    namespace: str = ""            # the prefix cache's partition its rows are indexed under
    stats: SeqStats = field(default_factory=SeqStats)
    shaper: Shaper | None = None   # the request's logit_bias and penalties, with its token counts (None: neither)
    # with sampling.logprobs set: one (logprob, [(token id, logprob), ...] most likely first) per generated token
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # with sampling.prompt_logprobs set: the same per prompt token, None for the first (filled as chunks prefill)
    prompt_logprobs: list | None = None

    @property
    def matcher(self):
        """The request's grammar state (core.grammar.Matcher: the committed tokens consumed), or None."""
        return None if self.shaper is None else self.shaper.matcher

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prefilled(self) -> bool:
        """Whether the whole prompt is cached (the sequence decodes; before that it takes prompt chunks)."""
        return self.cache_len >= self.prompt_len

    def append(self, tokens: list[int], logprobs: list | None, max_seq_len: int) -> list[int]:
        """Append emitted tokens (and their logprobs), stopping at a stop token, where the grammar is complete,
        at max_new_tokens or at the end of the context (``max_seq_len``); the grammar's matcher commits them and the
        shaper counts them. Returns the tokens appended."""
        out = []
        matcher = self.matcher
        for t in tokens:
            self.token_ids.append(t)
            out.append(t)
            if matcher is not None:
                matcher.consume([t])
            if t in self.stop_token_ids or (matcher is not None and matcher.stopped):
                self.finish_reason = "stop"
            elif self.num_generated >= self.max_new_tokens or len(self.token_ids) >= max_seq_len:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if logprobs is not None:
            self.logprobs += logprobs[:len(out)]
        if self.shaper is not None:
            self.shaper.append(out)
        return out


class SeqView:
    """Read-only view of a sequence for drafters (implements drafters.base.SequenceView)."""

    def __init__(self, seq: Sequence, pool: KVCachePool, target):
        self._seq, self._pool, self.target = seq, pool, target
        self.seq_id, self.prompt_len = seq.seq_id, seq.prompt_len

    @property
    def tokens(self) -> list[int]:
        return self._seq.token_ids

    @property
    def cache_len(self) -> int:
        return self._seq.cache_len

    @property
    def sampling(self) -> SamplingParams:
        return self._seq.sampling

    @property
    def max_rows(self) -> int:
        return self._seq.max_rows

    def target_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._seq.cache_len
        k, v = self._pool.k[layer, self._seq.slot, :, :n], self._pool.v[layer, self._seq.slot, :, :n]
        dtype = self._pool.hidden.dtype  # the model's: a narrower K/V store is widened for the reader
        return k.to(dtype), v.to(dtype)

    def target_hidden(self) -> torch.Tensor:
        return self._pool.hidden[self._seq.slot, :self._seq.cache_len, :self.target.args.hidden_size]

    def target_taps(self) -> torch.Tensor:
        n, W = self._seq.cache_len, self.target.args.hidden_size
        return self._pool.hidden[self._seq.slot, :n, W:].view(n, -1, W)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str
    stats: SeqStats
    prefill_s: float = 0.0
    decode_s: float = 0.0
    logprobs: list = field(default_factory=list)  # per token, with sampling.logprobs set (Sequence.logprobs)
    prompt_logprobs: list | None = None
