"""Falcon: the relaxed causal mask, no row seeing its own label, the drafter's tree (the Cartesian product of one
forward, expansion under the most probable leaves, the row cap) against a cache-free reference, its q rows and race
order for sampled requests, a cache that holds verified rows only, losslessness, and checkpoint errors.

Random-weight checkpoints (tmp dirs) stand in for the trained one, on the tiny random Llama of tests/conftest.py where
the real model is not needed; `test_shipped_checkpoint_is_lossless_greedy` needs the shipped checkpoint."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.ops import LlamaArgs
from core.sampling import SamplingParams, race, target_probs, token_clocks
from drafters.base import create_drafter
from drafters.falcon.drafter import FalconDrafter, load_falcon
from drafters.falcon.model import (
    FalconCheckpointError,
    _cache_attention,
    FalconConfig,
    FalconModel,
    block_ids,
    default_checkpoint,
    relaxed_mask,
)
from server.config import config_from_dict
from server.engine import Engine, StepPlan, load_target
from tests.conftest import chi2_pvalue
from tests.lossless import accepted_tokens, assert_lossless, tokens_per_step

V = 16                                               # the tiny target's vocabulary (write_tiny_llama)
TINY_PROMPTS = [[3, 7, 1, 12, 5, 9, 3, 7],           # n = 8 and n = 11 after the first token: both block alignments
                [2, 9, 4, 4, 13, 6, 2, 9, 4, 15, 8]]


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread: OpenMP spin/wake costs dominate the tiny forwards (200x here), and on a busy 2-core machine the
    default model's few-row forwards also ran 2.5x faster on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the head -----------------------------------------------------------------------------------------------------
def test_block_ids_and_relaxed_mask_small_example():
    pos = torch.arange(1, 7)
    assert block_ids(pos, 2).tolist() == [0, 1, 1, 2, 2, 3]
    assert block_ids(pos, 2, 1).tolist() == [1, 1, 2, 2, 3, 3]
    assert block_ids(pos, 3, 2).tolist() == [1, 1, 1, 2, 2, 2]
    # offset 0: blocks {1} {2, 3} {4, 5} {6}; a row sees its own block (also the later row in it) and earlier ones
    assert relaxed_mask(block_ids(pos, 2)).int().tolist() == [[1, 0, 0, 0, 0, 0],
                                                              [1, 1, 1, 0, 0, 0],
                                                              [1, 1, 1, 0, 0, 0],
                                                              [1, 1, 1, 1, 1, 0],
                                                              [1, 1, 1, 1, 1, 0],
                                                              [1, 1, 1, 1, 1, 1]]
    # offset 1: blocks {1, 2} {3, 4} {5, 6}
    assert relaxed_mask(block_ids(pos, 2, 1)).int().tolist() == [[1, 1, 0, 0, 0, 0],
                                                                 [1, 1, 0, 0, 0, 0],
                                                                 [1, 1, 1, 1, 0, 0],
                                                                 [1, 1, 1, 1, 0, 0],
                                                                 [1, 1, 1, 1, 1, 1],
                                                                 [1, 1, 1, 1, 1, 1]]


def _tiny_head(k: int, seed: int = 0) -> FalconModel:
    torch.manual_seed(seed)
    args = LlamaArgs(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                     max_position_embeddings=128, bos_token_id=0, eos_token_ids=(1,))
    m = FalconModel(FalconConfig.for_target(args, "tiny", k=k))
    with torch.no_grad():  # weights large enough that every input carries signal to every row that sees it
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape) * 0.3)
    emb = torch.randn(50, 32)
    return m.attach(emb, emb)


@pytest.mark.parametrize("k,offset", [(2, 0), (2, 1), (3, 1)])
def test_no_row_sees_its_label(k, offset):
    """Training-style forward over a whole sequence: row j (predicting t_{j+k}, whose inputs t_{j+k} and f_{j+k-1} sit
    at position j + k) is unchanged by any input of a later block, and changed by every input of its own block
    (the later rows of its block included) and of earlier ones."""
    m = _tiny_head(k)
    T = 12
    pos = torch.arange(1, T + 1)
    ids, feats = torch.randint(0, 50, (T,)), torch.randn(T, 32)
    blocks = block_ids(pos, k, offset)
    vis = relaxed_mask(blocks)
    base = m(ids, feats, pos, vis)
    assert all(blocks[j + k] > blocks[j] for j in range(T - k))  # a row's label input is always in a later block
    for at in range(T):
        ids2, feats2 = ids.clone(), feats.clone()
        ids2[at] = (ids[at] + 1) % 50
        feats2[at] += 1.0
        for out in (m(ids2, feats, pos, vis), m(ids, feats2, pos, vis)):
            for r in range(T):
                if blocks[at] > blocks[r]:
                    assert torch.equal(out[r], base[r]), (r, at)
                else:
                    assert not torch.allclose(out[r], base[r], atol=1e-5), (r, at)


# -- the drafter on the tiny target -------------------------------------------------------------------------------
def _tiny_config(tiny_dir, slots: int = 2):
    return config_from_dict({"model": {"source": str(tiny_dir), "dtype": "float32", "device": "cpu"},
                             "cache": {"num_slots": slots, "max_seq_len": 64}})


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_target(_tiny_config(tiny_dir), progress=False)


def _random_checkpoint(target, path, k: int = 2, vocab_subset: int = 12, scale: float | None = 0.3, seed: int = 0,
                       taps: tuple[int, ...] = ()):
    """A random Falcon head for ``target`` over a random ``vocab_subset`` of its vocabulary, saved in float32;
    ``scale``: the matrices' std (None: the model's own init, with noise added); ``taps``: lower layers it reads."""
    gen = torch.Generator().manual_seed(seed)
    m = FalconModel(FalconConfig.for_target(target.args, target.model_id, k=k, vocab_subset=vocab_subset,
                                            taps=list(taps)))
    m.vocab_ids = torch.randperm(target.args.vocab_size, generator=gen)[:vocab_subset]
    m.init_from_target(target.model)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale if scale else
                        p + torch.randn(p.shape, generator=gen) * 0.02)
    m.save(path, {"note": "random weights, for tests"}, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def tiny_ckpt(tiny, tmp_path_factory):
    """{k: checkpoint path} of random heads for the tiny target; "taps": k = 2, reading the stream after layer 1."""
    d = tmp_path_factory.mktemp("falcon-tiny")
    out = {k: str(_random_checkpoint(tiny, d / f"falcon-k{k}.safetensors", k=k)) for k in (2, 3)}
    out["taps"] = str(_random_checkpoint(tiny, d / "falcon-taps.safetensors", k=2, taps=(1,), seed=1))
    return out


def _start(engine: Engine, prompt, sampling: SamplingParams | None = None, max_new_tokens: int = 24):
    seq = engine.add(prompt, sampling, max_new_tokens=max_new_tokens)
    engine.prefill(seq)
    return seq


def _reference_model(target, path, weights: str = "auto") -> FalconModel:
    """The drafter's own head (its matrices as ``weights`` chooses them, as the drafter's did), run without its
    cache."""
    return load_falcon(target, path, weights)


@torch.no_grad()
def reference_block(model: FalconModel, view, chain) -> torch.Tensor:
    """Without a cache: the predicted features [k, hidden] of the block after the verified text and the drafted blocks
    ``chain`` [(tokens, features)] (the first block -- the last k verified positions -- when ``chain`` is empty), from
    one training-style forward over the whole context under the relaxed mask, blocks aligned to end at the root."""
    k, toks = model.c.k, view.tokens
    n = len(toks) - 1
    feats = view.target.final_norm(view.target_hidden())  # f_0 .. f_{n-1}: the inputs of positions 1 .. n
    ids = list(toks[1:]) + [t for block, _ in chain for t in block]
    drafted = sum(len(block) for block, _ in chain)
    feats = torch.cat([feats, *[f for _, f in chain]])
    taps = None
    if model.c.taps:  # the target's lower layers where it ran, zeros where the drafter guessed
        t = view.target_taps()
        taps = torch.cat([t, t.new_zeros(drafted, *t.shape[1:])])
    pos = torch.arange(1, len(ids) + 1)
    blocks = block_ids(pos, k, (-(n - k + 1)) % k)
    return model(torch.tensor(ids), feats, pos, relaxed_mask(blocks), taps=taps)[-k:]


def reference_tree(model: FalconModel, view, top_m, forwards: int, width: int, max_rows: int, next_top_m=None):
    """The greedy tree by its definition, each block from ``reference_block``: (tokens, parents)."""
    vocab = model.vocab_ids.tolist()
    tokens, parents, leaves = [view.tokens[-1]], [-1], []

    def grow(chain, parent, score):
        out = reference_block(model, view, chain)
        probs = torch.softmax(model.logits(out).float(), -1)
        level = [([], parent, score)]
        for i, m in enumerate(top_m if not chain or next_top_m is None else next_top_m):
            nxt = []
            for block, row, s in level:
                for loc in torch.topk(probs[i], m).indices.tolist():
                    if len(tokens) >= max_rows:
                        break
                    tokens.append(vocab[loc])
                    parents.append(row)
                    nxt.append((block + [vocab[loc]], len(tokens) - 1, s * float(probs[i, loc])))
            level = nxt
        leaves.extend((s, row, chain + [(block, out)]) for block, row, s in level)

    grow([], 0, 1.0)
    for _ in range(forwards - 1):
        if len(tokens) >= max_rows or not leaves:
            break
        leaves.sort(key=lambda leaf: -leaf[0])
        chosen = leaves[:width]
        del leaves[:width]
        for s, row, chain in chosen:
            grow(chain, row, s)
    return tokens, parents


def test_greedy_tree_is_the_cartesian_product_of_one_forward(tiny_dir, tiny, tiny_ckpt):
    drafter = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=1)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[2])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        tree = drafter.propose(view)
        tree.validate(V)
        assert tree.q is None  # greedy: top-k point masses
        assert tree.parents == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]  # root, 3 children, 2 under each: 9 draft rows
        first, second = tree.tokens[1:4], tree.tokens[4:]
        assert len(set(first)) == 3 and second == second[:2] * 3  # one forward: the same 2nd tokens under each node
        probs = torch.softmax(ref.logits(reference_block(ref, view, [])).float(), -1)
        vocab = ref.vocab_ids
        assert first == vocab[torch.topk(probs[0], 3).indices].tolist()
        assert second[:2] == vocab[torch.topk(probs[1], 2).indices].tolist()
        engine.release(seq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_attention_through_the_cpu_kernel_is_the_masked_softmax(dtype):
    """Drafting reads its cache through kernels.cpu.attend where it loads: every row's visible keys (all of them, or
    the verified prefix plus its ancestors), as SDPA computes them; None where a row's own keys do not fit its bits."""
    from kernels import cpu as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, D, S, n = 4, 6, 2, 64, 256, 150
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k, v = (torch.randn(Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    visible = torch.zeros(T, n + 10, dtype=torch.bool)
    visible[:, :n] = True  # the verified prefix
    visible[:2, [n + 1, n + 3, n + 6]] = True  # ancestors among the drafted rows, then each block's own rows
    visible[2:, [n + 2, n + 5, n + 8, n + 9]] = True

    def sdpa(keys, mask):
        o = F.scaled_dot_product_attention(q.float().transpose(0, 1), k[:, :keys].float().repeat_interleave(3, 0),
                                           v[:, :keys].float().repeat_interleave(3, 0), attn_mask=mask)
        return o.transpose(0, 1)

    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the kernel rounds its float32 output to the query's type once
    for keys, mask in ((n + 10, visible), (n + 4, None)):
        out = _cache_attention(q, k, v, keys, mask)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), sdpa(keys, mask), atol=tol, rtol=0)
    wide = torch.zeros(T, n + 70, dtype=torch.bool)
    wide[:, :n] = True
    wide[:, n + 65] = True  # 66 keys past the shared prefix: more than a row's bits hold
    assert _cache_attention(q, k, v, n + 70, wide) is None


@pytest.mark.parametrize("k,top_m,forwards,width,max_rows,next_top_m", [
    (2, (3, 2), 2, 1, 24, None),   # one extra block, under the most probable leaf
    (2, (3, 2), 2, 2, 32, None),   # two blocks in one forward, neither sees the other
    (2, (3, 2), 3, 1, 40, None),   # a third block: under the best leaf left, a drafted block among its ancestors
    (2, (2, 2), 4, 2, 64, None),   # deep: blocks three levels below the root
    (2, (3, 2), 3, 2, 20, None),   # the cap cuts a block's Cartesian product
    (3, (2, 2, 1), 3, 2, 40, None),  # k = 3
    (2, (2, 1), 3, 1, 40, (1, 1)),   # branches in the first block only, chains under it
    (2, (1, 1), 2, 2, 40, (2, 2)),   # a chain first, then a wider block
])
def test_expanded_tree_matches_the_cache_free_reference(tiny_dir, tiny, tiny_ckpt, k, top_m, forwards, width,
                                                        max_rows, next_top_m):
    drafter = FalconDrafter(tiny, tiny_ckpt[k], top_m=top_m, forwards=forwards, width=width, max_rows=max_rows,
                            next_top_m=next_top_m)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[k])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        tree = drafter.propose(view)
        tree.validate(V)
        assert (tree.tokens, tree.parents) == reference_tree(ref, view, top_m, forwards, width, max_rows, next_top_m)
        assert tree.num_rows <= max_rows
        engine.release(seq)


def test_a_head_with_taps_reads_the_targets_lower_layers(tiny_dir, tiny, tiny_ckpt):
    """A head that reads a lower target layer (EAGLE-3's multi-layer features): the engine keeps the layer's residual
    stream beside the hidden states (the target's own forward computes the same), the drafter's expanded tree is the
    cache-free reference's with those rows, the tap weights change it, and greedy decoding stays lossless."""
    drafter = FalconDrafter(tiny, tiny_ckpt["taps"], **OPTS, weights="dense")  # the reference zeroes a matrix
    assert drafter.target_taps == (1,)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    W = tiny.args.hidden_size
    assert engine.pool.hidden.shape[-1] == 2 * W
    ref = _reference_model(tiny, tiny_ckpt["taps"], "dense")
    blind = _reference_model(tiny, tiny_ckpt["taps"], "dense")
    with torch.no_grad():
        blind.tap_fuse.zero_()
    differs = 0
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        own = tiny.forward(view.tokens[:-1], (1,))
        assert torch.allclose(view.target_taps(), own.taps, atol=1e-5)
        assert torch.allclose(view.target_hidden(), own.hidden, atol=1e-5)
        tree = drafter.propose(view)
        want = reference_tree(ref, view, OPTS["top_m"], OPTS["forwards"], OPTS["width"], OPTS["max_rows"])
        assert (tree.tokens, tree.parents) == want
        differs += want != reference_tree(blind, view, OPTS["top_m"], OPTS["forwards"], OPTS["width"],
                                          OPTS["max_rows"])
        engine.release(seq)
    assert differs
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    assert_lossless(engine, TINY_PROMPTS, plain, 40)


def test_expansion_hangs_under_the_most_probable_leaf(tiny_dir, tiny, tiny_ckpt):
    """forwards=2, width=1: the first forward's tree, then a whole Cartesian block under its most probable leaf."""
    engine = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=1), tiny)
    deep = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=2, width=1, max_rows=24)
    ref = _reference_model(tiny, tiny_ckpt[2])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt)
        view = engine.view(seq)
        one, two = engine.drafter.propose(view), deep.propose(view)
        assert two.tokens[:10] == one.tokens and two.parents[:10] == one.parents
        probs = torch.softmax(ref.logits(reference_block(ref, view, [])).float(), -1)
        local = {int(t): i for i, t in enumerate(ref.vocab_ids)}
        score = {r: float(probs[0, local[one.tokens[one.parents[r]]]] * probs[1, local[one.tokens[r]]])
                 for r in range(4, 10)}
        best = max(score, key=score.get)
        assert two.num_rows == 19 and two.parents[10:] == [best] * 3 + [10, 10, 11, 11, 12, 12]
        engine.release(seq)


def test_max_rows_truncates_the_same_tree_and_stops_forwards(tiny_dir, tiny, tiny_ckpt):
    engine = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=3, width=2,
                                                          max_rows=64), tiny)
    seq = _start(engine, TINY_PROMPTS[0])
    view = engine.view(seq)
    full = engine.drafter.propose(view)
    assert full.num_rows == 1 + 9 + 2 * 9 + 2 * 9
    for cap in (2, 5, 7, 10, 16, 25, 37):
        d = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=3, width=2, max_rows=cap)
        tree = d.propose(view)
        assert tree.num_rows == cap
        assert (tree.tokens, tree.parents) == (full.tokens[:cap], full.parents[:cap])
        if cap <= 10:  # the first forward fills the tree: no expansion forward runs (the other one caught up)
            assert d.num_forwards == 2, cap
    engine.release(seq)


# -- sampled requests ---------------------------------------------------------------------------------------------
@pytest.mark.statistical
def test_unseeded_sampled_tree_hands_over_q_and_draws_from_it(tiny_dir, tiny, tiny_ckpt):
    sp = SamplingParams(temperature=0.7, top_k=6)
    drafter = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=2, width=2, max_rows=32)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[2])
    torch.manual_seed(0)
    seq = _start(engine, TINY_PROMPTS[0], sp)
    view = engine.view(seq)
    want = torch.zeros(2, V)  # the drafter's q at the two positions after the root, over the whole vocabulary
    want[:, ref.vocab_ids] = target_probs(ref.logits(reference_block(ref, view, [])), sp)
    counts = torch.zeros(V)
    for i in range(300):
        tree = drafter.propose(view)
        tree.validate(V)
        q = tree.q
        assert q is not None and q.shape == (tree.num_rows, V) and not q[0].any()
        assert torch.allclose(q[1:].sum(-1), torch.ones(tree.num_draft), atol=1e-5)
        assert all(q[r, tree.tokens[r]] > 0 for r in range(1, tree.num_rows))
        assert int((q[1:] > 0).sum(-1).max()) <= 6  # shaped like the request: top-k 6
        if i == 0:
            assert tree.num_rows == 1 + 9 + 2 * 9  # two more blocks, under the two likeliest leaves
            assert tree.parents[:10] == [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
            assert torch.allclose(q[1:4], want[0].expand(3, V), atol=1e-5)
            assert torch.allclose(q[4:10], want[1].expand(6, V), atol=1e-5)
        for r in tree.children()[0]:
            counts[tree.tokens[r]] += 1
    # the root's children are independent draws from q (with replacement), fresh at every proposal
    assert chi2_pvalue(counts, want[0]) > 1e-3
    engine.release(seq)


def test_seeded_tree_proposes_race_order_as_point_masses(tiny_dir, tiny, tiny_ckpt):
    """A seeded request's target draws by a race on clocks keyed on (seed, position); Falcon runs the same race on its
    own distribution at each drafted position: the first candidates to ring, under every node alike."""
    sp = SamplingParams(temperature=0.8, top_k=6, seed=11)
    drafter = FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=1)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    ref = _reference_model(tiny, tiny_ckpt[2])
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt, sp)
        view = engine.view(seq)
        tree = drafter.propose(view)
        assert tree.q is None  # point masses: accepted where they equal the target's draws
        q = torch.zeros(2, V)
        q[:, ref.vocab_ids] = target_probs(ref.logits(reference_block(ref, view, [])), sp)
        at = len(seq.token_ids)  # the position of the root's children
        assert tree.tokens[1:4] == race(q[0], token_clocks(sp.seed, at, V), 3)
        assert tree.tokens[4:] == race(q[1], token_clocks(sp.seed, at + 1, V), 2) * 3
        assert drafter.propose(view).tokens == tree.tokens  # a function of the seed, not of a generator
        engine.release(seq)


# -- the cache holds verified rows only ---------------------------------------------------------------------------
OPTS = {"top_m": (3, 2), "forwards": 3, "width": 2, "max_rows": 32}


def test_cache_catch_up_matches_a_fresh_drafter(tiny_dir, tiny, tiny_ckpt):
    """Greedy generation where some steps draft and some skip the drafter (plain decode steps, as a draft budget
    does): every tree equals the one a fresh drafter proposes from the whole sequence, proposing twice without new
    tokens gives the same tree, and the output is plain decoding's, with drafts accepted."""
    live = FalconDrafter(tiny, tiny_ckpt[2], **OPTS)
    fresh = FalconDrafter(tiny, tiny_ckpt[2], **OPTS)
    engine = Engine(_tiny_config(tiny_dir), live, tiny)
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    pattern = [64, 1, 1, 1, 1, 1, 64, 64, 1, 64, 1, 1, 64, 64, 64]  # tree rows allowed per step; 1: no drafting
    accepted = skipped_then_drafted = 0
    for prompt in TINY_PROMPTS:
        seq = _start(engine, prompt, max_new_tokens=40)
        step = 0
        while seq.finish_reason is None:
            cap = pattern[step % len(pattern)]
            if cap > 1:
                view = engine.view(seq)
                want = fresh.propose(view)
                fresh.release(seq.seq_id)
                got = live.propose(view)
                assert (got.tokens, got.parents) == (want.tokens, want.parents), step
                assert live.propose(view).tokens == got.tokens
                skipped_then_drafted += step > 0 and pattern[(step - 1) % len(pattern)] == 1
            before = seq.stats.accepted_tokens
            engine.run(StepPlan([seq], max_rows={seq.seq_id: cap}))
            accepted += seq.stats.accepted_tokens - before
            step += 1
        assert seq.output_ids == plain.generate(prompt, max_new_tokens=40).token_ids
        engine.release(seq)
    assert accepted > 0 and skipped_then_drafted >= 4


def test_the_tree_depends_on_the_whole_verified_context(tiny_dir, tiny, tiny_ckpt):
    """The power behind the catch-up test: an early token (seen only through the cache) changes the tree."""
    drafter = FalconDrafter(tiny, tiny_ckpt[2], **OPTS)
    engine = Engine(_tiny_config(tiny_dir), drafter, tiny)
    trees = []
    for first in (3, 4):
        seq = _start(engine, [first] + TINY_PROMPTS[1][1:])
        trees.append(drafter.propose(engine.view(seq)).tokens)
        engine.release(seq)
    assert trees[0] != trees[1]


def test_lossless_greedy_on_the_tiny_target_with_deep_accepts(tiny_dir, tiny, tiny_ckpt):
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    spec = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 3), forwards=4, width=2,
                                                        max_rows=48), tiny)
    outs = assert_lossless(spec, TINY_PROMPTS + [[5, 5, 5, 5, 5, 5]], plain, 40)
    deep = sum(o.stats.step_tokens - o.stats.verify_steps for o in outs)  # tokens beyond one per step: accepted drafts
    assert deep >= 10


def test_seeded_sampling_is_plain_seeded_decoding_on_the_tiny_target(tiny_dir, tiny, tiny_ckpt):
    """Seeded requests return plain decoding's tokens with that seed, with race-ordered drafts accepted (also off the
    first child); the default model's version (tests/engine/test_seeded_sampling.py) needs the trained head."""
    plain = Engine(_tiny_config(tiny_dir), create_drafter("none", tiny), tiny)
    spec = Engine(_tiny_config(tiny_dir), FalconDrafter(tiny, tiny_ckpt[2], top_m=(3, 2), forwards=3, width=2,
                                                        max_rows=32), tiny)
    outs = [out for sp in (SamplingParams(temperature=0.8, top_k=8, seed=5),
                           SamplingParams(temperature=1.0, top_p=0.9, seed=-2))
            for out in assert_lossless(spec, TINY_PROMPTS, plain, 40, sampling=sp, label=sp)]
    assert accepted_tokens(outs) >= 10


# -- the default model (prompt_ids: tests/drafters/conftest.py) ---------------------------------------------------
@pytest.fixture(scope="module")
def random_falcon(target32, tmp_path_factory):
    """An untrained Falcon head for the default target (for contracts, not for acceptance)."""
    return str(_random_checkpoint(target32, tmp_path_factory.mktemp("falcon") / "falcon.safetensors",
                                  vocab_subset=8192, scale=None))


@pytest.mark.slow
def test_random_checkpoint_is_lossless_greedy_deep_tree(fp32_config, target32, prompt_ids, stops, random_falcon):
    plain = Engine(fp32_config, create_drafter("none", target32), target32)
    options = {"checkpoint": random_falcon, "top_m": [3, 2], "forwards": 3, "width": 2, "max_rows": 32}
    spec = Engine(fp32_config, create_drafter("falcon", target32, options), target32)
    for out in assert_lossless(spec, prompt_ids[1:], plain, 33, stops, label=options):
        # full trees were verified (32 rows, root included) while 32 tokens were still wanted, smaller ones after
        assert out.stats.max_draft == 31 and out.stats.draft_tokens >= 300


@pytest.mark.slow
def test_shipped_checkpoint_is_lossless_greedy(fp32_config, target32, stops, prompt_ids):
    assert default_checkpoint(target32.model_id).is_file(), "the trained checkpoint must ship in the repository"
    plain = Engine(fp32_config, create_drafter("none", target32), target32)
    spec = Engine(fp32_config, create_drafter("falcon", target32), target32)
    outs = assert_lossless(spec, prompt_ids, plain, 48, stops, label="falcon")
    assert tokens_per_step(outs) > 1.2  # the trained head really drafts (an untrained one stays near 1.0)


# -- checkpoints and options --------------------------------------------------------------------------------------
def test_missing_or_mismatched_checkpoint_fails_clearly(tiny, tiny_ckpt, tmp_path):
    assert not default_checkpoint(tiny.model_id).exists()
    with pytest.raises(FalconCheckpointError, match="specserve train falcon"):
        create_drafter("falcon", tiny)  # no checkpoint for this target at the default path
    with pytest.raises(FalconCheckpointError, match="nope.safetensors.*specserve train falcon"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "nope.safetensors"))
    m = FalconModel.load(tiny_ckpt[2])
    m.c.target_id = "some-other-model"
    m.save(tmp_path / "other.safetensors")
    with pytest.raises(FalconCheckpointError, match="trained for target 'some-other-model'.*specserve train falcon"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "other.safetensors"))
    shapes = FalconModel(FalconConfig.for_target(tiny.args, tiny.model_id, num_kv_heads=4, vocab_subset=12))
    shapes.save(tmp_path / "shapes.safetensors")
    with pytest.raises(FalconCheckpointError, match="target shapes.*specserve train falcon"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "shapes.safetensors"))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(FalconCheckpointError, match="not a Falcon checkpoint"):
        FalconDrafter(tiny, checkpoint=str(tmp_path / "plain.safetensors"))


def test_bad_options_fail_with_the_option(tiny, tiny_ckpt):
    for bad in ({"top_m": [3]}, {"top_m": [3, 0]}, {"next_top_m": [1]}, {"next_top_m": [0, 1]}, {"forwards": 0},
                {"width": 9}, {"max_rows": 65}, {"max_rows": 1}):
        with pytest.raises(ValueError, match="falcon"):
            create_drafter("falcon", tiny, {"checkpoint": tiny_ckpt[2], **bad})
    with pytest.raises(ValueError, match="top_m needs 3"):
        create_drafter("falcon", tiny, {"checkpoint": tiny_ckpt[3], "top_m": [3, 2]})
