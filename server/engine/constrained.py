"""A draft tree under a request's grammar: drafts the grammar rules out are pruned before verification, and the
tokens it forces are added as free drafts.

- A point-mass draft the grammar does not allow (and its subtree) is dropped: the target's masked row gives it
  probability 0, so it would be rejected for certain. Dropping it changes no greedy or seeded token, and for
  speculative sampling only which uniform draws are used, not the distribution.
- A sampled draft (q > 0) is kept even where the grammar rules it out: its token was drawn from q, and rejecting it
  is what shapes the residual max(p - q, 0) the next sibling or the bonus token is drawn from. Only its subtree
  (never reachable: the draft itself is never accepted) is dropped.
- At every leaf the grammar allows, the tokens it forces next (keys, punctuation, a named tool's prefix: the canonical
  tokenization of the forced bytes) are appended as a chain of point-mass drafts, for every drafter, ``none``
  included. They are verified like any draft, so where the target would tokenize the forced text differently its
  own token wins.
"""
from __future__ import annotations

import torch

from core.grammar import Matcher
from core.tree import DraftTree
from server.engine.acceptance import path_tokens


def constrain_tree(tree: DraftTree, matcher: Matcher, max_rows: int) -> DraftTree:
    """``tree`` (rooted at the last committed token) pruned and extended under ``matcher`` (the committed state), at
    most ``max_rows`` rows."""
    n = tree.num_rows
    children = tree.children()
    sampled = tree.sampled_rows()
    valid = [True] + [False] * (n - 1)
    for leaf in range(n):  # one check per leaf marks its whole path
        if children[leaf]:
            continue
        path = path_tokens(tree, leaf)
        ok = matcher.valid_prefix(path)
        node, depth = leaf, len(path)
        while node > 0:
            if depth <= ok:
                valid[node] = True
            node, depth = tree.parents[node], depth - 1
    new_of: dict[int, int] = {}
    tokens, parents, rows = [], [], []
    for i in range(n):
        p = tree.parents[i]
        if i == 0 or (p in new_of and valid[p] and (valid[i] or sampled[i])):
            new_of[i] = len(tokens)
            tokens.append(tree.tokens[i])
            parents.append(new_of[p] if i else -1)
            rows.append(i)
    has_child = [False] * len(tokens)
    for p in parents[1:]:
        has_child[p] = True
    for j in range(len(rows)):  # the kept leaves the grammar allows, in row order
        if has_child[j] or not valid[rows[j]]:
            continue
        room = max_rows - len(tokens)
        if room <= 0:
            break
        ff = matcher.forced(path_tokens(tree, rows[j]))[:room]
        parent = j
        for t in ff:
            tokens.append(t)
            parents.append(parent)
            parent = len(tokens) - 1
    forced_rows = len(tokens) - len(rows)
    if len(rows) == n and not forced_rows:
        return tree
    q = None
    if tree.q is not None:
        q = tree.q[rows]
        if forced_rows:
            q = torch.cat([q, q.new_zeros(forced_rows, q.shape[1])])
    return DraftTree(tokens, parents, q)
