"""The data card of the self-distilled answers: what ``train data`` wrote, next to the answers file.

The card counts prompts, answers and tokens, how answers ended (a stop token or the token cap), the sampling
temperatures, user turns per prompt, answers per category, a histogram of answer lengths, the targets that wrote
them and the generation's throughput, as JSON and as Markdown. ``temperature_counts`` also goes into the checkpoints'
cards (training/glide.py).
"""
from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

LENGTH_BINS = (16, 32, 64, 128, 256, 512, 1024)


def length_histogram(lengths: list[int], bins: tuple[int, ...] = LENGTH_BINS) -> dict[str, int]:
    """{"<16": n, "16-31": n, ..., ">=1024": n}: answer lengths in tokens."""
    edges = [0, *bins]
    hist = {}
    for lo, hi in zip(edges, edges[1:]):
        hist[f"<{hi}" if lo == 0 else f"{lo}-{hi - 1}"] = sum(lo <= n < hi for n in lengths)
    hist[f">={bins[-1]}"] = sum(n >= bins[-1] for n in lengths)
    return hist


def temperature_counts(items: list[dict]) -> dict[str, int]:
    """Answers per sampling temperature ("0" = greedy), as the data card and the checkpoints' cards report them."""
    return {f"{t:g}": n for t, n in sorted(Counter(float(it.get("temperature", 0.0)) for it in items).items())}


def data_card(data: dict, records: list[dict], command: str | None, seconds: float) -> dict:
    items = data["items"]
    lengths = [len(it["response_ids"]) for it in items]
    by_cat: dict[str, dict[str, int]] = {}
    for it in items:
        c = by_cat.setdefault(it.get("category") or it["source"] or "unknown", {"answers": 0, "answer_tokens": 0})
        c["answers"] += 1
        c["answer_tokens"] += len(it["response_ids"])
    turns = Counter(sum(m["role"] == "user" for m in r.get("messages", [])) or 1 for r in records)
    return {
        "model_id": data["model_id"], "command": command, "prompts": len(records), "answers": len(items),
        "answer_tokens": sum(lengths), "prompt_tokens": sum(len(it["prompt_ids"]) for it in items),
        "max_new_tokens": data["max_new_tokens"], "seed": data["seed"],
        "from_conversations": sum("turn" in it for it in items),
        "finished": sum(it["finish_reason"] == "stop" for it in items),
        "cut_at_max_new_tokens": sum(it["finish_reason"] == "length" for it in items),
        "temperatures": temperature_counts(items),
        "user_turns": {str(k): v for k, v in sorted(turns.items())},
        "by_category": dict(sorted(by_cat.items())),
        "answer_length_histogram": length_histogram(lengths),
        "refused_prompts": data.get("refused", 0),
        "targets": data.get("targets", {}),
        "generation_seconds": data.get("generation_seconds"),
        "answer_tokens_per_s": round(sum(lengths) / data["generation_seconds"], 1)
        if data.get("generation_seconds") else None,
        "seconds_this_run": round(seconds, 1),
    }


def card_markdown(card: dict) -> str:
    lines = [f"# Self-distilled answers of {card['model_id']}", "",
             f"- command: `{card['command']}`" if card["command"] else "- command: (library call)",
             f"- prompts: {card['prompts']}, answers: {card['answers']}, answer tokens: {card['answer_tokens']}, "
             f"prompt tokens: {card['prompt_tokens']}",
             f"- answers taken from multi-turn prompts (the target's first answer, no generation): "
             f"{card['from_conversations']}",
             f"- finished with a stop token: {card['finished']}; cut at {card['max_new_tokens']} new tokens: "
             f"{card['cut_at_max_new_tokens']}",
             f"- temperatures (0 = greedy): {card['temperatures']}, seed {card['seed']}",
             f"- user turns per prompt: {card['user_turns']}; prompts over the context left out: "
             f"{card['refused_prompts']}",
             f"- answered by (dtype/quantization: generated answers): {card.get('targets') or 'not recorded'}",
             f"- generation: {card['generation_seconds']} s over all shards, {card['answer_tokens_per_s']} answer "
             "tokens/s", "",
             "| category | answers | answer tokens |", "| --- | ---: | ---: |"]
    lines += [f"| {c} | {v['answers']} | {v['answer_tokens']} |" for c, v in card["by_category"].items()]
    lines += ["", "| answer length (tokens) | answers |", "| --- | ---: |"]
    lines += [f"| {k} | {v} |" for k, v in card["answer_length_histogram"].items()]
    return "\n".join(lines) + "\n"


def write_data_card(out: Path, data: dict, records: list[dict], command: str | None, seconds: float) -> dict:
    card = data_card(data, records, command, seconds)
    out.with_suffix(".card.json").write_text(json.dumps(card, indent=1) + "\n")
    out.with_suffix(".card.md").write_text(card_markdown(card))
    return card


def format_command(argv: list[str]) -> str:
    return shlex.join(["specserve", *argv])
