"""The contract between drafters and the engine: the draft tree, the drafter Protocol, and the registry.

A drafter proposes a :class:`DraftTree` rooted at the last accepted token; the engine verifies all of its rows in one
target forward, accepts a path losslessly, and tells the drafter what happened through :meth:`Drafter.observe`.
Drafters read the target only through the read-only :class:`SequenceView` / :class:`TargetView` the engine hands them.
Nothing outside this package branches on which drafter is running.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

MAX_TREE_ROWS = 64  # root included: the verification mask is one int64 bitmask per row


@dataclass
class DraftTree:
    """Rows in topological order; row 0 is the root (the last accepted token, whose KV is not cached yet).

    tokens:  [T+1] token ids
    parents: [T+1] parent row of each row, -1 for the root; parents[i] < i
    q:       optional [T+1, V] float tensor, row i = the distribution row i's token was drawn from (independently of
             its siblings). An all-zero row (or q=None) marks a point mass: a deterministic proposal (top-k, n-gram).
             Row 0 is ignored.
    """

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls([root], [-1])

    @classmethod
    def chain(cls, root: int, draft: list[int], q: torch.Tensor | None = None) -> "DraftTree":
        return cls([root, *draft], list(range(-1, len(draft))), q)

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def num_draft(self) -> int:
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            ch[self.parents[i]].append(i)
        return ch

    def truncate(self, num_rows: int) -> "DraftTree":
        """The first ``num_rows`` rows (still a valid tree: parents precede children)."""
        if num_rows >= self.num_rows:
            return self
        q = self.q[:num_rows] if self.q is not None else None
        return DraftTree(self.tokens[:num_rows], self.parents[:num_rows], q)

    def validate(self, vocab_size: int) -> None:
        n = len(self.tokens)
        if n < 1 or len(self.parents) != n:
            raise ValueError(f"draft tree: {n} tokens but {len(self.parents)} parents")
        if n > MAX_TREE_ROWS:
            raise ValueError(f"draft tree has {n} rows; at most {MAX_TREE_ROWS} (root included)")
        if self.parents[0] != -1:
            raise ValueError("draft tree: row 0 must be the root (parent -1)")
        for i in range(1, n):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"draft tree: row {i} has parent {self.parents[i]}; rows must be topological")
        if any(not 0 <= t < vocab_size for t in self.tokens):
            raise ValueError(f"draft tree: token id out of range [0, {vocab_size})")
        if self.q is not None and tuple(self.q.shape) != (n, vocab_size):
            raise ValueError(f"draft tree: q has shape {tuple(self.q.shape)}, expected {(n, vocab_size)}")


@dataclass
class VerifyResult:
    """What verification decided for one tree."""

    accepted_rows: list[int]  # the accepted path, root (row 0) first
    tokens: list[int]         # tokens emitted: the accepted draft tokens, then the target's bonus token
    num_draft: int            # draft rows proposed (root excluded)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_rows) - 1


class TargetView(Protocol):
    """Frozen, read-only pieces of the target model that drafters may share."""

    args: Any  # server.engine.model.LlamaArgs
    device: torch.device
    dtype: torch.dtype
    model_id: str

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...           # [N] -> [N, hidden]
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...      # [N, hidden] pre-norm -> [N, V] logits
    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...  # [N, heads, D] rotated
    @property
    def embed_weight(self) -> torch.Tensor: ...    # [V, hidden] input embedding (frozen; do not modify)
    @property
    def lm_head_weight(self) -> torch.Tensor: ...  # [V, hidden] output projection (frozen; do not modify)


class SequenceView(Protocol):
    """Read-only view of one running sequence."""

    seq_id: int
    prompt_len: int
    target: TargetView

    @property
    def tokens(self) -> list[int]: ...     # prompt + accepted tokens; the last one is the next tree's root
    @property
    def cache_len(self) -> int: ...        # tokens whose target KV is cached (= len(tokens) - 1)
    def target_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # post-RoPE K, V [H_kv, cache_len, D]
    def target_hidden(self) -> torch.Tensor: ...  # last-layer hidden states of cached tokens [cache_len, hidden]
    @property
    def sampling(self) -> Any: ...         # server.engine.acceptance.SamplingParams of the request


@runtime_checkable
class Drafter(Protocol):
    """Per-deployment drafter; keeps per-sequence state keyed by ``seq.seq_id``."""

    name: str

    def prefill(self, seq: SequenceView) -> None: ...
    def propose(self, seq: SequenceView) -> DraftTree: ...
    def observe(self, seq: SequenceView, result: VerifyResult) -> None: ...
    def release(self, seq_id: int) -> None: ...


# name -> "module:Class". Modules load lazily, so a deployment imports only the drafter it runs.
_REGISTRY: dict[str, str] = {
    "none": "drafters.none:NoneDrafter",
    "ngram": "drafters.ngram:NgramDrafter",
    "glide": "drafters.glide.drafter:GlideDrafter",
    "glide-cape": "drafters.glide.drafter:GlideCapeDrafter",
    "maxgram": "drafters.cascade.maxgram:MaxGramDrafter",
    "cascade": "drafters.cascade.drafter:CascadeDrafter",
}


def drafter_names() -> list[str]:
    return sorted(_REGISTRY)


def create_drafter(name: str, target: TargetView, options: dict[str, Any] | None = None) -> Drafter:
    """Build the drafter called ``name``; unknown names and options fail with the valid choices."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; valid drafters: {', '.join(drafter_names())}")
    module, cls_name = _REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    try:
        return cls(target, **(options or {}))
    except TypeError as e:
        raise ValueError(f"drafter {name!r}: bad options {sorted(options or {})}: {e}") from None
