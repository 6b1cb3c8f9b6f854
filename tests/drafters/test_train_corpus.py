"""The training corpus kept in the repository (training/corpus.py): saved from one cache, restored into another, the
pipeline there resumes with no generation and the trainers read the same answers."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from training import corpus
from training.paths import answers_path, shard_dir, synth_dir
from training.data import AnswerSettings, answer_records, load_responses, prompt_records
from training.synth import synthesize_prompts
from training.synth_jobs import SynthSettings

SYNTH = SynthSettings(count=6, max_generated=6, shard_size=3, max_prompt_tokens=24, max_answer_tokens=16,
                      multi_turn_share=0.34, seed=0)
ANSWERS = AnswerSettings(max_new_tokens=8, sampled_share=0.5, temperatures=(0.7, 1.0), shard_size=3, seed=0)
QUIET = dict(progress=False, log=lambda m: None)


def in_cache(cfg, path):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, cache_dir=str(path)))


def run_pipeline(cfg, target, max_shards=None):
    """``train prompts`` then ``train data`` into cfg's cache, as the CLI runs them (default paths)."""
    st = synthesize_prompts(cfg, target, synth_dir(cfg, target.model_id), SYNTH, batch=4, max_shards=max_shards,
                            **QUIET)
    data = answer_records(cfg, target, pipeline_records(cfg, target), answers_path(cfg, target.model_id), ANSWERS,
                          batch=3, max_shards=max_shards, **QUIET)
    return st, data


def pipeline_records(cfg, target):
    records = prompt_records("synth", synth_dir(cfg, target.model_id) / "train.jsonl")
    return records + [
        {"messages": [{"role": "user", "content": "Name a color."}], "source": "chat", "category": "chat"},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                      {"role": "user", "content": "And times 3?"}], "source": "synth", "category": "math"}]


@pytest.fixture(scope="module")
def first(fp32_config, target32, tmp_path_factory):
    cfg = in_cache(fp32_config, tmp_path_factory.mktemp("cache-one"))
    st, data = run_pipeline(cfg, target32)
    assert st["complete"] and data["complete"] and any("turn" in it for it in data["items"])
    return cfg, data


def test_answers_pack_to_uint16_and_back(first, target32):
    cfg, data = first
    shards = sorted(shard_dir(answers_path(cfg, target32.model_id)).glob("answers-*.pt"))
    assert len(shards) >= 2
    for p in shards:
        shard = torch.load(p, weights_only=True)
        arrays = corpus.pack_answers(shard)
        assert arrays["prompt"].dtype == np.uint16 and arrays["response"].dtype == np.uint16
        assert corpus.unpack_answers(arrays) == shard
    turns = [it for it in data["items"] if "turn" in it]
    conv = {"key": "conversations", "items": turns, "seconds": 0.0}
    assert turns and corpus.unpack_answers(corpus.pack_answers(conv)) == conv
    big = {"key": "k", "seconds": 0.0, "items": [{**turns[0], "response_ids": [70000]}]}
    with pytest.raises(ValueError, match="uint16"):
        corpus.pack_answers(big)


def test_saved_corpus_restores_into_a_fresh_cache_and_the_pipeline_resumes_there(first, fp32_config, target32,
                                                                                   tmp_path, monkeypatch):
    cfg, data = first
    root = tmp_path / "corpus"
    saved = corpus.save(cfg, target32.model_id, root=root, log=lambda m: None)
    assert saved["synth_shards"] == 2 and saved["answer_shards"] >= 2
    assert corpus.save(cfg, target32.model_id, root=root, log=lambda m: None) == \
        {"synth_shards": 0, "synth_files": 0, "answer_shards": 0}  # nothing new: nothing rewritten
    # A fresh machine: the trainers' ensure_data finds no answers in its cache and takes the corpus's.
    from training.data import ensure_data

    monkeypatch.setattr(corpus, "CORPUS_ROOT", root)
    fresh = in_cache(fp32_config, tmp_path / "cache-two")
    path, items = ensure_data(fresh, target32, None, 8, 3, None, **QUIET)
    assert path == answers_path(fresh, target32.model_id) and items == data["items"]
    assert load_responses(path)["complete"]
    one, two = synth_dir(cfg, target32.model_id), synth_dir(fresh, target32.model_id)
    for name in ("train.jsonl", "heldout.jsonl", "plan.json", "shards/raw-00000.json", "shards/raw-00001.json"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name
    assert answers_path(fresh, target32.model_id).with_suffix(".card.json").read_text() == \
        answers_path(cfg, target32.model_id).with_suffix(".card.json").read_text()
    # The pipeline there generates nothing: every prompt shard and every answer shard is reused (keys match).
    st, again = run_pipeline(fresh, target32, max_shards=0)
    assert st["complete"] and again["complete"] and again["items"] == data["items"]
    # A restore never overwrites what a cache holds.
    (two / "train.jsonl").write_text("")
    assert corpus.restore(fresh, target32.model_id, root=root, log=lambda m: None) == \
        {"synth_shards": 0, "synth_files": 0, "answer_shards": 0, "answers_file": 0}
    assert (two / "train.jsonl").read_text() == ""


def test_save_refuses_shards_of_other_settings(first, target32, tmp_path):
    cfg, _ = first
    root = tmp_path / "corpus"
    corpus.save(cfg, target32.model_id, root=root, log=lambda m: None)
    plan = root / target32.model_id / "synth" / "plan.json"
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "seed": 5}))
    with pytest.raises(ValueError, match="other settings"):
        corpus.save(cfg, target32.model_id, root=root, log=lambda m: None)


def test_saved_header_covers_only_the_shards_of_the_merged_file(first, fp32_config, target32, tmp_path):
    """A merged file of the first prompts (``train data --limit``) next to more shards: the corpus's header names only
    the shards that file holds, so a restore rebuilds that file and no more."""
    import shutil

    cfg, _ = first
    copy = in_cache(fp32_config, tmp_path / "cache")
    shutil.copytree(answers_path(cfg, target32.model_id).parent, answers_path(copy, target32.model_id).parent)
    records = prompt_records("synth", synth_dir(copy, target32.model_id) / "train.jsonl")[:3]
    limited = answer_records(copy, target32, records, answers_path(copy, target32.model_id), ANSWERS, batch=3,
                             max_shards=0, **QUIET)
    assert limited["complete"] and len(list(shard_dir(answers_path(copy, target32.model_id)).glob("*.pt"))) > 1
    root = tmp_path / "corpus"
    corpus.save(copy, target32.model_id, root=root, log=lambda m: None)
    assert json.loads((root / target32.model_id / "answers" / "data.json").read_text())["shards"] == 1
    fresh = in_cache(fp32_config, tmp_path / "fresh")
    corpus.restore(fresh, target32.model_id, root=root, log=lambda m: None)
    assert load_responses(answers_path(fresh, target32.model_id))["items"] == limited["items"]


def test_a_run_on_another_target_answers_only_the_prompts_the_reused_shards_lack(first, target32, int4, tmp_path):
    """A run on another device or dtype (here the int4 target after float32 shards) keeps, with ``reuse``, the shards
    whose prompts and settings match and answers only the new prompts; the merged file counts each target's answers.
    Without ``reuse`` no shard of the other target counts (its key names the dtype and quantization)."""
    import shutil

    cfg, data = first
    cfg4, target4 = int4
    copy = in_cache(cfg4, tmp_path / "cache")
    shutil.copytree(answers_path(cfg, target32.model_id).parent, answers_path(copy, target4.model_id).parent)
    records = pipeline_records(cfg, target32)
    records += [{"messages": [{"role": "user", "content": f"Name {n} animals."}], "source": "chat",
                 "category": "chat"} for n in ("two", "three", "four")]
    kept = len(pipeline_records(cfg, target32)) // ANSWERS.shard_size  # the full shards keep their prompts
    out, sdir = answers_path(copy, target4.model_id), shard_dir(answers_path(copy, target4.model_id))
    before = {p.name: p.read_bytes() for p in sorted(sdir.glob("answers-*.pt"))[:kept]}
    assert kept >= 1 and len(before) == kept
    assert not answer_records(copy, target4, records, out, ANSWERS, batch=3, max_shards=0, **QUIET)["complete"]
    with pytest.raises(ValueError, match="dtype/quantization"):
        answer_records(copy, target4, records, out, ANSWERS, batch=3, max_shards=0, reuse=["float32"], **QUIET)
    both = answer_records(copy, target4, records, out, ANSWERS, batch=3, reuse=["float32/none"], **QUIET)
    assert both["complete"] and {p.name: p.read_bytes() for p in sorted(sdir.glob("answers-*.pt"))[:kept]} == before
    old = [it for it in data["items"] if "turn" not in it and it["index"] < kept * ANSWERS.shard_size]
    assert [it for it in both["items"] if "turn" not in it][:len(old)] == old
    generated = [it for it in both["items"] if "turn" not in it]
    assert both["targets"] == {"float32/none": len(old), "float32/int4": len(generated) - len(old)}
    assert sorted(it["index"] for it in generated) == list(range(len(records)))
    assert json.loads(out.with_suffix(".card.json").read_text())["targets"] == both["targets"]


def test_an_answer_set_of_its_own_is_saved_restored_and_read_after_the_main_set(first, fp32_config, target32,
                                                                               tmp_path, monkeypatch):
    """``train data --set NAME``: a prompt source answered apart from the main set (its prompts numbered from 0, its
    shards in a folder of their own), kept in the corpus with its prompts, and read by the trainers after the main
    set's answers."""
    from training.paths import answer_set_names, answer_set_path
    from training.data import ensure_data

    cfg, data = first
    records = [{"messages": [{"role": "user", "content": q}], "source": "people"}
               for q in ("Why is the sky blue?", "Give me a tip for sleeping better.", "What is a verb?")]
    path = answer_set_path(cfg, target32.model_id, "people")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    extra = answer_records(cfg, target32, records, path, ANSWERS, batch=3, **QUIET)
    assert extra["complete"] and sorted(it["index"] for it in extra["items"]) == [0, 1, 2]
    assert answer_set_names(cfg, target32.model_id) == ["people"]
    root = tmp_path / "corpus"
    corpus.save(cfg, target32.model_id, root=root, log=lambda m: None)
    kept = root / target32.model_id / "sets" / "people"
    assert (kept / "answers-00000.npz").is_file() and (kept / "data.json").is_file()
    monkeypatch.setattr(corpus, "CORPUS_ROOT", root)
    fresh = in_cache(fp32_config, tmp_path / "cache-two")
    _, items = ensure_data(fresh, target32, None, 8, 3, None, **QUIET)
    assert items == data["items"] + extra["items"]
    assert answer_set_path(fresh, target32.model_id, "people").with_suffix(".jsonl").read_text() == \
        path.with_suffix(".jsonl").read_text()
    # An explicit answers file is read alone.
    _, alone = ensure_data(fresh, target32, answers_path(fresh, target32.model_id), 8, 3, None, **QUIET)
    assert alone == data["items"]


def test_prompts_written_by_people_are_tidied_deduplicated_kept_off_the_benchmarks_and_shuffled():
    from training.people import people_records
    from training.prompt_dedup import BenchmarkGuard

    guard = BenchmarkGuard(["Explain what a hash map is and when to use one."])
    pairs = [("a", "why  is the sky blue"), ("b", "Why is the sky blue?"), ("a", "   "),
             ("b", "explain what a hash map is and when to use one"), ("a", "how do I boil an egg"),
             ("b", "Write a haiku about rain.")]
    records = people_records(pairs, guard.overlaps, seed=0)
    texts = sorted(r["messages"][0]["content"] for r in records)
    assert texts == ["Write a haiku about rain.", "how do I boil an egg", "why is the sky blue"]
    assert {r["source"] for r in records} == {"people"} and {r["category"] for r in records} == {"a", "b"}
    assert people_records(pairs, guard.overlaps, seed=0) == records
    # a seeded order, not the sources' (a partial run covers them all)
    from training.common import stable_int

    assert [r["messages"][0]["content"] for r in records] == sorted(texts, key=lambda t: stable_int(0, "people", t))
