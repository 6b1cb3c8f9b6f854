"""Attention metadata for one target forward over the new rows of several sequences: which rows attend how (per
sequence SDPA segments, or one row group for the batched Triton kernel on CUDA, the C++ row-invariant attention on a
CPU, or one decode group), and where their K/V go in the KV pool. Built once per step for all layers."""
from __future__ import annotations

import torch

from server.engine.backend import (make_attention, make_batched_kernel_attention, make_decode_group_attention,
                                   make_row_kernel_attention, windowed)
from server.engine.kv_cache import KVCachePool
from server.engine.model import CpuRows, RowGroup, Segment


class RowLayout:
    """For an engine's pool, device and dtype: the metadata of a forward's ``parts`` ([(seq, tokens, positions,
    tree_mask)], back to back)."""

    def __init__(self, pool: KVCachePool, device: torch.device, dtype: torch.dtype, max_seq_len: int,
                 row_kernel: bool, window: int | None = None):
        self.pool, self.device, self.dtype, self.max_seq_len = pool, device, dtype, max_seq_len
        self.row_kernel = row_kernel  # a 16-bit CPU target where the C++ kernels load
        self.window = window  # the model's sliding-window layers' (their rows get a second attention where it hides keys)
        if row_kernel and window is not None:
            raise ValueError("the C++ row attention knows no sliding window")

    def _long(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def attention(self, parts) -> tuple[list[Segment], RowGroup | None]:
        """(segments: sequences attending on their own, group: rows attending in one call)."""
        if self.device.type == "cuda" and len(parts) > 1:  # every row of the step: one kernel launch per layer
            segments, group = [], self.kernel_group(parts)
        elif self.row_kernel:  # a prompt's first chunk: causal SDPA; every other row: the C++ attention
            segments, rest, start = [], [], 0
            for part in parts:
                seq, tokens, _, tree_mask = part
                n = len(tokens)
                if seq.cache_len == 0 and tree_mask is None and n > 1:
                    segments.append(Segment(start, start + n, self.pool.k[:, seq.slot], self.pool.v[:, seq.slot], 0,
                                            None, make_attention(self.device, 0, n, None, self.dtype)))
                else:
                    rest.append((start, part))
                start += n
            group = self.row_kernel_group(rest, start) if rest else None
        else:  # CPU: decode steps of several sequences attend in one call (per-sequence calls cost a few dozen
            # small ops per layer each); trees and prompt chunks attend per sequence
            batch_decodes = sum(len(p[1]) == 1 for p in parts) > 1
            segments, decodes, start = [], [], 0
            for seq, tokens, positions, tree_mask in parts:
                n = len(tokens)
                if batch_decodes and n == 1:
                    decodes.append((start, seq))
                else:
                    attn = make_attention(self.device, seq.cache_len, n, tree_mask, self.dtype, self.max_seq_len)
                    local = None
                    if windowed(self.window, seq.cache_len, n):
                        local = make_attention(self.device, seq.cache_len, n, tree_mask, self.dtype, self.max_seq_len,
                                               self.window, positions)
                    segments.append(Segment(start, start + n, self.pool.k[:, seq.slot], self.pool.v[:, seq.slot],
                                            seq.cache_len, tree_mask, attn, local))
                start += n
            group = None
            if decodes:
                slots, lens = [s.slot for _, s in decodes], [s.cache_len for _, s in decodes]
                local = None
                if any(windowed(self.window, n, 1) for n in lens):
                    local = make_decode_group_attention(slots, lens, self.dtype, self.max_seq_len, self.device,
                                                        self.window)
                group = RowGroup(torch.tensor([r for r, _ in decodes], device=self.device),
                                 torch.tensor(slots, device=self.device), torch.tensor(lens, device=self.device),
                                 self.pool.k, self.pool.v,
                                 make_decode_group_attention(slots, lens, self.dtype, self.max_seq_len, self.device),
                                 local)
        return segments, group

    def cpu_rows(self, parts) -> CpuRows:
        """Every row of the quantized CPU target's forward (``row_specs``)."""
        return CpuRows(self.pool.k, self.pool.v, *row_specs(parts))

    def row_kernel_group(self, parts: list[tuple[int, tuple]], num_rows: int) -> RowGroup:
        """The rows of ``parts`` ([(first row in the forward, part)]) for the C++ attention (``row_specs``); all of
        the forward's ``num_rows`` rows as a slice where no other row shares the forward."""
        slot, pos, cached, base, bits = row_specs([part for _, part in parts])
        if len(slot) == num_rows:
            rows = slice(0, num_rows)
        else:
            rows = torch.tensor([r for start, part in parts for r in range(start, start + len(part[1]))])
        return RowGroup(rows, slot, pos, self.pool.k, self.pool.v, make_row_kernel_attention(slot, cached, base, bits))

    def kernel_group(self, parts) -> RowGroup:
        """Every row of a multi-sequence forward for the batched Triton kernel: per-row slot and cache row, and the
        per-sequence layout (slot, cache length, row offsets, causal flag, tree bits) built once for all layers."""
        slots, lens, starts, causal, masks, row_slots, row_pos, positions = [], [], [0], [], [], [], [], []
        for seq, tokens, pos, tree_mask in parts:
            n = len(tokens)
            slots.append(seq.slot)
            lens.append(seq.cache_len)
            starts.append(starts[-1] + n)
            causal.append(tree_mask is None and n > 1)
            masks.append(tree_mask if tree_mask is not None else torch.ones(n, dtype=torch.long, device=self.device))
            row_slots += [seq.slot] * n
            row_pos += range(seq.cache_len, seq.cache_len + n)
            positions.append(pos)
        t = self._long
        layout = (t(slots), t(lens), t(starts), torch.cat(masks), t(causal).bool())
        local = None
        if any(windowed(self.window, seq.cache_len, len(tokens)) for seq, tokens, _, _ in parts):
            local = make_batched_kernel_attention(*layout, self.window, torch.cat(positions).to(self.device))
        return RowGroup(torch.arange(starts[-1], device=self.device), t(row_slots), t(row_pos), self.pool.k,
                        self.pool.v, make_batched_kernel_attention(*layout), local)


def row_specs(parts) -> tuple[torch.Tensor, ...]:
    """Where the rows of ``parts`` ([(seq, tokens, positions, tree_mask)]) go and what they read, for the C++
    attention (``specserve_kernels.cpu.attend``): slot, pos, cached, base, bits, int64 [rows] each on the CPU. Causal rows
    (prompt chunks, decode steps) read their slot up to themselves in place, tree rows the cached prefix and then
    their ancestors."""
    slot, pos, cached, base, bits = [], [], [], [], []
    for seq, toks, _, tree_mask in parts:
        n, c = len(toks), seq.cache_len
        slot += [seq.slot] * n
        pos += range(c, c + n)
        if tree_mask is None:
            cached += range(c + 1, c + n + 1)
            base += [0] * n
            bits += [0] * n
        else:
            cached += [c] * n
            base += [c] * n
            bits += tree_mask.tolist()
    t = torch.tensor
    return t(slot), t(pos), t(cached), t(base), t(bits)
