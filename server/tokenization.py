"""Prompt files and prompt encoding, shared by the CLI, the benchmarks, training and the API process (the worker only
sees token ids)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_prompts(path: str | Path) -> list[dict]:
    """A JSONL prompt file: one {messages} or {prompt} record per line."""
    records = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            rec = json.loads(line)
            if "messages" not in rec and "prompt" not in rec:
                raise ValueError(f"{path}:{i + 1}: each line needs `messages` or `prompt`")
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def encode_text(tokenizer, text: str) -> list[int]:
    """A raw completion prompt, with whatever special tokens the tokenizer adds by default."""
    return list(tokenizer(text)["input_ids"])


class ChatTemplateError(ValueError):
    """The model cannot render these messages: it has no chat template, or its template refuses them (a role order
    it does not take). A client error: the API answers 400 with this message."""


def encode_chat(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Apply the model's chat template (with the assistant turn opened) and tokenize. ``tools`` (OpenAI's tool
    objects) go to a template that renders tools itself; for one that does not, the API process has written them
    into the messages already (server.api.tools)."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template (a base model): send a text prompt to "
                                "/v1/completions instead")
    kw = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    except TemplateError as e:  # raise_exception() in the template: the model's own words
        raise ChatTemplateError(f"the model's chat template refused these messages: {e}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The model's end-of-sequence ids plus the tokenizer's eos (chat models end turns with it)."""
    ids = set(eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def encode_record(tokenizer, record: dict[str, Any]) -> list[int]:
    """A prompts-file line: {"messages": [...]} (chat template applied) or {"prompt": "..."}."""
    if "messages" in record:
        return encode_chat(tokenizer, record["messages"])
    if "prompt" in record:
        return encode_text(tokenizer, record["prompt"])
    raise ValueError("each prompt record needs `messages` or `prompt`")
