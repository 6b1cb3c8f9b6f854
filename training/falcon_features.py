"""The teacher features Falcon trains on: one target forward per sequence, kept in a file named by content.

Every position's final-normed target features f_0 .. f_{T-1} (bfloat16), and the residual stream after the lower
layers a head with taps reads, for the sequences with at least 3 answer positions. ``train falcon`` and
``train accept-head --drafter falcon`` share the file.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from training.common import answers_digest
from training.teacher import padded_pass, teacher_pass


@dataclass
class FeatureData:
    tokens: list[torch.Tensor]   # per sequence [T] long
    answer_start: list[int]      # prompt_len - 1: the first position whose next token is an answer token
    feats: list[torch.Tensor]    # per sequence [T, hidden] post-norm target features (bfloat16)
    index: list[int] = field(default_factory=list)  # per sequence: its position in the items the pass read
    taps: list[torch.Tensor] = field(default_factory=list)  # per sequence [T, n_taps, hidden] lower layers (bfloat16)
    tap_layers: list[int] = field(default_factory=list)     # the layer counts ``taps`` holds

    def __len__(self) -> int:
        return len(self.tokens)

    def tap_rows(self, i: int, layers: list[int]) -> torch.Tensor:
        """Sequence i's lower-layer rows [T, len(layers), hidden] for ``layers``, in that order (any the file holds)."""
        return self.taps[i][:, [self.tap_layers.index(n) for n in layers]]


def features_tag(seqs: list[dict], n_text: int, max_len: int, dtype: torch.dtype) -> str:
    """The name of a teacher pass over ``seqs`` (the last ``n_text`` of them shipped text), keyed by content: another
    data set of the same size is not it. ``train falcon`` and ``train accept-head --drafter falcon`` share the file."""
    return f"{len(seqs) - n_text}+{n_text}-{max_len}-{str(dtype)[6:]}-{answers_digest(seqs)}"


def cached_features(target, items: list[dict], max_len: int, path: Path, taps: list[int], progress: bool = True,
                    log=print) -> FeatureData:
    """``teacher_features`` kept in ``path`` (the caller names it by content): read when it is there, keeps every
    sequence's item index and holds the lower layers ``taps``, else computed and written."""
    data = FeatureData(**torch.load(path, weights_only=True)) if path.exists() else None
    # none yet, written before sequences kept their item index, or without the lower layers the head reads
    if data is None or len(data.index) != len(data) or not set(taps) <= set(data.tap_layers):
        t0 = time.perf_counter()
        data = teacher_features(target, items, max_len, progress=progress, taps=tuple(taps))
        if target.device.type != "cuda":  # a GPU computes the pass faster than it would read the file back
            torch.save(data.__dict__, path)
        log(f"teacher pass: {len(data)} sequences in {time.perf_counter() - t0:.0f} s")
    return data


def teacher_features(target, items: list[dict], max_len: int, progress: bool = True,
                     taps: tuple[int, ...] = ()) -> FeatureData:
    """The teacher pass (``training.teacher``) for Falcon: every position's final-normed target features (and the
    residual stream after each layer count in ``taps``), for the sequences with at least 3 answer positions. An
    unquantized target on a GPU runs it as padded batches (``padded_pass``, its features left on the GPU)."""
    if target.device.type == "cuda" and target.quantization == "none":
        t = padded_pass(target, items, max_len, min_answer=3, taps=tuple(taps))
    else:
        t = teacher_pass(target, items, [], max_len, progress=progress, all_positions=True, min_answer=3,
                         taps=tuple(taps))
    return FeatureData(t.tokens, t.answer_start, t.hidden, t.index, t.taps, list(taps))
