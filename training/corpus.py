"""The training data kept in the repository, so that it accumulates from run to run instead of living only in a cache.

``training/corpus/<target id>/`` holds, compactly, what ``train prompts`` and ``train data`` write to the work
directory (``<cache>/train/<target id>/``, training/common.py):

    synth/plan.json, synth/stats.json          the settings the shards were made with, the last filtering's stats
    synth/train.jsonl.xz, synth/heldout.jsonl.xz   the synthesized prompts (what ``train data`` answers)
    synth/raw-NNNNN.json.xz                    the raw shards, so a larger ``--count`` continues them
    answers/answers-NNNNN.npz                  the target's answers: token ids as uint16, one file per shard
    answers/conversations.npz                  answers taken from synthesized conversations (no generation)
    answers/data.json, answers/card.json       the merged answers file's header, and its data card
    sets/NAME/                                 an answer set of a prompt source of its own (``train data --set``):
                                               its prompts (prompts.jsonl.xz) and the same answer files as answers/

``restore`` copies what the work directory lacks out of the corpus before a run (a shard is then reused only when its
key still matches, as any cached shard) and, where the corpus holds a complete answers set, writes the merged answers
file the trainers read (whatever dtype the trainer's own target runs in); ``save`` (``specserve train save-data``)
writes the work directory's shards the corpus lacks or holds in another version back into it, to be committed. The
shard formats, keys and resumption are the pipeline's own (training/synth.py, training/data.py): this module only
moves files and packs answers.
"""
from __future__ import annotations

import json
import lzma
from pathlib import Path

import numpy as np
import torch

from training.paths import SET_NAME, answer_set_names, answer_set_path, answers_path, save_atomic, shard_dir, synth_dir

CORPUS_ROOT = Path(__file__).resolve().parent / "corpus"
FINISH = ("stop", "length", "refused")  # finish_reason codes of packed answers
_SYNTH_PLAIN = ("plan.json", "stats.json")
_SYNTH_PACKED = ("train.jsonl", "heldout.jsonl")


def corpus_dir(model_id: str, root: Path | None = None) -> Path:
    return Path(root or CORPUS_ROOT) / model_id


# -- answers: a shard of items <-> uint16 arrays --------------------------------------------------------------------
def pack_answers(shard: dict) -> dict[str, np.ndarray]:
    """An answer shard ({"key", "items", "seconds"}, training/data.py) as arrays: token ids uint16, lengths, labels."""
    items = shard["items"]
    if any(max(it["prompt_ids"] + it["response_ids"], default=0) > 0xFFFF for it in items):
        raise ValueError("token ids above 65535 do not fit the uint16 corpus format")
    labels = [[it["source"], it["category"]] for it in items]
    return {
        "key": np.frombuffer(shard["key"].encode(), dtype=np.uint8),
        "seconds": np.array([shard["seconds"]], dtype=np.float64),
        "prompt": np.array([t for it in items for t in it["prompt_ids"]], dtype=np.uint16),
        "prompt_len": np.array([len(it["prompt_ids"]) for it in items], dtype=np.int32),
        "response": np.array([t for it in items for t in it["response_ids"]], dtype=np.uint16),
        "response_len": np.array([len(it["response_ids"]) for it in items], dtype=np.int32),
        "index": np.array([it["index"] for it in items], dtype=np.int64),
        "temperature": np.array([it["temperature"] for it in items], dtype=np.float32),
        "finish": np.array([FINISH.index(it["finish_reason"]) for it in items], dtype=np.uint8),
        "turn": np.array([it.get("turn", -1) for it in items], dtype=np.int32),  # -1: a generated answer
        "labels": np.frombuffer(json.dumps(labels).encode(), dtype=np.uint8),
    }


def unpack_answers(arrays) -> dict:
    """The inverse of ``pack_answers``: the shard dict the pipeline reads."""
    labels = json.loads(bytes(arrays["labels"]).decode())
    p_end = np.cumsum(arrays["prompt_len"])
    r_end = np.cumsum(arrays["response_len"])
    prompt, response = arrays["prompt"].astype(np.int64), arrays["response"].astype(np.int64)
    items = []
    for i, (source, category) in enumerate(labels):
        items.append({
            "prompt_ids": prompt[p_end[i] - arrays["prompt_len"][i]:p_end[i]].tolist(),
            "response_ids": response[r_end[i] - arrays["response_len"][i]:r_end[i]].tolist(),
            "source": source, "index": int(arrays["index"][i]), "category": category,
            # float32 keeps the temperatures the pipeline uses (0.0, 0.7, 1.0 ...) to their shortest decimal
            "temperature": float(np.format_float_positional(arrays["temperature"][i])),
            "finish_reason": FINISH[int(arrays["finish"][i])],
        })
        if arrays["turn"][i] >= 0:
            items[-1]["turn"] = int(arrays["turn"][i])
    return {"key": bytes(arrays["key"]).decode(), "items": items, "seconds": float(arrays["seconds"][0])}


def _load_packed(path: Path) -> dict:
    with np.load(path) as arrays:
        return unpack_answers(arrays)


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


# -- restore: corpus -> work directory --------------------------------------------------------------------------------
def restore(cfg, model_id: str, root: Path | None = None, log=print) -> dict[str, int]:
    """Copy into the work directory every corpus file it lacks. Returns counts of what was copied."""
    src = corpus_dir(model_id, root)
    counts = {"synth_shards": 0, "synth_files": 0, "answer_shards": 0, "answers_file": 0}
    if not src.is_dir():
        return counts
    sdir = synth_dir(cfg, model_id)
    for name in _SYNTH_PLAIN:
        if (src / "synth" / name).is_file() and not (sdir / name).exists():
            _write_bytes(sdir / name, (src / "synth" / name).read_bytes())
            counts["synth_files"] += 1
    for name in _SYNTH_PACKED:
        counts["synth_files"] += _unpack_xz(src / "synth" / (name + ".xz"), sdir / name)
    for packed in sorted((src / "synth").glob("raw-*.json.xz")):
        counts["synth_shards"] += _unpack_xz(packed, sdir / "shards" / packed.name[:-3])
    counts["answer_shards"], counts["answers_file"] = _restore_answers(src / "answers", answers_path(cfg, model_id))
    for sub in sorted(p for p in (src / "sets").glob("*") if p.is_dir() and SET_NAME.fullmatch(p.name)):
        path = answer_set_path(cfg, model_id, sub.name)
        _unpack_xz(sub / "prompts.jsonl.xz", path.with_suffix(".jsonl"))
        shards, merged = _restore_answers(sub, path)
        counts["answer_shards"] += shards
        counts["answers_file"] += merged
    if any(counts.values()):
        log(f"restored from the repository's corpus {src}: {counts['synth_shards']} prompt shards, "
            f"{counts['synth_files']} prompt files, {counts['answer_shards']} answer shards")
    return counts


def _restore_answers(src: Path, out: Path) -> tuple[int, int]:
    """One answer set's corpus folder (``answers/`` or ``sets/NAME/``) into the work directory's shards of ``out``,
    and ``out`` itself where the folder holds a complete set: (shards copied, merged files written)."""
    adir, copied, merged = shard_dir(out), 0, 0
    for packed in sorted(src.glob("answers-*.npz")):
        dst = adir / (packed.stem + ".pt")
        if not dst.exists():
            adir.mkdir(parents=True, exist_ok=True)
            save_atomic(_load_packed(packed), dst)
            copied += 1
    adata = src / "data.json"
    if adata.is_file() and not out.exists():
        head = json.loads(adata.read_text())
        shards = [src / f"answers-{k:05d}.npz" for k in range(head.pop("shards"))]
        if all(p.exists() for p in shards):
            items = [it for p in shards for it in _load_packed(p)["items"]
                     if it["finish_reason"] != "refused" and it["response_ids"]]
            if (src / "conversations.npz").is_file():
                items += _load_packed(src / "conversations.npz")["items"]
            out.parent.mkdir(parents=True, exist_ok=True)
            save_atomic({**head, "items": items}, out)
            if (src / "card.json").is_file():
                _write_bytes(out.with_suffix(".card.json"), (src / "card.json").read_bytes())
            merged = 1
    return copied, merged


# -- save: work directory -> corpus -----------------------------------------------------------------------------------
def save(cfg, model_id: str, root: Path | None = None, log=print) -> dict[str, int]:
    """Write into the corpus every work-directory shard and file it lacks or holds in another version. An answer
    shard is saved only when its key is new to the corpus; the prompt files and stats are replaced by the work
    directory's (they are derived from the shards). Returns counts of what was written."""
    dst = corpus_dir(model_id, root)
    counts = {"synth_shards": 0, "synth_files": 0, "answer_shards": 0}
    sdir = synth_dir(cfg, model_id)
    if (sdir / "plan.json").is_file():
        if (dst / "synth" / "plan.json").is_file() and \
                json.loads((dst / "synth" / "plan.json").read_text()) != json.loads((sdir / "plan.json").read_text()):
            raise ValueError(f"{dst / 'synth'} holds prompt shards made with other settings than {sdir}: move one "
                             "of them aside first")
        for name in _SYNTH_PLAIN:
            if (sdir / name).is_file() and _write_if_changed(dst / "synth" / name, (sdir / name).read_bytes()):
                counts["synth_files"] += 1
        for name in _SYNTH_PACKED:
            counts["synth_files"] += _pack_xz(sdir / name, dst / "synth" / (name + ".xz"))
        for raw in sorted((sdir / "shards").glob("raw-*.json")):
            packed = dst / "synth" / (raw.name + ".xz")
            if not packed.exists():
                _write_bytes(packed, lzma.compress(raw.read_bytes(), preset=9))
                counts["synth_shards"] += 1
    counts["answer_shards"] += _save_answers(answers_path(cfg, model_id), dst / "answers")
    for name in answer_set_names(cfg, model_id):
        path = answer_set_path(cfg, model_id, name)
        _pack_xz(path.with_suffix(".jsonl"), dst / "sets" / name / "prompts.jsonl.xz")
        counts["answer_shards"] += _save_answers(path, dst / "sets" / name)
    log(f"saved into {dst}: {counts['synth_shards']} prompt shards, {counts['synth_files']} prompt files, "
        f"{counts['answer_shards']} answer shards")
    return counts


def _save_answers(merged: Path, dst: Path) -> int:
    """One answer set's work-directory shards (those of ``merged``) into the corpus folder ``dst``, with the merged
    file's header, conversation answers and card when it is complete. Returns the shards written."""
    adir, written = shard_dir(merged), 0
    first_index = []  # of each shard's first item: which shards a merged file of the first N prompts covers
    for path in sorted(adir.glob("answers-*.pt")):
        shard = torch.load(path, weights_only=True)
        first_index.append(shard["items"][0]["index"] if shard["items"] else float("inf"))
        out = dst / (path.stem + ".npz")
        if out.exists():
            with np.load(out) as old:
                if bytes(old["key"]).decode() == shard["key"]:
                    continue
        _save_npz(out, pack_answers(shard))
        written += 1
    if merged.is_file():  # a complete ``train data``: its header, the conversation answers and the card
        data = torch.load(merged, weights_only=True)
        # the shards the merged file covers: a later, unfinished ``train data`` may have added more after them
        shards = sum(1 for i in first_index if i < data.get("records", float("inf")))
        if data.get("complete") and shards:
            head = {k: v for k, v in data.items() if k != "items"} | {"shards": shards}
            _write_if_changed(dst / "data.json", (json.dumps(head, indent=1) + "\n").encode())
            conv = {"key": "conversations", "items": [it for it in data["items"] if "turn" in it], "seconds": 0.0}
            path = dst / "conversations.npz"
            if not path.is_file() or _load_packed(path) != conv:
                _save_npz(path, pack_answers(conv))
            card = merged.with_suffix(".card.json")
            if card.is_file():
                _write_if_changed(dst / "card.json", card.read_bytes())
    return written


def _unpack_xz(packed: Path, dst: Path) -> bool:
    """``packed`` decompressed into ``dst`` where the corpus holds it and the work directory does not; True when
    written."""
    if not packed.is_file() or dst.exists():
        return False
    _write_bytes(dst, lzma.decompress(packed.read_bytes()))
    return True


def _pack_xz(src: Path, packed: Path) -> bool:
    """``src`` xz-compressed into ``packed`` unless that holds the same bytes already; True when written."""
    if not src.is_file():
        return False
    data = src.read_bytes()
    if packed.exists() and lzma.decompress(packed.read_bytes()) == data:
        return False
    _write_bytes(packed, lzma.compress(data, preset=9))
    return True


def _write_if_changed(path: Path, data: bytes) -> bool:
    """Write ``data`` unless ``path`` holds it already (a save rewrites nothing it need not); True when written."""
    if path.is_file() and path.read_bytes() == data:
        return False
    _write_bytes(path, data)
    return True
