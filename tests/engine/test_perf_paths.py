"""The CPU fast paths: per-row-count matmul kernels (model.linear) and decode-form attention (backend).

- every linear path computes x @ W.T, and in bfloat16 gives a row the same bits whatever the row count;
- every CPU attention call shape (prefill, decode, chain rows, tree rows with gathered keys or in one multi-row call,
  keys padded up to the end of the KV slot) agrees with the plain-torch reference;
- bfloat16 on the default model, through either CPU attention (the C++ kernel where it loads, else the batched
  matmuls of the decode form): the rows of a draft chain (and of a few-branch tree) get bit-identical logits to
  plain decode steps, so greedy ngram speculation emits exactly the plain decoding tokens (in float32
  test_speculative_greedy covers this).
The bit-exactness tests skip where none of this CPU's bfloat16 matmul kernels (core.ops.LINEAR_KERNELS) is
row-invariant (measured on AMX Xeons): then no kernel choice can make speculation bit-exact in bfloat16.
"""
from __future__ import annotations

import pytest
import torch

from core import ops
from core.ops import linear
from core.tree import DraftTree
from drafters.base import create_drafter
from specserve_kernels import cpu as cpu_kernels
from specserve_kernels.tree_attention_reference import tree_attention_ref
from specserve_kernels.tree_mask import ancestor_bitmask
from server.config import config_from_dict
from server.engine.backend import EXACT_MAX_ROWS, make_attention, make_decode_group_attention
from server.engine import Engine, load_target
from server.tokenization import encode_chat, stop_token_ids

CPU = torch.device("cpu")


def _rows_invariant(kernel, x: torch.Tensor, w: torch.Tensor, counts) -> bool:
    """Whether ``kernel`` gives the first t rows of x the bits it gives each row alone, for each t in ``counts``."""
    one = torch.cat([kernel(x[i:i + 1], w) for i in range(x.shape[0])])
    return all(torch.equal(kernel(x[:t], w), one[:t]) for t in counts)


def _bf16_row_invariant_kernels() -> list[str]:
    """The kernels of core.ops.LINEAR_KERNELS that are row-invariant in bfloat16 on this CPU (at the model's qkv
    shape). The precondition of the bit-exactness tests: a property of the CPU's kernels, not of the kernel choice
    (``linear``) that the tests check."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(960, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(40, 576, generator=g).to(torch.bfloat16)
    return [name for name, kernel in ops.LINEAR_KERNELS.items() if _rows_invariant(kernel, x, w, (2, 6, 32, 40))]


needs_row_invariance = pytest.mark.skipif(not _bf16_row_invariant_kernels(),
                                          reason="none of this CPU's bfloat16 matmul kernels is row-invariant")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 6, 64, 65, 130])
def test_linear_paths_compute_x_wt(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    out = linear(x, w)
    assert out.shape == (rows, 96) and out.dtype == dtype and out.is_contiguous()
    ref = x.double() @ w.double().T
    tol = 1e-4 if dtype == torch.float32 else 5e-2 * ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_any_layout_linear_gives_the_same_bits(rows, monkeypatch):
    """``any_layout``: the same values, bit for bit, handed over transposed in memory where mv+mm skips its copy
    into rows (2..64 rows); a transposed input (SwiGLU of such an output) gives the bits of a contiguous one."""
    monkeypatch.setattr(ops, "_chosen", dict(ops._chosen))
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 80, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 80, generator=g).to(torch.bfloat16)
    ops.use_linear_kernel(ops.linear_key(w), "mv+mm")
    want = linear(x, w)
    free = linear(x, w, any_layout=True)
    assert want.is_contiguous() and torch.equal(free, want)
    assert free.is_contiguous() == (rows == 1)
    transposed = x.t().contiguous().t()  # x's values, column-major
    assert not transposed.is_contiguous() or rows == 1
    assert torch.equal(linear(transposed, w), want)


@needs_row_invariance
def test_bf16_linear_rows_are_row_count_invariant(monkeypatch):
    """At each of the model's bfloat16 shapes, ``linear`` with the kernel the engine's measurement picks
    (measure_linear_kernels, which tune_linear runs at load) gives a row the same bits whatever the row count."""
    monkeypatch.setattr(ops, "_chosen", dict(ops._chosen))  # the choices made here end with the test
    g = torch.Generator().manual_seed(1)
    for out_f, in_f in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.bfloat16)
        x = torch.randn(64, in_f, generator=g).to(torch.bfloat16)
        best, report = ops.measure_linear_kernels([w])
        assert report[best]["row_invariant"], (out_f, in_f, report)
        ops.use_linear_kernel(ops.linear_key(w), best)
        assert _rows_invariant(linear, x, w, (2, 3, 6, 17, 32, 33, 64)), (out_f, in_f, best)


CASES = [  # (cache_len, parents or None for causal rows, max_len)
    (0, list(range(-1, 7)), 256),  # prefill (causal)
    (0, [-1], 256),  # one-token prompt
    (5, [-1], 256),  # decode steps, before and across a key block boundary
    (63, [-1], 256),
    (64, [-1], 256),
    (40, list(range(-1, 5)), 256),  # an ngram chain
    (60, list(range(-1, 5)), 256),  # a chain whose rows pad to two different key counts
    (60, [-1, 0, 1, 1, 0, 4, 2, 3], 256),  # a tree: chain prefix 0-1-2, then branches
    (10, list(range(-1, EXACT_MAX_ROWS - 1)), 256),  # the longest chain: every row in decode form
    (30, list(range(-1, 40)) + [3, 5, 40], 256),  # a long chain, then branch rows
    (60, [-1, 0, 1, 2, 1, 4, 5, 6, 7, 8], 256),  # a branch whose rows pad to two key counts (gathered keys)
    (70, [-1, 0, 1, 2, 0, 0, 1, 1, 2, 3], 256),  # six leaves: one batched call of six paths
    (61, [-1, 0, 0, 1, 2, 3, 4, 0, 7, 8], 256),  # branches whose rows pad to two key counts, batched
    (90, list(range(-1, 7)), 100),  # padding clamped at the end of the slot
    (97, [-1], 100),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_len,parents,max_len", CASES)
def test_cpu_attention_matches_reference(dtype, cache_len, parents, max_len):
    H, H_kv, D, T = 6, 2, 32, len(parents)
    g = torch.Generator().manual_seed(cache_len * 100 + T)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(H_kv, max_len, D, generator=g).to(dtype)
    v = torch.randn(H_kv, max_len, D, generator=g).to(dtype)
    mask = ancestor_bitmask(parents) if T > 1 and cache_len > 0 else None
    attn = make_attention(CPU, cache_len, T, mask, dtype, max_len)
    out = attn(q, k, v, cache_len, mask)
    ref = tree_attention_ref(q, k, v, cache_len, mask)
    assert out.shape == (T, H, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def _positions(cache_len: int, parents: list[int], causal: bool) -> torch.Tensor:
    """Each new row's position, walked through the parent links (a tree row: cache_len + its depth)."""
    def depth(j):
        return 0 if parents[j] < 0 else depth(parents[j]) + 1
    return torch.tensor([cache_len + (j if causal else depth(j)) for j in range(len(parents))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 20])
@pytest.mark.parametrize("cache_len,parents,max_len", [c for c in CASES if c[0] + len(c[1]) > 20])
def test_cpu_attention_through_a_sliding_window_matches_reference(dtype, window, cache_len, parents, max_len):
    """Every call shape above in a sliding-window layer, with and without the slot's capacity (decode form, or one
    plain SDPA call): a row at position p reads keys at positions > p - window only."""
    H, H_kv, D, T = 6, 2, 32, len(parents)
    g = torch.Generator().manual_seed(cache_len * 100 + T + window)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(H_kv, max_len, D, generator=g).to(dtype)
    v = torch.randn(H_kv, max_len, D, generator=g).to(dtype)
    mask = ancestor_bitmask(parents) if T > 1 and cache_len > 0 else None
    pos = _positions(cache_len, parents, mask is None)
    ref = tree_attention_ref(q, k, v, cache_len, mask, window=window, positions=pos)
    assert not torch.allclose(ref.float(), tree_attention_ref(q, k, v, cache_len, mask).float(), atol=2e-2)
    for capacity in (max_len, None):
        out = make_attention(CPU, cache_len, T, mask, dtype, capacity, window)(q, k, v, cache_len, mask)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3, 40])
def test_decode_steps_of_several_sequences_in_one_call_match_reference(dtype, window):
    """``make_decode_group_attention``: decode steps of sequences of different lengths (two padded key counts) read
    their own slot, as each would alone, through a sliding window where one is given."""
    H, H_kv, D, slots, S = 6, 2, 32, 4, 160
    g = torch.Generator().manual_seed(7)
    k = torch.randn(slots, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(slots, H_kv, S, D, generator=g).to(dtype)
    seq_slots, lens = [2, 0, 3], [5, 70, 100]  # cached before the step; the new key at row len
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    out = make_decode_group_attention(seq_slots, lens, dtype, S, CPU, window)(q, k, v)
    for b, (slot, n) in enumerate(zip(seq_slots, lens)):
        ref = tree_attention_ref(q[b:b + 1], k[slot], v[slot], n, None, window=window,
                                 positions=None if window is None else torch.tensor([n]))
        torch.testing.assert_close(out[b:b + 1].float(), ref.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=0)


@pytest.fixture(scope="module")
def target16():
    cfg = config_from_dict({"model": {"dtype": "bfloat16", "device": "cpu"},
                            "cache": {"num_slots": 1, "max_seq_len": 512}})
    return cfg, load_target(cfg, progress=False)


@pytest.fixture(params=["kernel", "matmuls"])
def attention16(request):
    """Which CPU attention a 16-bit engine runs: the C++ kernel (one call per layer for every row after a cached
    prefix) or, where the kernel does not load, the decode form's batched matmuls."""
    if request.param == "kernel" and cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels unavailable here: {cpu_kernels.unavailable_reason()}")
    return request.param


def engine16(cfg, target, attention: str, drafter=None) -> Engine:
    engine = Engine(cfg, drafter, target)
    assert engine.row_kernel == (cpu_kernels.load() is not None)  # the kernel wherever it loads
    engine.row_kernel = attention == "kernel"
    return engine


@needs_row_invariance
def test_bf16_chain_rows_equal_decode_steps_bitwise(target16, tokenizer, attention16, monkeypatch):
    cfg, target = target16
    engine = engine16(cfg, target, attention16)
    calls = []
    attend = cpu_kernels.attend
    monkeypatch.setattr(cpu_kernels, "attend", lambda q, *a: calls.append(q.shape[0]) or attend(q, *a))
    ids = encode_chat(tokenizer, [{"role": "user", "content": "List three uses of a paperclip."}])
    seq = engine.add(ids, max_new_tokens=200)
    engine.prefill(seq)
    while seq.cache_len % 64 != 61:  # the draft's rows then pad to two key counts (64k and 64k + 64)
        engine.step(seq)
    start, root = seq.cache_len, seq.token_ids[-1]
    with torch.inference_mode():
        decoded = []  # logits of 6 plain decode steps
        for _ in range(6):
            logits, hidden = engine.verify(seq, DraftTree.root_only(seq.token_ids[-1]))
            decoded.append(logits[0])
            engine.commit(seq, [0], hidden)
            seq.token_ids.append(int(logits[0].argmax()))
        chain = seq.token_ids[-6:-1]
        # the same rows as one chain verification, and as the chain rows of a tree with two extra branches
        seq.cache_len = start
        chain_logits, _ = engine.verify(seq, DraftTree.chain(root, chain))
        tree = DraftTree([root, *chain[:3], 7, chain[3], chain[4]], [-1, 0, 1, 2, 1, 3, 5])  # 2 leaves: 4 and 6
        tree_logits, _ = engine.verify(seq, tree)
        big = DraftTree([root, *chain[:3], 7, chain[3], 8, chain[4], 9], [-1, 0, 1, 2, 1, 3, 0, 5, 2])  # 4 leaves
        calls.clear()
        big_logits, _ = engine.verify(seq, big)
    engine.release(seq)
    # the kernel: every row of the tree in one call per layer
    assert calls == ([9] * target.args.num_layers if attention16 == "kernel" else [])
    assert torch.equal(chain_logits, torch.stack(decoded))
    assert torch.equal(tree_logits[:4], torch.stack(decoded[:4]))  # rows 0..3 are a chain from the root
    # rows 5 and 6 are further decode steps on the chain, behind branch row 4: their ancestors sit at other cache
    # rows than a decode step's, and gathered back into decode-step order they give the same bits
    assert torch.equal(tree_logits[[5, 6]], torch.stack(decoded[4:6]))
    # every branch of a tree, however many, is a batch entry of one call: rows 5 and 7 (behind branches 4 and 6,
    # with a third branch at row 8) get the decode steps' bits
    assert torch.equal(big_logits[:4], torch.stack(decoded[:4]))
    assert torch.equal(big_logits[[5, 7]], torch.stack(decoded[4:6]))


@needs_row_invariance
def test_bf16_ngram_equals_plain(target16, tokenizer, attention16):
    cfg, target = target16
    stops = stop_token_ids(tokenizer, target.args.eos_token_ids)
    plain = engine16(cfg, target, attention16)
    ngram = engine16(cfg, target, attention16, create_drafter("ngram", target, {"num_tokens": 6}))
    accepted = 0
    for text in ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
                 "Write a Python function that checks whether a number is prime."]:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
        ref = plain.generate(ids, max_new_tokens=48, stop_token_ids=stops).token_ids
        out = ngram.generate(ids, max_new_tokens=48, stop_token_ids=stops)
        assert out.token_ids == ref
        accepted += out.stats.accepted_tokens
    assert accepted > 0
