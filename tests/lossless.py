"""The lossless check, one way for every test: a speculative engine returns, token for token, what plain decoding
returns for the same prompt, sampling and stop tokens (greedy, or seeded sampling).

    plain = plain_tokens(Engine(cfg, target=target), prompts, 32, stops)       # once, e.g. in a module fixture
    outs = assert_lossless(Engine(cfg, drafter, target), prompts, plain, 32, stops)
    assert tokens_per_step(outs) > 1.2                                          # drafts were really accepted

Engines are duck-typed (``generate(prompt_ids, sampling, max_new_tokens, stop_token_ids)``), so this module imports
nothing of the engine. A plain-decoding engine is one without a drafter (``Engine(cfg, target=...)``, or the drafter
``none``).
"""
from __future__ import annotations

from typing import Any, Sequence

# The default model's prompts for the drafters' lossless tests: a chat answer with code, a prose answer, and a raw
# code completion (tests/drafters/conftest.py encodes them as the `prompt_ids` fixture).
DRAFTER_PROMPTS = [("chat", "Write a Python function that checks whether a string is a palindrome."),
                   ("chat", "Explain why the sky is blue."),
                   ("text", "def add(a: int, b: int) -> int:\n    \"\"\"Return the sum of a and b.\"\"\"\n")]


def generate_all(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops=None,
                 sampling=None) -> list:
    """``engine.generate`` on each prompt, one after the other: its GenerationOutputs in prompt order."""
    return [engine.generate(list(p), sampling, max_new_tokens, stops) for p in prompts]


def plain_tokens(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, stops=None,
                 sampling=None) -> list[list[int]]:
    """The tokens plain decoding (``engine`` has no drafter) returns for each prompt."""
    return [out.token_ids for out in generate_all(engine, prompts, max_new_tokens, stops, sampling)]


def assert_lossless(spec, prompts: Sequence[Sequence[int]], plain: Any, max_new_tokens: int, stops=None,
                    sampling=None, label: Any = None) -> list:
    """Generate each prompt with the speculative engine ``spec`` and assert it returns plain decoding's tokens.

    ``plain`` is plain decoding's token lists in prompt order (``plain_tokens``), or a plain-decoding engine to run
    here with the same arguments. ``label`` goes into the failure message (a drafter name, options, a sampling).
    Returns the speculative GenerationOutputs, for the tests' own checks on their stats.
    """
    want = plain_tokens(plain, prompts, max_new_tokens, stops, sampling) if hasattr(plain, "generate") else plain
    assert len(want) == len(prompts), "one plain output per prompt"
    outs = generate_all(spec, prompts, max_new_tokens, stops, sampling)
    for i, (out, tokens) in enumerate(zip(outs, want)):
        assert out.token_ids == list(tokens), f"prompt {i} ({label}): speculative {out.token_ids} != plain {tokens}"
    return outs


def tokens_per_step(outs: Sequence) -> float:
    """Tokens emitted per verify step over ``outs`` (1.0 when no draft token was ever accepted)."""
    return sum(o.stats.step_tokens for o in outs) / sum(o.stats.verify_steps for o in outs)


def drafts_per_step(outs: Sequence) -> float:
    """Draft tokens proposed per verify step over ``outs``."""
    return sum(o.stats.draft_tokens for o in outs) / sum(o.stats.verify_steps for o in outs)


def accepted_tokens(outs: Sequence) -> int:
    """Draft tokens accepted over ``outs``."""
    return sum(o.stats.accepted_tokens for o in outs)
