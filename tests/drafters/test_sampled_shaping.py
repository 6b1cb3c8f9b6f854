"""Sampled exactness with the request's shaping on (logit_bias, penalties, min_p) and under a grammar: every tree row
shaped or masked with its own path's state, checked against the reference with the same definitions applied (the
method: test_sampled_exactness.py); the planted bugs peers shipped are caught."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import core.sampling as sampling_module
import server.engine.acceptance as acceptance_module
import server.engine.engine as engine_module
from core.sampling import SamplingParams
from server.engine import Engine
from tests.conftest import bias_row, chi2_pvalue
from tests.drafters.exactness import (  # noqa: F401 (reference_logits, target, weight_files: fixtures)
    CASES, N_CONTROL, V, Coverage, make_engine, recording, reference_joint, reference_logits, sample_joint,
    seed_base, shaped_probs, target, weight_files)

from tests.drafters import exactness

pytestmark = pytest.mark.statistical
if exactness.WIDE:
    tiny_dir = exactness.tiny_dir  # the wider tiny target (a GPU run)


# -- logit_bias, penalties and min_p: every tree row shaped with its own path's counts -------------------------------
# Token 4 banned, 9 and 3 moved, penalties strong enough to reshape the tiny target's distributions at each position.
SHAPING = dict(presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.4, min_p=0.02,
               logit_bias=((3, -2.0), (4, -100.0), (9, 1.5)))
N_SHAPED = 1500  # requests per drafter (the shaping cases' power is shown by the controls below, at the same count)
N_SHAPED_NGRAM = 3000  # penalties cut n-gram drafts short: two-deep accepts need more requests (ngram's are cheap)


def shaped_case(name: str) -> SamplingParams:
    return dataclasses.replace(CASES[name].sampling, **SHAPING)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampling_with_penalties_and_bias_matches_the_target(name, tiny_dir, target, weight_files, reference_logits,
                                                             monkeypatch):
    """Penalties, logit_bias and min_p on: the drafts are shaped with each row's own path, so the sampled sequences
    still follow the target's shaped distribution (the reference applies the same definitions to transformers'
    logits after each prefix)."""
    engine = make_engine(tiny_dir, target, weight_files, name)
    sp = shaped_case(name)
    cov = Coverage()
    monkeypatch.setattr(engine_module, "accept_sampling", recording(engine_module.accept_sampling, cov))
    n = N_SHAPED_NGRAM if name == "ngram" else N_SHAPED
    counts = sample_joint(engine, sp, n, seed_base(name, control=8))
    joint = reference_joint(reference_logits, sp)
    assert float(joint[4].sum() + joint[:, 4].sum() + joint[:, :, 4].sum()) == 0  # the banned token has no mass
    pvalue = chi2_pvalue(counts, joint)
    print(f"\n{name} shaped: p = {pvalue:.4g}; {cov}")
    assert cov.accepted >= n // 40 and cov.deep_accepts > 0, cov  # penalties cut copy drafts short
    assert pvalue > 1e-3, f"{name}: shaped sampling does not follow the target's distribution (p = {pvalue:.3g})"


def _bias_skipped_for_drafted_rows(self, node):
    """ShapedRows.__getitem__ with the bias left out of every row past the root."""
    path = acceptance_module.path_tokens(self.tree, node)
    row = self.shaper(self.logits[node], path)
    if node:
        row = row - bias_row(self.shaper.sp, row)
    return sampling_module.target_probs(row[None], self.sp)[0] if self.sp is not None else row


@pytest.mark.parametrize("bug", ["root state everywhere", "root counted twice", "bias skipped for drafted rows"])
def test_negative_control_shaping_bugs_are_caught(bug, tiny_dir, target, weight_files, reference_logits,
                                                  monkeypatch):
    """The bugs peers shipped: penalties computed with the committed state at every tree row, the root token
    counted again for the drafted rows, the bias applied to the root row only."""
    real = acceptance_module.path_tokens
    if bug == "root state everywhere":
        monkeypatch.setattr(acceptance_module, "path_tokens", lambda tree, node: [])
    elif bug == "root counted twice":
        monkeypatch.setattr(acceptance_module, "path_tokens",
                            lambda tree, node: ([tree.tokens[0]] + real(tree, node)) if node else [])
    else:
        monkeypatch.setattr(acceptance_module.ShapedRows, "__getitem__", _bias_skipped_for_drafted_rows)
    name = "glide-cape"
    engine = make_engine(tiny_dir, target, weight_files, name)
    sp = shaped_case(name)
    counts = sample_joint(engine, sp, N_CONTROL, seed_base(name, control=9))
    joint = reference_joint(reference_logits, sp)
    impossible = int(counts[joint == 0].sum())
    if impossible:  # a banned token sampled: chi2_pvalue fails on it outright
        with pytest.raises(AssertionError, match="probability zero"):
            chi2_pvalue(counts, joint)
    pvalue = chi2_pvalue(counts * (joint > 0), joint)
    print(f"\n{name} ({bug}): p = {pvalue:.3g}; {impossible} of {N_CONTROL} with target probability 0")
    assert impossible or pvalue < 1e-6


# -- a grammar: every tree row masked with its own path's state, forced tokens as free drafts -----------------------
# Tokens 0..14 are the letters a..o (15 is end of sequence). The grammar: after `a` only `g` (forced: a free draft),
# after b..f only g..o, after anything else any letter; it never accepts, so end of sequence is never allowed. The
# mask at position 2 and 3 depends on the token before it, so a row masked with the wrong path's state shows.
GRAMMAR_REGEX = "([g-o]|ag|[b-f][g-o])*q"
GRAMMAR_DRAFTERS = ("cascade", "falcon", "glide-cape", "ngram")
N_GRAMMAR = 1500


def grammar_allowed(prev: int | None) -> np.ndarray:
    """[V] bool: the letters the grammar allows after ``prev`` (None: the first token), from its definition."""
    ok = np.zeros(V, dtype=bool)
    if prev == 0:
        ok[6] = True
    elif prev is not None and 1 <= prev <= 5:
        ok[6:15] = True
    else:
        ok[:15] = True
    return ok


def grammar_joint(reference_logits: np.ndarray, sp: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) under the grammar: the mask first, then the request's temperature / top-k / top-p."""
    x = reference_logits.astype(np.float64) + 0.0
    x[0, 0, 0, ~grammar_allowed(None)] = -np.inf
    for a in range(V):
        x[a, :, 1, ~grammar_allowed(a)] = -np.inf
        for b in range(V):
            x[a, b, 2, ~grammar_allowed(b)] = -np.inf
    p = shaped_probs(x, sp)
    p1, p2, p3 = p[0, 0, 0], p[:, 0, 1], p[:, :, 2]
    return torch.from_numpy(p1[:, None, None] * p2[:, :, None] * p3)


@pytest.fixture(scope="module")
def letters_tokenizer():
    """The tiny target's vocabulary as a byte-level tokenizer: ids 0..14 spell a..o, 15 is end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from core.grammar import GrammarTokenizer

    vocab = {c: i for i, c in enumerate("abcdefghijklmno")}
    vocab["</s>"] = 15
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["</s>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return GrammarTokenizer(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>"), V, [15])


def grammar_engine(tiny_dir, target, weight_files, name, letters_tokenizer) -> tuple[Engine, SamplingParams]:
    from core.grammar import regex_grammar

    engine = make_engine(tiny_dir, target, weight_files, name)
    engine._grammar_tokenizer = letters_tokenizer
    return engine, dataclasses.replace(CASES[name].sampling, grammar=regex_grammar(GRAMMAR_REGEX))


@pytest.mark.parametrize("name", GRAMMAR_DRAFTERS)
def test_sampling_under_a_grammar_matches_the_masked_target(name, tiny_dir, target, weight_files, reference_logits,
                                                            letters_tokenizer, monkeypatch):
    engine, sp = grammar_engine(tiny_dir, target, weight_files, name, letters_tokenizer)
    cov = Coverage()
    monkeypatch.setattr(engine_module, "accept_sampling", recording(engine_module.accept_sampling, cov))
    counts = sample_joint(engine, sp, N_GRAMMAR, seed_base(name, control=12))
    joint = grammar_joint(reference_logits, sp)
    pvalue = chi2_pvalue(counts, joint)  # fails outright on a sequence the grammar rules out (probability 0)
    print(f"\n{name} grammar: p = {pvalue:.4g}; {cov}")
    assert cov.accepted >= N_GRAMMAR // 20 and cov.deep_accepts > 0, cov
    assert pvalue > 1e-3, f"{name}: sampling under a grammar does not follow the masked target (p = {pvalue:.3g})"


def _mask_at_the_root_row_only(self, node):
    """ShapedRows.__getitem__ with the grammar's mask left out of every row past the root."""
    matcher = self.shaper.matcher
    if node:
        self.shaper.matcher = None
    try:
        row = self.shaper(self.logits[node], acceptance_module.path_tokens(self.tree, node))
    finally:
        self.shaper.matcher = matcher
    return sampling_module.target_probs(row[None], self.sp)[0]


def test_negative_control_mask_at_the_root_row_only_is_caught(tiny_dir, target, weight_files, reference_logits,
                                                              letters_tokenizer, monkeypatch):
    """The rows past the root unmasked (the grammar's state not advanced along the draft): a token the grammar rules
    out is accepted, and the committed matcher refuses it (or, were it let through, the chi-square fails)."""
    from core.grammar import GrammarError

    monkeypatch.setattr(acceptance_module.ShapedRows, "__getitem__", _mask_at_the_root_row_only)
    bug, name = "mask at the root row only", "falcon"
    engine, sp = grammar_engine(tiny_dir, target, weight_files, name, letters_tokenizer)
    try:
        counts = sample_joint(engine, sp, N_CONTROL, seed_base(name, control=13))
    except GrammarError as e:
        print(f"\n{name} ({bug}): {str(e).splitlines()[0]}")
        return
    pvalue = chi2_pvalue(counts, grammar_joint(reference_logits, sp))
    print(f"\n{name} ({bug}): p = {pvalue:.3g}")
    assert pvalue < 1e-6
