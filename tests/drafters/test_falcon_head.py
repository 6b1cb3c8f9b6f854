"""Falcon's head: block ids and the relaxed causal mask, no row seeing its own label, and the drafting attention
through the CPU kernel against the masked softmax."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.ops import LlamaArgs
from drafters.falcon.model import FalconConfig, FalconModel, _cache_attention, block_ids, relaxed_mask

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/drafters/conftest.py


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_attention_through_the_cpu_kernel_is_the_masked_softmax(dtype):
    """Drafting reads its cache through specserve_kernels.cpu.attend where it loads: every row's visible keys (all of them, or
    the verified prefix plus its ancestors), as SDPA computes them; None where a row's own keys do not fit its bits."""
    from specserve_kernels import cpu as cpu_kernels

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
