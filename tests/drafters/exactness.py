"""The harness of the sampled-exactness tests (test_sampled_exactness.py, test_sampled_shaping.py): the tiny
target, random drafter weights, the reference distribution computed without the code under test, batched
sampling through the engine, coverage of the speculative path, and broken acceptance rules for the negative
controls. The method is in test_sampled_exactness.py's docstring."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from core.sampling import SamplingParams
from server.config import config_from_dict
from server.engine import Engine, StepPlan, load_target

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

WIDE = DEVICE != "cpu" or bool(os.environ.get("SPECSERVE_TEST_WIDE"))
if WIDE:  # the test modules take this fixture in place of tests/conftest.py's
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
