"""Greedy speculative decoding equals greedy plain decoding, token for token, on the default model (float32)."""
from __future__ import annotations

import pytest

from drafters.base import create_drafter
from server.engine import Engine
from tests.engine.tree_drafters import OracleTreeDrafter
from tests.lossless import accepted_tokens, assert_lossless, plain_tokens, tokens_per_step

PROMPTS = [
    ("chat", "Write a Python function that checks whether a number is prime."),
    ("chat", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"),
    ("text", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def plain(fp32_config, target32, prompts, stops):
    return plain_tokens(Engine(fp32_config, target=target32), prompts, MAX_NEW, stops)


def test_ngram_equals_plain(fp32_config, target32, prompts, plain, stops):
    engine = Engine(fp32_config, create_drafter("ngram", target32, {"num_tokens": 6}), target32)
    outs = assert_lossless(engine, prompts, plain, MAX_NEW, stops, label="ngram")
    assert accepted_tokens(outs) > 0  # the repeat-after-me prompt must hit


@pytest.mark.parametrize("kinds,max_rows", [(("chain",), 9), (("cape",), 32), (("bushy",), 64),
                                             (("chain", "cape", "bushy"), 64)])
def test_random_trees_equal_plain(fp32_config, target32, prompts, plain, stops, kinds, max_rows):
    reference = {tuple(p): want for p, want in zip(prompts, plain)}
    drafter = OracleTreeDrafter(reference, kinds=kinds, max_rows=max_rows, vocab_size=target32.args.vocab_size)
    engine = Engine(fp32_config, drafter, target32)
    outs = assert_lossless(engine, prompts, plain, MAX_NEW, stops, label=kinds)
    assert tokens_per_step(outs) > 1.5  # the hidden paths were really accepted (and compacted)


def test_the_engine_verifies_trees_depth_first(fp32_config, target32, prompts, plain, stops):
    """A tree drafted level by level is verified with the likeliest chain first (its leading rows then run in place,
    and an accepted path along it needs no compaction), and decoding stays lossless."""
    reference = {tuple(p): want for p, want in zip(prompts, plain)}
    drafter = OracleTreeDrafter(reference, kinds=("bushy",), max_rows=16, vocab_size=target32.args.vocab_size)
    engine = Engine(fp32_config, drafter, target32)
    drafted, verified = [], []
    propose, accept = drafter.propose, engine._accept
    drafter.propose = lambda seq: drafted.append(propose(seq)) or drafted[-1]
    engine._accept = lambda seq, tree, logits: verified.append(tree) or accept(seq, tree, logits)
    assert_lossless(engine, prompts[:1], plain[:1], MAX_NEW, stops, label="depth-first")
    drafted, verified = ([t for t in trees if t.num_rows > 1] for trees in (drafted, verified))  # steps with drafts
    assert len(drafted) == len(verified) and any(t.depth_first() is not t for t in drafted)
    for d, v in zip(drafted, verified):
        want = d.truncate(v.num_rows).depth_first()  # the rows the request still has room for, reordered
        assert (v.tokens, v.parents) == (want.tokens, want.parents)
