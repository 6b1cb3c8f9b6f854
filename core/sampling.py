"""A request's sampling parameters, the target distribution they define, and a request's random draws.

The engine's acceptance rule and every drafter's sampling code share these, so a drafter's q and the engine's p are
shaped by one function.

A request with a seed draws each token by an exponential race keyed on (seed, position) (:func:`token_clocks`,
:func:`race`): token x wins with probability p(x), and the winner depends on the target's distribution at that
position and on nothing else, so a seeded request returns the same tokens whatever drafts were verified, whatever
else shared its steps and whether the load-aware budget let it draft. A request without a seed keeps a generator
(:func:`request_generator`) and speculative sampling's rejection rule, which accepts more of a sampled draft.
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


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError("temperature must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def target_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p (vLLM's order).

    Only for sampled requests (``not sp.greedy``): greedy requests take the argmax.
    """
    if sp.greedy:
        raise ValueError(f"temperature {sp.temperature} decodes greedily; there is no distribution to sample")
    x = logits.float() / sp.temperature
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
