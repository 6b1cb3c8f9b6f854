"""`maxgram`: the Max-Gram statistical drafter of Cascade Speculative Drafting, no neural model.

To extend a context, find the longest suffix of it that occurred earlier (a match in the prompt wins over one of the
same length in the generated text; among equals the most recent wins) and copy the tokens that followed that
occurrence. Where no earlier occurrence exists (or it is shorter than ``min_match``), take one token from a bigram
table -- the most likely next token given the previous one -- and try matching again. Repeat until ``num_tokens``
tokens are proposed; they go to the target as a chain of point masses.

The bigram table is one next-token id per vocabulary entry, counted over text the target itself generated
(``specserve train bigram``, training/bigram.py) and shipped next to the GLIDE checkpoint:
``drafters/checkpoints/<target id>/bigram.safetensors``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from core.tree import DraftTree, VerifyResult
from drafters.base import SequenceView, TargetView

from drafters.checkpoint import default_path, write_card
MAX_MATCH = 64  # longer matches continue the same way; the cap bounds the search on degenerate repetitive text


class BigramTableError(RuntimeError):
    """A bigram table is missing or does not fit the target."""


def default_bigram_path(target_id: str) -> Path:
    return default_path(target_id, "bigram")


def save_bigram(path: str | Path, table: torch.Tensor, target_id: str, card: dict | None = None) -> None:
    """``table`` [V] int32 (next token id per token id) + the target id; ``card`` goes next to it as JSON."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"next_token": table.to(torch.int32).contiguous()}, str(path),
              metadata={"target_id": target_id, "vocab_size": str(len(table))})
    write_card(path, card)


def load_bigram(target: TargetView, path: str | Path | None = None) -> np.ndarray:
    """The bigram table for ``target`` as int64 [V]; fails clearly when it is missing or built for another target."""
    from safetensors import safe_open

    default = default_bigram_path(target.model_id)
    how = (f"build one with `specserve train bigram --config <your config>` (it writes {default}) or set the "
           f"drafter's `bigram` option to a table built for {target.model_id!r}")
    path = Path(path) if path else default
    if not path.is_file():
        raise BigramTableError(f"no bigram table for target {target.model_id!r} at {path}; {how}")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if "next_token" not in f.keys() or "target_id" not in meta:
            raise BigramTableError(f"{path} is not a bigram table (no next_token tensor / target_id metadata); {how}")
        table = f.get_tensor("next_token")
    if meta["target_id"] != target.model_id:
        raise BigramTableError(f"{path} was built for target {meta['target_id']!r}, not {target.model_id!r}; {how}")
    V = target.args.vocab_size
    if tuple(table.shape) != (V,) or int(table.min()) < 0 or int(table.max()) >= V:
        raise BigramTableError(f"{path} holds {tuple(table.shape)} entries in [{int(table.min())}, "
                               f"{int(table.max())}]; the target's vocabulary has {V} tokens; {how}")
    return table.numpy().astype(np.int64)


def longest_match(ctx: np.ndarray, prompt_len: int, min_match: int = 1, max_match: int = MAX_MATCH
                  ) -> tuple[int, int]:
    """The longest suffix of ``ctx`` that occurred earlier -> (its length, the index of the earlier occurrence's last
    token), or (0, -1) when there is none of at least ``min_match`` tokens.

    An occurrence ending inside the prompt (index < ``prompt_len``) beats one of the same length in the generated
    text; among those left, the most recent wins. The occurrence must end before ``ctx``'s last token, so at least
    one token follows it.
    """
    n = len(ctx)
    ends = np.flatnonzero(ctx[:n - 1] == ctx[n - 1]) if n > 1 else np.empty(0, dtype=np.int64)
    if not len(ends):
        return 0, -1
    length = 1
    while length < max_match:  # grow the match one token to the left while some occurrence still agrees
        longer = ends[ends >= length]
        longer = longer[ctx[longer - length] == ctx[n - 1 - length]]
        if not len(longer):
            break
        ends, length = longer, length + 1
    if length < min_match:
        return 0, -1
    in_prompt = ends[ends < prompt_len]
    return length, int(in_prompt[-1] if len(in_prompt) else ends[-1])


class MaxGram:
    """The Max-Gram proposer over a bigram table (engine-free)."""

    def __init__(self, table: np.ndarray, min_match: int = 1):
        if min_match < 1:
            raise ValueError("maxgram: min_match must be >= 1")
        self.table, self.min_match = np.asarray(table, dtype=np.int64), min_match

    def extend(self, context: list[int], prompt_len: int, num_tokens: int) -> list[int]:
        """``num_tokens`` tokens continuing ``context`` (whose first ``prompt_len`` tokens are the prompt)."""
        ctx = np.asarray(context, dtype=np.int64)
        out: list[int] = []
        while len(out) < num_tokens:
            full = np.concatenate([ctx, np.asarray(out, dtype=np.int64)])
            length, end = longest_match(full, prompt_len, self.min_match)
            if length:
                out.extend(full[end + 1:end + 1 + num_tokens - len(out)].tolist())
            else:
                out.append(int(self.table[full[-1]]))
        return out


class MaxGramDrafter:
    name = "maxgram"

    def __init__(self, target: TargetView, num_tokens: int = 10, min_match: int = 1, bigram: str | None = None):
        if not 1 <= num_tokens <= 63:
            raise ValueError("maxgram: num_tokens must be in [1, 63]")
        self.num_tokens = num_tokens
        self.maxgram = MaxGram(load_bigram(target, bigram), min_match)

    def prefill(self, seq: SequenceView) -> None:
        pass

    def propose(self, seq: SequenceView) -> DraftTree:
        tokens = seq.tokens
        return DraftTree.chain(tokens[-1], self.maxgram.extend(tokens, seq.prompt_len,
                                                                min(self.num_tokens, seq.max_rows - 1)))

    def observe(self, seq: SequenceView, result: VerifyResult) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass
