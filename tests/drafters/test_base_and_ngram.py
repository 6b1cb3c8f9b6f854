"""Drafter contract: registry, DraftTree helpers, and the ngram (prompt lookup) proposer."""
from __future__ import annotations

import numpy as np
import pytest

from core.tree import DraftTree
from drafters.base import create_drafter, drafter_names
from drafters.ngram import lookup


def test_registry_lists_valid_names_on_unknown():
    assert {"none", "ngram"} <= set(drafter_names())
    with pytest.raises(ValueError, match="valid drafters: .*ngram"):
        create_drafter("nope", target=None)
    with pytest.raises(ValueError, match="no option 'bogus'; valid options: num_tokens, max_ngram, min_ngram"):
        create_drafter("ngram", target=None, options={"bogus": 1})
    with pytest.raises(ValueError, match="'num_tokens' must be int"):
        create_drafter("ngram", target=None, options={"num_tokens": 2.5})


def test_draft_tree_helpers():
    t = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    assert t.depths() == [0, 1, 1, 2, 2]
    assert t.children() == [[1, 2], [3, 4], [], [], []]
    assert t.truncate(3).tokens == [9, 1, 2] and t.truncate(3).parents == [-1, 0, 0]
    c = DraftTree.chain(5, [6, 7])
    assert c.parents == [-1, 0, 1] and c.num_draft == 2


def test_lookup_prefers_longest_then_most_recent_match():
    h = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # suffix [2, 3] (n=2) last seen at index 6 -> proposes what followed: 7, 8, 5
    assert lookup(h, max_ngram=3, min_ngram=1, num_tokens=3) == [7, 8, 5]
    # a 3-gram match wins over a more recent 2-gram one
    h = np.array([4, 2, 3, 6, 6, 2, 3, 8, 8, 4, 2, 3])
    assert lookup(h, 3, 1, 2) == [6, 6]
    assert lookup(np.array([1, 2, 3]), 3, 1, 4) == []
    assert lookup(np.array([5, 6, 5]), 3, 1, 4) == [6, 5]
    assert lookup(np.array([5, 6, 5]), 3, 2, 4) == []  # min_ngram 2: no match


def test_ngram_drafter_proposes_a_chain_rooted_at_last_token():
    class Seq:
        tokens = [1, 2, 3, 4, 1, 2]
        max_rows = 64

    d = create_drafter("ngram", target=None, options={"num_tokens": 2})
    tree = d.propose(Seq())
    assert tree.tokens == [2, 3, 4] and tree.parents == [-1, 0, 1]
    Seq.max_rows = 2  # the step's row budget: one draft token
    assert d.propose(Seq()).tokens == [2, 3]
    assert create_drafter("none", target=None).propose(Seq()).tokens == [2]
