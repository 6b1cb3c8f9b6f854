"""Automatic prefix caching: an exact radix index over the token ids whose KV rows the pool's slots hold.

Every KV slot holds one sequence's rows from position 0, so a slot is a prefix of tokens. The index maps token
prefixes to the slots that hold them, in a radix tree per namespace (the API key and ``cache_salt``: a request never
sees another partition's slots). Token ids are compared exactly, edge by edge; there is no hash to collide.

Two kinds of entries:
  - a running sequence's prompt, from admission: its rows become usable as its prefill caches them (the caller's
    ``usable`` bound), so a request that shares a long prompt with one being prefilled can wait for it and copy;
  - an idle slot, left by a finished or aborted sequence: its committed rows (prompt and generated tokens that have
    KV; never rejected draft rows or tokens past a stop). Idle slots are evicted least recently used.

``PrefixCache`` keeps the index, the idle slots' LRU order and the counters; the engine does the copying. Where
KV events are published (``server.engine.kv_events``), every change of what a slot is indexed as goes through its
``BlockLedger`` to the publisher.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


class _Node:
    __slots__ = ("edge", "children", "slots", "ends", "parent")

    def __init__(self, edge: tuple[int, ...] = (), parent: "_Node | None" = None):
        self.edge = edge                       # token ids from the parent to this node
        self.children: dict[int, _Node] = {}   # first token of the child's edge -> child
        self.slots: set[int] = set()           # slots whose entries run through this node (or end in it)
        self.ends: set[int] = set()            # slots whose entries end exactly here
        self.parent = parent


def _common(a: tuple[int, ...], b, start: int) -> int:
    """How many leading tokens of edge ``a`` equal ``b[start:]``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixIndex:
    """Slots by the token prefixes they hold, one radix tree per namespace."""

    def __init__(self):
        self._roots: dict[str, _Node] = {}
        self._where: dict[int, tuple[str, _Node, int]] = {}  # slot -> (namespace, node its entry ends at, length)

    def __contains__(self, slot: int) -> bool:
        return slot in self._where

    def length(self, slot: int) -> int:
        return self._where[slot][2]

    def insert(self, namespace: str, tokens, slot: int) -> None:
        """Index ``slot`` as holding ``tokens`` (replacing what it was indexed as)."""
        if slot in self._where:
            self.remove(slot)
        node = self._roots.setdefault(namespace, _Node())
        node.slots.add(slot)
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _Node(tuple(tokens[i:]), node)
                child.slots.add(slot)
                node, i = child, len(tokens)
                break
            k = _common(child.edge, tokens, i)
            if k < len(child.edge):  # split the edge where the entry leaves (or ends inside) it
                mid = _Node(child.edge[:k], node)
                node.children[tokens[i]] = mid
                child.edge, child.parent = child.edge[k:], mid
                mid.children[child.edge[0]] = child
                mid.slots = set(child.slots)
                child = mid
            child.slots.add(slot)
            node, i = child, i + k
        node.ends.add(slot)
        self._where[slot] = (namespace, node, len(tokens))

    def remove(self, slot: int) -> None:
        namespace, node, _ = self._where.pop(slot)
        node.ends.discard(slot)
        while node is not None:
            node.slots.discard(slot)
            parent = node.parent
            if parent is not None and not node.slots:
                del parent.children[node.edge[0]]
            elif parent is not None and not node.ends and len(node.children) == 1:  # merge a pass-through node
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[node.edge[0]] = child
            node = parent
        if not self._roots[namespace].slots:
            del self._roots[namespace]

    def longest(self, namespace: str, tokens, usable: Callable[[int], int], limit: int) -> tuple[int | None, int]:
        """The slot holding the longest usable prefix of ``tokens``, at most ``limit`` tokens: (slot, length), or
        (None, 0). A slot's match is the common prefix of its entry and ``tokens``, cut to ``usable(slot)`` (the
        rows it has cached by now)."""
        node = self._roots.get(namespace)
        best, best_len, depth, i = None, 0, 0, 0
        while node is not None:
            # every slot under this node shares the first `depth` tokens with the query
            cap = min(depth, limit)
            if cap > best_len:
                for s in node.slots:
                    n = min(cap, usable(s))
                    if n > best_len:
                        best, best_len = s, n
            if i >= len(tokens) or depth >= limit:
                break
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common(child.edge, tokens, i)
            depth, i = depth + k, i + k
            if k < len(child.edge):  # the query leaves (or ends inside) this edge: the child's slots share `depth`
                cap = min(depth, limit)
                for s in child.slots:
                    n = min(cap, usable(s))
                    if n > best_len:
                        best, best_len = s, n
                break
            node = child
        return best, best_len


@dataclass
class Hit:
    slot: int | None    # the slot holding the rows, None on a miss
    length: int         # rows usable now
    pending: int = 0    # rows a running source will have once its prompt is cached (>= length)


class PrefixCache:
    """The index plus the idle slots (least recently used first) and the counters the metrics report."""

    def __init__(self, enabled: bool, ledger=None, publish: Callable[[list], None] | None = None):
        self.enabled = enabled   # False: finished sequences free their slots, and only running ones are indexed
        self.ledger, self._publish = ledger, publish  # KV events (kv_events.BlockLedger and a publisher), or None
        self.index = RadixIndex()
        self.idle: OrderedDict[int, None] = OrderedDict()  # idle cached slots, least recently used first
        self.queries = self.hits = self.evictions = 0

    def lookup(self, namespace: str, tokens: list[int], usable: Callable[[int], int]) -> Hit:
        """The best source for a new sequence's prompt: at most len(tokens) - 1 rows (the last prompt token is
        always computed, for its logits). ``pending`` is the match when running sources finish their prompts."""
        limit = len(tokens) - 1
        slot, n = self.index.longest(namespace, tokens, usable, limit)
        _, pending = self.index.longest(namespace, tokens, self.index.length, limit)
        return Hit(slot, n, max(pending, n))

    def count(self, prompt_tokens: int, cached: int) -> None:
        self.queries += prompt_tokens
        self.hits += cached

    def hold(self, namespace: str, tokens: list[int], slot: int) -> None:
        """A running sequence's prompt: its rows become usable as they are cached."""
        self.idle.pop(slot, None)
        self._indexed(namespace, tokens, slot)

    def _indexed(self, namespace: str, tokens: list[int], slot: int) -> None:
        self.index.insert(namespace, tokens, slot)
        if self.ledger is not None:
            self._publish(self.ledger.set(slot, namespace, tokens))

    def park(self, namespace: str, tokens: list[int], slot: int) -> bool:
        """A finished or aborted sequence leaves its committed rows: True if the slot is kept (idle), False if the
        caller frees it (caching off, or no rows)."""
        if not self.enabled or not tokens:
            self.drop(slot)
            return False
        self._indexed(namespace, tokens, slot)
        self.idle[slot] = None
        return True

    def touch(self, slot: int) -> None:
        if slot in self.idle:
            self.idle.move_to_end(slot)

    def drop(self, slot: int) -> None:
        """Forget a slot (its owner frees or reuses it)."""
        if slot in self.index:
            self.index.remove(slot)
            if self.ledger is not None:
                self._publish(self.ledger.clear(slot))
        self.idle.pop(slot, None)

    def evict(self) -> int | None:
        """Take the least recently used idle slot out of the index: the slot, or None."""
        if not self.idle:
            return None
        slot = next(iter(self.idle))
        self.drop(slot)
        self.evictions += 1
        return slot
