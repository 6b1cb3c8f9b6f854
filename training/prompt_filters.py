"""The text filters of ``train prompts``: why one synthesized user turn is unusable, read from its text alone.

A small model writes much that is unusable: empty, too short or too long, mostly non-text, repetitive (repeated word
n-grams, runs of one word or character, a sentence said twice), of few distinct words, or an answer instead of a
question. ``text_reason`` names the first such reason (a rejection reason in the stats) or None. The word helpers
here (``words``, ``normalize``, ``shingles``, ``jaccard``) are also what deduplication (training/prompt_dedup.py)
compares texts by.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class FilterConfig:
    min_words: int = 3
    min_chars: int = 10
    max_words: int = 400
    max_chars: int = 3000
    min_letter_share: float = 0.5      # letters among non-space characters
    max_repeat_share: float = 0.3      # word 3-grams that repeat an earlier one
    max_char_run: int = 12             # the same non-space character this many times in a row
    max_word_run: int = 4              # the same word this many times in a row
    min_distinct_ratio: float = 0.3    # distinct words / words, for texts of at least distinct_min_words words
    distinct_min_words: int = 20
    near_dup_threshold: float = 0.6    # word 3-gram Jaccard at which two prompts are one
    bench_threshold: float = 0.5       # Jaccard with a benchmark prompt at which a prompt overlaps it
    bench_ngram: int = 8               # a shared run of this many words overlaps a benchmark prompt


ASSISTANT_OPENERS = re.compile(r"^(sure|certainly|of course|absolutely|as an ai\b|i'm sorry|i am sorry|here is|"
                               r"here's|great question|i'd be happy|i would be happy|hello! how can i)", re.I)
WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def normalize(text: str) -> str:
    """Case, accents' forms, punctuation and spacing folded away: the key of exact deduplication."""
    return " ".join(words(unicodedata.normalize("NFKC", text)))


def shingles(text: str, n: int = 3) -> frozenset[str]:
    w = words(text)
    if len(w) < n:
        return frozenset([" ".join(w)]) if w else frozenset()
    return frozenset(" ".join(w[i:i + n]) for i in range(len(w) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def repeat_share(w: list[str], n: int = 3) -> float:
    """Share of word n-grams that already occurred earlier in the text."""
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def repeats_a_sentence(text: str, min_words: int = 5) -> bool:
    """Some sentence or line of at least ``min_words`` words occurs twice (a loop the n-gram share can miss)."""
    seen = set()
    for part in re.split(r"[.!?\n]+", text):
        w = words(part)
        if len(w) >= min_words:
            key = " ".join(w)
            if key in seen:
                return True
            seen.add(key)
    return False


def longest_run(items) -> int:
    best = run = 0
    prev = object()
    for x in items:
        run = run + 1 if x == prev else 1
        prev = x
        best = max(best, run)
    return best


def text_reason(text: str, cfg: FilterConfig = FilterConfig()) -> str | None:
    """Why a finished user turn is unusable (a rejection reason), or None when it is kept."""
    t = text.strip()
    if not t:
        return "empty"
    w = words(t)
    if len(w) < cfg.min_words or len(t) < cfg.min_chars:
        return "too_short"
    if len(w) > cfg.max_words or len(t) > cfg.max_chars:
        return "too_long"
    visible = [c for c in t if not c.isspace()]
    if sum(c.isalpha() for c in visible) < cfg.min_letter_share * len(visible):
        return "non_text"
    if (repeat_share(w) > cfg.max_repeat_share or longest_run(w) >= cfg.max_word_run
            or longest_run(visible) >= cfg.max_char_run or repeats_a_sentence(t)):
        return "repetitive"
    if len(w) >= cfg.distinct_min_words and len(set(w)) < cfg.min_distinct_ratio * len(w):
        return "low_diversity"
    if ASSISTANT_OPENERS.match(t):
        return "assistant_like"
    return None
