"""Continuous batching in the worker's scheduler, on the real default model (float32):

- every drafter: greedy outputs of 16 requests stepped together equal their outputs run alone with plain decoding,
  token for token;
- a seeded sampled request draws the same tokens in a batch as alone;
- a long prompt is prefilled in chunks over several steps while another stream gets a token every step, and its
  output equals its unchunked output;
- a budget of one row is a plain decode step (the drafter is not asked), and the goodput budget drafts when rows are
  cheap and stops when they cost as much as decode rows;
- an engine fault fails the requests of that step, frees their slots, and the next requests run.
"""
from __future__ import annotations

import pytest

from core.tree import DraftTree
from drafters.base import create_drafter, drafter_names
from server.config import config_from_dict
from server.engine import Engine, StepPlan
from server.tokenization import encode_chat, stop_token_ids
from server.worker import messages as m
from server.engine.stepcost import step_token_budget
from server.worker.budget import DraftBudget
from server.worker.scheduler import Scheduler

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "List three uses of a paperclip.",
           "Explain recursion in one sentence.", "Write a Python function that reverses a string.",
           "Name the planets of the solar system.", "Translate 'good morning' to French.", "Give me a fun fact.",
           "What is the capital of Japan?", "Describe a cat in five words.", "Count from one to ten.",
           "Why is the sky blue?", "Write a limerick about a dog.", "What does HTTP stand for?",
           "Suggest a name for a bakery.", "Summarize the plot of Cinderella."]


@pytest.fixture(scope="module")
def cfg():
    return config_from_dict({"model": {"dtype": "float32", "device": "cpu"},
                             "cache": {"num_slots": 16, "max_seq_len": 512}})


class Client:
    """What the API process would see: the worker's messages per request."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, m.FromWorker] = {}
        self.arrivals: dict[str, list[int]] = {}  # request -> ticks at which tokens arrived
        self.tick = 0

    def send(self, msg) -> None:
        if isinstance(msg, m.Tokens):
            self.tokens.setdefault(msg.request_id, []).extend(msg.token_ids)
            self.arrivals.setdefault(msg.request_id, []).append(self.tick)
            if msg.finish_reason:
                self.done[msg.request_id] = msg
        elif isinstance(msg, (m.Failed, m.Aborted)):
            self.done[msg.request_id] = msg


def run(sched: Scheduler, client: Client, max_ticks: int = 10_000) -> None:
    while not sched.idle and client.tick < max_ticks:
        sched.tick()
        client.tick += 1


def submit(sched, rid, ids, max_tokens, stops, **kw) -> None:
    sched.handle(m.Generate(rid, ids, max_tokens, stop_token_ids=list(stops), **kw))


@pytest.fixture(scope="module")
def alone(cfg, target32, tokenizer):
    """(prompt ids, stops, each prompt's greedy output run alone with plain decoding): what every drafter's batch must
    give (greedy speculation alone equals plain decoding alone, so one reference serves them all)."""
    engine = Engine(cfg, create_drafter("none", target32), target32)
    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    ids = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    return ids, stops, [engine.generate(x, max_new_tokens=12, stop_token_ids=stops).token_ids for x in ids]


@pytest.mark.slow
@pytest.mark.parametrize("name", drafter_names())
def test_batched_greedy_equals_alone(name, cfg, target32, alone):
    engine = Engine(cfg, create_drafter(name, target32, cfg.drafter.options_for(name)), target32)
    ids, stops, alone = alone
    client = Client()
    sched = Scheduler(engine, client.send, max_waiting=64, max_step_tokens=256)
    for i, x in enumerate(ids):
        submit(sched, str(i), x, 12, stops)
    run(sched, client)
    assert [client.tokens[str(i)] for i in range(len(ids))] == alone
    assert engine.slots_running == 0
    assert client.tick < sum(len(a) for a in alone)  # steps were shared: fewer steps than tokens


def test_seeded_sampling_does_not_depend_on_the_batch(cfg, target32, tokenizer):
    engine = Engine(cfg, create_drafter("ngram", target32, {"num_tokens": 4}), target32)
    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    ids = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[:6]]
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    client = Client()
    sched = Scheduler(engine, client.send, max_waiting=64)
    submit(sched, "alone", ids[0], 16, stops, **sampled)
    run(sched, client)
    client2 = Client()
    sched = Scheduler(engine, client2.send, max_waiting=64)
    for i, x in enumerate(ids):  # the same request among greedy and differently seeded ones
        extra = sampled if i == 0 else ({"temperature": 0.9, "seed": i} if i % 2 else {})
        submit(sched, str(i), x, 16, stops, **extra)
    run(sched, client2)
    assert client2.tokens["0"] == client.tokens["alone"]


def test_a_long_prompt_is_chunked_while_other_streams_step(cfg, target32, tokenizer):
    engine = Engine(cfg, create_drafter("none", target32), target32)
    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    long_text = " ".join(f"Item {i}: a red apple, a green pear." for i in range(30))
    long_ids = encode_chat(tokenizer, [{"role": "user", "content": long_text + " How many items?"}])
    short_ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    assert len(long_ids) > 300
    whole = engine.generate(long_ids, max_new_tokens=8, stop_token_ids=stops).token_ids
    client = Client()
    sched = Scheduler(engine, client.send, max_waiting=64, max_step_tokens=64)
    submit(sched, "short", short_ids, 40, [])
    sched.tick()  # the short prompt is prefilled and streams
    client.tick += 1
    submit(sched, "long", long_ids, 8, stops, namespace="cold")  # not the cached run above: all of it prefills
    run(sched, client)
    first_long = client.arrivals["long"][0]
    assert first_long >= 1 + len(long_ids) // 64  # prefilled over many steps, never more than the budget per step
    short_ticks = client.arrivals["short"]
    assert short_ticks[:first_long] == list(range(first_long))  # a token every step while the long prompt prefilled
    assert client.tokens["long"] == whole


class LongChainDrafter:
    """Always drafts a 15-token chain (of token 0: mostly rejected): 16 verify rows every step."""
    name = "long-chain"

    def prefill(self, seq): pass
    def propose(self, seq): return DraftTree.chain(seq.tokens[-1], [0] * min(15, seq.max_rows - 1))
    def observe(self, seq, result): pass
    def release(self, seq_id): pass


def test_draft_rows_never_take_a_prompt_chunks_rows(cfg, target32, tokenizer):
    """Prompt chunks are sized as for a plain step and draft rows come on top: a stream that drafts does not delay
    another prompt's first token by a single step (drafting that crowded prompts out doubled TTFT under load)."""
    long_text = " ".join(f"Item {i}: a red apple, a green pear." for i in range(30))
    long_ids = encode_chat(tokenizer, [{"role": "user", "content": long_text + " How many items?"}])
    short_ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    first = {}
    for drafter in (create_drafter("none", target32), LongChainDrafter()):
        engine = Engine(cfg, drafter, target32)
        client = Client()
        sched = Scheduler(engine, client.send, max_waiting=64, max_step_tokens=64, budget=DraftBudget.fixed())
        submit(sched, "short", short_ids, 64, [])
        sched.tick()
        client.tick += 1
        submit(sched, "long", long_ids, 2, [])
        run(sched, client)
        first[drafter.name] = client.arrivals["long"][0]
        assert len(client.tokens["short"]) == 64
    # the long prompt arrives at tick 1 and takes 63 rows a step (64 less the short stream's row)
    assert first["long-chain"] == first["none"] == 1 + (-(-len(long_ids) // 63) - 1), first


class CountingDrafter:
    """A real ngram drafter that counts its proposals."""

    def __init__(self, inner):
        self.inner, self.name, self.proposals = inner, inner.name, 0

    def prefill(self, seq):
        self.inner.prefill(seq)

    def propose(self, seq):
        self.proposals += 1
        return self.inner.propose(seq)

    def observe(self, seq, result):
        self.inner.observe(seq, result)

    def release(self, seq_id):
        self.inner.release(seq_id)


def test_one_row_is_a_plain_decode_step(cfg, target32, tokenizer):
    drafter = CountingDrafter(create_drafter("ngram", target32, {"num_tokens": 6}))
    engine = Engine(cfg, drafter, target32)
    plain = Engine(cfg, create_drafter("none", target32), target32)
    ids = encode_chat(tokenizer, [{"role": "user", "content": "Repeat: one two three, one two three, one two"}])
    ref = plain.generate(ids, max_new_tokens=16).token_ids
    seq = engine.add(ids, max_new_tokens=16)
    engine.prefill(seq)
    while seq.finish_reason is None:
        engine.run(StepPlan([seq], max_rows={seq.seq_id: 1}))
    engine.release(seq)
    assert drafter.proposals == 0 and seq.stats.draft_tokens == 0
    assert seq.output_ids == ref


class Seq:
    def __init__(self, seq_id):
        self.seq_id = seq_id


def test_goodput_budget_drafts_when_it_pays_and_stops_under_load():
    seqs = [Seq(i) for i in range(4)]
    flat = DraftBudget(lambda rows: 20.0 + 0.1 * rows, max_rows=64)  # rows nearly free, drafting cheap
    for s in seqs:
        flat.record(s.seq_id, drafted=6, accepted=3, allowed=64)
    flat.record_step(22.0, rows=28, sequences=4, drafting=4, propose_ms=1.0)
    assert all(r == 64 for r in flat.plan(seqs).values())
    steep = DraftBudget(lambda rows: 10.0 * rows, max_rows=64)  # every row costs a decode step: never pays
    for s in seqs:
        steep.record(s.seq_id, drafted=6, accepted=3, allowed=64)
    assert all(r == 1 for r in steep.plan(seqs).values())
    # the drafters' own cost, learned from steps: cheap rows stop paying once a draft costs more than it brings
    costly = DraftBudget(lambda rows: 20.0 + 0.1 * rows, max_rows=64)
    many = [Seq(i) for i in range(64)]
    for s in many:
        costly.record(s.seq_id, drafted=6, accepted=1, allowed=64)
    costly.record_step(20.0 + 6.4, rows=64, sequences=64, drafting=0, propose_ms=0.0)  # 0.1 ms per sequence
    assert all(r == 64 for r in costly.plan(many[:1]).values())  # alone, before any drafting cost is known
    for _ in range(20):  # every drafter's proposal took 4 ms
        costly.record_step(20.0 + 0.1 * 448 + 6.4 + 4.0 * 64, rows=448, sequences=64, drafting=64,
                           propose_ms=4.0 * 64)
    assert costly.draft_ms > 3.0
    assert all(r == 1 for r in costly.plan(many).values())  # 64 sequences: drafting would slow the step down
    assert list(costly.plan(many[:1]).values()) == [64]  # one sequence: 1 expected token for ~5 ms still pays
    # acceptance is the drafter's, over all sequences: a run of rejections stops drafting, good steps resume it
    mid = DraftBudget(lambda rows: 10.0 + 0.5 * rows, max_rows=64)
    for _ in range(60):
        mid.record(0, drafted=6, accepted=0, allowed=64)
    assert mid.plan(seqs[:2]) == {0: 1, 1: 1}
    for _ in range(60):
        mid.record(1, drafted=6, accepted=4, allowed=64)
    assert mid.plan(seqs[:2]) == {0: 64, 1: 64}


def test_the_measured_gate_overrules_a_model_that_drafts_where_drafting_measures_slower():
    """The model wants every sequence to draft (rows nearly free); the steps say otherwise: drafting steps emit a
    token per 10 ms, plain ones per 5 ms. After the warm-up each arm gets, the gate keeps the plain arm and tries
    drafting once in EXPLORE_EVERY steps; where drafting measures faster, it drafts."""
    from server.worker.budget import EXPLORE_EVERY, GATE_WARMUP

    def simulate(draft_ms_per_token: float, plain_ms_per_token: float, steps: int) -> list[bool]:
        budget = DraftBudget(lambda rows: 20.0 + 0.1 * rows, max_rows=64)
        seqs = [Seq(i) for i in range(8)]
        for s in seqs:
            budget.record(s.seq_id, drafted=6, accepted=3, allowed=64)
        drafted = []
        for _ in range(steps):
            plan = budget.plan(seqs)
            drafts = any(r > 1 for r in plan.values())
            drafted.append(drafts)
            tokens = 16 if drafts else 8
            ms = tokens * (draft_ms_per_token if drafts else plain_ms_per_token)
            budget.record_step(ms, rows=8 + 40 * drafts, sequences=8, drafting=8 * drafts, propose_ms=2.0 * drafts,
                               tokens=tokens)
        return drafted

    warm = 2 * GATE_WARMUP
    slower = simulate(10.0, 5.0, warm + 4 * EXPLORE_EVERY)
    assert sum(slower[:warm]) == GATE_WARMUP  # each arm measured in turn
    assert sum(slower[warm:]) == 4  # then drafting only to explore
    faster = simulate(3.0, 5.0, warm + 4 * EXPLORE_EVERY)
    assert len(faster[warm:]) - sum(faster[warm:]) == 4  # drafting, plain only to explore


def test_budget_from_a_measured_curve_interpolates():
    budget = DraftBudget.from_curve({1: 20.0, 8: 24.0, 64: 80.0})
    assert budget.cost(1) == 20.0 and budget.cost(8) == 24.0
    assert 20.0 < budget.cost(4) < 24.0 and budget.cost(128) > 80.0


def test_the_automatic_step_budget_keeps_a_step_within_a_few_decode_steps():
    cpu = {1: 24.0, 8: 22.0, 16: 25.5, 32: 47.8, 64: 67.5, 128: 108.8, 256: 193.0}
    rows = step_token_budget(cpu)  # 2.5 x 24 ms = 60 ms: between 32 and 64 rows
    assert 32 < rows < 64 and DraftBudget.from_curve(cpu).cost(rows) <= 60.0 + 1e-6
    assert step_token_budget({1: 5.0, 64: 5.5, 512: 6.0}) == 512  # a flat curve (GPU): the most measured
    assert step_token_budget({1: 20.0, 2: 100.0}) == 17  # a decode row and at least 16 prompt tokens
    # 64 sequences decoding: their step already costs 67.5 ms, a chunk may take it to 2.5 x that
    assert 128 < step_token_budget(cpu, base_rows=64) < 256


def test_an_engine_fault_fails_that_step_and_frees_its_slots(cfg, target32, tokenizer):
    class Broken(CountingDrafter):
        def propose(self, seq):
            raise RuntimeError("drafter exploded")

    engine = Engine(cfg, Broken(create_drafter("ngram", target32)), target32)
    client = Client()
    sched = Scheduler(engine, client.send, max_waiting=64, budget=DraftBudget.fixed())
    ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    for i in range(3):
        submit(sched, str(i), ids, 8, [])
    run(sched, client)
    assert all(isinstance(client.done[str(i)], m.Failed) for i in range(3))
    assert "drafter exploded" in client.done["0"].message and engine.slots_running == 0


@pytest.mark.parametrize("name", [n for n in drafter_names() if n != "none"])
def test_steps_without_drafts_keep_every_drafter_exact(name, cfg, target32, tokenizer):
    """The budget may skip a drafter for some steps (a plain decode step) or give it fewer rows than it drafts: the
    drafter drafts within the row budget it is handed, and its state follows anyway."""
    engine = Engine(cfg, create_drafter(name, target32, cfg.drafter.options_for(name)), target32)
    plain = Engine(cfg, create_drafter("none", target32), target32)
    stops = stop_token_ids(tokenizer, target32.args.eos_token_ids)
    ids = encode_chat(tokenizer, [{"role": "user", "content": "Write a Python function that adds two numbers."}])
    ref = plain.generate(ids, max_new_tokens=24, stop_token_ids=stops).token_ids
    proposals = []  # (row budget, rows the drafter proposed)
    propose = engine.drafter.propose

    def recording(view):
        tree = propose(view)
        proposals.append((view.max_rows, tree.num_rows))
        return tree

    engine.drafter.propose = recording
    seq = engine.add(ids, max_new_tokens=24, stop_token_ids=stops)
    engine.prefill(seq)
    pattern = [64, 1, 1, 2, 1, 3, 64, 1, 2]  # tree rows allowed per step; 1: no drafting
    step = 0
    while seq.finish_reason is None:
        engine.run(StepPlan([seq], max_rows={seq.seq_id: pattern[step % len(pattern)]}))
        step += 1
    engine.release(seq)
    assert seq.output_ids == ref
    assert seq.stats.draft_tokens > 0
    budgets = {b for b, _ in proposals}  # 64 cut to the tokens still wanted: 23 at the first step
    assert {2, 3, 23} <= budgets
    assert all(rows <= budget for budget, rows in proposals), proposals
