"""Training prompts written by the target itself: ``specserve train prompts`` (the Magpie method, arXiv 2406.08464).

No dataset can be downloaded here, and the hand-written prompts (training/prompts.py) are a thousand. But the
target is an instruct model: fed its chat template up to the start of a user turn, it writes a user turn, because that
is what follows in the conversations it was tuned on. Sampling that turn until the end-of-turn token gives prompts in
the target's own idea of what users ask, which is the traffic a drafter will see. The prefix comes from the
tokenizer's chat template (a placeholder user message is rendered and cut), so another chat model works unchanged.

Steering: a system message per category (coding, math, writing, advice, explanation, extraction/summarisation, plus
the template's default one), half of them with a topic hint drawn from prompts.py's lists, so every kind of request
appears. A share of the jobs becomes multi-turn: the target answers the first turn (greedy) and writes a follow-up
user turn after its own answer the same way, so drafters see longer contexts.

A small model writes much that is unusable, so filters drop what is empty, truncated (no end-of-turn before the token
cap), degenerate (repeated n-grams, few distinct words, mostly non-text, an answer instead of a question, a copy of
the system message), too short or too long; then exact duplicates (normalised text), near duplicates (MinHash over
word 3-grams with LSH banding, confirmed by exact Jaccard) and anything overlapping the benchmark prompts in
deploy/prompts/ are dropped. A deterministic held-out split (by a hash of the text) is kept apart.

Every job is seeded by (seed, index, turn): the engine draws a seeded token by a race keyed on (seed, position), so a
run is a function of its settings. Generation goes in shards of consecutive job indices, each written atomically when
done; a killed run continues at the first missing shard, and since a shard never depends on another, a resumed run
gives the very same prompts as an uninterrupted one. Filtering runs over the shards in index order, so it is
deterministic too (and a changed filter re-selects from the shards without generating again); generation stops once
``count`` prompts survive.

Output under ``<cache>/train/<target>/synth/``: ``train.jsonl`` and ``heldout.jsonl`` (one ``{"messages",
"category", "source": "synth", "index"}`` per line), ``stats.json`` (counts per category, rejections per reason with
examples, throughput), ``plan.json`` (the settings the shards were made with) and ``shards/``.
"""
from __future__ import annotations

import json
import re
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
from tqdm import tqdm

from training import prompts as hand
from training.common import stable_int, stable_unit
from training.data import BatchedGenerator, GenRequest, GenResult

BENCH_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prompts"
MARK = "\u2063MAGPIE-USER-TURN\u2063"  # a placeholder user message, cut out of the rendered template

# -- steering: system messages per category, topic hints ------------------------------------------------------
CODE_TOPICS = [*hand.CODE_TASKS, "recursion", "regular expressions", "SQL joins", "unit tests", "REST APIs",
               "sorting algorithms", "classes and inheritance", "reading and writing JSON files", "error handling",
               "list comprehensions", "async code", "linked lists", "hash maps", "string formatting", "git branches",
               "shell scripts", "dynamic programming", "binary trees", "HTML forms", "CSS layouts"]
MATH_TOPICS = ["fractions", "percentages", "a word problem about shopping", "linear equations", "quadratic equations",
               "the area of a circle", "the Pythagorean theorem", "probability with dice", "averages", "prime numbers",
               "unit conversion", "simple interest", "ratios", "speed, distance and time", "angles in a triangle",
               "exponents", "a word problem about ages", "the volume of a box", "mental arithmetic",
               "counting combinations", "basic statistics", "derivatives", "sequences and series", "logarithms"]
EXTRACTION_SOURCES = ["a news article", "a product review", "a meeting note", "an email", "a recipe", "a job posting",
                      "a scientific abstract", "a travel blog post", "a customer complaint", "a short biography",
                      "a list of appointments", "a restaurant menu", "a weather report", "a movie plot",
                      "a company announcement", "a lecture transcript"]
WRITING_KINDS = ["a short story", "a poem", "an email", "a speech", "a product description", "a letter",
                 "a blog post", "a dialogue", "a slogan", "a song", "a review", "a cover letter"]


@dataclass(frozen=True)
class Category:
    name: str
    weight: float
    system: str | None            # None: the chat template's default system message (plain Magpie)
    hinted: str | None = None     # the system message with a {topic} hint
    topics: tuple[str, ...] = ()


CATEGORIES = (
    Category("coding", 0.20, "You are an expert programmer. Users ask you to write, explain or fix code in Python, "
             "JavaScript and other languages.", "You are an expert programmer. The user asks you a coding question "
             "about {topic}.", tuple(CODE_TOPICS)),
    Category("math", 0.14, "You are a patient math tutor. The user gives you a math problem to solve step by step.",
             "You are a patient math tutor. The user gives you a math problem about {topic}.", tuple(MATH_TOPICS)),
    Category("writing", 0.14, "You are a creative writing assistant. The user asks you to write a story, a poem, an "
             "email or a speech.", "You are a creative writing assistant. The user asks you to write {topic}.",
             tuple(f"{k} about {t}" for k in WRITING_KINDS for t in hand.TOPICS[::3])),
    Category("advice", 0.14, "You are a friendly and practical coach. The user asks you for advice.",
             "You are a friendly and practical coach. The user asks you for advice about {topic}.",
             tuple(hand.ACTIVITIES)),
    Category("explanation", 0.16, "You are a knowledgeable teacher. The user asks you to explain something clearly.",
             "You are a knowledgeable teacher. The user asks you to explain {topic}.", tuple(hand.TOPICS)),
    Category("extraction", 0.12, "You are a helpful assistant. The user pastes a short text and asks you to "
             "summarize it or to extract information from it.", "You are a helpful assistant. The user pastes "
             "{topic} and asks you to summarize it or to extract the key facts from it.", tuple(EXTRACTION_SOURCES)),
    Category("general", 0.10, None),
)


# -- settings ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SynthSettings:
    count: int = 20_000              # prompts to keep (train + held out)
    seed: int = 0
    max_prompt_tokens: int = 128     # a user turn without its end-of-turn token by then is dropped as truncated
    max_answer_tokens: int = 256     # the target's answer before a follow-up turn
    temperature: float = 0.8         # 1.0 (Magpie's) makes a 135M model ramble; top-p sorts the vocabulary per token
    top_p: float = 1.0
    multi_turn_share: float = 0.25
    heldout_fraction: float = 0.02
    shard_size: int = 512
    max_generated: int | None = None  # stop after this many jobs whatever survives (default: 10 x count)

    def __post_init__(self):
        if self.count < 1 or self.shard_size < 1 or self.max_prompt_tokens < 2 or self.max_answer_tokens < 1:
            raise ValueError("--count, the shard size and the token caps must be positive")
        if not 0.0 <= self.multi_turn_share <= 1.0 or not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError("--multi-turn-share must be in [0, 1] and --heldout in [0, 1)")
        if self.temperature <= 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("prompts are sampled: --temperature must be > 0 and --top-p in (0, 1]")

    def generation_key(self) -> dict:
        """What the shards depend on (not count, split or filters: those only select among generated jobs)."""
        return {k: v for k, v in asdict(self).items() if k not in ("count", "heldout_fraction", "max_generated")}

    @property
    def limit(self) -> int:
        return self.max_generated if self.max_generated is not None else 10 * self.count


# -- text filters --------------------------------------------------------------------------------------------------
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


# -- near duplicates -------------------------------------------------------------------------------------------
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


def is_heldout(text: str, fraction: float) -> bool:
    """A fixed function of the normalised first user turn (a prompt lands in the same split whatever the run)."""
    return stable_unit("heldout", normalize(text)) < fraction


# -- selection: filters + dedup over the generated jobs, in index order -------------------------------------------
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


# -- generation jobs -----------------------------------------------------------------------------------------------
class Templates:
    """Token ids of user-turn prefixes, derived from the tokenizer's chat template, and the stop tokens."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        from server.tokenization import stop_token_ids

        self.tok = tokenizer
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
        suffix = rendered[rendered.index(MARK) + len(MARK):]
        ids = tokenizer(suffix, add_special_tokens=False)["input_ids"] if suffix else []
        # Special added tokens count too: some tokenizers (transformers 5.17's GGUF conversion) list only the named
        # ones (bos, eos, unk, pad) in ``all_special_ids``, and the end-of-turn token is then missing from it.
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        specials |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}
        answer_stops = set(stop_token_ids(tokenizer, eos_token_ids))
        # The end of a user turn: the first token after the user's text (``<|im_end|>`` in ChatML), when special.
        self.end_of_turn = ids[0] if ids and ids[0] in specials else min(answer_stops)
        self.answer_stops = tuple(sorted(answer_stops))
        self.turn_stops = tuple(sorted(answer_stops | specials | {self.end_of_turn}))

    def user_prefix(self, system: str | None, history: list[dict]) -> list[int]:
        """The conversation up to where the next user message's text begins."""
        msgs = ([{"role": "system", "content": system}] if system else []) + history
        text = self.tok.apply_chat_template([*msgs, {"role": "user", "content": MARK}], tokenize=False)
        return list(self.tok(text[:text.index(MARK)], add_special_tokens=False)["input_ids"])

    def answer_prompt(self, history: list[dict]) -> list[int]:
        from server.tokenization import encode_chat

        return encode_chat(self.tok, history)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).strip()


def job_plan(index: int, s: SynthSettings) -> dict:
    """Category, system message, topic and turns of job ``index``: a fixed function of (seed, index)."""
    u, acc = stable_unit(s.seed, "category", index), 0.0
    total = sum(c.weight for c in CATEGORIES)
    cat = CATEGORIES[-1]
    for c in CATEGORIES:
        acc += c.weight / total
        if u < acc:
            cat = c
            break
    system, topic = cat.system, None
    if cat.topics and stable_unit(s.seed, "hint", index) < 0.5:
        topic = cat.topics[stable_int(s.seed, "topic", index) % len(cat.topics)]
        system = cat.hinted.format(topic=topic)
    multi = stable_unit(s.seed, "multi", index) < s.multi_turn_share
    return {"index": index, "category": cat.name, "system": system, "topic": topic, "multi_turn": multi}


def synth_job(plan: dict, s: SynthSettings, tpl: Templates):
    """One prompt (a generator driven by BatchedGenerator): user turn; if multi-turn, the target's answer and a
    follow-up user turn. Returns the raw job record (texts and how each generation ended). Only a turn that did not
    end (or is empty) cuts a multi-turn job short: the text filters run later, over the shards, so a shard does not
    depend on them."""
    from core.sampling import SamplingParams

    raw = {**plan, "turns": [], "answer": None, "tokens": 0}

    def user_turn(history: list[dict], k: int):
        sp = SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=stable_int(s.seed, "turn", plan["index"], k))
        return GenRequest(tpl.user_prefix(plan["system"], history), sp, s.max_prompt_tokens, tpl.turn_stops)

    def turn(res: GenResult) -> dict:
        raw["tokens"] += len(res.token_ids)
        if res.finish_reason == "stop" and res.token_ids[-1] != tpl.end_of_turn:
            finish = "special"
        else:
            finish = res.finish_reason
        return {"text": tpl.decode(res.token_ids[:-1] if finish == "stop" else res.token_ids), "finish": finish}

    first = turn((yield user_turn([], 0)))
    raw["turns"].append(first)
    if not plan["multi_turn"] or first["finish"] != "stop" or not first["text"]:
        return raw
    history = [{"role": "user", "content": first["text"]}]
    res = yield GenRequest(tpl.answer_prompt(history), SamplingParams(), s.max_answer_tokens, tpl.answer_stops)
    raw["tokens"] += len(res.token_ids)
    done = res.finish_reason == "stop"
    raw["answer"] = {"text": tpl.decode(res.token_ids[:-1] if done else res.token_ids), "finish": res.finish_reason}
    if not done or not raw["answer"]["text"]:
        return raw
    history.append({"role": "assistant", "content": raw["answer"]["text"]})
    raw["turns"].append(turn((yield user_turn(history, 1))))
    return raw


# -- the pipeline ----------------------------------------------------------------------------------------------------
def _check_plan(out: Path, plan: dict) -> None:
    path = out / "plan.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != plan:
            diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise ValueError(f"{out} holds shards made with other settings ({', '.join(diff)} differ); pass another "
                             "--out or delete it")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan, indent=1) + "\n")


def _categories_digest() -> int:
    return stable_int(json.dumps([asdict(c) for c in CATEGORIES]))


def synthesize_prompts(cfg, target, out: Path, settings: SynthSettings | None = None, batch: int = 64,
                       step_tokens: int = 512, filters: FilterConfig | None = None, max_shards: int | None = None,
                       progress: bool = True, log=print, command: str | None = None) -> dict:
    """Generate (resumably, by shards), filter and deduplicate until ``settings.count`` prompts survive; write the
    train and held-out JSONL files and the stats. Returns the stats (``complete`` False when ``max_shards`` stopped
    the run first)."""
    from server.model_files import load_tokenizer

    s, filters, out = settings or SynthSettings(), filters or FilterConfig(), Path(out)
    tpl = Templates(load_tokenizer(target.hf_dir), target.args.eos_token_ids)
    _check_plan(out, {"model_id": target.model_id, "dtype": str(target.dtype), **s.generation_key(),
                      "categories": _categories_digest()})
    (out / "shards").mkdir(parents=True, exist_ok=True)
    run = _Run(Selection(filters), s)
    k = 0
    while run.wants_more(k) and (out / "shards" / f"raw-{k:05d}.json").exists():  # resume: what is done
        run.feed(json.loads((out / "shards" / f"raw-{k:05d}.json").read_text()))
        k += 1
    if k:
        log(f"resumed: {k} shards ({run.jobs} jobs, {len(run.sel.kept)} prompts kept) already in {out / 'shards'}")
    gen, new_shards = None, 0
    bar = tqdm(total=run.estimate(), initial=run.jobs, desc="synth prompts", unit="prompt", disable=not progress,
               smoothing=0.05)
    t0, run_tokens = time.perf_counter(), 0

    def on_step(n_tok: int, finished: int) -> None:
        nonlocal run_tokens
        run_tokens += n_tok
        bar.update(finished)
        bar.set_postfix(kept=len(run.sel.kept), tok_s=f"{run_tokens / (time.perf_counter() - t0):.0f}", refresh=False)

    while run.wants_more(k):
        path = out / "shards" / f"raw-{k:05d}.json"
        if path.exists():
            shard = json.loads(path.read_text())
        elif max_shards is not None and new_shards >= max_shards:
            break
        else:
            if gen is None:
                longest = max(len(tpl.user_prefix(c.hinted or c.system, [])) for c in CATEGORIES) + 64
                gen = BatchedGenerator(cfg, target, batch, longest + 2 * s.max_prompt_tokens + s.max_answer_tokens,
                                       step_tokens)
            shard = _generate_shard(gen, k, s, tpl, on_step)
            _write_atomic(path, json.dumps(shard))
            new_shards += 1
        run.feed(shard)
        k += 1
        _write_atomic(out / "stats.json", json.dumps(_stats(run, target, command, False), indent=1) + "\n")
        bar.total = run.estimate()
        bar.n = run.jobs
        bar.set_postfix(kept=len(run.sel.kept), tok_s=f"{run_tokens / max(1e-9, time.perf_counter() - t0):.0f}")
    bar.close()
    complete = not run.wants_more(k)
    stats = _stats(run, target, command, complete)
    if complete:
        if len(run.sel.kept) < s.count:
            log(f"only {len(run.sel.kept)} of {s.count} prompts survived the filters after {run.sel.generated} "
                "generated (raise --max-generated)")
        _write_outputs(out, run.sel.kept, s)
    _write_atomic(out / "stats.json", json.dumps(stats, indent=1) + "\n")
    return stats


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@dataclass
class _Run:
    """The shards fed so far: selection state and throughput totals."""

    sel: Selection
    s: SynthSettings
    jobs: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def wants_more(self, next_shard: int) -> bool:
        return len(self.sel.kept) < self.s.count and next_shard * self.s.shard_size < self.s.limit

    def feed(self, shard: dict) -> None:
        self.jobs += len(shard["jobs"])
        self.tokens += shard["tokens"]
        self.seconds += shard["seconds"]
        for raw in shard["jobs"]:
            if len(self.sel.kept) < self.s.count and raw["index"] < self.s.limit:
                self.sel.add(raw)

    def estimate(self) -> int:
        """Jobs likely needed in all, at the acceptance seen so far."""
        if not self.sel.kept:  # before any evidence: about two thirds survive
            return min(self.s.limit, max(self.jobs, round(1.5 * self.s.count)))
        rate = len(self.sel.kept) / self.sel.generated
        return min(self.s.limit, self.jobs + round((self.s.count - len(self.sel.kept)) / rate))


def _generate_shard(gen: BatchedGenerator, k: int, s: SynthSettings, tpl: Templates, on_step) -> dict:
    """Jobs [k * shard_size, (k + 1) * shard_size): always the whole range, so a shard never depends on the limit."""
    t0 = time.perf_counter()
    plans = [job_plan(i, s) for i in range(k * s.shard_size, (k + 1) * s.shard_size)]
    # Multi-turn jobs (three generations in a row) start first, so the shard's tail, when the batch runs half empty,
    # holds only short single-turn jobs. Every job is seeded on its own: the order changes no result.
    order = sorted(range(len(plans)), key=lambda j: not plans[j]["multi_turn"])
    done = gen.run([synth_job(plans[j], s, tpl) for j in order], on_step)
    raws = [None] * len(plans)
    for j, r in zip(order, done):
        raws[j] = r
    return {"shard": k, "seconds": round(time.perf_counter() - t0, 3), "tokens": sum(r["tokens"] for r in raws),
            "jobs": raws}


def _write_outputs(out: Path, kept: list[dict], s: SynthSettings) -> None:
    train, held = [], []
    for rec in kept:
        (held if is_heldout(rec["messages"][0]["content"], s.heldout_fraction) else train).append(rec)
    for name, recs in (("train.jsonl", train), ("heldout.jsonl", held)):
        _write_atomic(out / name, "".join(json.dumps(r) + "\n" for r in recs))


def _stats(run: _Run, target, command: str | None, complete: bool) -> dict:
    sel, s = run.sel, run.s
    by_cat: dict[str, int] = {}
    for rec in sel.kept:
        by_cat[rec["category"]] = by_cat.get(rec["category"], 0) + 1
    held = sum(is_heldout(r["messages"][0]["content"], s.heldout_fraction) for r in sel.kept)
    n, g = max(1, len(sel.kept)), max(1, sel.generated)
    rejected = sorted(sel.rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "model_id": target.model_id, "dtype": str(target.dtype).removeprefix("torch."), "command": command,
        "complete": complete, "settings": asdict(s), "generated": sel.generated, "kept": len(sel.kept),
        "train": len(sel.kept) - held, "heldout": held, "acceptance": round(len(sel.kept) / g, 4),
        "multi_turn": sum(len(r["messages"]) > 1 for r in sel.kept),
        "by_category": dict(sorted(by_cat.items())),
        "category_shares": {c: round(v / n, 4) for c, v in sorted(by_cat.items())},
        "generated_by_category": dict(sorted(sel.generated_by_category.items())),
        "rejected": dict(rejected), "rejected_share": {r: round(v / g, 4) for r, v in rejected},
        "multi_turn_fallbacks": dict(sorted(sel.fallbacks.items())),
        "rejected_examples": {r: sel.examples[r] for r, _ in rejected},
        "fallback_examples": {r: sel.examples[r] for r in sorted(sel.fallbacks)},
        "generation": {"jobs": run.jobs, "tokens": run.tokens, "seconds": round(run.seconds, 1),
                       "prompts_per_s": round(run.jobs / max(1e-9, run.seconds), 3),
                       "tokens_per_s": round(run.tokens / max(1e-9, run.seconds), 1)},
        "filter_seconds": round(sel.seconds, 2),
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
