"""Greedy speculative decoding equals greedy plain decoding, token for token, on the default model (float32)."""
from __future__ import annotations

import pytest

from drafters.base import create_drafter
from server.engine import Engine
from tests.conftest import encode_prompts
from server.tokenization import stop_token_ids
from tests.engine.tree_drafters import OracleTreeDrafter

PROMPTS = [
    ("chat", "Write a Python function that checks whether a number is prime."),
    ("chat", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"),
    ("text", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return encode_prompts(tokenizer, PROMPTS)


@pytest.fixture(scope="module")
def plain(fp32_config, target32, tokenizer, prompts):
    engine = Engine(fp32_config, target=target32)
    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    return {tuple(p): engine.generate(p, max_new_tokens=MAX_NEW, stop_token_ids=stops).token_ids for p in prompts}


def _run(engine, prompts, tokenizer):
    stops = stop_token_ids(tokenizer, engine.model.args.eos_token_ids)
    return [engine.generate(p, max_new_tokens=MAX_NEW, stop_token_ids=stops) for p in prompts]


def test_ngram_equals_plain(fp32_config, target32, tokenizer, prompts, plain):
    engine = Engine(fp32_config, create_drafter("ngram", target32, {"num_tokens": 6}), target32)
    outs = _run(engine, prompts, tokenizer)
    for p, out in zip(prompts, outs):
        assert out.token_ids == plain[tuple(p)]
    assert sum(o.stats.accepted_tokens for o in outs) > 0  # the repeat-after-me prompt must hit


@pytest.mark.parametrize("kinds,max_rows", [(("chain",), 9), (("cape",), 32), (("bushy",), 64),
                                             (("chain", "cape", "bushy"), 64)])
def test_random_trees_equal_plain(fp32_config, target32, tokenizer, prompts, plain, kinds, max_rows):
    drafter = OracleTreeDrafter(plain, kinds=kinds, max_rows=max_rows, vocab_size=target32.args.vocab_size)
    engine = Engine(fp32_config, drafter, target32)
    outs = _run(engine, prompts, tokenizer)
    for p, out in zip(prompts, outs):
        assert out.token_ids == plain[tuple(p)]
    steps = sum(o.stats.verify_steps for o in outs)
    emitted = sum(o.stats.step_tokens for o in outs)
    assert emitted / steps > 1.5  # the hidden paths were really accepted (and compacted)
