"""`glide` and `glide-cape`: the GLIDE draft model as a drafter, with CAPE proposal expansion for `glide-cape`.

Per step: feed the tokens the drafter has not seen yet through the draft model (the root; before it, for their K/V
only, the prompt at a first proposal and any accepted tokens it never processed), then draft ``gamma`` tokens one
forward each. Every draft row reads the target's KV of the verified
tokens only (``SequenceView.target_kv``: the first ``cache_len`` positions). Greedy requests get argmax chains of point
masses; unseeded sampled requests draw each chain token from the drafter's distribution (shaped by the request's
temperature, top-k and top-p) and hand that distribution to the engine, which keeps acceptance lossless. A seeded
request's target draws its tokens by a race on clocks keyed on (seed, position) (``core.sampling``); the drafter runs
the same race on its own distribution, so its chain token and CAPE alternatives (the next to ring) are its best
guesses at the target's draw, proposed as point masses. After verification the drafter's own KV cache is rolled back
to the longest prefix of its inputs that the accepted text confirms.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.sampling import race, request_generator, target_probs, token_clocks
from core.tree import DraftTree, VerifyResult
from drafters.adaptive import AdaptiveLength, AdaptiveStop
from drafters.base import SequenceView, TargetView
from drafters.cape import PAPER_BINS, cape_tree, check_bins
from drafters.checkpoint import load_drafter_model
from drafters.glide.model import GlideCheckpointError, GlideModel, causal_visibility, check_fits, default_checkpoint


@dataclass
class _State:
    k: torch.Tensor            # [num_layers, H_kv, S, D] the drafter's own cache
    v: torch.Tensor
    generator: torch.Generator  # draws the chain tokens of unseeded sampled requests
    inputs: list[int] = field(default_factory=list)  # tokens whose KV sits in the cache, by position
    confirmed: int = 0  # inputs[:confirmed] are known to equal the sequence's tokens


def _sync(st: _State, tokens: list[int]) -> None:
    """Roll the drafter's cache back to the longest prefix of its inputs the sequence confirms (never the last token,
    the next root, which is always fed again)."""
    n = min(len(st.inputs), len(tokens) - 1)
    keep = min(st.confirmed, n)
    while keep < n and st.inputs[keep] == tokens[keep]:
        keep += 1
    del st.inputs[keep:]  # the cache rows past ``keep`` are overwritten by the next forward
    st.confirmed = keep


def load_glide(target: TargetView, checkpoint: str | Path | None = None, name: str = "glide",
               weights: str = "auto") -> GlideModel:
    """The checkpoint for this target (default: drafters/checkpoints/<target id>/glide.safetensors), on its device, its
    matrices as ``weights`` says (``drafters.checkpoint.drafter_weights``)."""
    default = default_checkpoint(target.model_id, name)
    return load_drafter_model(target, GlideModel.load, check_fits, Path(checkpoint) if checkpoint else default,
                              default, GlideCheckpointError, "GLIDE checkpoint", "train glide", weights)


class GlideDrafter:
    name = "glide"

    def __init__(self, target: TargetView, checkpoint: str | None = None, gamma: int = 5, cape: bool = False,
                 bins: list | tuple = PAPER_BINS, max_rows: int = 32, weights: str = "auto"):
        if not 1 <= gamma <= 63:
            raise ValueError("glide: gamma must be in [1, 63]")
        if not 2 <= max_rows <= 64:
            raise ValueError("glide: max_rows must be in [2, 64]")
        self.target, self.gamma, self.cape, self.max_rows = target, gamma, cape, max_rows
        self.bins = check_bins(bins)
        self.max_expand = max(k for _, k in self.bins) if cape else 0
        self.model = load_glide(target, checkpoint, weights=weights)
        self.c = self.model.c
        self.vocab_ids = self.model.vocab_ids.to(target.device)
        self._states: dict[int, _State] = {}
        # For the cost coefficient c = drafter forward time / target forward time (see `specserve bench offline`).
        self.num_forwards = 0
        self.forward_seconds = 0.0

    # -- state ---------------------------------------------------------------------------------------------------
    def _state(self, seq: SequenceView, need: int) -> _State:
        st = self._states.get(seq.seq_id)
        if st is None or st.k.shape[2] < need:
            size = max(256, 1 << (need - 1).bit_length())
            c = self.c
            shape = (c.num_layers, c.num_kv_heads, size, c.head_dim)
            k = torch.zeros(shape, dtype=self.target.dtype, device=self.target.device)
            v = torch.zeros_like(k)
            if st is not None:
                n = len(st.inputs)
                k[:, :, :n], v[:, :, :n] = st.k[:, :, :n], st.v[:, :, :n]
                st.k, st.v = k, v
            else:
                gen = request_generator(seq.sampling, self.target.device, offset=1)
                st = self._states[seq.seq_id] = _State(k, v, gen)
        return st

    def _forward(self, seq: SequenceView, st: _State, tokens: list[int], kv_only: bool = False) -> torch.Tensor:
        """Run ``tokens`` at the next positions of the drafter's cache; returns hidden [T, hidden]."""
        t0 = time.perf_counter()
        n, T = len(st.inputs), len(tokens)
        dev = self.target.device
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        positions = torch.arange(n, n + T, device=dev)
        target_kv = [seq.target_kv(self.c.target_layer(m)) for m in range(self.c.num_layers)]
        # A row at position p sees the verified target keys < p: every cached key once p >= cache_len.
        visible = None if n >= seq.cache_len else causal_visibility(positions, seq.cache_len)
        h = self.model(ids, positions, (st.k, st.v), n, target_kv, visible, kv_only=kv_only)
        st.inputs.extend(tokens)
        self.num_forwards += 1
        self.forward_seconds += time.perf_counter() - t0
        return h

    # -- Drafter protocol ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: SequenceView) -> None:
        """A new sequence: nothing runs until its first proposal (a sequence the draft budget never lets draft costs
        the drafter nothing), which reads the prompt then (``_catch_up``)."""
        self._states.pop(seq.seq_id, None)

    def _catch_up(self, seq: SequenceView, st: _State, tokens: list[int]) -> list[int]:
        """Bring the drafter's cache up to the tokens before the root (only their K/V is needed: the prompt at a
        first proposal, the tokens accepted while the budget kept the sequence from drafting); returns the root."""
        _sync(st, tokens)
        if len(st.inputs) < len(tokens) - 1:
            self._forward(seq, st, tokens[len(st.inputs):-1], kv_only=True)
        return tokens[-1:]

    @torch.inference_mode()
    def propose(self, seq: SequenceView) -> DraftTree:
        tokens, max_rows = seq.tokens, min(self.max_rows, seq.max_rows)
        gamma = min(self.gamma, seq.max_rows - 1)  # the step's row budget: drafting past it is never verified
        st = self._state(seq, len(tokens) + gamma + 1)
        h = self._forward(seq, st, self._catch_up(seq, st, tokens))  # the root
        greedy, seed = seq.sampling.greedy, seq.sampling.seed
        stop = self._new_stop()
        chain, alts, confs, qs = [], [], [], []  # qs: the chain's q rows for unseeded sampling (seeded: point masses)
        for i in range(gamma):
            logits = self.model.logits(h).float()  # [1, V_kept]
            probs = torch.softmax(logits, dim=-1)[0]
            if greedy:
                top = torch.topk(probs, 1 + self.max_expand)
                tok_local = int(top.indices[0])
                conf = float(top.values[0])
                alt_local = top.indices[1:]
            elif seed is not None:  # the target draws by a race on clocks keyed on (seed, position): run it on q
                q = target_probs(logits, seq.sampling)[0]
                clocks = token_clocks(seed, len(tokens) + i, self.c.vocab_size)[self.vocab_ids]
                order = race(q, clocks, 1 + self.max_expand)
                tok_local, alt_local = order[0], torch.tensor(order[1:], dtype=torch.long)
                conf = float(q[tok_local])
            else:
                q = target_probs(logits, seq.sampling)[0]  # the distribution the chain token is drawn from
                tok_local = int(torch.multinomial(q, 1, generator=st.generator).item())
                conf = float(q[tok_local])
                alt_local = torch.topk(q, min(1 + self.max_expand, q.numel())).indices
                alt_local = alt_local[alt_local != tok_local][:self.max_expand]
                full = torch.zeros(self.c.vocab_size, dtype=torch.float32, device=q.device)
                qs.append(full.index_copy_(0, self.vocab_ids, q))
            chain.append(int(self.vocab_ids[tok_local]))
            confs.append(conf)
            alts.append(self.vocab_ids[alt_local].tolist() if self.cape else [])
            if stop is not None and not stop.more(self._accept_prob(h, seq.sampling, i + 1, conf)):
                break  # the chance of a rejection passed the threshold: verify what is drafted
            if i + 1 < gamma:
                h = self._forward(seq, st, [chain[-1]])
        chain_q = torch.stack(qs) if qs else None
        if not self.cape:
            return DraftTree.chain(tokens[-1], chain, None if chain_q is None else
                                   torch.cat([chain_q.new_zeros(1, chain_q.shape[1]), chain_q]))
        return cape_tree(tokens[-1], chain, alts, confs, self.bins, max_rows, chain_q)

    def _new_stop(self) -> AdaptiveStop | None:
        """A fixed-length chain drafts ``gamma`` tokens; the adaptive drafter stops earlier (drafters/adaptive.py)."""
        return None

    @torch.inference_mode()
    def review(self, seq: SequenceView, draft: list[int]) -> torch.Tensor:
        """Score a proposed continuation in ONE drafter forward (the cascade's vertical review).

        Returns float32 probabilities [len(draft) + 1, V] over the full vocabulary (zero outside the kept rows):
        row i is the drafter's next-token distribution after root + draft[:i] (shaped by the request's sampling
        parameters when it samples). The rows enter the drafter's cache like drafted tokens; ``observe`` rolls back
        what verification rejects.
        """
        tokens = seq.tokens
        st = self._state(seq, len(tokens) + len(draft) + 1)
        h = self._forward(seq, st, self._catch_up(seq, st, tokens) + list(draft))  # rows: root, draft...
        logits = self.model.logits(h).float()
        local = torch.softmax(logits, -1) if seq.sampling.greedy else target_probs(logits, seq.sampling)
        full = torch.zeros(local.shape[0], self.c.vocab_size, dtype=torch.float32, device=local.device)
        return full.index_copy_(1, self.vocab_ids, local)

    def observe(self, seq: SequenceView, result: VerifyResult) -> None:
        st = self._states.get(seq.seq_id)
        if st is not None:
            _sync(st, seq.tokens)

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)


class GlideCapeDrafter(GlideDrafter):
    name = "glide-cape"

    def __init__(self, target: TargetView, checkpoint: str | None = None, gamma: int = 5, cape: bool = True,
                 bins: list | tuple = PAPER_BINS, max_rows: int = 32, weights: str = "auto"):
        super().__init__(target, checkpoint, gamma, cape, bins, max_rows, weights)


class GlideAdaptiveDrafter(AdaptiveLength, GlideDrafter):
    """`glide-adaptive`: the GLIDE chain, stopped per step by the acceptance head (drafters/adaptive.py) once the
    chance of a rejection passes ``threshold``, at most ``max_gamma`` tokens. The head reads the hidden state each
    token was drafted from, so stopping costs no drafter forward. ``cape: true`` adds CAPE's alternatives to the
    chain it keeps."""

    name = "glide-adaptive"

    def __init__(self, target: TargetView, checkpoint: str | None = None, accept_head: str | None = None,
                 threshold: float = 0.5, max_gamma: int = 8, cape: bool = False, bins: list | tuple = PAPER_BINS,
                 max_rows: int = 32, weights: str = "auto"):
        head, path = self._head_and_checkpoint(target, "glide", accept_head, checkpoint,
                                               default_checkpoint(target.model_id))
        super().__init__(target, str(path), max_gamma, cape, bins, max_rows, weights)
        self._init_adaptive(head, path, threshold)
