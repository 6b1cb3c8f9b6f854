"""The generation jobs of ``train prompts``: what each job asks the target, and the generations that answer it.

A job's plan is a fixed function of (seed, index) under the settings: a category with its steering system message
(half of them with a topic hint drawn from training/prompts.py's lists) and whether it is multi-turn. Its run is a
generator driven by the batched engine (training/batched_generator.py): a user turn sampled after the chat template's
user-turn prefix (``Templates`` cuts it from the tokenizer's own template), and for a multi-turn job the target's
greedy answer and a follow-up user turn.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from training import prompts as hand
from training.batched_generator import GenRequest, GenResult
from training.common import stable_int, stable_unit

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
