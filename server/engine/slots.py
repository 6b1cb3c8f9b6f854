"""KV slots and prefix admission: which slot a new sequence runs in (an idle slot that caches its prefix, a free one,
or an evicted one), the cached rows it starts with, and what a finished sequence leaves in the prefix cache."""
from __future__ import annotations

from server.engine.kv_cache import KVCachePool, NoFreeSlotError
from server.engine.prefix_cache import Hit, PrefixCache
from server.engine.sequence import Sequence


class Slots:
    def __init__(self, pool: KVCachePool, prefix: PrefixCache):
        self.pool, self.prefix = pool, prefix
        self.running: dict[int, Sequence] = {}  # slot -> the sequence running in it

    def hit(self, prompt_ids: list[int], namespace: str | None = None) -> Hit:
        """The longest prefix of the prompt (at most all but its last token) whose KV rows a slot holds now, and
        what a running sequence's prefill will hold once its prompt is cached (``Hit.pending``). ``namespace`` None
        is the default partition, and with ``cache.prefix_caching`` off finds nothing."""
        if namespace is None and not self.prefix.enabled:
            return Hit(None, 0)
        return self.prefix.lookup(namespace or "", prompt_ids, self._usable)

    def _usable(self, slot: int) -> int:
        seq = self.running.get(slot)
        return self.prefix.index.length(slot) if seq is None else min(seq.cache_len, seq.prompt_len)

    def take(self, hit: Hit, namespace: str, prompt_ids: list[int]) -> int:
        """A slot for a new sequence with ``prompt_ids``, holding the hit's rows (raises NoFreeSlotError when every
        slot runs a sequence). An idle slot that holds them is adopted as it is, else they are copied from their
        slot; the prompt is held in the prefix index (its rows become usable as they are cached)."""
        slot = self._choose(hit)
        try:
            if hit.length and slot != hit.slot:
                self._copy_rows(hit.slot, slot, hit.length)
            self.prefix.count(len(prompt_ids), hit.length)
            self.prefix.hold(namespace, prompt_ids, slot)
        except BaseException:  # nothing runs in the slot: free it (its rows may be half copied)
            self.free(slot)
            raise
        return slot

    def _choose(self, hit: Hit) -> int:
        """The hit's idle slot itself when the sequence keeps all of its rows, else a free slot (the rows are
        copied), else the idle source (its rows past the match are lost, not another prefix), else the least
        recently used idle slot."""
        src = hit.slot if hit.length else None
        idle_src = src is not None and src in self.prefix.idle
        if idle_src and (hit.length == self.prefix.index.length(src) or not self.pool.free_slots):
            self.prefix.drop(src)
            return src
        if src is not None:
            self.prefix.touch(src)
        if self.pool.free_slots:
            return self.pool.allocate()
        slot = self.prefix.evict()
        if slot is None:
            raise NoFreeSlotError(f"all {self.pool.num_slots} KV-cache slots are in use")
        return slot

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        """The first ``n`` cached rows of slot ``src`` (K/V of every layer, hidden states) into slot ``dst``."""
        p = self.pool
        p.k[:, dst, :, :n].copy_(p.k[:, src, :, :n])
        p.v[:, dst, :, :n].copy_(p.v[:, src, :, :n])
        p.hidden[dst, :n].copy_(p.hidden[src, :n])

    def free(self, slot: int) -> None:
        """A slot no sequence runs in and nothing is cached in."""
        self.prefix.drop(slot)
        self.pool.free(slot)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """The sequence is done: leave its committed rows in the prefix cache (prompt and generated tokens that have
        KV: never rejected draft rows or tokens past a stop), or free its slot (``cache`` False, caching off, or
        nothing committed)."""
        if self.running.get(seq.slot) is not seq:
            return  # released before
        del self.running[seq.slot]
        committed = min(seq.cache_len, len(seq.token_ids))
        if not (cache and self.prefix.park(seq.namespace, seq.token_ids[:committed], seq.slot)):
            self.free(seq.slot)

    def usage(self) -> tuple[float, float]:
        """(running sequences', idle cached slots') share of the pool's token capacity."""
        cap = self.pool.num_slots * self.pool.max_seq_len
        cached = sum(self.prefix.index.length(s) for s in self.prefix.idle)
        return sum(s.cache_len for s in self.running.values()) / cap, cached / cap
