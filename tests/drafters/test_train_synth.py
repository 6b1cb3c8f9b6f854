"""Training data at scale: the prompt filters and deduplication on written strings, the Magpie prefix from the chat
template, determinism and resume of `train prompts` and `train data`, and small real runs on the default model."""
from __future__ import annotations

import json
import random

import pytest

from training.batched_generator import BatchedGenerator, GenRequest, single
from training.data import (AnswerSettings, answer_records, answer_temperature, load_responses, prompt_records,
                           shard_dir)
from training.data_card import length_histogram
from training.prompt_dedup import BenchmarkGuard, NearDuplicates, benchmark_texts
from training.prompt_filters import FilterConfig, repeat_share, repeats_a_sentence, shingles, text_reason, words
from training.synth import is_heldout, read_jsonl, synthesize_prompts
from training.synth_jobs import CATEGORIES, SynthSettings, Templates, job_plan
from training.synth_selection import Selection, echoes, turn_reason


# -- filters ------------------------------------------------------------------------------------------------------
def de_bruijn(symbols: list[str], n: int) -> list[str]:
    """Every n-gram of ``symbols`` exactly once (cyclically): few distinct words, no repeated 3-grams."""
    k = len(symbols)
    a, seq = [0] * k * n, []

    def db(t: int, p: int) -> None:
        if t > n:
            if n % p == 0:
                seq.extend(a[1:p + 1])
        else:
            a[t] = a[t - p]
            db(t + 1, p)
            for j in range(a[t - p] + 1, k):
                a[t] = j
                db(t + 1, t)

    db(1, 1)
    return [symbols[i] for i in seq + seq[:n - 1]]


@pytest.mark.parametrize("text, reason", [
    ("How do I reverse a list in Python without using reversed()?", None),
    ("   \n ", "empty"),
    ("Hi there", "too_short"),
    (" ".join(f"topic{i}" for i in range(450)), "too_long"),
    ("12 + 34 = 46; 56 * 78 = 4368 (x)", "non_text"),
    ("Tell me a joke. Tell me a joke. Tell me a joke. Tell me a joke please", "repetitive"),
    ("Why is the sky very very very very blue today?", "repetitive"),
    ("What does !!!!!!!!!!!!!!!! mean in a chat message?", "repetitive"),
    ("A storm hit our town last night.\nA storm hit our town last night.\nWhat should we repair first, the roof or "
     "the windows?", "repetitive"),
    (" ".join(de_bruijn(["red", "blue", "green"], 3)), "low_diversity"),
    ("Sure! Here is a summary of the article you sent me.", "assistant_like"),
    ("Certainly, the capital of France is Paris.", "assistant_like"),
])
def test_each_filter_catches_its_case(text, reason):
    assert text_reason(text) == reason


def test_filter_thresholds_are_what_the_cases_test():
    f = FilterConfig()
    cycle = de_bruijn(["red", "blue", "green"], 3)
    assert len(set(cycle)) / len(cycle) < f.min_distinct_ratio and len(cycle) >= f.distinct_min_words
    # the low-diversity case repeats no 3-gram, so only the distinct-word filter can catch it
    assert text_reason(" ".join(cycle), FilterConfig(min_distinct_ratio=0.0)) is None
    # the repeated sentence is below the 3-gram share: only the sentence check catches it
    loop = "A storm hit our town last night.\nA storm hit our town last night.\nWhat should we repair first?"
    assert repeat_share(words(loop)) < f.max_repeat_share and repeats_a_sentence(loop)


def test_turn_end_and_system_echo():
    assert turn_reason({"text": "How do magnets work in motors?", "finish": "length"}, FilterConfig()) == "truncated"
    assert turn_reason({"text": "How do magnets work in motors?", "finish": "special"}, FilterConfig()) == \
        "special_token"
    assert turn_reason({"text": "How do magnets work in motors?", "finish": "stop"}, FilterConfig()) is None
    system = "You are a patient math tutor. The user gives you a math problem."
    assert echoes("you are a patient MATH tutor! Solve 3x + 2 = 11.", system)
    assert not echoes("As my math tutor, can you solve 3x + 2 = 11?", system)
    assert not echoes("You are a patient math tutor.", None)


def raw(index: int, *texts: str, category: str = "coding", system: str | None = None,
        answer: str | None = None) -> dict:
    return {"index": index, "category": category, "system": system, "topic": None, "multi_turn": len(texts) > 1,
            "turns": [{"text": t, "finish": "stop"} for t in texts],
            "answer": {"text": answer, "finish": "stop"} if answer else None, "tokens": 10}


@pytest.fixture(scope="module")
def guard():
    return BenchmarkGuard(benchmark_texts())


def test_selection_dedups_exact_and_near_and_guards_the_benchmarks(guard):
    sel = Selection(bench=guard)
    base = "Write a Python script that downloads a web page and counts how often each word appears in its text."
    assert sel.add(raw(0, base)) is None
    assert sel.add(raw(1, base.upper().replace(".", " !"))) == "duplicate"       # case, punctuation, spacing
    assert sel.add(raw(2, base.replace("web page", "website"))) == "near_duplicate"
    assert sel.add(raw(3, "Write a poem about a lighthouse keeper who collects storms in glass jars.")) is None
    assert sel.add(raw(4, "Explain in three sentences why the sky is blue!")) == "benchmark"   # deploy/prompts
    assert sel.add(raw(5, "Please explain in three sentences why the sky is blue, for my son")) == "benchmark"
    assert sel.add(raw(6, "Could you list five tips for writing clean code?")) == "benchmark"
    assert sel.add(raw(7, "Hi")) == "too_short"
    assert sel.add(raw(8, "How do I sort a dictionary by value?", "And in reverse order, please?",
                       answer="Use sorted(d.items(), key=lambda kv: kv[1]).")) is None
    assert sel.add(raw(9, "How do I center a div in CSS?", "ok", answer="Use flexbox.")) is None  # falls back
    assert sel.add(raw(10, "What is the tallest mountain in Africa?", "And in Europe?")) is None  # no answer
    assert sel.add(raw(11, "You are an expert programmer. Fix my loop.", system="You are an expert programmer. Users "
                       "ask you to fix code.")) == "system_echo"
    assert [r["index"] for r in sel.kept] == [0, 3, 8, 9, 10]
    assert sel.kept[2]["messages"] == [
        {"role": "user", "content": "How do I sort a dictionary by value?"},
        {"role": "assistant", "content": "Use sorted(d.items(), key=lambda kv: kv[1])."},
        {"role": "user", "content": "And in reverse order, please?"}]
    assert sel.kept[3]["messages"] == [{"role": "user", "content": "How do I center a div in CSS?"}]
    assert len(sel.kept[4]["messages"]) == 1
    assert sel.fallbacks == {"followup_too_short": 1, "answer_truncated": 1}
    assert sel.rejected == {"duplicate": 1, "near_duplicate": 1, "benchmark": 3, "too_short": 1, "system_echo": 1}
    assert sel.generated == 12 and sel.examples["benchmark"][0].startswith("Explain in three")


def test_benchmark_guard_reads_every_benchmark_file(guard):
    from pathlib import Path

    files = sorted(Path("deploy/prompts").glob("*.jsonl"))
    assert len(files) >= 2 and len(guard.norms) == sum(len(f.read_text().splitlines()) for f in files)
    heldout = Path("deploy/prompts/humaneval-heldout.jsonl")
    heldout_task = json.loads(heldout.read_text().splitlines()[0])["messages"][0]["content"]
    assert guard.overlaps(heldout_task[40:])  # a piece of a held-out HumanEval task
    assert not guard.overlaps("What is the boiling point of water on a high mountain?")


def test_near_duplicates_scale_and_recall(monkeypatch):
    rng = random.Random(0)
    vocab = [f"w{i}x" for i in range(3000)]
    texts = [" ".join(rng.choice(vocab) for _ in range(rng.randint(12, 30))) for _ in range(30_000)]
    truth = set()
    for j in range(1000):  # plant near copies: one word changed
        w = texts[j].split()
        w[rng.randrange(len(w))] = "changed"
        texts.append(" ".join(w))
        if len(shingles(texts[j]) & shingles(texts[-1])) / len(shingles(texts[j]) | shingles(texts[-1])) >= 0.6:
            truth.add(len(texts) - 1)
    # Linear in the texts: LSH hands each new text a handful of candidates to compare exactly (its Jaccard), not
    # every text before it. Counted, not timed: on average at most one exact comparison per text (quadratic would be
    # ~n^2 / 2 = 5e8 here; the count stops the run as soon as it passes the budget).
    exact = NearDuplicates.add.__globals__["jaccard"]  # the function add() compares candidates with
    budget, calls = len(texts), [0]

    def counted(a, b):
        calls[0] += 1
        assert calls[0] <= budget, f"more than {budget} exact comparisons for {len(texts)} texts: not linear"
        return exact(a, b)

    monkeypatch.setitem(NearDuplicates.add.__globals__, "jaccard", counted)
    nd = NearDuplicates(0.6)
    found = {i for i, t in enumerate(texts) if nd.add(shingles(t))}
    assert found <= truth and len(found) >= 0.97 * len(truth) and len(truth) > 800
    assert len(found) <= calls[0] <= budget  # every near copy found was confirmed by an exact comparison


def test_heldout_split_is_a_stable_two_percent():
    texts = [f"question number {i} about topic {i % 97}" for i in range(10_000)]
    held = [t for t in texts if is_heldout(t, 0.02)]
    assert 150 < len(held) < 250
    assert held == [t for t in texts if is_heldout(t.upper() + " ", 0.02)]  # a function of the normalised text


def test_job_plans_are_seeded_and_cover_every_category():
    s = SynthSettings(seed=3)
    plans = [job_plan(i, s) for i in range(3000)]
    assert plans == [job_plan(i, SynthSettings(seed=3)) for i in range(3000)]
    assert plans != [job_plan(i, SynthSettings(seed=4)) for i in range(3000)]
    total = sum(c.weight for c in CATEGORIES)
    for c in CATEGORIES:
        share = sum(p["category"] == c.name for p in plans) / len(plans)
        assert abs(share - c.weight / total) < 0.03, (c.name, share)
        hinted = [p for p in plans if p["category"] == c.name and p["topic"]]
        assert bool(hinted) == bool(c.topics) and all(p["topic"] in p["system"] for p in hinted)
    assert abs(sum(p["multi_turn"] for p in plans) / len(plans) - s.multi_turn_share) < 0.03


def test_answer_temperatures_follow_the_share():
    s = AnswerSettings(sampled_share=0.25, temperatures=(0.7, 1.0), seed=1)
    temps = [answer_temperature(i, s) for i in range(4000)]
    assert abs(sum(t > 0 for t in temps) / 4000 - 0.25) < 0.03 and set(temps) == {0.0, 0.7, 1.0}
    assert temps == [answer_temperature(i, AnswerSettings(sampled_share=0.25, seed=1)) for i in range(4000)]
    assert length_histogram([3, 16, 40, 2000]) == {"<16": 1, "16-31": 1, "32-63": 1, "64-127": 0, "128-255": 0,
                                                   "256-511": 0, "512-1023": 0, ">=1024": 1}


# -- the chat template -----------------------------------------------------------------------------------------
class _NamedSpecialsOnly:
    """The tokenizer as transformers 5.17 converts it from the GGUF file: ``all_special_ids`` lists only the named
    special tokens ([1, 0]), not ``<|im_end|>``, which stays a special added token, and eos is ``<|im_start|>``."""

    def __init__(self, tok, ids, eos):
        self._tok, self.all_special_ids, self.eos_token_id = tok, ids, eos

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)


def test_end_of_turn_is_found_when_the_tokenizer_lists_only_named_specials(tokenizer, target32):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start, endoftext = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    narrow = _NamedSpecialsOnly(tokenizer, [im_start, endoftext], im_start)
    tpl = Templates(narrow, target32.args.eos_token_ids)
    assert tpl.end_of_turn == im_end and im_end in tpl.turn_stops


def test_user_turn_prefix_comes_from_the_chat_template(tokenizer, target32):
    tpl = Templates(tokenizer, target32.args.eos_token_ids)
    assert tokenizer.convert_ids_to_tokens(tpl.end_of_turn) == "<|im_end|>"
    assert tpl.end_of_turn in tpl.turn_stops and tpl.end_of_turn in tpl.answer_stops
    prefix = tokenizer.decode(tpl.user_prefix("Be brief.", []))
    assert prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    default = tokenizer.decode(tpl.user_prefix(None, []))
    assert default.startswith("<|im_start|>system\n") and default.endswith("<|im_start|>user\n")
    history = [{"role": "user", "content": "Hi, what is 2 + 2?"}, {"role": "assistant", "content": "4."}]
    conv = tokenizer.decode(tpl.user_prefix("Be brief.", history))
    assert conv.endswith("<|im_start|>user\nHi, what is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
                         "<|im_start|>user\n")


# -- real runs on the default model ---------------------------------------------------------------------------------
TINY = dict(count=6, max_generated=6, shard_size=3, max_prompt_tokens=24, max_answer_tokens=16, multi_turn_share=0.34,
            seed=0)


def synth(cfg, target, out, max_shards=None, **kw):
    s = SynthSettings(**{**TINY, **kw})
    return synthesize_prompts(cfg, target, out, s, batch=4, max_shards=max_shards, progress=False,
                              log=lambda m: None)


def outputs(d) -> dict:
    """The prompt files and the generated jobs of every shard (not the timings)."""
    out = {name: (d / name).read_text() for name in ("train.jsonl", "heldout.jsonl", "plan.json")}
    for p in sorted((d / "shards").glob("*")):
        out[p.name] = json.loads(p.read_text())["jobs"]
    return out


@pytest.fixture(scope="module")
def synth_run(fp32_config, target32, tmp_path_factory):
    d = tmp_path_factory.mktemp("synth") / "one-run"
    return d, synth(fp32_config, target32, d)


def test_synthesized_prompts_are_well_formed(synth_run):
    d, st = synth_run
    assert st["complete"] and st["generated"] == 6 and st["generation"]["jobs"] == 6
    assert st["kept"] + sum(st["rejected"].values()) == 6 and st["train"] + st["heldout"] == st["kept"]
    shards = sorted((d / "shards").glob("raw-*.json"))
    assert [p.name for p in shards] == ["raw-00000.json", "raw-00001.json"]
    jobs = [j for p in shards for j in json.loads(p.read_text())["jobs"]]
    assert [j["index"] for j in jobs] == list(range(6)) and any(j["multi_turn"] for j in jobs)
    assert all(t["finish"] in ("stop", "length", "special") for j in jobs for t in j["turns"])
    assert all(len(j["turns"]) == 2 for j in jobs if j["multi_turn"] and j["answer"]
               and j["answer"]["finish"] == "stop" and j["turns"][0]["finish"] == "stop")
    records = read_jsonl(d / "train.jsonl") + read_jsonl(d / "heldout.jsonl")
    assert len(records) == st["kept"]
    names = {c.name for c in CATEGORIES}
    for r in records:
        assert r["source"] == "synth" and r["category"] in names
        roles = [m["role"] for m in r["messages"]]
        assert roles in (["user"], ["user", "assistant", "user"]) and all(m["content"] for m in r["messages"])
    stats = json.loads((d / "stats.json").read_text())
    assert stats["kept"] == st["kept"] and set(stats["rejected_examples"]) == set(stats["rejected"])
    assert set(stats["fallback_examples"]) == set(stats["multi_turn_fallbacks"])


def test_same_seed_same_prompts_and_resume_matches_one_run(synth_run, fp32_config, target32, tmp_path):
    d, st = synth_run
    part = synth(fp32_config, target32, tmp_path / "resumed", max_shards=1)  # killed after one shard
    assert not part["complete"] and not (tmp_path / "resumed" / "train.jsonl").exists()
    assert [p.name for p in (tmp_path / "resumed" / "shards").glob("raw-*.json")] == ["raw-00000.json"]
    again = synth(fp32_config, target32, tmp_path / "resumed")
    assert outputs(tmp_path / "resumed") == outputs(d)
    timings = ("generation", "filter_seconds")  # wall-clock figures, the only fields a resume may change
    assert {k: v for k, v in again.items() if k not in timings} == {k: v for k, v in st.items() if k not in timings}
    other = synth(fp32_config, target32, tmp_path / "seed1", max_shards=1, seed=1)
    assert not other["complete"]
    jobs = [json.loads((x / "shards" / "raw-00000.json").read_text())["jobs"] for x in (d, tmp_path / "seed1")]
    assert [j["turns"] for j in jobs[0]] != [j["turns"] for j in jobs[1]]
    with pytest.raises(ValueError, match="other settings"):
        synth(fp32_config, target32, tmp_path / "seed1", seed=2)


def test_batched_generator_matches_one_sequence_at_a_time(fp32_config, target32, tokenizer):
    from core.sampling import SamplingParams
    from server.engine import Engine
    from server.tokenization import encode_record, stop_token_ids

    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    recs = [{"messages": [{"role": "user", "content": t}]} for t in
            ("Name three colors.", "What is a prime number?", "Say hi.", "Count to five.", "Define gravity.")]
    prompts = [encode_record(tokenizer, r) for r in recs]
    sps = [SamplingParams(), SamplingParams(temperature=1.0, seed=7), SamplingParams(), SamplingParams(temperature=0.7,
           seed=8), SamplingParams()]
    gen = BatchedGenerator(fp32_config, target32, slots=3, max_seq_len=256, step_tokens=40)  # 5 jobs, 3 slots
    got = gen.run([single(GenRequest(p, sp, 10, stops)) for p, sp in zip(prompts, sps)])
    engine = Engine(fp32_config, target=target32)
    for p, sp, res in zip(prompts, sps, got):
        want = engine.generate(p, sp, 10, stops)
        assert res.token_ids == want.token_ids and res.finish_reason == want.finish_reason


def test_answers_are_resumable_and_feed_glide_and_bigram(fp32_config, target32, tokenizer, tmp_path):
    from training.bigram import count_bigrams
    from training.common import vocab_by_frequency
    from training.data import ensure_data
    from server.tokenization import encode_chat, encode_record, stop_token_ids

    synth_file = tmp_path / "synth.jsonl"
    conversation = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."},
                    {"role": "user", "content": "And times 3?"}]
    synth_file.write_text(json.dumps({"messages": conversation, "category": "math", "source": "synth"}) + "\n"
                          + json.dumps({"messages": [{"role": "user", "content": "Name a fruit."}],
                                        "category": "general", "source": "synth"}) + "\n")
    records = prompt_records(f"{synth_file},project", None)[:5] + [{"prompt": "def add(a, b):\n", "source": "code"}]
    assert records[0]["category"] == "math" and records[2]["source"] == "chat"
    with pytest.raises(FileNotFoundError):
        prompt_records("synth", tmp_path / "none.jsonl")
    s = AnswerSettings(max_new_tokens=12, sampled_share=0.5, temperatures=(0.7, 1.0), shard_size=2, seed=0)

    def answer(out, **kw):
        return answer_records(fp32_config, target32, records, out, s, batch=3, progress=False, log=lambda m: None,
                              command="specserve train data --limit 6", **kw)

    one = answer(tmp_path / "one" / "responses.pt")
    part = answer(tmp_path / "two" / "responses.pt", max_shards=1)
    assert not part["complete"] and not (tmp_path / "two" / "responses.pt").exists()
    assert len(list(shard_dir(tmp_path / "two" / "responses.pt").glob("answers-*.pt"))) == 1
    two = answer(tmp_path / "two" / "responses.pt")
    assert one["items"] == two["items"] and one["complete"] and len(one["items"]) == 7
    items, stops = one["items"][:6], stop_token_ids(tokenizer, target32.args.eos_token_ids)
    # The target's answer inside the synthesized conversation is an item too, with no generation.
    turn = one["items"][6]
    assert turn["turn"] == 1 and turn["index"] == 0 and turn["finish_reason"] == "stop"
    assert turn["prompt_ids"] == encode_chat(tokenizer, conversation[:1])
    assert tokenizer.decode(turn["response_ids"][:-1]) == "2 + 2 = 4." and turn["response_ids"][-1] in stops
    assert turn["prompt_ids"] + turn["response_ids"] == encode_chat(tokenizer, conversation[:2])[:len(
        turn["prompt_ids"]) + len(turn["response_ids"])]
    assert [it["index"] for it in items] == list(range(6))
    assert [it["temperature"] for it in items] == [answer_temperature(i, s) for i in range(6)]
    for it, rec in zip(items, records):
        assert it["prompt_ids"] == encode_record(tokenizer, rec) and 1 <= len(it["response_ids"]) <= 12
        assert (it["finish_reason"] == "stop") == (it["response_ids"][-1] in stops)
    assert items[0]["prompt_ids"] == encode_chat(tokenizer, conversation)  # the whole conversation before the answer
    assert "2 + 2 = 4." in tokenizer.decode(items[0]["prompt_ids"])
    card = json.loads((tmp_path / "one" / "responses.card.json").read_text())
    assert card["answers"] == 7 and card["answer_tokens"] == sum(len(it["response_ids"]) for it in one["items"])
    assert sum(card["answer_length_histogram"].values()) == 7 and sum(card["temperatures"].values()) == 7
    assert card["from_conversations"] == 1
    assert card["user_turns"] == {"1": 5, "2": 1} and card["command"] == "specserve train data --limit 6"
    assert "| math | 2 |" in (tmp_path / "one" / "responses.card.md").read_text()
    # GLIDE and the bigram table read the same file through ensure_data, without regenerating it.
    path, got = ensure_data(fp32_config, target32, tmp_path / "one" / "responses.pt", 12, 3, None, progress=False,
                            log=lambda m: None)
    assert got == load_responses(path)["items"] == one["items"]
    count_bigrams([it["prompt_ids"] + it["response_ids"] for it in got], target32.args.vocab_size)
    # Without a file, ensure_data answers the default prompts (project prompts first) with the engine.
    path, fresh = ensure_data(fp32_config, target32, tmp_path / "fresh" / "responses.pt", 6, 3, 3, progress=False,
                              log=lambda m: None)
    assert path.exists() and len(fresh) == 3 and {it["source"] for it in fresh} == {"chat"}
    assert all(1 <= len(it["response_ids"]) <= 6 for it in fresh) and load_responses(path)["complete"]
    assert len(vocab_by_frequency(got, target32.args.vocab_size, 64)) == 64


def test_cli_train_prompts_and_data(tmp_path, capsys):
    from specserve.cli import main

    out = tmp_path / "synth"
    assert main(["train", "prompts", "--dtype", "float32", "--device", "cpu", "--count", "3", "--max-generated", "3",
                 "--shard-size", "3", "--max-prompt-tokens", "16", "--max-answer-tokens", "8", "--batch", "3",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{out}:" in printed and "of 3 generated" in printed
    stats = json.loads((out / "stats.json").read_text())
    assert stats["command"].startswith("specserve train prompts --dtype float32 --device cpu --count 3 --seed 0 ")
    assert "--out " + str(out) in stats["command"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Say yes."}]}) + "\n")
    data = tmp_path / "r.pt"
    assert main(["train", "data", "--dtype", "float32", "--device", "cpu", "--prompts", f"{prompts},project",
                 "--limit", "2", "--max-new-tokens", "4", "--gen-batch", "2", "--data", str(data)]) == 0
    assert "2 answers" in capsys.readouterr().out
    card = json.loads(data.with_suffix(".card.json").read_text())
    assert card["prompts"] == 2 and "--sampled-share 0.25" in card["command"] and "--limit 2" in card["command"]
    assert main(["train", "data", "--dtype", "float32", "--temperatures", "hot"]) == 2
