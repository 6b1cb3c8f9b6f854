"""`none`: plain autoregressive decoding. Every tree is the root alone, so each target forward emits one token."""
from __future__ import annotations

from core.tree import DraftTree, VerifyResult
from drafters.base import SequenceView, TargetView


class NoneDrafter:
    name = "none"

    def __init__(self, target: TargetView):
        del target

    def prefill(self, seq: SequenceView) -> None:
        pass

    def propose(self, seq: SequenceView) -> DraftTree:
        return DraftTree.root_only(seq.tokens[-1])

    def observe(self, seq: SequenceView, result: VerifyResult) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass
