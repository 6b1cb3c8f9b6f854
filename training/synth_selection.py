"""Which generated jobs of ``train prompts`` become prompts: the filters and deduplication applied in index order.

A job's user turns must end with the end-of-turn token, pass the text filters (training/prompt_filters.py) and not
copy the steering system message; then exact duplicates (normalised text), near duplicates and overlap with the
benchmark prompts (training/prompt_dedup.py) are dropped. Jobs are fed in index order, so the selection is
deterministic, and a changed filter re-selects from the shards without generating again.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from training.prompt_dedup import BenchmarkGuard, NearDuplicates, benchmark_texts
from training.prompt_filters import FilterConfig, normalize, shingles, text_reason


@dataclass
class Selection:
    """Filters and deduplication over the generated jobs, fed in index order (so the result is deterministic).

    A multi-turn job whose first turn is good but whose answer or follow-up is not falls back to a single-turn prompt
    (counted under ``fallbacks``): the first turn is as good as any other.
    """

    filters: FilterConfig = field(default_factory=FilterConfig)
    bench: BenchmarkGuard | None = None
    kept: list[dict] = field(default_factory=list)
    generated: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    generated_by_category: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self):
        self.exact: set[str] = set()
        self.near = NearDuplicates(self.filters.near_dup_threshold)
        if self.bench is None:
            self.bench = BenchmarkGuard(benchmark_texts(), self.filters.bench_threshold, self.filters.bench_ngram)

    def add(self, raw: dict) -> str | None:
        """Judge one generated job; keeps its record and returns None, or returns the rejection reason."""
        t0 = time.perf_counter()
        self.generated += 1
        cat = raw["category"]
        self.generated_by_category[cat] = self.generated_by_category.get(cat, 0) + 1
        reason, turns = self._judge(raw)
        if reason is None:
            self.kept.append(to_record(raw, turns))
        else:
            self._count(self.rejected, reason, raw)
        self.seconds += time.perf_counter() - t0
        return reason

    def _count(self, counts: dict[str, int], reason: str, raw: dict) -> None:
        counts[reason] = counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 3:
            ex.append(" || ".join(t["text"] for t in raw["turns"])[:400])

    def _turn(self, raw: dict, k: int) -> str | None:
        turn = raw["turns"][k]
        return turn_reason(turn, self.filters) or ("system_echo" if echoes(turn["text"], raw["system"]) else None)

    def _judge(self, raw: dict) -> tuple[str | None, list[str]]:
        """(rejection reason or None, the user turns kept)."""
        reason = self._turn(raw, 0)
        if reason:
            return reason, []
        turns = [raw["turns"][0]["text"]]
        if raw["multi_turn"]:
            if raw["answer"] is None or raw["answer"]["finish"] != "stop" or not raw["answer"]["text"]:
                follow = "answer_truncated"
            elif len(raw["turns"]) < 2:
                follow = "incomplete"
            else:
                follow = self._turn(raw, 1)
                follow = follow and "followup_" + follow
            if follow:
                self._count(self.fallbacks, follow, raw)
            else:
                turns.append(raw["turns"][1]["text"])
        if any(self.bench.overlaps(t) for t in turns):
            return "benchmark", turns
        key = " || ".join(normalize(t) for t in turns)
        if key in self.exact:
            return "duplicate", turns
        if self.near.add(shingles(" ".join(turns))):
            return "near_duplicate", turns
        self.exact.add(key)
        return None, turns


def turn_reason(turn: dict, filters: FilterConfig) -> str | None:
    """A generated user turn: it must end with the end-of-turn token, then pass the text filters."""
    if turn["finish"] == "length":
        return "truncated"
    if turn["finish"] != "stop":
        return "special_token"
    return text_reason(turn["text"], filters)


def echoes(text: str, system: str | None) -> bool:
    """The user turn repeats the steering system message's first sentence (the model read it as text to copy)."""
    if not system:
        return False
    first = normalize(re.split(r"(?<=[.!?])\s", system, maxsplit=1)[0])
    return bool(first) and f" {first} " in f" {normalize(text)} "


def to_record(raw: dict, turns: list[str]) -> dict:
    """The kept user turns as chat messages, the target's answer between a first turn and its follow-up."""
    msgs = [{"role": "user", "content": turns[0].strip()}]
    if len(turns) > 1:
        msgs += [{"role": "assistant", "content": raw["answer"]["text"].strip()},
                 {"role": "user", "content": turns[1].strip()}]
    return {"messages": msgs, "category": raw["category"], "source": "synth", "index": raw["index"]}
