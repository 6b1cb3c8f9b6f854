"""Sampled exactness through every real drafter's own sampling code (tiny random Llama target, random drafter weights).

For each registered drafter but `none`, an Engine on the tiny random target (float32, CPU) runs the drafter the
registry builds from a config -- its own prefill / propose / observe code -- with randomly initialised weights where
it has a model: a random GLIDE network (also the cascade's reviewer) and a random Falcon head, each over a random
subset of the vocabulary, and a random Max-Gram bigram table. Each case samples K tokens after a prompt from many
independent requests at temperature > 0, some with top-k / top-p. The drafter's quality does not matter; its code
path does. Requests without a seed go through speculative sampling's rejection rule (each request's random state
fixed by seeding torch's global generator before it, so a run is reproducible); requests with a seed go through the
race keyed on (seed, position) that makes them token-exact (``core.sampling``): through a drafter they are tested
token for token against plain seeded decoding, whose distribution is tested once, with a control that reuses one
position's clocks at every position.

The reference is computed without the code under test: transformers' own LlamaForCausalLM forward on the same saved
weights (float64), this file's own temperature -> top-k -> top-p (vLLM's order, from the definitions), and every one
of the V**K continuations enumerated. A chi-square test compares the sampled K-token sequences with it.

The draws must go through the speculative path, not only the bonus token: every case asserts that drafts were
proposed and accepted, also at depth 2, and, where the drafter makes them, that its trees carried draft
distributions q and sibling branches and that a non-first sibling was accepted. Negative controls (power): with
acceptance broken to take the first child all the way down, the same check fails for every drafter; and the subtler
classic bug (a rejection leaves p as it was: later siblings and the bonus see p, not the residual) fails it too,
through glide-cape, whose trees hold both q rows and point-mass siblings. Every case runs as served: 8 requests with
different trees (and, at a batch's end, fewer) share every target forward.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import core.sampling as sampling_module
import drafters.glide.drafter as glide_module
import server.engine.acceptance as acceptance_module
import server.engine.engine as engine_module
from core.sampling import SamplingParams
from drafters.base import drafter_names
from server.config import config_from_dict
from server.engine import Engine, StepPlan, load_target
from tests.conftest import bias_row, chi2_pvalue

pytestmark = pytest.mark.statistical

V = 16                              # the tiny target's vocabulary (tests/conftest.py: write_tiny_llama)
PROMPT = [3, 7, 1, 12, 5, 9, 3, 7]  # with repeats, for n-gram / Max-Gram matches
K = 3                               # tokens per request: the first from prefill, then speculative steps
MAX_DRAFT = 64                      # tokens a request asks for beyond the K counted: the row budget never binds
N = 2000                            # requests per drafter
N_CONTROL = 1500                    # requests per negative control (fewer than N: it must fail even so)
GLIDE_VOCAB = 12                    # GLIDE's LM head keeps a random 12 of the 16 tokens (its vocab_ids path)
BATCH = 8                           # requests sharing each target forward (every case runs batched, as served)
SEED_STRIDE = 1000  # request seeds far apart (independent requests; drafters hash their own streams from them)


@dataclass(frozen=True)
class Case:
    options: dict             # the drafter's config options ("{glide}" / "{bigram}": the random weights' files)
    sampling: SamplingParams  # the request's shaping (the seed is set per request)
    expects: tuple[str, ...] = ()  # "q": trees carry draft distributions; "siblings": branching trees


# One case per registered drafter (but `none`); a drafter added to the registry needs one here (see the last test).
CASES: dict[str, Case] = {
    "ngram": Case({"num_tokens": 4, "max_ngram": 3, "min_ngram": 1}, SamplingParams(temperature=0.7)),
    # GLIDE's cases sample at lower entropy (fewer cells, more power against a q that is not the one the token was
    # drawn from; a mild misreport such as q**1.25 renormalised still needs several times N to be caught reliably)
    "glide": Case({"checkpoint": "{glide}", "gamma": 3}, SamplingParams(temperature=0.6, top_p=0.8), ("q",)),
    "glide-cape": Case({"checkpoint": "{glide}", "gamma": 3, "max_rows": 10}, SamplingParams(temperature=0.6, top_k=6),
                       ("q", "siblings")),
    "maxgram": Case({"bigram": "{bigram}", "num_tokens": 4}, SamplingParams(temperature=0.9, top_k=10, top_p=0.95)),
    "cascade": Case({"checkpoint": "{glide}", "bigram": "{bigram}", "k": [[2, 4], [4]], "max_rows": 12},
                    SamplingParams(temperature=0.7, top_k=8, top_p=0.9), ("siblings",)),
    # Falcon's tree: independent draws under every node (two per position of a block), a second block under the
    # likeliest leaf
    "falcon": Case({"checkpoint": "{falcon}", "top_m": [2, 2], "forwards": 2, "max_rows": 12},
                   SamplingParams(temperature=0.6, top_k=6), ("q", "siblings")),
    # the GLIDE chain cut by a random acceptance head: draft lengths vary from step to step with the context
    "glide-adaptive": Case({"checkpoint": "{glide}", "accept_head": "{accept}", "threshold": 0.5, "max_gamma": 3},
                           SamplingParams(temperature=0.6, top_p=0.8), ("q", "lengths")),
    "falcon-adaptive": Case({"checkpoint": "{falcon}", "accept_head": "{accept_falcon}", "threshold": 0.5,
                             "max_forwards": 2}, SamplingParams(temperature=0.6, top_k=6), ("q", "lengths")),
}


# -- the reference: transformers' forward + this file's own sampling transforms ---------------------------------------
def shaped_probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """[..., V] logits -> float64 probabilities after temperature, min_p (drop tokens below min_p x the most
    likely one's probability), top-k, then top-p (keep the smallest set of most likely tokens whose mass reaches
    top_p), written from the definitions."""
    x = logits.astype(np.float64) / sp.temperature
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    flat, out = p.reshape(-1, p.shape[-1]), np.zeros(p.size).reshape(-1, p.shape[-1])
    for row, pr in enumerate(flat):
        order = np.argsort(-pr, kind="stable")
        order = order[pr[order] >= sp.min_p * pr.max()]
        keep = order[:sp.top_k] if sp.top_k else order
        mass = pr[keep] / pr[keep].sum()
        if sp.top_p < 1.0:
            keep = keep[:int(np.searchsorted(np.cumsum(mass), sp.top_p)) + 1]
        out[row, keep] = pr[keep] / pr[keep].sum()
    return out.reshape(p.shape)


@pytest.fixture(scope="module")
def reference_logits(tiny_dir) -> np.ndarray:
    """[V, V, K, V] float64 logits: [a, b, j] = transformers' logits after PROMPT + [a, b][:j]."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float64).eval()
    ids = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        logits = hf(ids, use_cache=False).logits[:, len(PROMPT) - 1:]  # [V*V, 3, V]
    assert K == 3
    return logits.view(V, V, K, V).numpy()


def penalised(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """[V, V, K, V] reference logits -> the same after the request's logit_bias, then the repetition penalty on the
    tokens of PROMPT and of the tokens generated before each position, then frequency x count and presence x
    [count > 0] over the generated ones (vLLM's definitions), in float64."""
    x = logits.astype(np.float64) + 0.0
    for t, b in sp.logit_bias:
        x[..., t] += b
    for a in range(V):
        for b in range(V):
            for j in range(K):
                generated = [a, b][:j]
                row = x[a, b, j]
                for t in set(PROMPT) | set(generated):
                    if sp.repetition_penalty != 1.0:
                        row[t] = row[t] / sp.repetition_penalty if row[t] > 0 else row[t] * sp.repetition_penalty
                for t in set(generated):
                    row[t] -= sp.frequency_penalty * generated.count(t) + sp.presence_penalty
    return x


def reference_joint(reference_logits: np.ndarray, sp: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] after PROMPT, under the request's shaping."""
    p = shaped_probs(penalised(reference_logits, sp) if sp.shaped else reference_logits, sp)
    p1, p2, p3 = p[0, 0, 0], p[:, 0, 1], p[:, :, 2]  # p(t1); p(t2 | t1) [V, V]; p(t3 | t1, t2) [V, V, V]
    return torch.from_numpy(p1[:, None, None] * p2[:, :, None] * p3)


# -- the system under test ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_dir):
    # Tens of thousands of tiny forwards: one thread avoids OpenMP spin/wake costs that dominate such small ops.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_target(_config(tiny_dir), progress=False)
    torch.set_num_threads(threads)


# The engine's device: CPU here and in CI; SPECSERVE_TEST_DEVICE=cuda runs the same checks on a GPU (the reference
# stays transformers' float64 on the CPU) with a wider tiny target (SPECSERVE_TEST_WIDE=1: that target on the CPU).
DEVICE = os.environ.get("SPECSERVE_TEST_DEVICE", "cpu")

if DEVICE != "cpu" or os.environ.get("SPECSERVE_TEST_WIDE"):
    @pytest.fixture(scope="module")
    def tiny_dir(tmp_path_factory):
        """The compiled Triton kernels take head dims of 16 and more: a wider tiny target, its embeddings scaled so
        its distributions are about as spread as the default one's (mean entropy ~2.4 nats)."""
        from tests.conftest import write_tiny_llama

        d = tmp_path_factory.mktemp("tiny-llama-wide")
        write_tiny_llama(d, hidden=64, embed_scale=1.8)
        return d


def _config(tiny_dir, drafter: dict | None = None, slots: int = BATCH):
    return config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": DEVICE},
                             "cache": {"num_slots": slots, "max_seq_len": 32}, "drafter": drafter or {}})


@pytest.fixture(scope="module")
def weight_files(target, tmp_path_factory) -> dict[str, str]:
    """A randomly initialised GLIDE checkpoint, Falcon head and bigram table for the tiny target, saved where the
    drafters load them from (their `checkpoint` / `bigram` options)."""
    from drafters.adaptive import AcceptHead, AcceptHeadConfig
    from drafters.cascade.maxgram import save_bigram
    from drafters.falcon.model import FalconConfig, FalconModel
    from drafters.glide.model import GlideConfig, GlideModel

    d = tmp_path_factory.mktemp("random-drafters")
    gen = torch.Generator().manual_seed(1234)
    glide = GlideModel(GlideConfig.for_target(target.args, target.model_id, vocab_subset=GLIDE_VOCAB))
    glide.vocab_ids = torch.randperm(V, generator=gen)[:GLIDE_VOCAB]
    with torch.no_grad():  # random weights large enough that GLIDE's q depends on the context and differs from p
        for p in glide.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    glide.save(d / "glide.safetensors", {"note": "random weights, for tests"}, dtype=torch.float32)
    save_bigram(d / "bigram.safetensors", torch.randint(0, V, (V,), generator=gen), target.model_id)
    falcon = FalconModel(FalconConfig.for_target(target.args, target.model_id, vocab_subset=GLIDE_VOCAB))
    falcon.vocab_ids = torch.randperm(V, generator=gen)[:GLIDE_VOCAB]
    with torch.no_grad():
        for p in falcon.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    falcon.save(d / "falcon.safetensors", {"note": "random weights, for tests"}, dtype=torch.float32)
    head = AcceptHead(AcceptHeadConfig(target.model_id, "glide", target.args.hidden_size))
    with torch.no_grad():  # P(accept) spread around the threshold, so the chain's length depends on the context
        head.out.weight.copy_(torch.randn(head.out.weight.shape, generator=gen))
    head.save(d / "accept-glide.safetensors")
    head.c.drafter = "falcon"
    head.save(d / "accept-falcon.safetensors")
    return {"glide": str(d / "glide.safetensors"), "bigram": str(d / "bigram.safetensors"),
            "falcon": str(d / "falcon.safetensors"), "accept": str(d / "accept-glide.safetensors"),
            "accept_falcon": str(d / "accept-falcon.safetensors")}


def make_engine(tiny_dir, target, weight_files, name: str, slots: int = BATCH) -> Engine:
    """An engine whose drafter the registry builds from the config, as `specserve` does."""
    options = {k: v.format(**weight_files) if isinstance(v, str) else v for k, v in CASES[name].options.items()}
    engine = Engine(_config(tiny_dir, {"name": name, name: options}, slots), target=target)
    assert engine.drafter.name == name
    return engine


@dataclass
class Coverage:
    """What the acceptance calls saw: proof that the draws went through the speculative path."""

    steps: int = 0
    draft_rows: int = 0
    accepted: int = 0
    deep_accepts: int = 0      # steps that accepted >= 2 draft tokens
    q_rows: int = 0            # draft rows handed over with a draft distribution
    sibling_trees: int = 0     # trees where some node has more than one child
    later_sibling_accepts: int = 0  # accepted rows that were not their parent's first child
    draft_lengths: set = dataclasses.field(default_factory=set)  # the tree sizes proposed (draft rows)

    def record(self, tree, rows: list[int]) -> None:
        children = tree.children()
        self.steps += 1
        self.draft_rows += tree.num_draft
        self.draft_lengths.add(tree.num_draft)
        self.accepted += len(rows) - 1
        self.deep_accepts += len(rows) >= 3
        if tree.q is not None:
            self.q_rows += int((tree.q[1:].sum(-1) > 0).sum())
        self.sibling_trees += any(len(c) > 1 for c in children)
        self.later_sibling_accepts += sum(children[tree.parents[r]][0] != r for r in rows[1:])


# The order that gives each case its seeds: a new case goes at the end, so the others keep the seeds they were checked
# with.
SEED_ORDER = ("cascade", "glide", "glide-cape", "maxgram", "ngram", "falcon", "glide-adaptive", "falcon-adaptive")


def seed_base(name: str, control: int = 0) -> int:
    """Each case and control its own request seeds (cases sharing seeds would share their draws)."""
    return 1 + 10 * SEED_ORDER.index(name) + 3 * control


def request(engine: Engine, sp: SamplingParams, seed: int, seeded: bool, k: int = K):
    """A request seeded ``seed``, or (``seeded`` false) one without a seed whose random streams torch's global
    generator, seeded ``seed`` here, sets. It asks for more tokens than the ``k`` counted, so the engine's row budget
    (never more rows than tokens still wanted) leaves the drafters their whole trees while the k are drawn."""
    if seeded:
        return engine.add(PROMPT, dataclasses.replace(sp, seed=seed), max_new_tokens=k + MAX_DRAFT)
    torch.default_generator.manual_seed(seed)  # torch.manual_seed's lazy per-device seeding formats a stack per call
    return engine.add(PROMPT, dataclasses.replace(sp, seed=None), max_new_tokens=k + MAX_DRAFT)


def outputs(engine: Engine, sp: SamplingParams, seeds: list[int], seeded: bool = False, k: int = K,
            batch: int = BATCH) -> list[list[int]]:
    """The first ``k`` tokens of one request per seed, ``batch`` requests at a time sharing every target forward
    (``Engine.run``): one prefill forward for them all, then batched speculative steps, each sequence with its own
    tree and its own random state. A batch's last steps run the sequences still short of ``k`` alone. A request the
    engine failed (its fault isolated from the others) raises its exception here."""
    def run(plan: StepPlan) -> None:
        failed = engine.run(plan).failed
        if failed:
            raise next(iter(failed.values()))

    out = []
    for b in range(0, len(seeds), batch):
        seqs = [request(engine, sp, seed, seeded, k) for seed in seeds[b:b + batch]]
        try:
            run(StepPlan(prefill=[(seq, seq.prompt_len) for seq in seqs]))
            while any(seq.num_generated < k for seq in seqs):
                run(StepPlan([seq for seq in seqs if seq.num_generated < k]))
        finally:
            for seq in seqs:
                engine.release(seq)
        out += [seq.output_ids[:k] for seq in seqs]
    return out


def sample_joint(engine: Engine, sp: SamplingParams, n: int, seed0: int, seeded: bool = False) -> torch.Tensor:
    """Counts [V, V, V] of the K tokens generated after PROMPT by n independent requests (seeds seed0 + i * stride),
    run in batches (``outputs``)."""
    counts = torch.zeros(V, V, V)
    for ids in outputs(engine, sp, [seed0 + i * SEED_STRIDE for i in range(n)], seeded):
        counts[tuple(ids)] += 1
    return counts


def recording(accept, coverage: Coverage):
    def wrapped(tree, probs, *args):
        rows, tokens = accept(tree, probs, *args)
        coverage.record(tree, rows)
        return rows, tokens
    return wrapped


def accept_first_children(tree, probs, generator):
    """A broken rule: accept the first child at every node, then draw the bonus from p at the leaf."""
    children = tree.children()
    rows, node = [0], 0
    while children[node]:
        node = children[node][0]
        rows.append(node)
    bonus = int(torch.multinomial(probs[node], 1, generator=generator).item())
    return rows, [tree.tokens[r] for r in rows[1:]] + [bonus]


def accept_without_residual(tree, probs, generator):
    """A broken rule: siblings are tried with min(1, p/q) as they should, but a rejection leaves p as it was, so the
    next sibling and the bonus token see p instead of the residual."""
    children, q = tree.children(), tree.q
    rows, tokens, node = [0], [], 0
    while True:
        p, accepted = probs[node], None
        for c in children[node]:
            x = tree.tokens[c]
            qx = float(q[c, x]) if q is not None and float(q[c].sum()) > 0 else 1.0  # point mass: q(x) = 1
            if float(torch.rand((), generator=generator)) * qx < float(p[x]):
                accepted = c
                break
        if accepted is None:
            return rows, tokens + [int(torch.multinomial(p, 1, generator=generator).item())]
        rows.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted


# -- the tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_sampling_through_the_drafter_matches_the_target(name, tiny_dir, target, weight_files, reference_logits,
                                                         monkeypatch):
    case = CASES[name]
    engine = make_engine(tiny_dir, target, weight_files, name)
    cov = Coverage()
    monkeypatch.setattr(engine_module, "accept_sampling", recording(engine_module.accept_sampling, cov))
    t0 = time.perf_counter()
    counts = sample_joint(engine, case.sampling, N, seed_base(name))
    pvalue = chi2_pvalue(counts, reference_joint(reference_logits, case.sampling))
    print(f"\n{name}: p = {pvalue:.4g} over {N} requests in {time.perf_counter() - t0:.1f} s; {cov}")
    # the speculative path really ran: drafts proposed and accepted, also two deep (rare for `ngram`, whose most recent
    # match here sits near the end of the text, so its drafts are mostly one token long)
    assert cov.draft_rows >= cov.steps // 2 and cov.accepted >= N // 20 and cov.deep_accepts > 0, cov
    if "q" in case.expects:  # sampled chain tokens come with the distribution they were drawn from
        assert cov.q_rows >= cov.steps, cov
    if "siblings" in case.expects:  # trees branch, and acceptance goes past a rejected first child
        assert cov.sibling_trees >= cov.steps // 2 and cov.later_sibling_accepts >= N // 100, cov
    if "lengths" in case.expects:  # the draft length varies from step to step
        assert len(cov.draft_lengths) >= 2, cov
    assert pvalue > 1e-3, f"{name}: sampled continuations do not follow the target's distribution (p = {pvalue:.3g})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_negative_control_accepting_first_children_is_caught(name, tiny_dir, target, weight_files, reference_logits,
                                                             monkeypatch):
    """If the drafts were never proposed, or never reached the output, this broken rule would pass unnoticed."""
    case = CASES[name]
    engine = make_engine(tiny_dir, target, weight_files, name)
    monkeypatch.setattr(engine_module, "accept_sampling", accept_first_children)
    counts = sample_joint(engine, case.sampling, N_CONTROL, seed_base(name, control=1))
    joint = reference_joint(reference_logits, case.sampling)
    impossible = int(counts[joint == 0].sum())
    if impossible:  # drafted tokens the target never samples (top-k / top-p): chi2_pvalue fails on them outright
        with pytest.raises(AssertionError, match="probability zero"):
            chi2_pvalue(counts, joint)
    pvalue = chi2_pvalue(counts * (joint > 0), joint)  # and the chi-square alone, on the other continuations
    print(f"\n{name} (first children): p = {pvalue:.3g}; {impossible} of {N_CONTROL} with target probability 0")
    assert pvalue < 1e-6


def test_negative_control_bonus_from_p_instead_of_the_residual_is_caught(tiny_dir, target, weight_files,
                                                                         reference_logits, monkeypatch):
    """The classic bug, subtler than the above: rejections never update p, so later siblings and the bonus token see
    the node's whole distribution instead of the residual (through q rows and point-mass siblings alike)."""
    name = "glide-cape"
    monkeypatch.setattr(engine_module, "accept_sampling", accept_without_residual)
    engine = make_engine(tiny_dir, target, weight_files, name)
    sp = CASES[name].sampling
    counts = sample_joint(engine, sp, N_CONTROL, seed_base(name, control=2))
    pvalue = chi2_pvalue(counts, reference_joint(reference_logits, sp))
    print(f"\n{name} (no residual): p = {pvalue:.3g}")
    assert pvalue < 1e-6


SEEDED_REQUESTS = 240  # seeds per drafter compared token for token with plain seeded decoding
SEEDED_TOKENS = 8     # tokens compared per seed


def seeded_tokens(engine: Engine, sp: SamplingParams, seeds: list[int]) -> list[list[int]]:
    return outputs(engine, sp, seeds, seeded=True, k=SEEDED_TOKENS)


@pytest.mark.parametrize("name", ["glide-cape", "cascade", "falcon"])  # race-ordered candidates and siblings
def test_seeded_sampling_through_the_drafter_is_plain_seeded_decoding(name, tiny_dir, target, weight_files,
                                                                      monkeypatch):
    """Seeded requests are token-exact by design: the race keyed on (seed, position) picks the target's token whatever
    was drafted, and drafts are accepted only where they equal it. So through the drafter each seed gives plain
    seeded decoding's tokens, token for token (a stronger check than a chi-square of the two: any draw that differs
    fails); the next test checks plain seeded decoding's distribution against the reference."""
    case = CASES[name]
    engine = make_engine(tiny_dir, target, weight_files, name)
    plain = Engine(_config(tiny_dir), target=target)
    cov = Coverage()
    monkeypatch.setattr(engine_module, "accept_seeded", recording(engine_module.accept_seeded, cov))
    seeds = [seed_base(name, control=6) + i * SEED_STRIDE for i in range(SEEDED_REQUESTS)]
    got, want = seeded_tokens(engine, case.sampling, seeds), seeded_tokens(plain, case.sampling, seeds)
    assert [s for s, a, b in zip(seeds, got, want) if a != b] == [], name  # no seed differs
    print(f"\n{name} seeded: {SEEDED_REQUESTS} seeds equal plain seeded decoding; {cov}")
    # the speculative path really ran: drafts accepted, also two deep, and past a rejected first child
    assert cov.accepted >= SEEDED_REQUESTS and cov.deep_accepts > 0 and cov.later_sibling_accepts > 0, cov


@pytest.mark.parametrize("name", ["glide-cape", "cascade", "falcon"])
def test_negative_control_seeded_drafts_accepted_unequal_to_the_race_are_caught(name, tiny_dir, target,
                                                                               weight_files, monkeypatch):
    """A broken seeded rule that takes the first child at every node: its tokens leave plain seeded decoding's."""
    engine = make_engine(tiny_dir, target, weight_files, name)
    plain = Engine(_config(tiny_dir), target=target)
    sp = CASES[name].sampling
    monkeypatch.setattr(engine_module, "accept_seeded", lambda tree, probs, *a: accept_first_children(
        tree, probs, torch.Generator().manual_seed(0)))
    seeds = [seed_base(name, control=6) + i * SEED_STRIDE for i in range(40)]
    differ = sum(a != b for a, b in zip(seeded_tokens(engine, sp, seeds), seeded_tokens(plain, sp, seeds)))
    assert differ >= 10, differ


def test_plain_seeded_decoding_matches_the_target(tiny_dir, target, reference_logits):
    """The race keyed on (seed, position) samples the target's distribution: plain seeded decoding, every case's
    shaping that the seeded cases above use, N seeds."""
    plain = Engine(_config(tiny_dir), target=target)
    sp = CASES["glide-cape"].sampling
    counts = sample_joint(plain, sp, N, seed_base("glide-cape", control=6), seeded=True)
    pvalue = chi2_pvalue(counts, reference_joint(reference_logits, sp))
    print(f"\nplain seeded: p = {pvalue:.4g}")
    assert pvalue > 1e-3, f"seeded sampling does not follow the target's distribution (p = {pvalue:.3g})"


def test_negative_control_seeded_clocks_reused_across_positions_are_caught(tiny_dir, target, reference_logits,
                                                                           monkeypatch):
    """Clocks keyed on the seed alone (every position of a request runs the same race): each token alone still
    follows its marginal, but successive tokens are no longer independent draws."""
    real = sampling_module.token_clocks
    for module in (sampling_module, engine_module, acceptance_module, glide_module):
        monkeypatch.setattr(module, "token_clocks", lambda seed, position, vocab: real(seed, 0, vocab))
    plain = Engine(_config(tiny_dir), target=target)
    sp = CASES["glide-cape"].sampling
    counts = sample_joint(plain, sp, N_CONTROL, seed_base("glide-cape", control=7), seeded=True)
    assert chi2_pvalue(counts, reference_joint(reference_logits, sp)) < 1e-6


def test_every_registered_drafter_has_a_case():
    """New drafters join this test as they land: each needs a Case (options with random weights) above."""
    missing = sorted(set(drafter_names()) - {"none"} - set(CASES))
    assert not missing, f"drafters without a sampled-exactness case in {Path(__file__).name}: {missing}"
    assert set(CASES) <= set(drafter_names()), "a case for a drafter that is no longer registered"
    assert sorted(SEED_ORDER) == sorted(CASES), "each case needs its place in SEED_ORDER (new ones at the end)"


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
