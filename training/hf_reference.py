"""The self-distilled answers by Hugging Face ``generate``: the reference the batched engine path is checked against.

The target's Hugging Face model answers every record in left-padded batches of similar lengths (greedy when the
temperature is 0), resumably, into the same data format as ``answer_records`` (training/data.py), the path that
scales.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from server.model_files import hf_causal_lm
from server.tokenization import encode_record, stop_token_ids
from training.data import load_responses


@torch.inference_mode()
def generate_responses(hf_dir: Path, model_id: str, records: list[dict], out: Path, max_new_tokens: int = 256,
                       batch_size: int = 32, temperature: float = 0.0, seed: int = 0, dtype=torch.bfloat16,
                       device: str = "cpu", progress: bool = True, gguf: Path | None = None) -> dict:
    """Answer every record with Hugging Face ``generate`` (greedy when temperature is 0); resumable, returns the data
    dict. The reference the engine path is checked against; ``answer_records`` is the one that scales. ``gguf``: the
    file holding the weights where ``hf_dir`` holds a GGUF source's metadata (``target.gguf``)."""
    from transformers import AutoTokenizer

    out = Path(out)
    data = {"model_id": model_id, "max_new_tokens": max_new_tokens, "temperature": temperature, "items": []}
    if out.exists():
        data = load_responses(out)
        if data["model_id"] != model_id:
            raise ValueError(f"{out} holds data for {data['model_id']!r}, not {model_id!r}; pass another --data path")
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = hf_causal_lm(hf_dir, gguf, dtype).to(device).eval()
    stops = set(stop_token_ids(tok, tuple(model.generation_config.eos_token_id
                                          if isinstance(model.generation_config.eos_token_id, list)
                                          else [model.generation_config.eos_token_id])))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
    prompts = [(encode_record(tok, r), r.get("source", "")) for r in records]
    have = {it["index"] for it in data["items"]}
    todo = [i for i in range(len(prompts)) if i not in have]
    # Similar lengths share a batch (less padding).
    order = sorted(todo, key=lambda i: len(prompts[i][0]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    torch.manual_seed(seed)
    t0, n_tok = time.perf_counter(), 0
    bar = tqdm(total=len(todo), desc="target answers", unit="prompt", disable=not progress)
    for batch in batches:
        width = max(len(prompts[i][0]) for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):  # left padding: every prompt ends at the same column
            p = prompts[i][0]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                             top_p=None, top_k=None, pad_token_id=pad, eos_token_id=sorted(stops))
        for row, i in enumerate(batch):
            resp = []
            for t in gen[row, width:].tolist():
                resp.append(t)
                if t in stops:
                    break
            data["items"].append({"prompt_ids": prompts[i][0], "response_ids": resp, "source": prompts[i][1],
                                  "index": i})
            n_tok += len(resp)
        torch.save(data, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").replace(out)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}")
    bar.close()
    data["items"].sort(key=lambda it: it["index"])
    return data
