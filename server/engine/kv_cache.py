"""Preallocated KV-cache pool: one slot per running sequence, all layers in one tensor.

Layout ``[L, num_slots, H_kv, S, D]``: a (layer, slot) view is a contiguous ``[H_kv, S, D]`` block, which is what
attention reads, and one kernel launch can compact a slot's accepted rows across every layer. Beside K/V the pool
keeps the target's last-layer hidden state of every cached token (``[num_slots, S, hidden]``) for feature-level
drafters, followed by the residual streams of the lower layers a drafter taps (``hidden_size`` is then that many times
wider: ``Engine`` sizes it). K and V may be stored narrower than the model computes (the quantized CPU target keeps
float16 K/V and computes in float32: half the bytes a decode step reads per cached token, as llama.cpp's default f16
cache).
"""
from __future__ import annotations

import torch


class NoFreeSlotError(RuntimeError):
    """Every KV slot is taken; the caller should queue the request or retry later."""


AUTO_MAX_SLOTS = 64      # sequences a step batches at most, by default
AUTO_MEMORY_SHARE = 0.25  # of the memory free at start, for an automatically sized pool


def bytes_per_slot(num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int, hidden_size: int,
                   dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
    """K and V of every layer (in ``kv_dtype``, default ``dtype``) plus the hidden states (``dtype``), for one
    sequence of ``max_seq_len`` tokens."""
    item, kv_item = (torch.empty(0, dtype=d).element_size() for d in (dtype, kv_dtype or dtype))
    return (2 * num_layers * num_kv_heads * head_dim * kv_item + hidden_size * item) * max_seq_len


def auto_num_slots(per_slot: int, device: torch.device) -> int:
    """KV slots for ``cache.num_slots: null``: a quarter of the memory free now (MemAvailable on CPU, free device
    memory on CUDA, after the weights are loaded), at most AUTO_MAX_SLOTS, at least 1."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = 0
        try:
            for line in open("/proc/meminfo"):
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
        except OSError:
            pass
        free = free or 4 << 30  # unknown: assume 4 GiB
    return max(1, min(AUTO_MAX_SLOTS, int(free * AUTO_MEMORY_SHARE) // per_slot))


class KVCachePool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None):
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)  # [L, slots, H_kv, S, D]
        self.v = torch.zeros(shape, dtype=kv_dtype or dtype, device=device)  # [L, slots, H_kv, S, D]
        self.hidden = torch.zeros(num_slots, max_seq_len, hidden_size, dtype=dtype, device=device)  # [slots, S, hid]
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlotError(f"all {self.num_slots} KV-cache slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self._free)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.hidden.nbytes
