"""`falcon`: the Falcon SAR drafting head with its decoding tree (paper section 3.4, appendix A).

Per step (``k`` = tokens per block, 2 by default):
1. Catch up: the verified positions the head has not seen enter its cache (their K/V only), then the last ``k``
   verified positions run as one block; its outputs are the drafted features and tokens of the next ``k`` positions.
2. Tree: under the root, the top ``top_m[0]`` tokens at the first drafted position, under each of them the top
   ``top_m[1]`` at the second, ... (the Cartesian product; one forward predicts every position of a block at once,
   so a later position's candidates do not depend on the earlier one's choice). A k-token path is a leaf block.
3. Expand: up to ``forwards - 1`` more forwards. Each runs the ``width`` leaf blocks with the highest path
   probability as new blocks (inputs: the drafted tokens and the features predicted for them; each row sees the
   verified cache, its ancestor blocks and its own block) and hangs the Cartesian product of its outputs
   (``next_top_m`` candidates per position, ``top_m`` by default) under the block's last token. The tree stops at
   ``max_rows`` rows (root included).

Greedy requests get point masses (the top tokens). Unseeded sampled requests: the candidates under a node are
independent draws from the drafter's distribution q at that position (shaped by the request's temperature, top-k and
top-p), handed to the engine with q, so acceptance stays distribution-exact. Seeded requests: the drafter runs the
target's race on its own q with the clocks of (seed, position) and proposes the first to ring as point masses (its
guesses at the target's draws, as GLIDE does). Drafted rows never stay in the head's cache: it holds verified
positions only, so nothing is rolled back after verification.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.sampling import race, request_generator, target_probs, token_clocks
from core.tree import MAX_TREE_ROWS, DraftTree, VerifyResult
from drafters.adaptive import AdaptiveLength, AdaptiveStop
from drafters.base import SequenceView, TargetView
from drafters.checkpoint import load_drafter_model
from drafters.falcon.model import FalconCheckpointError, FalconModel, check_fits, default_checkpoint


@dataclass
class _State:
    k: torch.Tensor             # [H_kv, S, D]; cache row p - 1 holds position p (verified positions first)
    v: torch.Tensor
    generator: torch.Generator  # the candidates' draws of unseeded sampled requests
    cached: int = 0             # verified positions 1..cached are in the cache


@dataclass
class _Leaf:
    """A drafted k-token path segment whose block can be run next."""

    score: float                # the path's probability under the drafter
    rows: list[int]             # its k tree rows (the block's tokens, in position order)
    tokens: list[int]
    feats: torch.Tensor         # [k, hidden] the features predicted for the positions before each token
    position: int               # position of its first token
    ancestors: list[int] = field(default_factory=list)  # cache rows (past the verified ones) of the blocks above


@dataclass
class _Tree:
    tokens: list[int]
    parents: list[int]
    q: list[torch.Tensor]  # per draft row, its q over the vocabulary (unseeded sampling only)
    root: int = 0          # the root's position
    stop: "AdaptiveStop | None" = None  # falcon-adaptive: the stopping rule of this proposal
    stopped: bool = False
    max_rows: int = MAX_TREE_ROWS  # the drafter's tree size within the step's row budget


def load_falcon(target: TargetView, checkpoint: str | Path | None = None, weights: str = "auto") -> FalconModel:
    """The head for this target (default: drafters/checkpoints/<target id>/falcon.safetensors), on its device, its
    matrices as ``weights`` says (``drafters.checkpoint.drafter_weights``)."""
    default = default_checkpoint(target.model_id)
    return load_drafter_model(target, FalconModel.load, check_fits, Path(checkpoint) if checkpoint else default,
                              default, FalconCheckpointError, "Falcon checkpoint", "train falcon", weights)


class FalconDrafter:
    name = "falcon"

    def __init__(self, target: TargetView, checkpoint: str | None = None, top_m: list | tuple | None = None,
                 forwards: int = 1, width: int = 1, max_rows: int = 10, next_top_m: list | tuple | None = None,
                 weights: str = "auto"):
        self.model = load_falcon(target, checkpoint, weights)
        self.c = self.model.c
        top_m = (1,) * self.c.k if top_m is None else top_m  # None: a chain
        next_top_m = top_m if next_top_m is None else next_top_m  # the blocks of later forwards: the same by default
        for name, shape in (("top_m", top_m), ("next_top_m", next_top_m)):
            if len(shape) != self.c.k or any(int(m) < 1 for m in shape):
                raise ValueError(f"falcon: {name} needs {self.c.k} sizes >= 1 (one per position of a block), got "
                                 f"{shape}")
        if not 1 <= forwards <= 16 or not 1 <= width <= 8:
            raise ValueError("falcon: forwards must be in [1, 16], width in [1, 8]")
        if not 2 <= max_rows <= MAX_TREE_ROWS:
            raise ValueError(f"falcon: max_rows must be in [2, {MAX_TREE_ROWS}]")
        self.target, self.top_m, self.next_top_m = target, [int(m) for m in top_m], [int(m) for m in next_top_m]
        self.forwards, self.width, self.max_rows = forwards, width, max_rows
        self.vocab_ids = self.model.vocab_ids.to(target.device)
        self.target_taps = tuple(self.c.taps)  # the lower target layers the head reads (the engine keeps them)
        self._states: dict[int, _State] = {}
        self.num_forwards = 0  # for the cost coefficient in `specserve bench offline`
        self.forward_seconds = 0.0

    def _state(self, seq: SequenceView, need: int) -> _State:
        st = self._states.get(seq.seq_id)
        if st is None or st.k.shape[1] < need:
            size = max(256, 1 << (need - 1).bit_length())
            c = self.c
            k = torch.zeros(c.num_kv_heads, size, c.head_dim, dtype=self.target.dtype, device=self.target.device)
            v = torch.zeros_like(k)
            if st is not None:
                k[:, :st.cached], v[:, :st.cached] = st.k[:, :st.cached], st.v[:, :st.cached]
                st.k, st.v = k, v
            else:
                gen = request_generator(seq.sampling, self.target.device, offset=3)
                st = self._states[seq.seq_id] = _State(k, v, gen)
        return st

    def _forward(self, st: _State, ids: list[int], feats: torch.Tensor, positions: list[int], cache_len: int,
                 visible: torch.Tensor | None = None, kv_only: bool = False,
                 taps: torch.Tensor | None = None) -> torch.Tensor | None:
        t0 = time.perf_counter()
        dev = self.target.device
        out = self.model(torch.tensor(ids, device=dev), feats, torch.tensor(positions, device=dev), visible,
                         (st.k, st.v), cache_len, kv_only, taps)
        self.num_forwards += 1
        self.forward_seconds += time.perf_counter() - t0
        return out

    # -- Drafter protocol ----------------------------------------------------------------------------------------
    def prefill(self, seq: SequenceView) -> None:
        """Nothing runs until the first proposal (a sequence that never drafts costs nothing)."""
        self._states.pop(seq.seq_id, None)

    @torch.inference_mode()
    def propose(self, seq: SequenceView) -> DraftTree:
        tokens, kb = seq.tokens, self.c.k
        n = len(tokens) - 1  # the root's position
        if n < kb:
            return DraftTree.root_only(tokens[-1])
        st = self._state(seq, n + self.forwards * self.width * kb + 1)
        b0 = n - kb + 1  # the first block: the last k verified positions
        start = min(st.cached + 1, b0)
        feats = self.target.final_norm(seq.target_hidden()[start - 1:n]).to(self.target.dtype)  # f_{p-1}, p >= start
        taps = seq.target_taps()[start - 1:n] if self.target_taps else None  # the lower layers at p - 1 (verified)
        if start < b0:  # verified positions the head has not seen: their K/V only
            self._forward(st, tokens[start:b0], feats[:b0 - start], list(range(start, b0)), start - 1, kv_only=True,
                          taps=None if taps is None else taps[:b0 - start])
        out = self._forward(st, tokens[b0:n + 1], feats[b0 - start:], list(range(b0, n + 1)), b0 - 1,
                            taps=None if taps is None else taps[b0 - start:])
        st.cached = n
        tree = _Tree([tokens[-1]], [-1], [], n, self._new_stop(), max_rows=min(self.max_rows, seq.max_rows))
        leaves: list[_Leaf] = []
        self._grow(seq, st, out, [], 0, 1.0, n + 1, tree, leaves, self.top_m)
        used = 0  # drafted rows in the cache past the verified ones
        for _ in range(self.forwards - 1):
            if len(tree.tokens) >= tree.max_rows or not leaves or tree.stopped:
                break
            leaves.sort(key=lambda leaf: -leaf.score)
            chosen, leaves = leaves[:self.width], leaves[self.width:]
            base, T = n + used, kb * len(chosen)
            visible = torch.zeros(T, base + T, dtype=torch.bool, device=self.target.device)
            visible[:, :n] = True
            for j, leaf in enumerate(chosen):
                block = slice(j * kb, (j + 1) * kb)
                visible[block, leaf.ancestors] = True
                visible[block, base + j * kb:base + (j + 1) * kb] = True
            ids = [t for leaf in chosen for t in leaf.tokens]
            positions = [leaf.position + i for leaf in chosen for i in range(kb)]
            out = self._forward(st, ids, torch.cat([leaf.feats for leaf in chosen]), positions, base, visible)
            used += T
            for j, leaf in enumerate(chosen):
                own = list(range(base + j * kb, base + (j + 1) * kb))
                self._grow(seq, st, out[j * kb:(j + 1) * kb], leaf.ancestors + own, leaf.rows[-1], leaf.score,
                           leaf.position + kb, tree, leaves, self.next_top_m)
        q = torch.stack([torch.zeros_like(tree.q[0]), *tree.q]) if tree.q else None
        return DraftTree(tree.tokens, tree.parents, q)

    def _candidates(self, seq: SequenceView, st: _State, q: torch.Tensor, position: int, m: int) -> list[int]:
        """Local (kept-vocabulary) candidate ids at ``position`` from the drafter's distribution q."""
        sp = seq.sampling
        if sp.greedy:
            return torch.topk(q, min(m, q.numel())).indices.tolist()
        if sp.seed is not None:
            return race(q, token_clocks(sp.seed, position, self.c.vocab_size)[self.vocab_ids], m)
        return torch.multinomial(q, m, replacement=True, generator=st.generator).tolist()

    def _grow(self, seq: SequenceView, st: _State, feats: torch.Tensor, ancestors: list[int], parent: int,
              score: float, position: int, tree: "_Tree", leaves: list[_Leaf], top_m: list[int]) -> None:
        """Hang the Cartesian product (``top_m`` candidates per position) of a block's predictions ``feats`` [k,
        hidden] (tokens at ``position`` ..) under tree row ``parent``, best first, while the tree has room; record
        its complete k-token paths as leaves."""
        sp = seq.sampling
        logits = self.model.logits(feats).float()  # [k, V_kept]
        probs = torch.softmax(logits, -1) if sp.greedy else target_probs(logits, sp)
        full = None  # unseeded sampling: the q rows handed to the engine, over the whole vocabulary
        if not sp.greedy and sp.seed is None:
            full = torch.zeros(probs.shape[0], self.c.vocab_size, dtype=torch.float32, device=probs.device)
            full.index_copy_(1, self.vocab_ids, probs)
        paths: list[tuple[list[int], float]] = [([parent], score)]  # (tree rows from ``parent``, probability)
        for i, m in enumerate(top_m):
            grown = []
            for rows, s in paths:
                # Fresh candidates under every node (for unseeded sampling: independent draws per node).
                for local in self._candidates(seq, st, probs[i], position + i, m):
                    if len(tree.tokens) >= tree.max_rows:
                        break
                    tree.tokens.append(int(self.vocab_ids[local]))
                    tree.parents.append(rows[-1])
                    if full is not None:
                        tree.q.append(full[i])
                    grown.append((rows + [len(tree.tokens) - 1], s * float(probs[i, local])))
                    if tree.stop is not None and not tree.stop.more(
                            self._accept_prob(feats[i:i + 1], sp, position + i - tree.root, float(probs[i, local]))):
                        tree.stopped = True  # a chain (top_m all 1): verify what is drafted
                        return
            paths = grown
        for rows, s in paths:  # complete paths only: every level was grown
            leaves.append(_Leaf(s, rows[1:], [tree.tokens[r] for r in rows[1:]], feats, position, ancestors))

    def _new_stop(self) -> AdaptiveStop | None:
        """The fixed tree grows to its shape; the adaptive chain stops earlier (drafters/adaptive.py)."""
        return None

    def observe(self, seq: SequenceView, result: VerifyResult) -> None:
        """Nothing to roll back: the cache holds verified positions only."""

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


class FalconAdaptiveDrafter(AdaptiveLength, FalconDrafter):
    """`falcon-adaptive`: the Falcon chain (the top token at every position, ``k`` per forward, up to ``max_forwards``
    forwards), stopped by the acceptance head once the chance of a rejection passes ``threshold``. The head reads the
    feature each token was drafted from; a stop inside a block drops the block's later tokens, a stop at its end
    saves the next forward."""

    name = "falcon-adaptive"

    def __init__(self, target: TargetView, checkpoint: str | None = None, accept_head: str | None = None,
                 threshold: float = 0.5, max_forwards: int = 2, weights: str = "auto"):
        if not 1 <= max_forwards <= 2:
            raise ValueError("falcon-adaptive: max_forwards must be 1 or 2 (the head learned the first two blocks)")
        head, path = self._head_and_checkpoint(target, "falcon", accept_head, checkpoint,
                                               default_checkpoint(target.model_id))
        super().__init__(target, str(path), top_m=None, forwards=max_forwards, width=1, max_rows=MAX_TREE_ROWS,
                         weights=weights)
        self._init_adaptive(head, path, threshold)
