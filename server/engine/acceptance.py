"""Lossless acceptance of a verified draft tree: greedy (token-exact) and speculative sampling (distribution-exact).

Greedy: from the root follow the child whose token is the target's argmax; at the first miss (or a leaf) emit the
target's argmax there (the bonus token).

Sampling (SpecInfer-style multi-candidate speculative sampling, exact for any tree): at the current node, p is the
target distribution after temperature / top-k / top-p. Children are tried in order; child c with token x and draft
distribution q_c is accepted with probability min(1, p(x) / q_c(x)); on rejection p <- norm(max(p - q_c, 0)) and the
next sibling is tried. A point-mass child (no q) is the special case q_c = onehot(x): accept with probability p(x),
else zero p(x) and renormalise. When no child is accepted, the bonus token is drawn from what is left of p.
Exactness needs each child's token to be drawn from its q independently of its siblings (or to be a point mass).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafters.base import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p (vLLM's order)."""
    x = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[:, -1:]  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= sp.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Returns (accepted rows, root first; emitted tokens, bonus last). logits: [T+1, V]."""
    best = logits.argmax(-1).tolist()  # [T+1]
    children = tree.children()
    rows, tokens, node = [0], [], 0
    while True:
        nxt = next((c for c in children[node] if tree.tokens[c] == best[node]), None)
        if nxt is None:
            tokens.append(best[node])
            return rows, tokens
        rows.append(nxt)
        tokens.append(tree.tokens[nxt])
        node = nxt


def request_generator(sampling: SamplingParams, device: torch.device, offset: int = 0) -> torch.Generator:
    """A generator for one request: seeded from its ``seed`` (+ ``offset``, so a drafter's draws differ from the
    engine's) or at random when it has none."""
    gen = torch.Generator(device=device)
    seed = sampling.seed
    gen.manual_seed(seed + offset if seed is not None else int(torch.randint(2**62, ()).item()))
    return gen


def accept_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator
                    ) -> tuple[list[int], list[int]]:
    """Lossless tree speculative sampling. probs: [T+1, V] shaped target distributions (see target_probs)."""
    children = tree.children()
    q = tree.q
    has_q = (q.sum(-1) > 0).tolist() if q is not None else [False] * tree.num_rows
    rows, tokens, node = [0], [], 0
    while True:
        p = probs[node]
        accepted = None
        for c in children[node]:
            x = tree.tokens[c]
            u = torch.rand((), generator=generator, device=p.device).item()
            if has_q[c]:
                qc = q[c].to(p.device, torch.float32)
                if u * float(qc[x]) < float(p[x]):  # u < p(x)/q(x), without dividing by a zero q(x)
                    accepted = c
                    break
                p = _normalise(torch.clamp(p - qc, min=0.0), fallback=p)
            else:
                if u < float(p[x]):
                    accepted = c
                    break
                p = p.clone()
                p[x] = 0.0
                p = _normalise(p, fallback=probs[node])
        if accepted is None:
            tokens.append(int(torch.multinomial(p, 1, generator=generator).item()))
            return rows, tokens
        rows.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted


def _normalise(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    s = float(p.sum())
    # A rejection implies p(x) < q(x) somewhere, so mass remains; the guard only catches float round-off.
    return p / s if s > 1e-12 else fallback
