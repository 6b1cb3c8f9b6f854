"""Where the engine picks its attention and KV-compaction implementations.

CUDA runs the Triton kernels (one launch per layer for all rows of a multi-sequence step); CPU runs PyTorch's SDPA
(masks built once per forward and shared by every layer), batched matmuls for decode steps, and the plain-torch
compaction reference. Kernel choice lives here, at the call site, so the model code stays plain
eager PyTorch.

CPU decode steps and draft rows ("decode form"). SDPA's CPU kernel is not row-invariant: a query row's low bits
depend on how many rows share the call, on the key count and on the mask. In bfloat16 one last-bit difference is
enough to flip a greedy token a few steps later: ngram speculation reproduced plain decoding on only 2 of 8 bench
prompts. Keys padded to a multiple of KEY_BLOCK with the padding masked, and 16-bit batched matmuls in which an
output row's bits do not depend on how many rows share the call (``_rowwise_attention``: scores and outputs as bmm
over the KV heads, softmax in float32), give a row the same bits whatever else is in the call (measured: bitwise,
cache lengths 5..1980, 1..64 rows). So a decode step makes that call, and verification in 16-bit dtypes runs the
leading chain rows of a draft (row i sees exactly new rows 0..i, as a decode step at that position would) through it
together. A tree branch row's ancestors sit at other cache rows than a decode step would read them; gathered back
into decode-step order (cached keys, then its ancestors, then itself) they give that row the decode step's bits too,
for trees with up to EXACT_MAX_BRANCHES leaves past the leading chain (a cascade's Max-Gram branch). The bfloat16
linear layers are row-invariant too (core.ops.linear runs kernels measured row-invariant), so those rows reproduce plain decoding
bit for bit and greedy speculation emits the same tokens as plain decoding. An earlier version put each row in its
own SDPA batch entry, which is row-invariant too but costs a decode row's attention per draft row. Float32 decode
steps keep SDPA over the padded keys and float32 verification keeps one multi-row call: its differences are ~1e-7
and its matmuls are not row-invariant anyway. Trade-off: bfloat16 decoding is no longer bit-identical to
transformers' (whose decode call has unpadded keys); float32 still is.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.kv_compact import kv_compact, kv_compact_ref
from kernels.tree_attention import tree_attention, tree_attention_batched, tree_mask_to_bool

KEY_BLOCK = 64  # decode-form calls pad the keys to a multiple of this, so a decode step and a draft row share shapes
# At most this many leading chain rows in decode form (all of them: a tree has at most 64 rows). With the bmm form
# (_rowwise_attention) a chain's rows cost about one decode row's attention together; with one SDPA call per row
# they cost one each, and a 16-row verify at 300 cached tokens took 134 ms instead of 50 (2-core EPYC, bf16).
EXACT_MAX_ROWS = 64
# Tree branches in decode form while a tree has at most this many leaves past its leading chain (a cascade's Max-Gram
# branch: one per review round). Each leaf costs a key gather and a call per layer: glide-cape's trees (up to 7 one-token
# leaves) verified that way ran 0.92x plain decoding instead of 1.14x-1.23x, so bigger trees put their branch rows in
# one multi-row call (close, not bitwise, in 16-bit dtypes).
EXACT_MAX_BRANCHES = 2


def make_attention(device: torch.device, cache_len: int, num_rows: int, tree_mask: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32, max_len: int | None = None):
    """An attention function for one forward of ``num_rows`` new rows after ``cache_len`` cached ones.

    ``dtype`` is the model's, ``max_len`` the KV slot's capacity; without ``max_len`` every CPU forward makes one
    plain SDPA call.
    """
    if device.type == "cuda":
        return tree_attention

    T, end = num_rows, cache_len + num_rows
    if cache_len == 0 and tree_mask is None:  # prefill: the prompt's rows are causal
        return _attention([(slice(0, T), end, None, False)], T, causal=True)
    if max_len is None:
        mask = None if T == 1 else tree_mask_to_bool(tree_mask, cache_len, T).to(device)  # [T, end]
        return _attention([(slice(0, T), end, mask, False)], T)

    visible = torch.ones(1, end, dtype=torch.bool, device=device) if T == 1 else \
        tree_mask_to_bool(tree_mask, cache_len, T).to(device)  # [T, end]
    if T == 1:
        n_exact = 1
    elif dtype == torch.float32:
        n_exact = 0
    else:  # leading rows that see exactly new rows 0..i: decode steps at positions cache_len + i
        chain = visible[:, cache_len:] == torch.ones(T, T, dtype=torch.bool, device=device).tril()  # [T, T]
        n_exact = min(int(chain.all(dim=1).cumprod(0).sum()), EXACT_MAX_ROWS)

    calls = []  # (rows: slice or index tensor, keys: count or index tensor, additive mask, decode form)
    if n_exact:  # the leading chain: rows 0..n_exact-1 read the keys in place
        _decode_form_calls(calls, list(range(n_exact)), list(range(n_exact)), cache_len, max_len, dtype, device)
    paths = _branch_paths(visible[:, cache_len:], n_exact) if n_exact and dtype != torch.float32 else None
    for rows, path in paths or ():  # tree branches: each row reads its ancestors as a decode step would
        _decode_form_calls(calls, rows, path, cache_len, max_len, dtype, device)
    if n_exact < T and paths is None:  # the other rows (big trees, float32): one multi-row call
        mask = torch.zeros(T - n_exact, end, dtype=dtype, device=device).masked_fill_(
            ~visible[n_exact:], float("-inf"))  # [rows, end]
        calls.append((slice(n_exact, T), end, mask, False))
    return _attention(calls, T)


def _branch_paths(new_visible: torch.Tensor, n_exact: int) -> list[tuple[list[int], list[int]]] | None:
    """Rows n_exact.. of a tree grouped by root-to-leaf path -> [(rows, path)], or None past EXACT_MAX_BRANCHES.

    new_visible [T, T]: row i sees new row j. A path lists a leaf's ancestors (itself included) by row; its rows are
    the ones no earlier path took.
    """
    T = new_visible.shape[0]
    if n_exact >= T:
        return []
    is_leaf = new_visible[n_exact:].sum(0) == 1  # nobody else sees it
    leaves = [r for r in range(n_exact, T) if is_leaf[r]]
    if len(leaves) > EXACT_MAX_BRANCHES:
        return None
    done, out = set(range(n_exact)), []
    for leaf in leaves:
        path = new_visible[leaf].nonzero().flatten().tolist()  # ascending: parents precede children
        rows = [r for r in path if r not in done]
        done.update(rows)
        out.append((rows, path))
    return out


def _decode_form_calls(calls: list, rows: list[int], path: list[int], cache_len: int, max_len: int,
                       dtype: torch.dtype, device: torch.device) -> None:
    """Decode-form calls for ``rows`` on the root-to-leaf ``path`` (new-row indices): the row at depth d reads the
    cached keys, then the path's first d + 1 new rows, at the key positions and padding a decode step at position
    cache_len + d reads (one call per padded key count; the path's keys are gathered when they are not in place)."""
    depth = {r: d for d, r in enumerate(path)}
    in_place = path == list(range(len(path)))
    mdtype = torch.float32 if dtype != torch.float32 else dtype  # bmm-form rows add the mask to fp32 scores
    by_e: dict[int, list[int]] = {}
    for r in rows:
        by_e.setdefault(min(-(-(cache_len + depth[r] + 1) // KEY_BLOCK) * KEY_BLOCK, max_len), []).append(r)
    for e, group in by_e.items():
        mask = torch.full((len(group), e), float("-inf"), dtype=mdtype, device=device)  # [rows, e]
        for i, r in enumerate(group):
            mask[i, :cache_len + depth[r] + 1] = 0.0
        if in_place:
            calls.append((slice(group[0], group[-1] + 1), e, mask, True))
            continue
        keys = list(range(cache_len)) + [cache_len + p for p in path]
        keys = (keys + list(range(len(keys), e)))[:e]  # padding: any rows of the slot, masked out
        calls.append((torch.tensor(group, device=device), torch.tensor(keys, device=device), mask, True))


def _rowwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Decode-form attention in 16-bit dtypes: q [n, H, D], k/v [H_kv, e, D], mask [n, e] additive fp32 -> [n, H, D].

    Scores and outputs are batched matmuls over the KV heads (the query rows of a head group stacked), the softmax
    runs in float32 (the eager Hugging Face recipe). On CPUs whose 16-bit GEMM computes an output row the same way
    whatever the number of rows, a row's bits depend only on its own query, keys and mask, so a draft row equals
    the decode step at its position. Per step this costs about one decode row's SDPA call in total, where one SDPA
    call per row (the query rows as batch entries) cost a decode row's attention each: ~8x less for an 8-row chain.
    """
    n, H, D = q.shape
    Hkv, e = k.shape[0], k.shape[1]
    g = H // Hkv
    qg = q.view(n, Hkv, g, D).permute(1, 0, 2, 3).reshape(Hkv, n * g, D)  # rows of one kv head together
    s = torch.bmm(qg, k.transpose(1, 2)).float().mul_(1.0 / math.sqrt(D)).view(Hkv, n, g, e)
    p = torch.softmax(s.add_(mask[None, :, None, :]), dim=-1).to(q.dtype).view(Hkv, n * g, e)
    return torch.bmm(p, v).view(Hkv, n, g, D).permute(1, 0, 2, 3).reshape(n, H, D)


def _attention(calls: list, T: int, causal: bool = False):
    def attention(q, k_cache, v_cache, cache_len_, tree_mask_):
        # q: [T, H, D]; k_cache, v_cache: [H_kv, S, D] -> [T, H, D]
        outs = []
        for rows, keys, mask, one_row in calls:
            qr = q if len(calls) == 1 else q[rows]
            if isinstance(keys, int):
                kc, vc = k_cache[:, :keys], v_cache[:, :keys]
            else:  # a tree branch's keys, gathered into decode-step order
                kc, vc = k_cache.index_select(1, keys), v_cache.index_select(1, keys)
            if one_row and q.dtype != torch.float32:
                outs.append(_rowwise_attention(qr, kc, vc, mask))
                continue
            k, v = kc[None], vc[None]  # [1, H_kv, e, D]
            if one_row:  # float32 decode step: queries [1, H, 1, D], mask [1, 1, 1, e]
                out = F.scaled_dot_product_attention(qr.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                                     enable_gqa=True)
                outs.append(out.squeeze(2))
            else:
                out = F.scaled_dot_product_attention(qr.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                                     is_causal=causal, enable_gqa=True)  # [1, H, rows, D]
                outs.append(out[0].transpose(0, 1))
        if len(outs) == 1:
            return outs[0]
        out = q.new_empty(q.shape)
        for (rows, *_), o in zip(calls, outs):
            out[rows] = o
        return out

    return attention


def make_batched_kernel_attention(slots: torch.Tensor, cache_lens: torch.Tensor, row_starts: torch.Tensor,
                                  tree_mask: torch.Tensor, causal: torch.Tensor):
    """Attention for every row of a multi-sequence step in one Triton launch per layer (CUDA): q [T, H, D] and one
    layer of the pool k/v [num_slots, H_kv, S, D] -> [T, H, D]; the per-sequence layout is built once per step."""
    def attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor:
        return tree_attention_batched(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal)

    return attention


def make_decode_group_attention(slots: list[int], cache_lens: list[int], dtype: torch.dtype, max_len: int,
                                device: torch.device):
    """Attention for B decode steps of different sequences in one call (CPU): q [B, H, D] and one layer of the pool
    k/v [num_slots, H_kv, S, D] -> [B, H, D]. Row b reads slot ``slots[b]``'s keys 0..cache_lens[b] (its own new key
    included, already written), padded to the decode form's key count and masked as a lone decode step would be.

    Sequences with the same padded key count share one batched matmul (16-bit: ``_rowwise_attention``'s products
    per sequence, so a row keeps its bits whatever else is in the batch) or one SDPA call (float32, batch over
    sequences); their keys are gathered from the pool once per layer. Per-sequence calls cost a few dozen small ops
    each per layer: at 64 sequences that was more than the matmuls of the whole step.
    """
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(cache_lens):
        groups.setdefault(min(-(-(n + 1) // KEY_BLOCK) * KEY_BLOCK, max_len), []).append(b)
    plan = []
    for e, members in groups.items():
        mask = torch.full((len(members), e), float("-inf"), dtype=torch.float32, device=device)  # [b, e]
        for i, b in enumerate(members):
            mask[i, :cache_lens[b] + 1] = 0.0
        rows = torch.tensor(members, device=device)
        plan.append((rows, torch.tensor([slots[b] for b in members], device=device), e,
                     mask if dtype != torch.float32 else mask[:, None, None, :], []))

    def attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor:
        B, H, D = q.shape
        Hkv = k_layer.shape[1]
        g = H // Hkv
        out = q.new_empty(q.shape) if len(plan) > 1 else None
        for rows, slot_ids, e, mask, buffers in plan:
            qr = q if out is None else q[rows]
            if not buffers:  # the group's gather buffers, reused by every layer of the step (a fresh gather per
                # layer faulted in new pages each time: at 256 sequences most of the step went to the kernel)
                buffers += [k_layer.new_empty(len(slot_ids), Hkv, e, D) for _ in range(2)]
            k = torch.index_select(k_layer[:, :, :e], 0, slot_ids, out=buffers[0])  # [b, H_kv, e, D]
            v = torch.index_select(v_layer[:, :, :e], 0, slot_ids, out=buffers[1])
            if dtype == torch.float32:
                o = F.scaled_dot_product_attention(qr.unsqueeze(2), k, v, attn_mask=mask,
                                                   enable_gqa=True).squeeze(2)  # [b, H, D]
            else:
                s = torch.matmul(qr.view(-1, Hkv, g, D), k.transpose(2, 3)).float().mul_(1.0 / math.sqrt(D))
                p = torch.softmax(s.add_(mask[:, None, None, :]), dim=-1).to(q.dtype)  # [b, H_kv, g, e]
                o = torch.matmul(p, v).view(-1, H, D)
            if out is None:
                return o
            out[rows] = o
        return out

    return attention


def compact_kv(k: torch.Tensor, v: torch.Tensor, slot: int, src_rows: torch.Tensor, dst_start: int) -> None:
    """Move accepted rows of every layer into place (k, v: [L, slots, H_kv, S, D])."""
    (kv_compact if k.device.type == "cuda" else kv_compact_ref)(k, v, slot, src_rows, dst_start)
