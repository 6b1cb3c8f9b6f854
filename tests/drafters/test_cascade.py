"""Cascade Speculative Drafting: Max-Gram matching and bigram fallback, the bigram table, the cascade's vertical review
and horizontal split (K matrix, leniency) with a scripted reviewer, and losslessness on the default model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core.sampling import SamplingParams
from drafters.base import create_drafter
from drafters.cascade.drafter import (CascadeDrafter, cascade_draft, cascade_tree, check_k, review_expansions,
                                      review_step, rewind)
from drafters.cascade.maxgram import (BigramTableError, MaxGram, default_bigram_path, load_bigram, longest_match,
                                      save_bigram)
from drafters.glide.model import default_checkpoint
from training.bigram import count_bigrams
from server.engine import Engine
from tests.lossless import assert_lossless, plain_tokens, tokens_per_step

V = 2000
COUNTING = np.arange(1, V + 1) % V  # bigram table: v -> v + 1


# -- Max-Gram ---------------------------------------------------------------------------------------------------
def test_longest_match_prefers_longest_then_prompt_then_most_recent():
    # prompt: [1 2 3 4 | 7 2 3 5]; generation: [9 2 3 6 ... 2 3]
    ctx = np.array([1, 2, 3, 4, 7, 2, 3, 5, 9, 2, 3, 6, 8, 2, 3])
    # [2, 3] occurs at ends 2, 6 (prompt) and 10 (generated); [x, 2, 3] never repeats -> length 2, prompt, latest
    assert longest_match(ctx, prompt_len=8) == (2, 6)
    assert longest_match(ctx, prompt_len=2) == (2, 10)  # no occurrence ends in the prompt: the most recent one
    # a longer match in the generated text beats a shorter one in the prompt
    ctx = np.array([5, 6, 1, 2, 9, 4, 5, 6, 7, 0, 4, 5, 6])
    assert longest_match(ctx, prompt_len=3) == (3, 7)  # [4, 5, 6] at 5..7 (generated), not [5, 6] at 0..1
    # the context's own suffix never matches itself; no earlier occurrence at all
    assert longest_match(np.array([1, 2, 3]), 3) == (0, -1)
    assert longest_match(np.array([7]), 1) == (0, -1)
    assert longest_match(np.array([4, 1, 4]), 3) == (1, 0)
    assert longest_match(np.array([4, 1, 4]), 3, min_match=2) == (0, -1)


def test_maxgram_copies_from_prompt_and_generation_then_falls_back_to_bigrams():
    mg = MaxGram(COUNTING)
    # prompt "10 11 12 13 14"; generated "50 11 12": copy what followed [11, 12] in the prompt, then keep matching
    ctx = [10, 11, 12, 13, 14, 50, 11, 12]
    assert mg.extend(ctx, 5, 2) == [13, 14]
    # a continuation runs on past the prompt's end into the generated text (50, 11, 12), then matching resumes
    assert mg.extend(ctx, 5, 6) == [13, 14, 50, 11, 12, 13]
    # no earlier occurrence of the last token: bigram chain (v -> v + 1), re-matching after every token
    assert mg.extend([100, 200, 300], 2, 4) == [301, 302, 303, 304]
    # the bigram token leads into a match in the generated text: copy from there
    ctx = [900, 901, 7, 8, 9, 30, 31, 6]
    assert mg.extend(ctx, 2, 4) == [7, 8, 9, 30]
    # a match in generated text only (nothing in the prompt)
    assert mg.extend([1, 2, 40, 41, 42, 43, 40, 41], 2, 3) == [42, 43, 40]


@pytest.mark.parametrize("n", [1, 3, 10, 63])
def test_maxgram_proposes_exactly_num_tokens(n):
    rng = np.random.default_rng(n)
    mg = MaxGram(rng.integers(0, 50, V))
    for _ in range(20):
        ctx = rng.integers(0, 50, int(rng.integers(1, 200))).tolist()
        out = mg.extend(ctx, int(rng.integers(0, len(ctx) + 1)), n)
        assert len(out) == n and all(0 <= t < V for t in out)


def test_min_match_sends_short_matches_to_the_bigram_table():
    ctx = [5, 9, 1, 2, 3, 9]  # [9] occurred (followed by 1) but [x, 9] never did
    assert MaxGram(COUNTING, min_match=1).extend(ctx, 6, 1) == [1]
    assert MaxGram(COUNTING, min_match=2).extend(ctx, 6, 1) == [10]


# -- the bigram table -------------------------------------------------------------------------------------------
def test_count_bigrams_keeps_the_most_frequent_successor():
    table, stats = count_bigrams([[1, 2, 1, 2, 1, 3], [1, 3, 4, 4, 4], [5]], vocab_size=8)
    # 1 -> 2 twice, 1 -> 3 twice: tie -> smaller id; 4 -> 4; 2 -> 1; 3 -> 4
    assert table.dtype == torch.int32 and table.shape == (8,)
    assert table[1] == 2 and table[2] == 1 and table[3] == 4 and table[4] == 4
    # tokens never followed by anything map to the most frequent successor overall (4: three times)
    assert stats["fallback_token"] == 4 and table[0] == table[5] == table[7] == 4
    assert stats["bigrams"] == 9 and stats["tokens_with_successor"] == 4
    with pytest.raises(ValueError, match="outside the vocabulary"):
        count_bigrams([[1, 9]], vocab_size=8)


def _fake_target(model_id="SmolLM2-135M-Instruct", vocab=49152):
    return SimpleNamespace(model_id=model_id, args=SimpleNamespace(vocab_size=vocab))


def test_bigram_table_checks_and_the_shipped_one(tmp_path):
    shipped = default_bigram_path("SmolLM2-135M-Instruct")
    assert shipped.is_file(), "the bigram table must ship in the repository (`specserve train bigram`)"
    table = load_bigram(_fake_target())
    assert table.shape == (49152,) and table.min() >= 0 and table.max() < 49152
    assert len(np.unique(table)) > 100  # learned, not a constant
    with pytest.raises(BigramTableError, match="no bigram table.*specserve train bigram"):
        load_bigram(_fake_target(), tmp_path / "nope.safetensors")
    with pytest.raises(BigramTableError, match="no bigram table for target 'other'.*specserve train bigram"):
        create_drafter("maxgram", _fake_target("other"))
    save_bigram(tmp_path / "t.safetensors", torch.arange(16, dtype=torch.int32), "tiny")
    with pytest.raises(BigramTableError, match="built for target 'tiny', not 'SmolLM2.*specserve train bigram"):
        load_bigram(_fake_target(), tmp_path / "t.safetensors")
    with pytest.raises(BigramTableError, match="vocabulary has 32 tokens"):
        load_bigram(_fake_target("tiny", 32), tmp_path / "t.safetensors")
    assert load_bigram(_fake_target("tiny", 16), tmp_path / "t.safetensors").tolist() == list(range(16))


def test_maxgram_drafter_chain():
    d = create_drafter("maxgram", _fake_target(), {"num_tokens": 4})
    seq = SimpleNamespace(tokens=[10, 11, 12, 13, 99, 11, 12], prompt_len=4, max_rows=64)
    tree = d.propose(seq)
    assert tree.tokens[:3] == [12, 13, 99] and tree.parents == [-1, 0, 1, 2, 3] and tree.q is None
    seq.max_rows = 3  # the step's row budget
    assert d.propose(seq).tokens == [12, 13, 99]
    with pytest.raises(ValueError, match="num_tokens"):
        create_drafter("maxgram", _fake_target(), {"num_tokens": 0})


# -- the cascade with a scripted reviewer ----------------------------------------------------------------------
class ScriptedReviewer:
    """A reviewer whose own next token after t is t + 1, except ``fix[t]``; it puts ``p_other`` on ``soft`` tokens."""

    def __init__(self, fix=None, soft=None, p_other=0.0):
        self.fix, self.soft, self.p_other = fix or {}, soft or set(), p_other
        self.reviews, self.rewinds = [], 0

    def review(self, seq, draft):
        self.reviews.append(list(draft))
        rows = []
        for prev in [seq.tokens[-1], *draft]:
            row = torch.zeros(V)
            own = self.fix.get(prev, (prev + 1) % V)
            alt = (prev + 1) % V
            if alt in self.soft and alt != own:
                row[alt] = self.p_other
            row[own] = 1.0 - row.sum()
            rows.append(row)
        return torch.stack(rows)

    def observe(self, seq, result):
        assert result.tokens == []  # only the cascade's rewind between rounds reaches a scripted reviewer
        self.rewinds += 1


SEQ = SimpleNamespace(tokens=[100, 200, 300], prompt_len=2)


def test_horizontal_split_follows_k():
    rev = ScriptedReviewer(fix={302: 999})
    # one round: Max-Gram proposes 301..304, the reviewer keeps 301, 302 and puts its own 999 at the miss (k11 = 3
    # reached); Max-Gram alone then extends from 999 to k12 = 7 tokens
    draft = cascade_draft(SEQ, MaxGram(COUNTING), rev, k11=3, k12=7, k21=4)
    assert rev.reviews == [[301, 302, 303, 304]] and rev.rewinds == 0
    assert draft == [301, 302, 999, 1000, 1001, 1002, 1003]
    # k11 = k12: no Max-Gram-only positions; the reviewed draft is cut to k12
    rev = ScriptedReviewer()
    assert cascade_draft(SEQ, MaxGram(COUNTING), rev, k11=2, k12=2, k21=4) == [301, 302]
    assert rev.reviews == [[301, 302, 303, 304]]


def test_vertical_review_repeats_until_k11():
    rev = ScriptedReviewer(fix={302: 999})
    draft = cascade_draft(SEQ, MaxGram(COUNTING), rev, k11=5, k12=7, k21=4)
    # round 1 -> [301, 302, 999]; round 2 reviews it again from the root with Max-Gram's next 4 tokens, all pass,
    # plus the reviewer's own token after them; then cut to k12
    assert rev.reviews == [[301, 302, 303, 304], [301, 302, 999, 1000, 1001, 1002, 1003]]
    assert rev.rewinds == 1
    assert draft == [301, 302, 999, 1000, 1001, 1002, 1003]
    assert check_k([[5, 7], [4]]) == (5, 7, 4)
    for bad in ([[5, 4], [4]], [[0, 4], [4]], [[5, 7]], [[5, 7], [0]], [[1, 64], [4]], 5):
        with pytest.raises(ValueError, match="cascade: "):
            check_k(bad)


def test_leniency_lets_likely_tokens_through():
    # the reviewer's own token after 302 is 999, but it gives Max-Gram's 303 probability 0.4
    rev = lambda: ScriptedReviewer(fix={302: 999}, soft={303}, p_other=0.4)  # noqa: E731
    for leniency, want in [(1.0, [301, 302, 999]), (2.0, [301, 302, 999]), (3.0, [301, 302, 303, 304, 305])]:
        assert cascade_draft(SEQ, MaxGram(COUNTING), rev(), k11=3, k12=3 if leniency < 3 else 5, k21=4,
                             leniency=leniency) == want


def test_branch_keeps_maxgram_continuation_beside_the_reviewed_tokens():
    rev = ScriptedReviewer(fix={302: 999})
    branches = []
    draft = cascade_draft(SEQ, MaxGram(COUNTING), rev, k11=3, k12=7, k21=4, branches=branches)
    assert draft == [301, 302, 999, 1000, 1001, 1002, 1003]  # the chain is unchanged
    assert branches == [(2, [303, 304])]  # Max-Gram's 303, 304 where the reviewer put 999
    tree = cascade_tree(300, draft, branches, max_depth=7)
    assert tree.tokens == [300, 301, 302, 999, 1000, 1001, 1002, 1003, 303, 304]
    assert tree.parents == [-1, 0, 1, 2, 3, 4, 5, 6, 2, 8]  # 303 is a sibling of 999 (both children of 302)
    tree.validate(V)
    assert tree.depths()[8:] == [3, 4]
    # the branch never reaches deeper than max_depth tokens below the root
    tree = cascade_tree(300, draft[:3], branches, max_depth=3)
    assert tree.tokens == [300, 301, 302, 999, 303] and tree.parents == [-1, 0, 1, 2, 2]
    # nothing rejected: no branch; a branch at max depth or repeating the chain's token adds nothing
    branches = []
    assert cascade_draft(SEQ, MaxGram(COUNTING), ScriptedReviewer(), k11=1, k12=5, k21=4, branches=branches) == \
        [301, 302, 303, 304, 305] and branches == []
    assert cascade_tree(300, [301, 302], [(2, [7]), (1, [302, 9])], 2).tokens == [300, 301, 302]
    # two rounds, two misses: two branches at their own depths; rows stop at the tree's limit
    rev = ScriptedReviewer(fix={302: 999, 1000: 5})
    branches = []
    draft = cascade_draft(SEQ, MaxGram(COUNTING), rev, k11=5, k12=7, k21=4, branches=branches)
    assert branches == [(2, [303, 304]), (4, [1001, 1002, 1003])]
    tree = cascade_tree(300, draft, branches, max_depth=7)
    assert tree.parents[len(draft) + 1:] == [2, 8, 4, 10, 11] and tree.num_rows == len(draft) + 6
    assert cascade_tree(300, list(range(1, 61)), [(2, list(range(100, 140)))], 63).num_rows == 64


def test_expand_adds_the_reviewers_next_best_tokens_by_confidence():
    # the reviewer's row after 302 puts 0.6 on its own 999 and 0.4 on Max-Gram's 303; every other row is sure
    rev = ScriptedReviewer(fix={302: 999}, soft={303}, p_other=0.4)
    rows = []
    draft = cascade_draft(SEQ, MaxGram(COUNTING), rev, k11=3, k12=5, k21=4, expansions=rows)
    assert draft == [301, 302, 999, 1000, 1001] and [d for d, _ in rows] == [0, 1, 2]  # reviewed depths only
    exp = review_expansions(rows, max_expand=7)
    assert exp[2][0] == 2 and exp[2][1] == [999, 303] and exp[2][2] == pytest.approx(0.6)
    assert exp[0][1] == [301] and exp[0][2] == 1.0  # zero-probability tokens are never candidates
    tree = cascade_tree(300, draft, [], 5, exp)
    assert tree.tokens == [300, 301, 302, 999, 1000, 1001, 303] and tree.parents[6] == 2  # sibling of 999
    tree.validate(V)
    # a token the branch already put there is not added twice
    tree = cascade_tree(300, draft, [(2, [303, 304])], 5, exp)
    assert tree.tokens == [300, 301, 302, 999, 1000, 1001, 303, 304]
    # S(p) from the bins: p = 0.2 -> 7 alternatives, p = 0.7 -> 3, p = 0.9 -> 1; expansions past the draft are
    # dropped; rows stop at max_rows, the chain and branches are never cut for them
    alts = lambda first: list(range(first, first + 8))  # noqa: E731
    exp = [(0, alts(10), 0.2), (1, alts(20), 0.7), (2, alts(30), 0.9), (3, alts(40), 0.1)]
    tree = cascade_tree(300, [10, 20, 30], [], 3, exp)
    assert tree.tokens[4:] == [11, 12, 13, 14, 15, 16, 17, 21, 22, 23, 31]
    assert tree.parents[4:] == [0] * 7 + [1] * 3 + [2]
    tree = cascade_tree(300, [10, 20, 30], [(1, [5, 6])], 3, exp, max_rows=8)
    assert tree.tokens == [300, 10, 20, 30, 5, 6, 11, 12]
    assert cascade_tree(300, [10, 20, 30], [], 3, exp, bins=[(1.0, 0)]).tokens == [300, 10, 20, 30]


def test_review_step_greedy_and_sampled():
    probs = torch.tensor([[0.1, 0.9, 0.0], [0.6, 0.0, 0.4], [0.0, 0.0, 1.0]])
    assert review_step([1, 2], probs) == (1, 0)             # 2 has 0.4 < 1 and is not the argmax
    assert review_step([1, 2], probs, leniency=2.0) == (1, 0)  # 0.4 <= 1/2
    assert review_step([1, 2], probs, leniency=3.0) == (2, 2)  # 0.4 > 1/3: passes; the last row's token follows
    assert review_step([1, 0], probs) == (2, 2)
    g = torch.Generator().manual_seed(0)
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    never = torch.tensor([[0.3, 0.0, 0.7], [1.0, 0.0, 0.0]])
    for _ in range(50):
        assert review_step([1], sure, generator=g) == (1, 2)   # probability 1: always passes
        n, tok = review_step([1], never, generator=g)          # probability 0: never passes; never redrawn
        assert n == 0 and tok in (0, 2)
    half = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert all(review_step([1], half, 2.0, g) == (1, 2) for _ in range(50))  # min(1, 2 * 0.5) = 1
    passed = sum(review_step([1], half, 1.0, g)[0] for _ in range(400))
    assert 150 < passed < 250


# -- the real cascade on the default model ----------------------------------------------------------------------
PROMPTS = [
    ("chat", "Write a Python function that checks whether a number is prime."),
    ("chat", "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"),
    ("chat", "Add type hints to this function:\n```python\ndef add_numbers(first_number, second_number):\n"
             "    total = first_number + second_number\n    return total\n```"),
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def plain(fp32_config, target32, prompts, stops):
    return plain_tokens(Engine(fp32_config, target=target32), prompts, MAX_NEW, stops)


def test_maxgram_greedy_equals_plain(fp32_config, target32, prompts, plain, stops):
    engine = Engine(fp32_config, create_drafter("maxgram", target32), target32)
    outs = assert_lossless(engine, prompts, plain, MAX_NEW, stops, label="maxgram")
    # the repeat-after-me and code prompts copy from the prompt: long accepted runs
    assert tokens_per_step(outs[1:]) > 1.5


@pytest.mark.parametrize("options", [{}, {"k": [[6, 9], [3]], "leniency": 3.0}, {"k": [[4, 4], [2]]},
                                     {"branch": False, "max_rows": 40}, {"branch": False, "expand": False}],
                         ids=["default-branch-expand", "rounds-lenient", "vertical-only", "expand-only", "chain"])
def test_cascade_greedy_equals_plain(fp32_config, target32, prompts, plain, stops, options):
    assert default_checkpoint(target32.model_id).is_file(), "the trained GLIDE checkpoint must ship"
    drafter = create_drafter("cascade", target32, options)
    engine = Engine(fp32_config, drafter, target32)
    outs = assert_lossless(engine, prompts, plain, MAX_NEW, stops, label=options)
    steps = sum(o.stats.verify_steps for o in outs)
    assert tokens_per_step(outs) > 1.3  # the reviewed drafts really get accepted
    assert drafter.num_forwards >= steps and drafter.forward_seconds > 0  # one review (at least) per step


def test_cascade_review_rounds_rewind_the_reviewer(fp32_config, target32, prompts):
    """A second review round scores exactly what a fresh reviewer scores for the same draft."""
    a = CascadeDrafter(target32)
    b = CascadeDrafter(target32)
    engine = Engine(fp32_config, a, target32)
    seq = engine.add(prompts[0], max_new_tokens=8)
    engine.prefill(seq)
    b.prefill(engine.view(seq))
    view = engine.view(seq)
    first = a.maxgram.extend(view.tokens, view.prompt_len, 6)
    a.reviewer.review(view, first)
    draft = first[:2] + [7, 8, 9]
    rewind(a.reviewer, view)
    again = a.reviewer.review(view, draft)
    fresh = b.reviewer.review(view, draft)
    assert torch.allclose(again, fresh, atol=1e-5)
    engine.release(seq)


def test_sampled_cascade_runs_and_repeats_with_a_seed(fp32_config, target32, prompts, stops):
    engine = Engine(fp32_config, create_drafter("cascade", target32, {"leniency": 2.0}), target32)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    outs = [engine.generate(prompts[0], sp, 16, stops) for _ in range(2)]
    assert outs[0].token_ids == outs[1].token_ids and 1 <= len(outs[0].token_ids) <= 16
    assert outs[0].stats.verify_steps < len(outs[0].token_ids)  # drafts were accepted
