"""Prompts that repeat other text: near duplicates among the synthesized prompts and overlap with the benchmarks.

``NearDuplicates`` finds a text whose word 3-grams nearly equal an earlier one's (MinHash with LSH banding, confirmed
by exact Jaccard), in time linear in the texts. ``BenchmarkGuard`` flags a text that overlaps a benchmark prompt in
deploy/prompts/ (read by ``benchmark_texts``), so no training prompt leaks into what the benchmarks measure; the
prompts written by people (training/people.py) pass the same guard.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from training.common import stable_int
from training.prompt_filters import jaccard, normalize, shingles

BENCH_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prompts"


class NearDuplicates:
    """MinHash signatures over shingle hashes, LSH in ``bands`` bands of ``rows`` rows, confirmed by exact Jaccard.

    With 32 bands of 4 rows a pair at Jaccard 0.6 shares a band with probability 1 - (1 - 0.6^4)^32 = 0.99, and pairs
    below 0.3 rarely meet, so each new text is compared exactly with a handful of candidates: linear in the texts.
    """

    def __init__(self, threshold: float = 0.6, bands: int = 32, rows: int = 4, seed: int = 0):
        rng = np.random.Generator(np.random.PCG64(seed))
        n = bands * rows
        self.a = rng.integers(1, 2**63, size=n, dtype=np.uint64) | np.uint64(1)   # odd multipliers
        self.b = rng.integers(0, 2**63, size=n, dtype=np.uint64)
        self.threshold, self.bands, self.rows = threshold, bands, rows
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.sets: list[frozenset] = []

    def signature(self, sh: frozenset) -> np.ndarray:
        x = np.fromiter((stable_int(s) for s in sh), dtype=np.uint64, count=len(sh))
        with np.errstate(over="ignore"):  # multiply-shift hashing wraps modulo 2**64 on purpose
            h = (self.a[:, None] * x[None, :] + self.b[:, None]) >> np.uint64(32)
        return h.min(axis=1)

    def add(self, sh: frozenset) -> bool:
        """True when ``sh`` is a near duplicate of a text added before (then it is not added)."""
        if not sh:
            return False
        sig = self.signature(sh)
        keys = [(i, sig[i * self.rows:(i + 1) * self.rows].tobytes()) for i in range(self.bands)]
        seen = set()
        for key in keys:
            for j in self.buckets.get(key, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(sh, self.sets[j]) >= self.threshold:
                        return True
        self.sets.append(sh)
        for key in keys:
            self.buckets.setdefault(key, []).append(len(self.sets) - 1)
        return False


class BenchmarkGuard:
    """Flags texts that overlap a benchmark prompt: the same normalised text, a shared run of ``ngram`` words (or a
    short benchmark prompt contained whole), or word 3-gram Jaccard at or above ``threshold``."""

    def __init__(self, texts: Iterable[str], threshold: float = 0.5, ngram: int = 8):
        self.threshold, self.ngram = threshold, ngram
        self.norms = [normalize(t) for t in texts if t.strip()]
        self.sets = [shingles(t) for t in self.norms]
        self.grams = {g for t in self.norms for g in self._grams(t)}
        self.short = [t for t in self.norms if len(t.split()) < ngram]

    def _grams(self, norm: str) -> set[str]:
        w = norm.split()
        return {" ".join(w[i:i + self.ngram]) for i in range(len(w) - self.ngram + 1)}

    def overlaps(self, text: str) -> bool:
        norm = normalize(text)
        if norm in self.norms or self._grams(norm) & self.grams:
            return True
        padded = f" {norm} "
        if any(f" {s} " in padded for s in self.short):
            return True
        sh = shingles(norm)
        return any(jaccard(sh, b) >= self.threshold for b in self.sets)


def benchmark_texts(directory: Path = BENCH_DIR) -> list[str]:
    """Every user message and raw prompt of the benchmark prompt files."""
    out = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            out += [m["content"] for m in rec.get("messages", []) if m.get("role") == "user"]
            if "prompt" in rec:
                out.append(rec["prompt"])
    return out
