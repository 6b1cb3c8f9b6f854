"""`ngram`: prompt lookup decoding (as vLLM's ngram proposer and transformers' ``prompt_lookup_num_tokens``).

Match the last n tokens of the history (n from ``max_ngram`` down to ``min_ngram``) against earlier text -- prompt
and generated tokens alike -- and propose the ``num_tokens`` tokens that followed the most recent match, as a chain
of point masses. No model, no state: cheap enough to run every step.
"""
from __future__ import annotations

import numpy as np

from core.tree import DraftTree, VerifyResult
from drafters.base import SequenceView, TargetView


def lookup(history: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching suffix of ``history``."""
    n_hist = len(history)
    for n in range(min(max_ngram, n_hist - 1), min_ngram - 1, -1):
        suffix = history[n_hist - n:]
        # windows[i] = history[i:i+n] for every start i whose continuation exists (i + n < n_hist)
        windows = np.lib.stride_tricks.sliding_window_view(history[:n_hist - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return history[start:start + num_tokens].tolist()
    return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, target: TargetView, num_tokens: int = 5, max_ngram: int = 3, min_ngram: int = 1):
        del target
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram: need 1 <= min_ngram <= max_ngram")
        if not 1 <= num_tokens <= 63:
            raise ValueError("ngram: num_tokens must be in [1, 63]")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def prefill(self, seq: SequenceView) -> None:
        pass

    def propose(self, seq: SequenceView) -> DraftTree:
        history = np.asarray(seq.tokens, dtype=np.int64)
        return DraftTree.chain(int(history[-1]), lookup(history, self.max_ngram, self.min_ngram,
                                                        min(self.num_tokens, seq.max_rows - 1)))

    def observe(self, seq: SequenceView, result: VerifyResult) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass
