"""`specserve bench serve --workload multi-turn | shared-prefix`: what automatic prefix caching buys, measured through
the OpenAI streaming API of any compatible server (ours, vLLM, llama.cpp's llama-server).

Each workload runs its requests twice in one run, cache **on** first, then cache **off**:

- on: every request carries the run's own ``cache_salt`` (fresh each run, so an earlier run's cache cannot help) and
  ``cache_prompt: true``;
- off: every request its own unique ``cache_salt`` and ``cache_prompt: false`` (llama-server's switch), so neither a
  salt-partitioned cache (ours, vLLM) nor llama.cpp's slot cache reuses anything.

Servers ignore the fields they do not know (a server without any prefix cache makes both modes cold). Token counts
and ``usage.prompt_tokens_details.cached_tokens`` (0 where absent) come from each stream's usage chunk; the token hit
rate is sum(cached_tokens) / sum(prompt_tokens).

- multi-turn: ``conversations`` chats of ``turns`` turns, all at once (the concurrency). The first user message is a
  document followed by the first question; each later turn appends the model's reply and the next question (from the
  prompts file, cycling) and sends the whole history. The document is sized so that the history reaches about
  ``history_tokens`` by the last turn, counting every reply as ``max_tokens`` long. Cache off replays the same
  requests, turn by turn, at the same concurrency. Reported: TTFT of turns >= 2 (history cached) on and off, their
  ratio, per-turn prompt length, TTFT and hit rate.
- shared-prefix: ``groups`` system prompts of about ``prefix_tokens`` tokens, each with ``questions`` short user
  questions, sent round-robin over the groups (question j of every group before question j + 1 of any, so the first
  request of each group fills the cache the rest reuse) at the given concurrency. Reported per mode: TTFT, requests/s,
  output tokens/s, hit rate; and the on/off ratios.

The client has no tokenizer: two untimed cache-off requests (one token each) measure the server's characters per
token on the padding text from their ``prompt_tokens`` before anything is sized. The padding is the Zen of Python
(stdlib ``this``), its lines in an order fixed by a seed through blake2b: the same text on every machine and Python
version, and different seeds start with different lines (see ``padding_text``).
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import hashlib
import io
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from server.bench.serve import _ms, _one, _summary, connect, make_client
from server.tokenization import read_prompts

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "deploy" / "prompts" / "bench.jsonl"
DEFAULT_CHARS_PER_TOKEN = 4.0  # used when the server reports no prompt_tokens to calibrate with
MESSAGE_TOKENS = 5  # chat-template tokens around each message after the first (role header, end of turn): a guess
PROBE_SEED = 1_000_003  # the calibration text's seed, apart from the documents' 0, 1, 2, ...
MODES = ("on", "off")


# -- deterministic text --------------------------------------------------------------------------------------------
@functools.cache
def _zen_lines() -> tuple[str, ...]:
    """The 19 aphorisms of the Zen of Python (rot13 in the stdlib's `this`, which prints them when first imported)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return tuple(x for x in codecs.decode(this.s, "rot13").splitlines()[1:] if x.strip())


@functools.cache
def _openers() -> tuple[str, ...]:
    """The lines whose first word no other line starts with (14 of the 19): a document's first line is one of them."""
    lines = _zen_lines()
    firsts = [x.split()[0] for x in lines]
    return tuple(x for x, w in zip(lines, firsts) if firsts.count(w) == 1)


def _hash_index(seed: int, i: int, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "big") % n


def padding_text(n_chars: int, seed: int) -> str:
    """About ``n_chars`` characters (at most, cut at a space) of Zen of Python lines: the first an opener chosen by
    ``seed`` (seeds 0-13 start with 14 different words), the second by ``seed // 14`` (seeds 0-265 differ within
    their first two lines), the rest by a hash of (seed, position). Empty for ``n_chars <= 0``."""
    if n_chars <= 0:
        return ""
    lines, openers = _zen_lines(), _openers()
    out = [openers[seed % len(openers)], lines[(seed // len(openers)) % len(lines)]]
    size = sum(len(x) + 1 for x in out)
    while size <= n_chars:
        out.append(lines[_hash_index(seed, len(out), len(lines))])
        size += len(out[-1]) + 1
    text = " ".join(out)[:n_chars]
    return text.rsplit(" ", 1)[0] if " " in text else text


def questions_of(prompts: list[dict]) -> list[str]:
    """The prompts file's questions: each record's last user message (a {messages} record) or its prompt."""
    out = []
    for rec in prompts:
        if "messages" in rec:
            users = [m for m in rec["messages"] if m.get("role") == "user"] or rec["messages"]
            content = users[-1]["content"]
            out.append(content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content))
        else:
            out.append(rec["prompt"])
    return out


def estimate_tokens(messages: list[dict], chars_per_token: float, base_tokens: float = 0.0) -> float:
    """A chat request's prompt tokens as this client estimates them: ``base_tokens`` (the template around one user
    message, measured by `calibrate`), the characters at ``chars_per_token``, and `MESSAGE_TOKENS` per further
    message."""
    chars = sum(len(m["content"]) for m in messages)
    return base_tokens + chars / chars_per_token + MESSAGE_TOKENS * (len(messages) - 1)


# -- workloads -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversation:
    index: int
    document: str
    questions: tuple[str, ...]  # one per turn

    def messages(self, replies: list[str]) -> list[dict]:
        """The request of turn ``len(replies) + 1``: the document and the first question as the first user message,
        then each earlier reply and the question after it."""
        first = f"{self.document}\n\n{self.questions[0]}" if self.document else self.questions[0]
        msgs = [{"role": "user", "content": first}]
        for reply, q in zip(replies, self.questions[1:]):
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": q}]
        return msgs


def plan_multi_turn(questions: list[str], conversations: int, turns: int, history_tokens: int, max_tokens: int,
                    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN, base_tokens: float = 0.0
                    ) -> list[Conversation]:
    """``conversations`` conversations of ``turns`` questions (the list cycled, conversation c from question
    c * turns on), each with a document of its own (seed c) sized so that its last turn's request, with every reply
    ``max_tokens`` long, comes to about ``history_tokens`` by `estimate_tokens`; no document where the questions
    and replies alone reach that."""
    out = []
    for c in range(conversations):
        qs = tuple(questions[(c * turns + t) % len(questions)] for t in range(turns))
        bare = Conversation(c, "", qs).messages(["x" * round(max_tokens * chars_per_token)] * (turns - 1))
        doc_tokens = history_tokens - estimate_tokens(bare, chars_per_token, base_tokens) - 2 / chars_per_token
        out.append(Conversation(c, padding_text(round(doc_tokens * chars_per_token), seed=c), qs))
    return out


def plan_shared_prefix(questions: list[str], groups: int, per_group: int, prefix_tokens: int,
                       chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> list[dict]:
    """The requests in send order, round-robin over the groups: {"group", "question", "messages": [the group's
    system prompt (about ``prefix_tokens`` tokens, seed = group), a user question]}; group g asks questions
    g * per_group, g * per_group + 1, ... of the list, cycled."""
    systems = [padding_text(round(prefix_tokens * chars_per_token), seed=g) for g in range(groups)]
    return [{"group": g, "question": j,
             "messages": [{"role": "system", "content": systems[g]},
                          {"role": "user", "content": questions[(g * per_group + j) % len(questions)]}]}
            for j in range(per_group) for g in range(groups)]


def run_salt() -> str:
    """A salt no earlier run used: every cache-on request of one run shares it."""
    return f"specserve-bench-{uuid.uuid4().hex}"


def cache_fields(on: bool, salt: str) -> dict:
    """The request fields of a mode: on, the run's salt and ``cache_prompt: true``; off, a salt of its own (never
    sent before) and ``cache_prompt: false``."""
    if on:
        return {"cache_salt": salt, "cache_prompt": True}
    return {"cache_salt": f"{salt}-off-{uuid.uuid4().hex}", "cache_prompt": False}


def hit_rate(results: list[dict]) -> float | None:
    """sum(cached_tokens) / sum(prompt_tokens) over the requests whose usage gave prompt_tokens (cached_tokens None,
    not reported, counts 0); None when there are none."""
    known = [r for r in results if r.get("prompt_tokens") is not None]
    prompt = sum(r["prompt_tokens"] for r in known)
    return sum(r.get("cached_tokens") or 0 for r in known) / prompt if prompt else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- running -------------------------------------------------------------------------------------------------------
async def calibrate(client, model: str, target_tokens: int, salt: str) -> tuple[float, float]:
    """(characters per token of the padding text, tokens of the template around one user message) on this server:
    two untimed cache-off requests of one token, a single user message of padding each, one four times the other
    (the longer about ``target_tokens`` at 4 characters a token, at most 1024). (`DEFAULT_CHARS_PER_TOKEN`, 0) when
    the server reports no prompt_tokens or the two do not differ."""
    n_long = round(DEFAULT_CHARS_PER_TOKEN * min(max(target_tokens, 64), 1024))
    texts = [padding_text(n_long // 4, PROBE_SEED), padding_text(n_long, PROBE_SEED)]
    counts = [(await _one(client, model, {"messages": [{"role": "user", "content": t}]}, 1,
                          cache_fields(False, salt)))["prompt_tokens"] for t in texts]
    if None in counts or counts[1] <= counts[0]:
        return DEFAULT_CHARS_PER_TOKEN, 0.0
    cpt = (len(texts[1]) - len(texts[0])) / (counts[1] - counts[0])
    return cpt, max(0.0, counts[0] - len(texts[0]) / cpt)


def _request(meta: dict, r: dict) -> dict:
    """One request of the JSON report (no text, no per-chunk gaps)."""
    return {**meta, "ttft_s": r["ttft"], "e2e_s": r["e2e"], "tokens": r["tokens"],
            "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"]}


def mode_summary(results: list[dict], errors: list[str], wall: float, num_requests: int) -> dict:
    """One mode's figures: results are `_request` dicts."""
    tokens = sum(r["tokens"] for r in results)
    return {"num_requests": num_requests, "completed": len(results), "errors": len(errors),
            "error_samples": list(dict.fromkeys(errors))[:5], "wall_s": wall,
            "requests_per_s": len(results) / wall if wall > 0 else None,
            "output_tokens_per_s": tokens / wall if wall > 0 else None, "output_tokens": tokens,
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in results),
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in results),
            # how many usages carried prompt_tokens_details.cached_tokens at all (0: the server does not report it)
            "cached_tokens_reported": sum(r["cached_tokens"] is not None for r in results),
            "token_hit_rate": hit_rate(results), "ttft_s": _summary([r["ttft_s"] for r in results]),
            "e2e_s": _summary([r["e2e_s"] for r in results])}


async def _send_all(client, model: str, items: list[tuple[dict, list[dict], dict]], concurrency: int,
                    max_tokens: int) -> tuple[list[dict], list[str], float]:
    """(meta, messages, extra body) items in order, at most ``concurrency`` in flight: (`_request` dicts, errors,
    wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    results, errors = [], []

    async def task(meta: dict, messages: list[dict], extra: dict):
        async with sem:
            try:
                results.append(_request(meta, await _one(client, model, {"messages": messages}, max_tokens, extra)))
            except Exception as e:  # counted and reported, the run goes on
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(task(*it) for it in items))
    return results, errors, time.perf_counter() - t0


async def _conversations_on(client, model: str, plan: list[Conversation], turns: int, max_tokens: int, salt: str
                            ) -> tuple[list[dict], list[tuple[dict, list[dict]]], list[str], float]:
    """All conversations at once, each turn after the previous one's reply: (`_request` dicts, the (meta, messages)
    sent, errors, wall seconds). A conversation whose turn fails ends there."""
    results, sent, errors = [], [], []

    async def converse(conv: Conversation):
        replies: list[str] = []
        for t in range(turns):
            meta, messages = {"conversation": conv.index, "turn": t + 1}, conv.messages(replies)
            try:
                r = await _one(client, model, {"messages": messages}, max_tokens, cache_fields(True, salt))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            results.append(_request(meta, r))
            sent.append((meta, messages))
            replies.append(r["text"])

    t0 = time.perf_counter()
    await asyncio.gather(*(converse(c) for c in plan))
    return results, sent, errors, time.perf_counter() - t0


def _later(results: list[dict]) -> list[dict]:
    return [r for r in results if r["turn"] >= 2]


async def _connect_calibrated(client, url, prompts, max_tokens, warmup, target_tokens,
                              salt) -> tuple[str, float, float]:
    """`connect`, then `calibrate` for about ``target_tokens``: (model, characters per token, template tokens);
    ConnectionError when either fails (nothing was measured yet)."""
    model = await connect(client, url, prompts, max_tokens, warmup)
    try:
        return (model, *await calibrate(client, model, target_tokens, salt))
    except Exception as e:
        raise ConnectionError(f"{url}: calibration request: {type(e).__name__}: {e}") from e


async def _multi_turn(url, api_key, prompts, conversations, turns, history_tokens, max_tokens, warmup, log) -> dict:
    client = make_client(url, api_key)
    salt = run_salt()
    try:
        model, cpt, base = await _connect_calibrated(client, url, prompts, max_tokens, warmup, history_tokens, salt)
        plan = plan_multi_turn(questions_of(prompts), conversations, turns, history_tokens, max_tokens, cpt, base)
        log(f"multi-turn: {conversations} conversations x {turns} turns, {cpt:.2f} chars/token, documents of "
            f"~{sum(len(c.document) for c in plan) / len(plan) / cpt:.0f} tokens; cache on")
        on, sent, on_err, on_wall = await _conversations_on(client, model, plan, turns, max_tokens, salt)
        sent.sort(key=lambda x: (x[0]["turn"], x[0]["conversation"]))  # turn by turn, as the conversations went
        log(f"multi-turn: the {len(sent)} requests again, cache off")
        off, off_err, off_wall = await _send_all(client, model, [(m, msgs, cache_fields(False, salt))
                                                                 for m, msgs in sent], conversations, max_tokens)
    finally:
        await client.close()
    modes = {}
    for name, res, err, wall, n in (("on", on, on_err, on_wall, conversations * turns),
                                    ("off", off, off_err, off_wall, len(sent))):
        res.sort(key=lambda r: (r["turn"], r["conversation"]))
        modes[name] = {**mode_summary(res, err, wall, n),
                       "ttft_first_turn_s": _summary([r["ttft_s"] for r in res if r["turn"] == 1]),
                       "ttft_later_turns_s": _summary([r["ttft_s"] for r in _later(res)]),
                       "later_turns_token_hit_rate": hit_rate(_later(res)), "requests": res}
    per_turn = []
    for t in range(1, turns + 1):
        row = {"turn": t}
        for name in MODES:
            rs = [r for r in modes[name]["requests"] if r["turn"] == t]
            known = [r["prompt_tokens"] for r in rs if r["prompt_tokens"] is not None]
            row[name] = {"count": len(rs), "prompt_tokens_mean": sum(known) / len(known) if known else None,
                         "ttft_s": _summary([r["ttft_s"] for r in rs]), "token_hit_rate": hit_rate(rs)}
        per_turn.append(row)
    later = {m: modes[m]["ttft_later_turns_s"] for m in MODES}
    return {"url": url, "model": model, "workload": "multi-turn", "max_tokens": max_tokens, "warmup_requests": warmup,
            "conversations": conversations, "turns": turns, "concurrency": conversations,
            "history_tokens": history_tokens, "chars_per_token": cpt, "base_tokens": base,
            "document_chars": [len(c.document) for c in plan], "cache_salt": salt,
            "errors": len(on_err) + len(off_err), "modes": modes, "per_turn": per_turn,
            "on_over_off": {"ttft_later_turns_median": _ratio(later["on"]["median"], later["off"]["median"]),
                            "ttft_later_turns_p99": _ratio(later["on"]["p99"], later["off"]["p99"]),
                            "requests_per_s": _ratio(modes["on"]["requests_per_s"], modes["off"]["requests_per_s"])}}


async def _shared_prefix(url, api_key, prompts, groups, questions, prefix_tokens, concurrency, max_tokens, warmup,
                         log) -> dict:
    client = make_client(url, api_key)
    salt = run_salt()
    try:
        model, cpt, _ = await _connect_calibrated(client, url, prompts, max_tokens, warmup, prefix_tokens, salt)
        plan = plan_shared_prefix(questions_of(prompts), groups, questions, prefix_tokens, cpt)
        modes = {}
        for name in MODES:
            log(f"shared-prefix: {groups} groups x {questions} questions at concurrency {concurrency}, "
                f"{cpt:.2f} chars/token; cache {name}")
            items = [({"group": p["group"], "question": p["question"]}, p["messages"], cache_fields(name == "on", salt))
                     for p in plan]
            res, err, wall = await _send_all(client, model, items, concurrency, max_tokens)
            res.sort(key=lambda r: (r["question"], r["group"]))
            modes[name] = {**mode_summary(res, err, wall, len(plan)), "requests": res}
    finally:
        await client.close()
    on, off = modes["on"], modes["off"]
    return {"url": url, "model": model, "workload": "shared-prefix", "max_tokens": max_tokens,
            "warmup_requests": warmup, "groups": groups, "questions": questions, "concurrency": concurrency,
            "prefix_tokens": prefix_tokens, "chars_per_token": cpt,
            "system_chars": [len(plan[g]["messages"][0]["content"]) for g in range(groups)], "cache_salt": salt,
            "errors": on["errors"] + off["errors"], "modes": modes,
            "on_over_off": {"requests_per_s": _ratio(on["requests_per_s"], off["requests_per_s"]),
                            "output_tokens_per_s": _ratio(on["output_tokens_per_s"], off["output_tokens_per_s"]),
                            "ttft_median": _ratio(on["ttft_s"]["median"], off["ttft_s"]["median"]),
                            "ttft_p99": _ratio(on["ttft_s"]["p99"], off["ttft_s"]["p99"])}}


def run_multi_turn_bench(url: str, api_key: str | None, prompts_path: str | Path, conversations: int = 4,
                         turns: int = 6, history_tokens: int = 1800, max_tokens: int = 64, warmup: int = 1,
                         log=lambda _: None) -> dict:
    """The multi-turn report (see the module). ConnectionError when the server cannot be listed, warmed up or
    calibrated (nothing was measured); per-request errors are counted per mode."""
    return asyncio.run(_multi_turn(url, api_key, read_prompts(prompts_path), conversations, turns, history_tokens,
                                   max_tokens, warmup, log))


def run_shared_prefix_bench(url: str, api_key: str | None, prompts_path: str | Path, groups: int = 8,
                            questions: int = 8, prefix_tokens: int = 1024, concurrency: int = 1, max_tokens: int = 64,
                            warmup: int = 1, log=lambda _: None) -> dict:
    """The shared-prefix report (see the module); errors as `run_multi_turn_bench`'s."""
    return asyncio.run(_shared_prefix(url, api_key, read_prompts(prompts_path), groups, questions, prefix_tokens,
                                      concurrency, max_tokens, warmup, log))


# -- reports -------------------------------------------------------------------------------------------------------
def _pct_str(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _row(values, cols) -> str:
    return " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, cols))


def _mode_rows(r: dict, ttft_key: str) -> list[str]:
    cols = [("cache", 5), ("done", 9), ("err", 5), ("req/s", 8), ("out tok/s", 10), ("TTFT p50", 9), ("p99", 9),
            ("hit rate", 9)]
    lines = [" ".join(f"{h:>{w}}" for h, w in cols)]
    for name in MODES:
        m = r["modes"][name]
        rps, tps = m["requests_per_s"], m["output_tokens_per_s"]
        lines.append(_row([name, f"{m['completed']}/{m['num_requests']}", m["errors"],
                           "-" if rps is None else f"{rps:.3f}", "-" if tps is None else f"{tps:.2f}",
                           _ms(m[ttft_key]["median"]), _ms(m[ttft_key]["p99"]), _pct_str(m["token_hit_rate"])], cols))
    return lines


def _errors(r: dict) -> list[str]:
    return [f"error, cache {name}: {e}"[:120] for name in MODES for e in r["modes"][name]["error_samples"]]


def format_multi_turn_report(r: dict) -> str:
    """Cache on and off (TTFT of turns >= 2, hit rate of all turns), then one row per turn, then the ratios."""
    last = r["per_turn"][-1]["on"]["prompt_tokens_mean"]
    lines = [f"{r['url']}  model {r['model']}  max_tokens {r['max_tokens']}  latencies in ms",
             f"multi-turn: {r['conversations']} conversations x {r['turns']} turns at once, history target "
             f"{r['history_tokens']} tokens (last turn: {'-' if last is None else f'{last:.0f}'}); TTFT of turns >= 2",
             *_mode_rows(r, "ttft_later_turns_s")]
    cols = [("turn", 5), ("prompt tok", 11), ("TTFT on p50", 12), ("off p50", 9), ("hit on", 8), ("hit off", 8)]
    lines.append(" ".join(f"{h:>{w}}" for h, w in cols))
    for row in r["per_turn"]:
        p = row["on"]["prompt_tokens_mean"]
        lines.append(_row([row["turn"], "-" if p is None else f"{p:.0f}", _ms(row["on"]["ttft_s"]["median"]),
                           _ms(row["off"]["ttft_s"]["median"]), _pct_str(row["on"]["token_hit_rate"]),
                           _pct_str(row["off"]["token_hit_rate"])], cols))
    q = r["on_over_off"]
    lines.append(f"on/off, turns >= 2: TTFT p50 {_x(q['ttft_later_turns_median'])}  p99 "
                 f"{_x(q['ttft_later_turns_p99'])};  req/s (all turns) {_x(q['requests_per_s'])}")
    return "\n".join(lines + _errors(r))


def format_shared_prefix_report(r: dict) -> str:
    """Cache on and off, then the on/off ratios."""
    lines = [f"{r['url']}  model {r['model']}  max_tokens {r['max_tokens']}  latencies in ms",
             f"shared-prefix: {r['groups']} groups x {r['questions']} questions, system prompts of ~"
             f"{r['prefix_tokens']} tokens, concurrency {r['concurrency']}",
             *_mode_rows(r, "ttft_s")]
    q = r["on_over_off"]
    lines.append(f"on/off: req/s {_x(q['requests_per_s'])}  out tok/s {_x(q['output_tokens_per_s'])}  TTFT p50 "
                 f"{_x(q['ttft_median'])}  p99 {_x(q['ttft_p99'])}")
    return "\n".join(lines + _errors(r))
