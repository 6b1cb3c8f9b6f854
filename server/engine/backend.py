"""Where the engine picks its attention and KV-compaction implementations.

CUDA runs the Triton kernels (one launch per layer for all rows of a multi-sequence step). A 16-bit CPU target
runs the C++ row-invariant attention (``make_row_kernel_attention``) for every row after a cached prefix where it
loads, and SDPA for a prompt's first chunk. Elsewhere CPU runs PyTorch's SDPA (masks built once per forward and
shared by every layer), batched matmuls for decode steps (below), and the plain-torch compaction reference. Kernel
choice lives here, at the call site, so the model code stays plain eager PyTorch.

CPU decode steps and draft rows ("decode form"). SDPA's CPU kernel is not row-invariant: a query row's low bits
depend on how many rows share the call, on the key count and on the mask. In bfloat16 one last-bit difference is
enough to flip a greedy token a few steps later: ngram speculation reproduced plain decoding on only 2 of 8 bench
prompts. Keys padded to a multiple of KEY_BLOCK with the padding masked, and 16-bit batched matmuls in which an
output row's bits do not depend on how many rows share the call (``_rowwise_attention``: scores and outputs as bmm
over the KV heads, softmax in float32), give a row the same bits whatever else is in the call (measured: bitwise,
cache lengths 5..1980, 1..64 rows). So a decode step makes that call, and verification in 16-bit dtypes runs the
leading chain rows of a draft (row i sees exactly new rows 0..i, as a decode step at that position would) through it
together. A tree branch row's ancestors sit at other cache rows than a decode step would read them; gathered back
into decode-step order (cached keys, then its ancestors, then itself) they give that row the decode step's bits too.
Every branch of a tree is one batch entry of the same call (``_batched_rowwise_attention``; one call per padded key
count, not one per branch), so every tree shape is verified bit-exactly. The bfloat16
linear layers are row-invariant too (core.ops.linear runs kernels measured row-invariant), so those rows reproduce plain decoding
bit for bit and greedy speculation emits the same tokens as plain decoding. An earlier version put each row in its
own SDPA batch entry, which is row-invariant too but costs a decode row's attention per draft row. Float32 decode
steps keep SDPA over the padded keys and float32 verification keeps one multi-row call: its differences are ~1e-7
and its matmuls are not row-invariant anyway. Trade-off: bfloat16 decoding is no longer bit-identical to
transformers' (whose decode call has unpadded keys); float32 still is.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from specserve_kernels import cpu as cpu_kernels
from specserve_kernels.kv_compact import kv_compact, kv_compact_ref
from specserve_kernels.tree_attention import tree_attention, tree_attention_batched
from specserve_kernels.tree_mask import tree_mask_to_bool

KEY_BLOCK = 64  # decode-form calls pad the keys to a multiple of this, so a decode step and a draft row share shapes
# At most this many leading chain rows in decode form (all of them: a tree has at most 64 rows). With the bmm form
# (_rowwise_attention) a chain's rows cost about one decode row's attention together; with one SDPA call per row
# they cost one each, and a 16-row verify at 300 cached tokens took 134 ms instead of 50 (2-core EPYC, bf16).
EXACT_MAX_ROWS = 64


def make_attention(device: torch.device, cache_len: int, num_rows: int, tree_mask: torch.Tensor | None,
                   dtype: torch.dtype = torch.float32, max_len: int | None = None, window: int | None = None,
                   positions: torch.Tensor | None = None):
    """An attention function for one forward of ``num_rows`` new rows after ``cache_len`` cached ones.

    ``dtype`` is the model's, ``max_len`` the KV slot's capacity; without ``max_len`` every CPU forward makes one
    plain SDPA call. ``window``: a sliding-window layer's (``windowed`` says whether it hides anything here): a row
    at position p reads keys at positions > p - window only (cache row n of the prefix is at position n, a tree row
    at cache_len + its depth; ``positions`` [num_rows] where the caller has them, else derived from the tree).
    """
    T, end = num_rows, cache_len + num_rows
    if not windowed(window, cache_len, T):
        window = None
    if device.type == "cuda":
        if window is None:
            return tree_attention
        pos = positions if positions is not None else row_positions(tree_mask, cache_len, T, device)
        return functools.partial(tree_attention, window=window, positions=pos)

    if cache_len == 0 and tree_mask is None:  # prefill: the prompt's rows are causal
        if window is None:
            return _attention([(slice(0, T), end, None, SDPA)], T, causal=True)
        mask = tree_mask_to_bool(None, 0, T).to(device) & _window_band(row_positions(None, 0, T, device), 0, window)
        return _attention([(slice(0, T), end, mask, SDPA)], T)
    if max_len is None:
        mask = None if T == 1 and window is None else tree_mask_to_bool(tree_mask, cache_len, T).to(device)
        if window is not None:  # [T, end]
            mask = mask & _window_band(row_positions(tree_mask, cache_len, T, device), cache_len, window)
        return _attention([(slice(0, T), end, mask, SDPA)], T)

    visible = torch.ones(1, end, dtype=torch.bool, device=device) if T == 1 else \
        tree_mask_to_bool(tree_mask, cache_len, T).to(device)  # [T, end]
    if T == 1:
        n_exact = 1
    elif dtype == torch.float32:
        n_exact = 0
    else:  # leading rows that see exactly new rows 0..i: decode steps at positions cache_len + i
        chain = visible[:, cache_len:] == torch.ones(T, T, dtype=torch.bool, device=device).tril()  # [T, T]
        n_exact = min(int(chain.all(dim=1).cumprod(0).sum()), EXACT_MAX_ROWS)

    calls = []  # (rows, keys, mask, form): see _attention
    if n_exact:  # the leading chain reads the keys in place; each further branch reads its path gathered
        paths = [(list(range(n_exact)), list(range(n_exact)))] + _branch_paths(visible[:, cache_len:], n_exact)
        _decode_form_calls(calls, paths, cache_len, max_len, device, window)
    if n_exact < T and dtype == torch.float32:  # float32 trees: the rows past the chain in one multi-row call
        if window is not None:
            visible = visible & _window_band(row_positions(tree_mask, cache_len, T, device), cache_len, window)
        mask = torch.zeros(T - n_exact, end, dtype=dtype, device=device).masked_fill_(
            ~visible[n_exact:], float("-inf"))  # [rows, end]
        calls.append((slice(n_exact, T), end, mask, SDPA))
    return _attention(calls, T)


def windowed(window: int | None, cache_len: int, num_rows: int) -> bool:
    """Whether a sliding window of ``window`` hides any key from ``num_rows`` new rows after ``cache_len`` cached
    ones (their positions are below cache_len + num_rows, so a window at least that long hides nothing)."""
    return window is not None and cache_len + num_rows > window


def row_positions(tree_mask: torch.Tensor | None, cache_len: int, T: int, device: torch.device) -> torch.Tensor:
    """The positions of ``T`` new rows after ``cache_len`` cached ones: causal rows follow each other, a tree row
    sits at cache_len + its depth (its ancestor bits less one)."""
    if tree_mask is None:
        return torch.arange(cache_len, cache_len + T, device=device)
    return cache_len + tree_mask_to_bool(tree_mask, 0, T).to(device).sum(1) - 1


def _window_band(positions: torch.Tensor, cache_len: int, window: int) -> torch.Tensor:
    """Bool [T, cache_len + T]: key within the window of each row (prefix row n at position n, new rows at
    ``positions``)."""
    keys = torch.cat([torch.arange(cache_len, device=positions.device), positions])
    return keys[None, :] > positions[:, None] - window


def _branch_paths(new_visible: torch.Tensor, n_exact: int) -> list[tuple[list[int], list[int]]]:
    """Rows n_exact.. of a tree grouped by root-to-leaf path -> [(rows, path)].

    new_visible [T, T]: row i sees new row j. A path lists a leaf's ancestors (itself included) by row; its rows are
    the ones no earlier path took.
    """
    T = new_visible.shape[0]
    if n_exact >= T:
        return []
    is_leaf = new_visible[n_exact:].sum(0) == 1  # nobody else sees it
    done, out = set(range(n_exact)), []
    for leaf in (r for r in range(n_exact, T) if is_leaf[r]):
        path = new_visible[leaf].nonzero().flatten().tolist()  # ascending: parents precede children
        rows = [r for r in path if r not in done]
        done.update(rows)
        out.append((rows, path))
    return out


def _decode_form_calls(calls: list, paths: list[tuple[list[int], list[int]]], cache_len: int, max_len: int,
                       device: torch.device, window: int | None = None) -> None:
    """Decode-form calls for the ``rows`` of each root-to-leaf ``path`` (new-row indices; the first path is the
    leading chain, in place): the row at depth d reads the cached keys, then the path's first d + 1 new rows, at
    the key positions and padding a decode step at position cache_len + d reads.

    Rows are grouped by their padded key count e. A group of the leading chain alone reads the keys in place
    (IN_PLACE); otherwise every path of the group is one batch entry of a single call (BATCHED): its keys gathered
    into decode-step order, its rows padded to the group's longest (the padding rows repeat its last row and are
    dropped), so a tree costs one call per key count rather than one per branch. In decode-step order a key's index
    is its position, so a ``window`` hides the keys below cache_len + depth + 1 - window, as in that decode step, and
    the row reads keys from ``window_start`` of its position only: a key range that depends on the position alone, so
    a draft row still reads what the decode step at its position reads.
    """
    by_e: dict[tuple[int, int], list[tuple[list[int], list[int], list[int]]]] = {}  # (lo, e) -> [(rows, depths, path)]
    for rows, path in paths:
        depth = {r: d for d, r in enumerate(path)}
        mine: dict[tuple[int, int], list[int]] = {}
        for r in rows:
            seen = cache_len + depth[r] + 1
            mine.setdefault((window_start(seen - 1, window),
                             min(-(-seen // KEY_BLOCK) * KEY_BLOCK, max_len)), []).append(r)
        for span, group in mine.items():
            by_e.setdefault(span, []).append((group, [depth[r] for r in group], path))
    for (lo, e), entries in by_e.items():
        n = max(len(rows) for rows, _, _ in entries)
        mask = torch.full((len(entries), n, e - lo), float("-inf"), dtype=torch.float32, device=device)  # [B, n, e-lo]
        for b, (rows, depths, _) in enumerate(entries):
            for i in range(n):
                seen = cache_len + depths[min(i, len(rows) - 1)] + 1
                mask[b, i, (max(0, seen - window) if window else 0) - lo:seen - lo] = 0.0
        rows, _, path = entries[0]
        if len(entries) == 1 and path == list(range(len(path))):  # in place: the leading chain
            calls.append((slice(rows[0], rows[-1] + 1), slice(lo, e), mask[0], IN_PLACE))
            continue
        row_index = torch.tensor([rows + rows[-1:] * (n - len(rows)) for rows, _, _ in entries], device=device)
        keys = []
        for _, _, path in entries:
            ks = list(range(cache_len)) + [cache_len + p for p in path]
            keys.append((ks + list(range(len(ks), e)))[lo:e])  # padding: any rows of the slot, masked out
        real = torch.tensor([b * n + i for b, (rows, _, _) in enumerate(entries) for i in range(len(rows))],
                            device=device)
        dest = torch.tensor([r for rows, _, _ in entries for r in rows], device=device)
        calls.append(((row_index, real, dest), torch.tensor(keys, device=device), mask, BATCHED))


def window_start(position: int, window: int | None) -> int:
    """The first key a decode-form row at ``position`` reads: its window's first visible key rounded down to a key
    block (0 without a window), so every row at that position reads the same key range."""
    if not window:
        return 0
    return max(0, position + 1 - window) // KEY_BLOCK * KEY_BLOCK


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


def _batched_rowwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``_rowwise_attention`` for B paths in one call: q [B, n, H, D], k/v [B, H_kv, e, D] (each path's own keys),
    mask [B, n, e] -> [B, n, H, D]. Each (path, KV head) is one entry of the batched matmuls, a row's bits the ones
    it would get alone."""
    B, n, H, D = q.shape
    Hkv, e = k.shape[1], k.shape[2]
    g = H // Hkv
    qg = q.view(B, n, Hkv, g, D).permute(0, 2, 1, 3, 4).reshape(B * Hkv, n * g, D)
    s = torch.bmm(qg, k.view(B * Hkv, e, D).transpose(1, 2)).float().mul_(1.0 / math.sqrt(D)).view(B, Hkv, n, g, e)
    p = torch.softmax(s.add_(mask[:, None, :, None, :]), dim=-1).to(q.dtype).view(B * Hkv, n * g, e)
    o = torch.bmm(p, v.view(B * Hkv, e, D)).view(B, Hkv, n, g, D)
    return o.permute(0, 2, 1, 3, 4).reshape(B, n, H, D)


SDPA, IN_PLACE, BATCHED = "sdpa", "in place", "batched"  # the forms of an attention call (_attention)


def _attention(calls: list, T: int, causal: bool = False):
    """The attention of one forward from its calls (rows, keys, mask, form):

    - SDPA: rows (a slice) over keys 0..keys-1 in place, additive or bool ``mask`` [rows, keys] (or None);
    - IN_PLACE: decode-form rows (a slice) over the keys of the slice ``keys`` in place, additive fp32 ``mask``
      [rows, len(keys)]
      (16-bit dtypes: ``_rowwise_attention``; float32: SDPA per row, a decode step's call);
    - BATCHED: 16-bit decode-form paths, rows = (row index [B, n], real entries [m] of the flattened [B * n],
      their rows of the output [m]), keys = key index [B, e] into the slot, mask [B, n, e].
    """
    flat_keys: dict = {}  # BATCHED: the [B, e] key index as flat rows of the [H_kv * S, D] cache, per call

    def attention(q, k_cache, v_cache, cache_len_, tree_mask_):
        # q: [T, H, D]; k_cache, v_cache: [H_kv, S, D] -> [T, H, D]
        outs = []
        for i, (rows, keys, mask, form) in enumerate(calls):
            if form == BATCHED:
                row_index, real, _ = rows
                Hkv, S, D = k_cache.shape
                idx = flat_keys.get(i)
                if idx is None:  # (path, head, key) order: each path's heads' keys contiguous
                    heads = torch.arange(Hkv, device=keys.device)[None, :, None] * S
                    idx = flat_keys[i] = (heads + keys[:, None, :]).reshape(-1)
                B, e = keys.shape
                kc = k_cache.reshape(Hkv * S, D).index_select(0, idx).view(B, Hkv, e, D)
                vc = v_cache.reshape(Hkv * S, D).index_select(0, idx).view(B, Hkv, e, D)
                qr = q.index_select(0, row_index.reshape(-1)).view(*row_index.shape, *q.shape[1:])
                o = _batched_rowwise_attention(qr, kc, vc, mask)
                outs.append(o.view(-1, *q.shape[1:]).index_select(0, real))
                continue
            qr = q if len(calls) == 1 else q[rows]
            span = keys if isinstance(keys, slice) else slice(0, keys)
            kc, vc = k_cache[:, span], v_cache[:, span]
            if form == IN_PLACE and q.dtype != torch.float32:
                outs.append(_rowwise_attention(qr, kc, vc, mask))
                continue
            k, v = kc[None], vc[None]  # [1, H_kv, e, D]
            if form == IN_PLACE:  # float32 decode step: queries [1, H, 1, D], mask [1, 1, 1, e]
                out = F.scaled_dot_product_attention(qr.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                                     enable_gqa=True)
                outs.append(out.squeeze(2))
            else:
                out = F.scaled_dot_product_attention(qr.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                                     is_causal=causal, enable_gqa=True)  # [1, H, rows, D]
                outs.append(out[0].transpose(0, 1))
        if len(outs) == 1 and calls[0][3] != BATCHED:
            return outs[0]
        out = q.new_empty(q.shape)
        for (rows, _, _, form), o in zip(calls, outs):
            out[rows[2] if form == BATCHED else rows] = o
        return out

    return attention


def make_batched_kernel_attention(slots: torch.Tensor, cache_lens: torch.Tensor, row_starts: torch.Tensor,
                                  tree_mask: torch.Tensor, causal: torch.Tensor, window: int | None = None,
                                  positions: torch.Tensor | None = None):
    """Attention for every row of a multi-sequence step in one Triton launch per layer (CUDA): q [T, H, D] and one
    layer of the pool k/v [num_slots, H_kv, S, D] -> [T, H, D]; the per-sequence layout is built once per step.
    ``window``, ``positions`` [T]: a sliding-window layer's, and each row's position."""
    def attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor:
        return tree_attention_batched(q, k_layer, v_layer, slots, cache_lens, row_starts, tree_mask, causal,
                                      window=window, positions=positions)

    return attention


def make_row_kernel_attention(slot: torch.Tensor, cached: torch.Tensor, base: torch.Tensor, bits: torch.Tensor):
    """Attention for rows of any sequences in one C++ call per layer (``specserve_kernels.cpu.attend``; CPU, 16-bit dtypes):
    q [n, H, D] and one layer of the pool k/v [num_slots, H_kv, S, D] -> [n, H, D]. Row t reads slot ``slot[t]``'s
    rows 0 .. cached[t] - 1, then rows base[t] + j for each bit j of bits[t] (its ancestors in a draft tree). A row's
    bits depend on its query and those keys only, so a draft row equals the decode step at its position whatever
    shares the call, with no padding or gathers; its arithmetic is float32 (the scores of the batched-matmul form
    are rounded to 16 bits)."""
    def attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.attend(q, k_layer, v_layer, slot, cached, base, bits)

    return attention


def make_decode_group_attention(slots: list[int], cache_lens: list[int], dtype: torch.dtype, max_len: int,
                                device: torch.device, window: int | None = None):
    """Attention for B decode steps of different sequences in one call (CPU): q [B, H, D] and one layer of the pool
    k/v [num_slots, H_kv, S, D] -> [B, H, D]. Row b reads slot ``slots[b]``'s keys 0..cache_lens[b] (its own new key
    included, already written), padded to the decode form's key count and masked as a lone decode step would be
    (with a sliding ``window``: keys 0..cache_lens[b] - window hidden too, and the keys before the decode form's
    ``window_start`` not read).

    Sequences with the same padded key count share one batched matmul (16-bit: ``_rowwise_attention``'s products
    per sequence, so a row keeps its bits whatever else is in the batch) or one SDPA call (float32, batch over
    sequences); their keys are gathered from the pool once per layer. Per-sequence calls cost a few dozen small ops
    each per layer: at 64 sequences that was more than the matmuls of the whole step.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for b, n in enumerate(cache_lens):
        groups.setdefault((window_start(n, window), min(-(-(n + 1) // KEY_BLOCK) * KEY_BLOCK, max_len)), []).append(b)
    plan = []
    for (lo, e), members in groups.items():
        mask = torch.full((len(members), e - lo), float("-inf"), dtype=torch.float32, device=device)  # [b, e - lo]
        for i, b in enumerate(members):
            seen = cache_lens[b] + 1
            mask[i, (max(0, seen - window) if window else 0) - lo:seen - lo] = 0.0
        rows = torch.tensor(members, device=device)
        plan.append((rows, torch.tensor([slots[b] for b in members], device=device), slice(lo, e),
                     mask if dtype != torch.float32 else mask[:, None, None, :], []))

    def attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor) -> torch.Tensor:
        B, H, D = q.shape
        Hkv = k_layer.shape[1]
        g = H // Hkv
        out = q.new_empty(q.shape) if len(plan) > 1 else None
        for rows, slot_ids, span, mask, buffers in plan:
            qr = q if out is None else q[rows]
            if not buffers:  # the group's gather buffers, reused by every layer of the step (a fresh gather per
                # layer faulted in new pages each time: at 256 sequences most of the step went to the kernel)
                buffers += [k_layer.new_empty(len(slot_ids), Hkv, span.stop - span.start, D) for _ in range(2)]
            k = torch.index_select(k_layer[:, :, span], 0, slot_ids, out=buffers[0])  # [b, H_kv, e - lo, D]
            v = torch.index_select(v_layer[:, :, span], 0, slot_ids, out=buffers[1])
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
