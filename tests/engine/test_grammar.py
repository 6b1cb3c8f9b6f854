"""Grammar-constrained decoding under speculation, on the real model in float32 (`make serve`'s int4 target).

Every registered drafter, for each grammar (any JSON object, a nested JSON schema with an enum, a pattern and a
recursive $ref, a named tool call), greedy and seeded: the output matches the grammar (it parses and validates with
`jsonschema`), equals drafter `none`'s token for token, and after every step the committed matcher is the state a
replay of the output tokens reaches. The tree surgery (grammar-invalid point-mass drafts pruned, sampled ones kept,
forced tokens appended as free drafts) is checked on hand-made trees.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import server.engine.engine as engine_module
from core.grammar import GrammarError, GrammarTokenizer, json_schema_grammar, json_schema_lark, lark_grammar
from core.sampling import SamplingParams
from core.tree import DraftTree
from drafters.base import create_drafter, drafter_names
from server.engine import Engine
from server.engine.constrained import constrain_tree

MAX_NEW = 64

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "code"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                         "friends": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/friend"}}},
          "$defs": {"friend": {"type": "object", "additionalProperties": False, "required": ["name"],
                               "properties": {"name": {"type": "string", "maxLength": 12},
                                              "friends": {"type": "array", "maxItems": 1,
                                                          "items": {"$ref": "#/$defs/friend"}}}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOL_CALL = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER}}

# (label, grammar, schema its JSON must validate against, the JSON's text from the output, prompt)
CASES = [
    ("json_object", json_schema_grammar(None), {"type": "object"}, lambda s: s,
     "Reply with a JSON object with two keys, name and age, for a cat called Tom aged 3."),
    ("schema", json_schema_grammar(PERSON), PERSON, lambda s: s,
     "Extract as JSON: Maria, 34, an admin with code MX-123, is friends with Ana and Bob."),
    ("named tool", lark_grammar(f'start: "<tool_call>\\n" {json_schema_lark(TOOL_CALL)} "\\n</tool_call>"'),
     TOOL_CALL, lambda s: s.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"),
     "What's the weather in Paris? Call the get_weather tool."),
]


@pytest.fixture(scope="module")
def grammar_tokenizer(tokenizer, target32, stops):
    return GrammarTokenizer(tokenizer, target32.args.vocab_size, stops)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from tests.conftest import encode_prompts

    return encode_prompts(tokenizer, [("chat", c[4]) for c in CASES])


SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.8, "seed": 11}}


def generate_checked(engine: Engine, gt: GrammarTokenizer, prompt: list[int], sp: SamplingParams, stops):
    """engine.generate, asserting after the first token and every step that the committed matcher is where a
    replay of the output tokens takes a fresh one (same allowed tokens, same accepting and stopped flags)."""
    seq = engine.add(prompt, sp, MAX_NEW, stops)
    try:
        engine.prefill(seq)
        while True:
            replay = gt.matcher(sp.grammar)
            replay.consume(seq.output_ids)
            assert torch.equal(replay.allowed(), seq.matcher.allowed())
            assert (replay.accepting, replay.stopped) == (seq.matcher.accepting, seq.matcher.stopped)
            if seq.finish_reason is not None:
                break
            engine.step(seq)
    finally:
        engine.release(seq)
    return seq


@pytest.fixture(scope="module")
def plain(int4, grammar_tokenizer, prompts, stops):
    cfg, target = int4
    engine = Engine(cfg, target=target)
    engine._grammar_tokenizer = grammar_tokenizer
    return {(c[0], mode): generate_checked(engine, grammar_tokenizer, p, SamplingParams(grammar=c[1], **kw), stops)
            for c, p in zip(CASES, prompts) for mode, kw in SAMPLINGS.items()}


def test_plain_decoding_matches_every_grammar(plain, tokenizer):
    """The baseline itself: each output is the grammar's (valid JSON against the schema, the tool call's frame),
    and the grammar ended it ("stop") before the token budget."""
    for (label, mode), seq in plain.items():
        case = next(c for c in CASES if c[0] == label)
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        assert seq.finish_reason == "stop", (label, mode, text)
        jsonschema.validate(json.loads(case[3](text)), case[2])


@pytest.mark.parametrize("name", [n for n in drafter_names() if n != "none"])  # every registered drafter
def test_every_drafter_decodes_a_grammar_like_plain_decoding(name, int4, grammar_tokenizer, prompts, stops, plain):
    cfg, target = int4
    engine = Engine(cfg, create_drafter(name, target), target)
    engine._grammar_tokenizer = grammar_tokenizer
    accepted = 0
    for case, prompt in zip(CASES, prompts):
        for mode, kw in SAMPLINGS.items():
            seq = generate_checked(engine, grammar_tokenizer, prompt, SamplingParams(grammar=case[1], **kw), stops)
            want = plain[case[0], mode]
            assert seq.output_ids == want.output_ids, (name, case[0], mode)
            assert seq.finish_reason == want.finish_reason
            accepted += seq.stats.accepted_tokens
    assert accepted > 0


def test_forced_tokens_are_free_drafts_for_drafter_none(plain):
    """Plain decoding (`none`) still verifies the tokens the grammar forces as drafts, and they are accepted: keys,
    punctuation and the tool call's frame cost no step of their own."""
    for (label, mode), seq in plain.items():
        if label == "json_object":
            continue  # any object: keys and values are free, nothing but a separator's half is ever forced
        s = seq.stats
        assert s.draft_tokens > 0 and s.accepted_tokens > 0, (label, mode, s)
        assert s.verify_steps < seq.num_generated - 1, (label, mode, s)
    tool = plain["named tool", "greedy"].stats
    assert tool.accepted_tokens >= 10  # "<tool_call>\n{"name": "get_weather", "arguments": {"city": "


def test_a_drafter_proposing_grammar_invalid_tokens_loses_nothing(int4, grammar_tokenizer, prompts, stops, plain,
                                                                  monkeypatch):
    """The n-gram drafter copies the prompt's prose, which the grammar rules out: its drafts are pruned before the
    forward (fewer rows verified than proposed) and the output is plain decoding's."""
    cfg, target = int4
    rows = []
    real = engine_module.constrain_tree

    def spy(tree, matcher, cap):
        out = real(tree, matcher, cap)
        rows.append((tree.num_rows, out.num_rows, len(set(tree.tokens[1:]) - set(out.tokens[1:]))))
        return out
    monkeypatch.setattr(engine_module, "constrain_tree", spy)
    engine = Engine(cfg, create_drafter("ngram", target), target)
    engine._grammar_tokenizer = grammar_tokenizer
    case, prompt = CASES[1], prompts[1]
    seq = generate_checked(engine, grammar_tokenizer, prompt, SamplingParams(grammar=case[1]), stops)
    assert seq.output_ids == plain[case[0], "greedy"].output_ids
    assert any(dropped for _, _, dropped in rows), rows


def test_budget_mid_json_ends_with_length_and_end_of_sequence_waits_for_an_accepting_state(
        int4, grammar_tokenizer, prompts, stops, tokenizer):
    cfg, target = int4
    engine = Engine(cfg, create_drafter("ngram", target), target)
    engine._grammar_tokenizer = grammar_tokenizer
    out = engine.generate(prompts[1], SamplingParams(grammar=CASES[1][1]), 8, stops)
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    # EOS banned by the grammar until it accepts: a strong bias towards EOS does not end the object early
    eos = [t for t in stops]
    sp = SamplingParams(grammar=CASES[1][1], logit_bias=tuple((t, 100.0) for t in eos))
    out = engine.generate(prompts[1], sp, MAX_NEW, stops)
    json.loads(tokenizer.decode(out.token_ids, skip_special_tokens=True))
    assert out.finish_reason == "stop"


def test_a_bad_grammar_is_a_request_error(int4, grammar_tokenizer):
    from server.engine.sequence import RequestError

    cfg, target = int4
    engine = Engine(cfg, target=target)
    engine._grammar_tokenizer = grammar_tokenizer
    with pytest.raises(RequestError):
        engine.add([1, 2, 3], SamplingParams(grammar=lark_grammar("start: undefined_rule")), 4)
    assert engine.slots_running == 0


# -- the tree surgery, on hand-made trees --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def letters(grammar_tokenizer, tokenizer):
    """A matcher for `{"a": "x"}` exactly (every token forced), and the ids of the pieces."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    g = json_schema_grammar({"type": "object", "required": ["a"], "additionalProperties": False,
                             "properties": {"a": {"const": "x"}}})
    return grammar_tokenizer.matcher(g), enc


def test_constrain_tree_prunes_point_masses_keeps_sampled_drafts_and_appends_forced_tokens(letters):
    m, enc = letters
    forced = m.forced()
    assert len(forced) >= 3 and m.valid_prefix(forced) == len(forced)
    good, bad = forced[0], enc("hello")[0]
    V = m.vocab_size
    # root -> bad (sampled, q > 0) -> good (point mass); root -> good (point mass) -> bad (point mass)
    q = torch.zeros(5, V)
    q[1, bad] = 1.0
    tree = DraftTree([7, bad, good, good, bad], [-1, 0, 1, 0, 3], q)
    out = constrain_tree(tree, m, 64)
    # kept: root, the sampled bad (never dropped; its subtree is), good, then the forced tokens after `good`
    assert out.tokens[:3] == [7, bad, good] and out.parents[:3] == [-1, 0, 0]
    assert float(out.q[1, bad]) == 1.0  # the sampled draft stays, with its q
    chain = out.tokens[3:]
    assert chain and chain == forced[1:1 + len(chain)] and out.parents[3] == 2  # forced after `good`, under it
    assert float(out.q[2:].abs().sum()) == 0.0  # point masses
    assert all(p < i for i, p in enumerate(out.parents))
    out.validate(V)
    # the row budget caps the forced chain
    assert constrain_tree(DraftTree.root_only(7), m, 3).tokens == [7, *forced[:2]]
    # the matcher is untouched: the committed state still allows the first forced token only
    assert m.forced() == forced


def test_an_unreadable_path_is_refused(letters):
    m, enc = letters
    with pytest.raises(GrammarError):
        m.allowed(enc("hello"))
    assert m.forced(enc("hello")) == []


def _prune_sampled_drafts_too(tree: DraftTree, matcher, max_rows: int) -> DraftTree:
    """The bug: a sampled draft the grammar rules out is dropped after its token was seen."""
    keep = [i for i in range(tree.num_rows) if i == 0 or matcher.valid_prefix([tree.tokens[i]]) == 1]
    q = tree.q[keep] if tree.q is not None else None
    return DraftTree([tree.tokens[i] for i in keep], [-1] + [0] * (len(keep) - 1), q)


@pytest.mark.parametrize("surgery", ["constrain_tree", "sampled draft pruned after its token is seen"])
def test_a_sampled_draft_outside_the_grammar_shapes_the_residual(surgery, grammar_tokenizer):
    """A root child drawn from q = 1/2 on the first allowed token, 1/2 on a token the grammar rules out: the emitted
    token must follow the masked target p (uniform over the allowed tokens). Kept, the ruled-out draft's rejection
    leaves the residual max(p - q, 0); dropped once its token was seen (the control), the bonus comes from p and the
    first allowed token is over-represented."""
    from core.sampling import Shaper
    from server.engine.acceptance import ShapedRows, accept_sampling
    from tests.conftest import chi2_pvalue

    m = grammar_tokenizer.matcher(json_schema_grammar(None))
    V = m.vocab_size
    allowed = m.allowed()
    ok = allowed.nonzero().flatten().tolist()
    assert len(ok) >= 2
    ruled_out = int((~allowed).nonzero()[0])
    q_row = torch.zeros(V)
    q_row[ok[0]] = q_row[ruled_out] = 0.5
    sp = SamplingParams(temperature=1.0, grammar="json")
    shaper = Shaper(sp, [], V, "cpu", m)
    surgery_fn = constrain_tree if surgery == "constrain_tree" else _prune_sampled_drafts_too
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(V)
    for _ in range(1200):
        x = int(torch.multinomial(q_row, 1, generator=gen))
        q = torch.zeros(2, V)
        q[1] = q_row
        tree = surgery_fn(DraftTree([7, x], [-1, 0], q), m, 2)
        logits = torch.zeros(tree.num_rows, V)
        _, tokens = accept_sampling(tree, ShapedRows(tree, logits, shaper, sp), gen)
        counts[tokens[0]] += 1
    p = allowed.double() / len(ok)
    pvalue = chi2_pvalue(counts, p)
    if surgery == "constrain_tree":
        assert pvalue > 1e-3, pvalue
    else:
        assert pvalue < 1e-6, pvalue


def test_a_step_the_budget_keeps_plain_still_takes_the_forced_tokens(int4, grammar_tokenizer, prompts, stops, plain):
    """``max_rows`` 1 (the load-aware budget's plain step): the drafter is not asked, but the tokens the grammar
    forces are verified as drafts; the output is unchanged."""
    from server.engine import StepPlan

    cfg, target = int4
    engine = Engine(cfg, create_drafter("ngram", target), target)
    engine._grammar_tokenizer = grammar_tokenizer
    case, prompt = CASES[2], prompts[2]
    seq = engine.add(prompt, SamplingParams(grammar=case[1]), MAX_NEW, stops)
    proposals = []
    real = engine.drafter.propose
    engine.drafter.propose = lambda view: proposals.append(1) or real(view)
    try:
        engine.prefill(seq)
        while seq.finish_reason is None:
            engine.run(StepPlan([seq], max_rows={seq.seq_id: 1}))
    finally:
        engine.release(seq)
    assert not proposals
    assert seq.output_ids == plain[case[0], "greedy"].output_ids
    assert seq.stats.accepted_tokens >= 10 and seq.stats.verify_steps < seq.num_generated - 10


def test_a_drafted_end_of_sequence_ends_the_path(grammar_tokenizer, tokenizer, stops):
    """Where the grammar accepts, end of sequence is a valid draft; nothing after it is, and the row after it (read
    for a bonus token the engine drops) allows end of sequence only, instead of failing the request."""
    from core.grammar import regex_grammar
    from server.engine.acceptance import path_tokens

    m = grammar_tokenizer.matcher(regex_grammar("ab"))
    ab = tokenizer.encode("ab", add_special_tokens=False)
    assert len(ab) == 1
    eos = stops[-1]
    out = constrain_tree(DraftTree([5, ab[0], eos, 198], [-1, 0, 1, 2]), m, 8)
    assert out.tokens == [5, ab[0], eos]  # the token drafted after the end is pruned
    allowed = m.allowed(path_tokens(out, 2))
    assert allowed.nonzero().flatten().tolist() == sorted(grammar_tokenizer.eos_token_ids)
    assert m.forced(path_tokens(out, 2)) == []
    assert m.valid_prefix([ab[0], eos, 198]) == 2
