import math
import random

import pytest
import torch

from specserve_kernels import ancestor_bitmask, tree_attention, tree_attention_ref, tree_mask_to_bool


def chain_parents(n):
    return [-1] + list(range(n - 1))


def cape_parents(n):
    # Chain c0 -> c1 -> ...; after each chain node c_k (k >= 1) comes an expansion token
    # that is an extra child of c_{k-1}, i.e. a sibling of c_k. Interleaved so that the
    # ancestor bits of a row are not a contiguous range.
    parents, last_chain, prev_chain = [-1], 0, None
    while len(parents) < n:
        prev_chain, last_chain = last_chain, len(parents)
        parents.append(prev_chain)  # next chain node
        if len(parents) < n:
            parents.append(prev_chain)  # expansion sibling
    return parents


def random_parents(n, seed):
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


TREES = {
    "decode": [-1],
    "chain8": chain_parents(8),
    "cape32": cape_parents(32),
    "random64": random_parents(64, seed=1234),
}


def make_inputs(T, H_kv, group, D, cache_len, device, dtype=torch.float32, slack=7):
    H = H_kv * group
    S = cache_len + T + slack
    q = torch.randn(T, H, D, dtype=dtype, device=device)  # [T, H, D]
    k = torch.randn(H_kv, S, D, dtype=dtype, device=device)  # [H_kv, S, D]
    v = torch.randn(H_kv, S, D, dtype=dtype, device=device)  # [H_kv, S, D]
    # Rows past cache_len + T are not part of the problem; NaN makes any stray read visible.
    k[:, cache_len + T:] = float("nan")
    v[:, cache_len + T:] = float("nan")
    return q, k, v


# Each listed value appears at least once without running the full cross product
# (the interpreter is slow): trees x head dims x GQA ratios x prefix lengths.
@pytest.mark.parametrize(
    "tree, D, group, cache_len",
    [
        ("decode", 64, 1, 300),
        ("decode", 128, 8, 0),
        ("chain8", 128, 3, 1),
        ("chain8", 64, 1, 0),
        ("cape32", 64, 8, 300),
        ("cape32", 128, 1, 1),
        ("random64", 128, 3, 300),
        ("random64", 64, 8, 1),
        ("random64", 64, 1, 0),
    ],
)
def test_tree_attention_matches_ref(tree, D, group, cache_len, device):
    parents = TREES[tree]
    T = len(parents)
    mask = ancestor_bitmask(parents).to(device)
    if T == 64:
        assert mask[63].item() < 0, "row 63 must carry bit 63 (the int64 sign bit)"
    q, k, v = make_inputs(T, 2, group, D, cache_len, device)
    out = tree_attention(q, k, v, cache_len, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, tree_attention_ref(q, k, v, cache_len, mask))


@pytest.mark.parametrize(
    "T, D, group, cache_len",
    [(300, 64, 3, 0), (257, 128, 1, 300), (200, 64, 8, 1)],
)
def test_causal_prefill_matches_ref(T, D, group, cache_len, device):
    q, k, v = make_inputs(T, 2, group, D, cache_len, device)
    out = tree_attention(q, k, v, cache_len, None)
    torch.testing.assert_close(out, tree_attention_ref(q, k, v, cache_len, None))


def test_strided_views_and_custom_scale(device):
    # The engine passes one layer/sequence of a pool [L, slots, H_kv, S, D] and q sliced out
    # of a fused qkv projection, so neither is contiguous in its outer dims.
    T, H, H_kv, D, cache_len, S = 8, 6, 2, 64, 45, 64
    k_pool = torch.randn(3, 4, H_kv, S, D, device=device)
    v_pool = torch.randn(3, 4, H_kv, S, D, device=device)
    qkv = torch.randn(T, (H + 2 * H_kv) * D, device=device)
    q = qkv[:, : H * D].view(T, H, D)  # [T, H, D], row stride (H + 2 H_kv) D
    # A row window of one (layer, slot): head stride S * D does not match the 60 rows kept.
    k, v = k_pool[1, 2, :, :60], v_pool[1, 2, :, :60]  # [H_kv, 60, D]
    assert not q.is_contiguous() and not k.is_contiguous()
    mask = ancestor_bitmask([-1, 0, 0, 1, 1, 2, 5, 6]).to(device)
    out = tree_attention(q, k, v, cache_len, mask, scale=0.3)
    torch.testing.assert_close(out, tree_attention_ref(q, k, v, cache_len, mask, scale=0.3))


# float32 runs use 16x32 tiles; 16-bit inputs take the 64-wide tiles, so run those here.
@pytest.mark.parametrize("tree, T, group, D, cache_len", [("cape32", 32, 3, 64, 100), (None, 300, 8, 128, 70)])
def test_float16(tree, T, group, D, cache_len, device):
    mask = None if tree is None else ancestor_bitmask(TREES[tree]).to(device)
    q, k, v = make_inputs(T, 2, group, D, cache_len, device, dtype=torch.float16)
    out = tree_attention(q, k, v, cache_len, mask)
    # The kernel rounds P to float16 before the P@V dot (the ref keeps it float32) and both
    # round the output to float16: allow a few float16 ulps.
    torch.testing.assert_close(out, tree_attention_ref(q, k, v, cache_len, mask), atol=2e-3, rtol=2e-3)


def test_bfloat16(device):
    if device == "cpu":
        pytest.skip("the Triton interpreter's tl.dot multiplies bfloat16 as raw uint16 bits")
    mask = ancestor_bitmask(chain_parents(8)).to(device)
    q, k, v = make_inputs(8, 2, 3, 128, 300, device, dtype=torch.bfloat16)
    out = tree_attention(q, k, v, 300, mask)
    # bfloat16 has 8 mantissa bits: P rounding plus output rounding are ~1e-2 relative.
    torch.testing.assert_close(out, tree_attention_ref(q, k, v, 300, mask), atol=2e-2, rtol=2e-2)


def naive_attention(q, k, v, cache_len, parents, scale, window=None):
    """Scalar loops, visibility from walking parent links (independent of the bitmask). With a window, a row at
    position p (a tree row's is cache_len + its number of ancestors) reads keys at positions > p - window only."""
    T, H, D = q.shape
    group = H // k.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for i in range(T):
        if parents is None:
            seen = set(range(i + 1))
        else:
            seen, node = set(), i
            while node != -1:
                seen.add(node)
                node = parents[node]
        keys = list(range(cache_len)) + [cache_len + j for j in sorted(seen)]
        if window is not None:
            pos = {n: n for n in range(cache_len)}
            pos.update({cache_len + j: cache_len + (j if parents is None else _depth(parents, j)) for j in seen})
            keys = [n for n in keys if pos[n] > pos[cache_len + i] - window]
        for h in range(H):
            kh = h // group
            logits = [sum(float(q[i, h, d]) * float(k[kh, n, d]) for d in range(D)) * scale for n in keys]
            top = max(logits)
            w = [math.exp(x - top) for x in logits]
            total = sum(w)
            for d in range(D):
                out[i, h, d] = sum(wn * float(v[kh, n, d]) for wn, n in zip(w, keys)) / total
    return out


def _depth(parents, j):
    d = 0
    while parents[j] != -1:
        d, j = d + 1, parents[j]
    return d


def _positions(parents, cache_len, T):
    """Each new row's position: a prefix row n is at n, a causal row j at cache_len + j, a tree row at cache_len +
    its depth (walked through the parent links)."""
    return torch.tensor([cache_len + (j if parents is None else _depth(parents, j)) for j in range(T)])


@pytest.mark.parametrize("parents, window", [([-1, 0, 0, 1, 2, 3], 3), (None, 4), ([-1, 0, 1, 2], 10)])
def test_window_ref_matches_naive_loops(parents, window):
    T, H, H_kv, D, cache_len = 6 if parents is None else len(parents), 4, 2, 8, 5
    q = torch.randn(T, H, D)
    k = torch.randn(H_kv, cache_len + T, D)
    v = torch.randn(H_kv, cache_len + T, D)
    mask = None if parents is None else ancestor_bitmask(parents)
    pos = _positions(parents, cache_len, T)
    ref = tree_attention_ref(q, k, v, cache_len, mask, window=window, positions=pos)
    expected = naive_attention(q, k, v, cache_len, parents, 1 / math.sqrt(D), window)
    torch.testing.assert_close(ref.double(), expected, atol=1e-5, rtol=1e-5)
    full = tree_attention_ref(q, k, v, cache_len, mask)
    if window >= cache_len + T:  # every key inside it
        assert torch.equal(ref, full)
    else:
        assert not torch.allclose(ref, full), "the window must hide some key"


# A window below a row block's tiles (skipped), across them, inside a tree (deeper rows than the window), and in a
# causal prompt chunk longer than it.
@pytest.mark.parametrize("tree, cache_len, window, dtype", [
    ("cape32", 300, 70, torch.float32),
    ("random64", 40, 9, torch.float32),
    (None, 70, 100, torch.float32),
    ("chain8", 130, 64, torch.float16),
    (None, 33, 50, torch.float16),
])
def test_sliding_window_matches_ref(tree, cache_len, window, dtype, device):
    parents = TREES[tree] if tree else None
    T = len(parents) if parents else 150
    mask = None if tree is None else ancestor_bitmask(parents).to(device)
    q, k, v = make_inputs(T, 2, 3, 64, cache_len, device, dtype=dtype)
    pos = _positions(parents, cache_len, T).to(device)
    out = tree_attention(q, k, v, cache_len, mask, window=window, positions=pos)
    ref = tree_attention_ref(q, k, v, cache_len, mask, window=window, positions=pos)
    tol = {} if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, ref, **tol)
    assert not torch.allclose(out, tree_attention_ref(q, k, v, cache_len, mask), **tol)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2], None])
def test_ref_matches_naive_loops(parents):
    T, H, H_kv, D, cache_len = 5, 4, 2, 8, 3
    q = torch.randn(T, H, D)
    k = torch.randn(H_kv, cache_len + T, D)
    v = torch.randn(H_kv, cache_len + T, D)
    mask = None if parents is None else ancestor_bitmask(parents)
    ref = tree_attention_ref(q, k, v, cache_len, mask)
    expected = naive_attention(q, k, v, cache_len, parents, 1 / math.sqrt(D))
    torch.testing.assert_close(ref.double(), expected, atol=1e-5, rtol=1e-5)


def test_ancestor_bitmask_known_trees():
    assert ancestor_bitmask([-1]).tolist() == [1]
    #      0
    #     / \
    #    1   2
    #    |
    #    3
    assert ancestor_bitmask([-1, 0, 0, 1]).tolist() == [0b1, 0b11, 0b101, 0b1011]
    assert ancestor_bitmask(torch.tensor([-1, 0, 1])).tolist() == [0b1, 0b11, 0b111]
    m = ancestor_bitmask(chain_parents(64))
    assert m.dtype == torch.int64 and m.shape == (64,)
    assert m[63].item() == -1  # all 64 bits set
    assert m[62].item() == (1 << 63) - 1
    star = ancestor_bitmask([-1] + [0] * 63)
    assert star[63].item() == 1 - (1 << 63)  # root bit + sign bit
    assert ancestor_bitmask(cape_parents(5)).tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10011]


@pytest.mark.parametrize(
    "parents", [[], [0], [-1, 1], [-1, 0, 3, 1], [-1, -1], list(range(-1, 64))],
)
def test_ancestor_bitmask_rejects_bad_trees(parents):
    with pytest.raises(ValueError):
        ancestor_bitmask(parents)


@pytest.mark.parametrize("tree", ["cape32", "random64", None])
def test_tree_mask_to_bool(tree):
    cache_len = 3
    parents = None if tree is None else TREES[tree]
    T = 20 if parents is None else len(parents)
    mask = None if parents is None else ancestor_bitmask(parents)
    got = tree_mask_to_bool(mask, cache_len, T)
    expected = torch.zeros(T, cache_len + T, dtype=torch.bool)
    expected[:, :cache_len] = True
    for i in range(T):
        node = i
        while node != -1:
            expected[i, cache_len + node] = True
            node = -1 if parents is None else parents[node]
        if parents is None:
            expected[i, cache_len: cache_len + i + 1] = True
    assert got.dtype == torch.bool
    assert torch.equal(got, expected)


def test_validation_errors(device):
    q, k, v = make_inputs(65, 1, 1, 64, 0, device)
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention(q, k, v, 0, torch.zeros(65, dtype=torch.int64, device=device))
    q, k, v = make_inputs(4, 2, 2, 64, 10, device)
    mask = ancestor_bitmask(chain_parents(4)).to(device)
    with pytest.raises(TypeError):
        tree_attention(q.half(), k, v, 10, mask)
    with pytest.raises(ValueError, match="rows"):
        tree_attention(q, k, v, 100, mask)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :3], k, v, 10, mask)
    with pytest.raises(ValueError, match="int64"):
        tree_attention(q, k, v, 10, mask.int())
    q, k, v = make_inputs(4, 1, 1, 48, 0, device)
    with pytest.raises(ValueError, match="power of two"):
        tree_attention(q, k, v, 0, mask)


def test_empty_query(device):
    q, k, v = make_inputs(0, 2, 2, 64, 5, device)
    assert tree_attention(q, k, v, 5, None).shape == (0, 4, 64)
