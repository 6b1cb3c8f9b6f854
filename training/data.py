"""Self-distilled training data: the target model answers the training prompts; we keep the token ids.

Why the target answers: a drafter is verified against the target's own distribution, so that distribution is what it
must learn. Why the batched engine: the answers are tens of thousands of sequences, and the serving engine already
runs many of them per target forward (continuous batching: a finished sequence's KV slot goes to the next prompt at
once, a new prompt is prefilled in chunks inside the decode steps of the others), over the same weights, dtype and
kernels that will serve. Most answers are greedy; a configurable share is sampled at the temperatures users send
(sampled requests are verified against the sampled distribution), each seeded by its prompt's index, so a run is a
function of its prompts and settings: the engine draws a seeded request's tokens by a race keyed on (seed, position),
whatever else shares the step.

Work is cut into shards of consecutive prompts, each written atomically when done and keyed by its settings and prompt
ids, so a killed run continues where it stopped and a changed prompt list regenerates only the shards it touches.

Output (``torch.save``): {"model_id", "max_new_tokens", "temperature", "temperatures", "seed", "complete",
"items": [{"prompt_ids", "response_ids", "source", "index", "category", "temperature", "finish_reason"}]} (index =
position in the prompt list); ``response_ids`` end with the stop token when the answer finished. The generated answers
come first, in prompt order; then the answers the target already wrote inside synthesized multi-turn prompts (one
item per such turn, marked with ``turn``: ``conversation_answers``). A data card (JSON and Markdown) sits
next to it (training/data_card.py). The engine runs the jobs through training/batched_generator.py;
``generate_responses`` (training/hf_reference.py) keeps the Hugging Face ``generate`` path as a reference.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from server.tokenization import encode_chat, encode_record, read_prompts, stop_token_ids
from training.batched_generator import BatchedGenerator, GenRequest, GenResult, single
from training.common import stable_int, stable_unit
from training.data_card import write_data_card
from training.paths import answer_set_names, answer_set_path, answers_path, save_atomic, shard_dir, synth_dir

DEFAULT_TEMPERATURES = (0.7, 1.0)


def load_responses(path: Path) -> dict:
    return torch.load(path, weights_only=True)


# -- answers at scale ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AnswerSettings:
    max_new_tokens: int = 256
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    sampled_share: float = 0.25    # share of prompts answered by sampling, at one of ``temperatures``
    seed: int = 0
    shard_size: int = 512

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if not 0.0 <= self.sampled_share <= 1.0:
            raise ValueError("--sampled-share must be in [0, 1]")
        if self.sampled_share > 0 and (not self.temperatures or any(t <= 0 for t in self.temperatures)):
            raise ValueError("--temperatures must be positive when --sampled-share is above 0")
        if self.shard_size < 1:
            raise ValueError("the shard size must be >= 1")


def answer_temperature(index: int, s: AnswerSettings) -> float:
    """Greedy (0.0) or one of the sampling temperatures for prompt ``index``: a fixed function of (seed, index)."""
    if s.sampled_share <= 0 or stable_unit(s.seed, "sampled", index) >= s.sampled_share:
        return 0.0
    return s.temperatures[stable_int(s.seed, "temperature", index) % len(s.temperatures)]


def answer_sampling(index: int, s: AnswerSettings):
    from core.sampling import SamplingParams

    t = answer_temperature(index, s)
    return SamplingParams() if t == 0.0 else SamplingParams(temperature=t, seed=stable_int(s.seed, "answer", index))


def _shard_key(model_id: str, dtype, quantization: str, s: AnswerSettings, records: list[dict],
               prompts: list[list[int]], indices: range) -> str:
    """What a shard's answers depend on: the target (weights, dtype, quantization), the settings, and its prompts (ids
    and labels)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([model_id, str(dtype), quantization, s.max_new_tokens, list(s.temperatures), s.sampled_share,
                         s.seed, indices.start, indices.stop]).encode())
    for i in indices:
        h.update(json.dumps([prompts[i], records[i].get("source"), records[i].get("category")]).encode())
    return h.hexdigest()


def answer_records(cfg, target, records: list[dict], out: Path, settings: AnswerSettings | None = None,
                   batch: int = 64, step_tokens: int = 512, max_shards: int | None = None, progress: bool = True,
                   log=print, command: str | None = None, reuse: Sequence[str] = ()) -> dict:
    """The target answers every record with the batched engine; resumable by shards. Returns the data dict (the
    merged file is written only when every shard is done; ``max_shards`` stops after that many new shards).

    ``reuse``: other targets of the same weights, as ``dtype/quantization`` (``float32/int4``), whose shards count as
    done where their prompts and settings match, so that a run on another device or dtype answers only the prompts
    they lack. The merged file counts the answers each target wrote (``targets``)."""
    from server.model_files import load_tokenizer

    s = settings or AnswerSettings()
    out = Path(out)
    tok = load_tokenizer(target.hf_dir)
    stops = stop_token_ids(tok, target.args.eos_token_ids)
    prompts = [encode_record(tok, r) for r in records]
    shards = [range(a, min(a + s.shard_size, len(records))) for a in range(0, len(records), s.shard_size)]
    sdir = shard_dir(out)
    sdir.mkdir(parents=True, exist_ok=True)
    mine = target_name(target.dtype, target.quantization)
    names = [mine, *(n for n in dict.fromkeys(target_name(*parse_target(r)) for r in reuse) if n != mine)]
    keys_of = {n: [_shard_key(target.model_id, *parse_target(n), s, records, prompts, r) for r in shards]
               for n in names}
    keys = keys_of[mine]
    origin: dict[int, str] = {}  # shard -> the target whose answers it holds
    for k in range(len(shards)):
        stored = _stored_key(sdir / f"answers-{k:05d}.pt")
        match = [n for n in names if keys_of[n][k] == stored]
        if match:
            origin[k] = match[0]
    done = set(origin)
    todo = [k for k in range(len(shards)) if k not in done]
    if done:
        log(f"{len(done)} of {len(shards)} answer shards already done in {sdir}")
    todo = todo if max_shards is None else todo[:max_shards]
    t0, n_tok = time.perf_counter(), 0
    bar = tqdm(total=sum(len(shards[k]) for k in todo), desc="target answers", unit="prompt", disable=not progress,
               smoothing=0.05)
    # Every shard left goes through one run: the next shard's prompts fill the slots the last one frees, so the batch
    # stays full to the end instead of draining at each shard's tail. A shard is written once its last answer is in.
    order = [(k, i) for k in todo for i in shards[k]]
    got: dict[int, dict[int, GenResult]] = {k: {} for k in todo}
    last_write, new_shards = time.perf_counter(), 0

    def on_step(tokens: int, finished: int) -> None:
        nonlocal n_tok
        n_tok += tokens
        bar.update(finished)
        bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}", refresh=False)

    def on_done(jid: int, result: GenResult) -> None:
        nonlocal last_write, new_shards
        k, i = order[jid]
        got[k][i] = result
        if len(got[k]) < len(shards[k]):
            return
        items = [_item(i, records[i], prompts[i], got[k][i], answer_temperature(i, s)) for i in shards[k]]
        now = time.perf_counter()  # a shard's seconds: the wall time since the previous write (they sum to the run's)
        save_atomic({"key": keys[k], "items": items, "seconds": now - last_write}, sdir / f"answers-{k:05d}.pt")
        origin[k] = mine
        del got[k]
        last_write, new_shards = now, new_shards + 1

    if order:
        longest = max(len(prompts[i]) for _, i in order)
        gen = BatchedGenerator(cfg, target, batch, longest + s.max_new_tokens + 1, step_tokens)
        gen.run((single(GenRequest(prompts[i], answer_sampling(i, s), s.max_new_tokens, stops)) for _, i in order),
                on_step, on_done)
    bar.close()
    if len(done) + new_shards < len(shards):
        return {"model_id": target.model_id, "complete": False, "items": []}
    data = _merge(sdir, [origin[k] for k in range(len(shards))], target.model_id, s)
    data["items"] += conversation_answers(records, tok, stops)
    data["records"] = len(records)
    save_atomic(data, out)
    write_data_card(out, data, records, command, time.perf_counter() - t0)
    return data


def conversation_answers(records: list[dict], tokenizer, stops: tuple[int, ...]) -> list[dict]:
    """Answers the target already wrote: a synthesized multi-turn prompt holds the target's own greedy, finished answer
    to its first turn (training/synth.py), so that answer joins the data as an item of its own, with no
    generation (259 answers, 4% more answer tokens, on the first 4,096 prompts of a run). Only ``synth`` records: an
    assistant turn in a prompt file may be anybody's text. The answer is re-tokenized from its text, which the target's
    tokens decode to, and ends with the end-of-turn token, as a finished answer does; ``turn`` marks the item."""
    eot = tokenizer.eos_token_id if tokenizer.eos_token_id in stops else stops[0]
    out = []
    for index, rec in enumerate(records):
        msgs = rec.get("messages", []) if rec.get("source") == "synth" else []
        for j, m in enumerate(msgs):
            if m["role"] != "assistant" or j == 0 or not m["content"].strip():
                continue
            response = list(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) + [eot]
            out.append({"prompt_ids": encode_chat(tokenizer, msgs[:j]), "response_ids": response,
                        "source": rec["source"], "index": index, "category": rec.get("category", rec["source"]),
                        "temperature": 0.0, "finish_reason": "stop", "turn": j})
    return out


def _stored_key(path: Path) -> str | None:
    """The key a shard file was written under; None when there is none (a torn or foreign file: regenerate it)."""
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=True)["key"]
    except Exception:
        return None


def target_name(dtype, quantization: str) -> str:
    """``float32/int4``: what a shard's answers were generated by, besides the weights (the data's model id)."""
    return f"{str(dtype).removeprefix('torch.')}/{quantization}"


def parse_target(name: str) -> tuple[torch.dtype, str]:
    """``bfloat16/none`` -> (torch.bfloat16, "none"); a clear error for anything else."""
    from core.ops import DTYPES, QUANTIZATIONS

    dtype, _, quantization = name.strip().partition("/")
    if dtype not in DTYPES or quantization not in QUANTIZATIONS:
        raise ValueError(f"a target is dtype/quantization with a dtype of {', '.join(DTYPES)} and a quantization of "
                         f"{', '.join(QUANTIZATIONS)}, got {name!r}")
    return DTYPES[dtype], quantization


def _item(index: int, record: dict, prompt: list[int], result: GenResult, temperature: float) -> dict:
    return {"prompt_ids": prompt, "response_ids": result.token_ids, "source": record.get("source", ""),
            "index": index, "category": record.get("category", record.get("source", "")),
            "temperature": temperature, "finish_reason": result.finish_reason}


def _merge(sdir: Path, origins: list[str], model_id: str, s: AnswerSettings) -> dict:
    """Every shard's answers in index order; prompts the engine refused (longer than its context) are left out.
    ``origins``: per shard, the target that answered it."""
    items, seconds, refused, targets = [], 0.0, 0, Counter()
    for k, name in enumerate(origins):
        shard = torch.load(sdir / f"answers-{k:05d}.pt", weights_only=True)
        kept = [it for it in shard["items"] if it["finish_reason"] != "refused" and it["response_ids"]]
        items += kept
        refused += len(shard["items"]) - len(kept)
        targets[name] += len(kept)
        seconds += shard["seconds"]
    return {"model_id": model_id, "max_new_tokens": s.max_new_tokens, "temperature": 0.0,
            "temperatures": list(s.temperatures), "sampled_share": s.sampled_share, "seed": s.seed,
            "complete": True, "refused": refused, "generation_seconds": round(seconds, 1),
            "targets": dict(targets), "items": items}


def prompt_records(sources: str | None, synth_train: Path | None, log=print) -> list[dict]:
    """The prompts to answer, from a comma-separated list of sources: ``project`` (training/prompts.py: chat
    prompts and the HumanEval training split), ``synth`` (the synthesized train split, ``synth_train``) or JSONL
    paths. None: ``project`` plus ``synth`` when it exists."""
    from training.prompts import training_records

    names = [x.strip() for x in (sources or "project,synth?").split(",") if x.strip()]
    records: list[dict] = []
    for name in names:
        if name == "project":
            records += training_records()
        elif name in ("synth", "synth?"):
            if synth_train is not None and Path(synth_train).exists():
                records += [dict(r, source=r.get("source", "synth")) for r in read_prompts(synth_train)]
            elif name == "synth":
                raise FileNotFoundError(f"no synthesized prompts at {synth_train}: run `specserve train prompts` first")
            else:
                log(f"no synthesized prompts at {synth_train} (`specserve train prompts` writes them); answering the "
                    "project prompts only")
        else:
            records += [dict(r, source=r.get("source", Path(name).stem)) for r in read_prompts(name)]
    return records


def ensure_data(cfg, target, data_path: Path | None, max_new_tokens: int, batch_size: int, limit: int | None,
                progress: bool = True, log=print) -> tuple[Path, list[dict]]:
    """The self-distilled answers: a complete file written by ``specserve train data`` is used as it is; otherwise
    the default prompts (project prompts, plus the synthesized ones when ``train prompts`` ran) are answered with the
    batched engine (resumable; training/data.py). Without ``data_path`` the answers of every complete answer set
    (``train data --set``) follow the main set's."""
    if not data_path:  # the answers the repository keeps (training/corpus.py), where this cache lacks them
        from training import corpus

        corpus.restore(cfg, target.model_id, log=log)
    path = Path(data_path) if data_path else answers_path(cfg, target.model_id)
    data = load_responses(path) if path.exists() else None
    if data is None or not data.get("complete", False):
        records = prompt_records(None, synth_dir(cfg, target.model_id) / "train.jsonl", log)
        records = records[:limit] if limit else records
        # A file from before the sharded format holds as many items as prompts when it is complete.
        if data is None or "complete" in data or len(data["items"]) < len(records):
            path.parent.mkdir(parents=True, exist_ok=True)
            log(f"generating target answers for {len(records)} prompts into {path}")
            data = answer_records(cfg, target, records, path, AnswerSettings(max_new_tokens=max_new_tokens),
                                  batch=batch_size, progress=progress, log=log)
    if data["model_id"] != target.model_id:
        raise ValueError(f"{path} holds answers of {data['model_id']!r}, not of the target {target.model_id!r}")
    items = list(data["items"])
    if not data_path:  # the default data: the main set, then every complete set of a prompt source of its own
        for name in answer_set_names(cfg, target.model_id):
            set_path = answer_set_path(cfg, target.model_id, name)
            extra = load_responses(set_path) if set_path.exists() else {}
            if extra.get("complete") and extra["model_id"] == target.model_id:
                log(f"+ answer set {name!r}: {len(extra['items'])} answers")
                items += extra["items"]
    items = items[:limit] if limit else items
    return path, items
