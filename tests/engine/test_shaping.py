"""logit_bias, penalties, min_p and logprobs under speculation, on the real model in float32: every registered drafter
returns plain decoding's tokens and logprobs, with prompts that make the drafters propose penalised and banned tokens.

Each of the planted bugs peers shipped (penalties applied with the root's state at every tree row, the root counted
twice, the bias skipped for drafted rows, logprobs read from the drafter's q) makes the same check fail.

Logprob tolerance: on the quantized CPU target (the GGUF's int4 on the qlinear kernel, float32) every row's result is
independent of the other rows, so a tree row's logprobs are bitwise plain decoding's; on the dense float32 target
PyTorch's GEMMs sum in an order that depends on the row count, within LOGPROB_TOL_FP32.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import server.engine.acceptance as acceptance_module
import server.engine.engine as engine_module
import server.engine.logprobs as logprobs_module
from core.sampling import SamplingParams
from drafters.base import create_drafter, drafter_names
from server.engine import Engine
from tests.conftest import bias_row
from tests.lossless import accepted_tokens

MAX_NEW = 24
# dense float32 target: a tree row against the same position decoded alone. Which GEMM each shape runs is measured
# at load (row-invariant kernels first, then speed), so the summation orders, and the differences, vary from run to
# run: up to 1.1e-4 seen on a 2-core EPYC (AVX2); the planted bugs move logprobs by far more.
LOGPROB_TOL_FP32 = 5e-4
TEXTS = [("chat", "Repeat the word banana ten times, separated by commas."),
         ("text", "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat on"),
         ("text", "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(")]


@pytest.fixture(scope="module")
def texts(tokenizer):
    from tests.conftest import encode_prompts

    return encode_prompts(tokenizer, TEXTS)


@pytest.fixture(scope="module")
def samplings(tokenizer):
    """Greedy with penalties and biases (the banned token is one the prompts repeat), seeded with those and min_p.
    The penalties are mild: the drafters do not shape their drafts, and strong penalties leave them no accepted
    draft to check (the processed logprobs, compared exactly, see any change of a row's state)."""
    ban, boost = tokenizer.encode(" cat")[0], tokenizer.encode(" return")[0]
    shaping = dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.05,
                   logit_bias=((ban, -100.0), (boost, 2.0)), logprobs=4)
    return {"greedy": SamplingParams(**shaping),
            "seeded": SamplingParams(temperature=0.8, seed=5, min_p=0.05, **shaping)}


def _run(engine, texts, samplings, stops):
    return {(k, i): engine.generate(p, sp, MAX_NEW, stops) for k, sp in samplings.items() for i, p in enumerate(texts)}


def assert_same(got: dict, want: dict, tol: float, label: str) -> None:
    """Tokens equal; each token's logprob within ``tol``; the same top alternatives (as sets: equal values may order
    either way) with values within ``tol``; alternatives of probability 0 (-inf, processed logprobs after top-k or
    min_p) only counted, since which of them fill the list is arbitrary."""
    for key, w in want.items():
        g = got[key]
        assert g.token_ids == w.token_ids, f"{label} {key}: {g.token_ids} != {w.token_ids}"
        assert len(g.logprobs) == len(g.token_ids) == len(w.logprobs), (label, key)
        for j, ((glp, gtop), (wlp, wtop)) in enumerate(zip(g.logprobs, w.logprobs)):
            assert abs(glp - wlp) <= tol, f"{label} {key} token {j}: logprob {glp} != {wlp}"
            gfin, wfin = ({t: v for t, v in top if v != float("-inf")} for top in (gtop, wtop))
            assert gfin.keys() == wfin.keys() and len(gtop) == len(wtop), f"{label} {key} token {j}: {gtop} != {wtop}"
            assert all(abs(v - wfin[t]) <= tol for t, v in gfin.items()), (label, key, j, gtop, wtop)


def _processed(cfg):
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, logprobs_mode="processed"))


@pytest.fixture(scope="module")
def processed(int4):
    """The int4 target with ``logprobs_mode: processed``: each token's logprobs are those of the row it was chosen
    from after the shaping, so they check every row's shaping, not only the argmax or the draw."""
    cfg, target = int4
    return _processed(cfg), target


@pytest.fixture(scope="module")
def plain_int4(processed, texts, samplings, stops):
    cfg, target = processed
    return _run(Engine(cfg, target=target), texts, samplings, stops)


@pytest.mark.parametrize("name", [n for n in drafter_names() if n != "none"])  # every registered drafter
def test_every_drafter_shapes_and_scores_like_plain_decoding(name, processed, texts, samplings, stops, plain_int4):
    cfg, target = processed
    got = _run(Engine(cfg, create_drafter(name, target), target), texts, samplings, stops)
    tol = 0.0 if Engine(cfg, target=target).exact_cpu else LOGPROB_TOL_FP32
    assert_same(got, plain_int4, tol, name)
    assert accepted_tokens(got.values()) > 0, f"{name}: no draft accepted, nothing speculative was checked"


@pytest.mark.parametrize("name", ["ngram", "glide-cape"])
def test_the_dense_float32_target_too(name, fp32_config, target32, texts, samplings, stops):
    """Raw logprobs here (the default): the model's, read from the row each token was chosen at."""
    plain = _run(Engine(fp32_config, target=target32), texts, samplings, stops)
    got = _run(Engine(fp32_config, create_drafter(name, target32), target32), texts, samplings, stops)
    assert_same(got, plain, LOGPROB_TOL_FP32, name)
    assert accepted_tokens(got.values()) > 0


def test_logprobs_are_the_models_log_softmax_at_each_position(fp32_config, target32, hf_model32, texts, stops):
    """Raw logprobs (the default) of greedy tokens under a bias and penalties: transformers' log-softmax at that
    position, before any shaping; the top alternatives its largest entries."""
    sp = SamplingParams(repetition_penalty=1.3, logit_bias=((texts[1][-1], -5.0),), logprobs=5)
    out = Engine(fp32_config, create_drafter("ngram", target32), target32).generate(texts[1], sp, 24, stops)
    ids = torch.tensor([texts[1] + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model32(ids).logits[0, len(texts[1]) - 1:-1].double(), -1)
    for j, (tok, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp - float(ref[j, tok])) < 1e-3, (j, lp, float(ref[j, tok]))
        want = torch.topk(ref[j], 5)
        assert abs(top[0][1] - float(want.values[0])) < 1e-3 and top[0][0] == int(want.indices[0]), (j, top)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_processed_logprobs_are_of_what_the_token_was_chosen_from(int4, texts, stops):
    """``server.logprobs_mode: processed``: after the bias a banned token's logprob is ~-100 below, a boosted one
    leads; for a sampled request the values are those of the distribution drawn from (top-k: the rest is -inf)."""
    cfg, target = int4
    cfg = _processed(cfg)
    boost = texts[1][-1]
    raw = Engine(int4[0], target=target).generate(texts[1], SamplingParams(logprobs=3), 4, stops)
    out = Engine(cfg, create_drafter("ngram", target), target).generate(
        texts[1], SamplingParams(logit_bias=((boost, 30.0),), logprobs=3), 4, stops)
    assert out.token_ids == [boost] * 4 and raw.token_ids[0] != boost
    assert all(lp > -1e-3 for lp, _ in out.logprobs)  # after +30 it takes nearly all the mass
    sampled = Engine(cfg, create_drafter("ngram", target), target).generate(
        texts[1], SamplingParams(temperature=1.0, top_k=2, seed=3, logprobs=4), 6, stops)
    for lp, top in sampled.logprobs:
        finite = [v for _, v in top if v != float("-inf")]
        assert len(finite) == 2 and abs(sum(torch.tensor(finite).exp().tolist()) - 1) < 1e-5 and lp in finite


def test_a_banned_token_never_appears_though_the_ngram_drafter_proposes_it(int4, tokenizer, stops):
    cfg, target = int4
    text = "the cat sat on the mat. " * 6 + "the cat sat on the"  # at "mat. the" the latest match goes on " cat"
    prompt = tokenizer.encode(text)
    cat = tokenizer.encode(" cat")[0]
    drafter = create_drafter("ngram", target, {"num_tokens": 10})  # drafts long enough to copy "... the cat"
    proposed = []
    real = drafter.propose

    def propose(seq):
        tree = real(seq)
        proposed.append(tree.tokens[1:].count(cat))
        return tree

    drafter.propose = propose
    free = Engine(cfg, target=target).generate(prompt, None, 30, stops)
    assert cat in free.token_ids  # the model wants it
    out = Engine(cfg, drafter, target).generate(prompt, SamplingParams(logit_bias=((cat, -100.0),)), 30, stops)
    assert cat not in out.token_ids and sum(proposed) > 0, (tokenizer.decode(out.token_ids), proposed)


def test_prompt_logprobs_in_chunks_are_the_whole_prompts(int4, texts, monkeypatch):
    """max_new_tokens 0 scores the prompt: one entry per prompt token (None for the first), the same whether the
    prompt goes through in one step or in chunks of 7 rows with 5 rows per LM-head call; a cached prefix is not
    used (its rows have no logits)."""
    from server.engine import StepPlan

    cfg, target = int4
    engine = Engine(cfg, target=target)
    prompt = texts[2]
    sp = SamplingParams(prompt_logprobs=2)
    engine.generate(prompt, None, 4)  # cached now
    whole = engine.add(prompt, sp, 0)
    assert whole.cache_len == 0
    engine.prefill(whole)
    engine.release(whole)
    assert whole.finish_reason == "length" and whole.output_ids == []
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGPROB_ROWS", 5)
    chunked = engine.add(prompt, sp, 0)
    while not chunked.prefilled:
        engine.run(StepPlan(prefill=[(chunked, 7)]))
    engine.release(chunked)
    assert len(whole.prompt_logprobs) == len(prompt) and whole.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert abs(a[0] - b[0]) < 1e-4 and [t for t, _ in a[1]] == [t for t, _ in b[1]]
    assert all(lp <= 0 and top[0][1] >= lp for lp, top in whole.prompt_logprobs[1:])


# -- the planted bugs peers shipped: each must fail the check above ---------------------------------------------------
def _root_state_everywhere(tree, node):
    return []  # every row shaped with the committed state only: penalties applied at the root row alone


def _root_counted_twice(tree, node, real=acceptance_module.path_tokens):
    return ([tree.tokens[0]] + real(tree, node)) if node else []


def _bias_skipped_for_drafted_rows(self, node, real=acceptance_module.ShapedRows.__getitem__):
    row = real(self, node)
    return row - bias_row(self.shaper.sp, row) if node and self.sp is None else row


@pytest.mark.parametrize("bug", ["root state everywhere", "root counted twice", "bias skipped for drafted rows"])
def test_planted_shaping_bugs_are_caught(bug, processed, texts, samplings, stops, plain_int4, monkeypatch):
    if bug == "bias skipped for drafted rows":
        monkeypatch.setattr(acceptance_module.ShapedRows, "__getitem__", _bias_skipped_for_drafted_rows)
    else:
        monkeypatch.setattr(acceptance_module, "path_tokens",
                            _root_state_everywhere if bug == "root state everywhere" else _root_counted_twice)
    cfg, target = processed
    got = _run(Engine(cfg, create_drafter("ngram", target), target), texts, {"greedy": samplings["greedy"]}, stops)
    want = {k: v for k, v in plain_int4.items() if k[0] == "greedy"}
    tol = 0.0 if Engine(cfg, target=target).exact_cpu else LOGPROB_TOL_FP32  # as the check above reads it
    with pytest.raises(AssertionError):
        assert_same(got, want, tol, bug)


def _scored(engine, prompt, out) -> list[float]:
    """The model's logprob of each token of ``out`` after ``prompt``: the prompt logprobs of prompt + out, scored
    by a plain request for 0 tokens."""
    seq = engine.add(prompt + out, SamplingParams(prompt_logprobs=0), 0)
    engine.prefill(seq)
    engine.release(seq)
    return [lp for lp, _ in seq.prompt_logprobs[len(prompt):]]


def _assert_sampled_logprobs_are_the_targets(int4, texts, stops):
    """Unseeded sampling through GLIDE's sampled drafts (trees with q rows): each token's logprob (raw) is the
    model's at that position, as scoring the output afterwards gives it."""
    cfg, target = int4
    engine = Engine(cfg, create_drafter("glide", target), target)
    sp = SamplingParams(temperature=0.8, logprobs=0)
    q_rows = accepted = 0
    for prompt in texts:
        torch.manual_seed(0)
        out = engine.generate(prompt, sp, MAX_NEW, stops)
        accepted += out.stats.accepted_tokens
        want = _scored(Engine(cfg, target=target), prompt, out.token_ids)
        for j, ((lp, _), w) in enumerate(zip(out.logprobs, want)):
            assert abs(lp - w) <= 1e-4, f"token {j}: logprob {lp} != the model's {w}"
    assert accepted > 0


def test_logprobs_of_sampled_drafts_are_the_targets(int4, texts, stops):
    _assert_sampled_logprobs_are_the_targets(int4, texts, stops)


def test_planted_logprobs_from_q_are_caught(int4, texts, stops, monkeypatch):
    """A drafted token's logprob read from the draft distribution q that proposed it, not the target's row."""
    real = engine_module.Engine._accept

    def accept(self, seq, tree, logits):
        path, tokens, lps = real(self, seq, tree, logits)
        if lps is not None and tree.q is not None:
            for j, node in enumerate(path[1:]):
                if float(tree.q[node].sum()) > 0:
                    lps[j] = (float(torch.log(tree.q[node][tokens[j]])), lps[j][1])
        return path, tokens, lps

    monkeypatch.setattr(engine_module.Engine, "_accept", accept)
    with pytest.raises(AssertionError, match="logprob"):
        _assert_sampled_logprobs_are_the_targets(int4, texts, stops)
