"""A request's sampling parameters, the target distribution they define, and a request's random draws.

The engine's acceptance rule and every drafter's sampling code share these, so a drafter's q and the engine's p are
shaped by one function.

A request with a seed draws each token by an exponential race keyed on (seed, position) (:func:`token_clocks`,
:func:`race`): token x wins with probability p(x), and the winner depends on the target's distribution at that
position and on nothing else, so a seeded request returns the same tokens whatever drafts were verified, whatever
else shared its steps and whether the load-aware budget let it draft. A request without a seed keeps a generator
(:func:`request_generator`) and speculative sampling's rejection rule, which accepts more of a sampled draft.

Shaping, in this order (vLLM's): grammar mask -> logit_bias -> penalties -> (greedy: argmax) -> temperature ->
min_p -> top-k -> top-p. The first three depend on the request's history (:class:`Shaper`); the engine applies them
to every tree row the acceptance walk visits with the state of that row's own path (the committed tokens plus the
drafted tokens from the root to the row), so a speculative step shapes each position exactly as plain decoding would
after the same tokens.
The rest (:func:`target_probs`) depends on the row alone.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

# Temperatures below this decode greedily (as vLLM does): logits / 1e-38 overflows float32 to inf, and softmax of
# that is NaN. At 1e-5 the distribution is already a point mass on the argmax for any logit gap above ~1e-3.
GREEDY_TEMPERATURE = 1e-5


MAX_LOGIT_BIAS = 100.0     # |bias| per token (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGPROBS = 20          # alternatives per position (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    seed: int | None = None
    min_p: float = 0.0        # drop tokens below min_p x the most likely one's probability (after temperature)
    presence_penalty: float = 0.0   # subtracted once from every token generated so far (OpenAI, -2..2)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens (OpenAI, -2..2)
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt + generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to the logits first
    logprobs: int | None = None         # generated tokens' logprobs with this many alternatives; None: off
    prompt_logprobs: int | None = None  # prompt tokens' logprobs (the first has none); None: off
    grammar: str | None = None          # a grammar string the output must match (core.grammar); None: free

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError("temperature must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError("repetition_penalty must be finite and > 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or tok < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (shaping then depends on the tokens so far)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def shaped(self) -> bool:
        """Whether the logits are shaped before the argmax / temperature (a grammar, a bias or a penalty)."""
        return self.penalized or bool(self.logit_bias) or self.grammar is not None


class Shaper:
    """One request's logit_bias and penalties, with the counts of the tokens it has so far.

    Only the columns they can change are touched: the biased tokens, the tokens generated so far (presence and
    frequency penalties) and, with a repetition penalty, the prompt's. :meth:`__call__` shapes one row of logits for
    the state after the committed tokens plus ``path`` (the drafted tokens between the committed ones and that row,
    root excluded: the root is committed). Each column is computed by the same float32 operations from its logit, its
    bias and its count (an exact small integer), so a row shaped with (committed + path) is bitwise the row plain
    decoding shapes once those tokens are committed."""

    def __init__(self, sp: SamplingParams, prompt_ids: list[int], vocab_size: int, device: torch.device | str,
                 matcher=None):
        self.sp, self.device = sp, torch.device(device)
        self.matcher = matcher  # the request's grammar state (core.grammar.Matcher), or None: no grammar
        self._bias = {int(t): float(b) for t, b in sp.logit_bias}
        if self._bias and max(self._bias) >= vocab_size:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab_size}")
        # the columns shaping touches, in the order they were first needed: token id, bias, generated count, seen
        # (prompt or generated); grown as new tokens are generated
        t = functools.partial(torch.tensor, device=self.device)
        prompt = set(prompt_ids) if sp.repetition_penalty != 1.0 else set()
        ids = list(self._bias) + sorted(prompt - set(self._bias))
        self._pos = {i: k for k, i in enumerate(ids)}
        self._ids = t(ids, dtype=torch.long)
        self._bias_v = t([self._bias.get(i, 0.0) for i in ids], dtype=torch.float32)
        self._counts = torch.zeros(len(ids), dtype=torch.float32, device=self.device)
        self._seen = t([i in prompt for i in ids], dtype=torch.bool)

    def _columns(self, tokens, ids, bias, counts, seen, pos):
        """The columns extended by tokens that have none yet (count 0, not seen) -> (ids, bias, counts, seen, pos)."""
        new = [i for i in dict.fromkeys(tokens) if i not in pos]
        if not new:
            return ids, bias, counts, seen, pos
        t = functools.partial(torch.tensor, device=self.device)
        return (torch.cat([ids, t(new, dtype=torch.long)]),
                torch.cat([bias, t([self._bias.get(i, 0.0) for i in new], dtype=torch.float32)]),
                torch.cat([counts, torch.zeros(len(new), device=self.device)]),
                torch.cat([seen, torch.zeros(len(new), dtype=torch.bool, device=self.device)]),
                {**pos, **{i: len(pos) + k for k, i in enumerate(new)}})

    def append(self, tokens: list[int]) -> None:
        """Generated tokens were committed (the engine commits them to the matcher itself, token by token, to stop
        where the grammar completes)."""
        if self.sp.penalized and tokens:
            self._ids, self._bias_v, self._counts, self._seen, self._pos = self._columns(
                tokens, self._ids, self._bias_v, self._counts, self._seen, self._pos)
            rows = torch.tensor([self._pos[i] for i in tokens], device=self.device)
            self._counts.index_add_(0, rows, torch.ones(len(tokens), device=self.device))
            self._seen[rows] = True

    def __call__(self, logits: torch.Tensor, path: list[int] = ()) -> torch.Tensor:
        """[V] logits of one row -> [V] float32 logits after the grammar's mask (-inf where the grammar, advanced
        along ``path``, allows no token), logit_bias and the penalties."""
        ids, bias, counts, seen = self._ids, self._bias_v, self._counts, self._seen
        if path:  # the path's tokens: counted once more each, and seen
            ids, bias, counts, seen, pos = self._columns(path, ids, bias, counts, seen, self._pos)
            rows = torch.tensor([pos[i] for i in path], device=self.device)
            counts = counts.index_add(0, rows, torch.ones(len(path), device=self.device))
            seen = seen.clone()
            seen[rows] = True
        x = logits.float()
        x = x.clone() if x.data_ptr() == logits.data_ptr() else x
        if self.matcher is not None:
            x.masked_fill_(~self.matcher.allowed(path).to(x.device), float("-inf"))
        v = x[ids]
        if self._bias:
            v = v + bias
        if self.sp.penalized:
            v = penalize(v, counts, seen, self.sp)
        x[ids] = v
        return x


def penalize(x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on float32 logits: the repetition penalty on every token seen (prompt or generated), then
    frequency x count and presence x (count > 0) subtracted for generated tokens."""
    r = sp.repetition_penalty
    if r != 1.0:
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if sp.frequency_penalty:
        x = x - sp.frequency_penalty * counts
    if sp.presence_penalty:
        x = x - sp.presence_penalty * (counts > 0).float()
    return x


def target_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, min_p, top-k and top-p (vLLM's order); the
    logits are already shaped by the request's :class:`Shaper` where it has one.

    Only for sampled requests (``not sp.greedy``): greedy requests take the argmax.
    """
    if sp.greedy:
        raise ValueError(f"temperature {sp.temperature} decodes greedily; there is no distribution to sample")
    x = logits.float() / sp.temperature
    if sp.min_p > 0.0:
        p = x.softmax(-1)
        x = x.masked_fill(p < sp.min_p * p.max(-1, keepdim=True).values, float("-inf"))
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[:, -1:]  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= sp.top_p  # keep the smallest prefix whose mass reaches top_p
        drop[..., 0] = False  # and always the most likely token (a top_p below float32's range compares as 0)
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


@functools.lru_cache(maxsize=64)  # a drafter's draws at the positions it drafts are the engine's when it verifies
def token_clocks(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[vocab_size] float32 Exp(1) draws for the token at index ``position`` of a request seeded ``seed`` (prompt
    included): a function of (seed, position) alone, independent across positions and seeds. Shared between
    callers: read it, never modify it in place."""
    gen = torch.Generator()
    gen.manual_seed(_stream_seed(f"{seed}@{position}"))
    return torch.rand(vocab_size, generator=gen).log_().neg_()  # u in [0, 1): -log u in (0, inf]


def race(probs: torch.Tensor, clocks: torch.Tensor, n: int = 1) -> list[int]:
    """The first ``n`` indices of ``probs`` [V] to ring when index x's clock runs at rate p(x) (smallest clocks / p
    first; equivalent to Gumbel-max). The first is a draw from ``probs``; indices of probability 0 never ring before
    the others."""
    ratio = clocks.to(probs.device) / probs.float()
    if n == 1:
        return [int(torch.argmin(ratio))]
    return torch.topk(ratio, min(n, ratio.numel()), largest=False).indices.tolist()


def _stream_seed(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch takes seeds below 2**64; keep it positive


def request_generator(sampling: SamplingParams, device: torch.device, offset: int = 0) -> torch.Generator:
    """A generator for one request: seeded from its ``seed`` or at random when it has none.

    ``offset`` names an independent stream of the same request (0: the engine's acceptance; a drafter takes its own):
    it is hashed with the seed, so a drafter's stream of request ``seed`` is never another request's acceptance
    stream (``seed + offset`` made request s's drafter draws request s + 1's acceptance draws).
    """
    gen = torch.Generator(device=device)
    seed = sampling.seed
    if seed is None:
        seed = int(torch.randint(2**62, ()).item())
    elif offset:
        seed = _stream_seed(f"{seed}:{offset}")
    gen.manual_seed(seed)
    return gen
