"""The worker's engine: target model, KV slots, and the draft -> verify -> accept -> compact loop.

One step of one sequence (see ``Engine.step``):
  tree = drafter.propose(seq)            # row 0 = root = last accepted token
  logits = verify(seq, tree)             # one target forward over all tree rows (prefix + ancestors + self)
  path, tokens = accept(tree, logits)    # greedy or lossless speculative sampling
  commit(seq, path)                      # compact the accepted rows' KV to [cache_len, cache_len + len(path))
  drafter.observe(seq, result)
Sequences are independent: the scheduler interleaves their steps.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from core.ops import DTYPES, LlamaArgs, rms_norm
from core.sampling import SamplingParams, race, request_generator, target_probs, token_clocks
from core.tree import MAX_TREE_ROWS, DraftTree, VerifyResult
from drafters.base import Drafter, create_drafter
from kernels.kv_compact import kv_compact_batched
from kernels.tree_attention import ancestor_bitmask
from server.config import EngineConfig
from server.engine.acceptance import accept_greedy, accept_sampling, accept_seeded
from server.engine.backend import (compact_kv, make_attention, make_batched_kernel_attention,
                                   make_decode_group_attention)
from server.engine.kv_cache import KVCachePool, NoFreeSlotError, auto_num_slots, bytes_per_slot
from server.engine.model import Llama, RowGroup, Segment
from server.engine.quant import quantize_model
from server.engine.stepcost import AUTO_ROWS, choose_dtype, step_curve, tune_linear
from server.engine.weights import load_hf_config, load_state_dict, resolve_model


class RequestError(ValueError):
    """A request the engine cannot run (empty prompt, prompt over the context, bad token ids)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class SeqStats:
    draft_tokens: int = 0      # draft rows proposed (roots excluded)
    accepted_tokens: int = 0   # draft tokens accepted
    verify_steps: int = 0      # target forwards after prefill
    step_tokens: int = 0       # tokens emitted by verify steps (bonus included, after truncation)
    verify_seconds: float = 0.0  # wall time in the target's verify forwards (the offline benchmark's split)
    draft_seconds: float = 0.0   # wall time in the drafter's propose calls
    max_draft: int = 0           # the most draft rows of one step

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward, bonus included (1.0 for plain decoding)."""
        return self.step_tokens / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "verify_steps": self.verify_steps, "mean_accepted_length": round(self.mean_accepted_length, 4),
                "mean_draft_length": round(self.draft_tokens / self.verify_steps, 4) if self.verify_steps else 0.0,
                "max_draft_length": self.max_draft}


@dataclass
class Sequence:
    seq_id: int
    slot: int
    prompt_len: int
    token_ids: list[int]           # prompt + generated; the last one is the next root (its KV is not cached)
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    cache_len: int = 0
    finish_reason: str | None = None
    max_rows: int = MAX_TREE_ROWS  # the row budget of the tree being drafted (root included)
    stats: SeqStats = field(default_factory=SeqStats)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]


class Target:
    """The frozen target model plus the read-only pieces drafters may share (implements drafters.base.TargetView)."""

    def __init__(self, model: Llama, model_id: str, device: torch.device, dtype: torch.dtype, hf_dir=None):
        self.model, self.model_id, self.device, self.dtype = model, model_id, device, dtype
        self.hf_dir = hf_dir  # converted HF directory: tokenizer files, and weights for reference runs
        self.args: LlamaArgs = model.args

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids)

    @torch.inference_mode()
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.model.norm, self.args.rms_norm_eps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.rope(x, positions)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.embed.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        w = self.model.lm_head.weight
        return w if isinstance(w, torch.Tensor) else w.dequantize()  # a quantized head: the matrix it stands for


class SeqView:
    """Read-only view of a sequence for drafters (implements drafters.base.SequenceView)."""

    def __init__(self, seq: Sequence, pool: KVCachePool, target: Target):
        self._seq, self._pool, self.target = seq, pool, target
        self.seq_id, self.prompt_len = seq.seq_id, seq.prompt_len

    @property
    def tokens(self) -> list[int]:
        return self._seq.token_ids

    @property
    def cache_len(self) -> int:
        return self._seq.cache_len

    @property
    def sampling(self) -> SamplingParams:
        return self._seq.sampling

    @property
    def max_rows(self) -> int:
        return self._seq.max_rows

    def target_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._seq.cache_len
        return self._pool.k[layer, self._seq.slot, :, :n], self._pool.v[layer, self._seq.slot, :, :n]

    def target_hidden(self) -> torch.Tensor:
        return self._pool.hidden[self._seq.slot, :self._seq.cache_len]


def load_target(cfg: EngineConfig, progress: bool = True) -> Target:
    """Build the target model from the config (converting a GGUF source once into the cache).

    ``model.dtype: auto`` measures the candidate dtypes on this machine first (``server.engine.stepcost``).
    """
    resolved = resolve_model(cfg.model.source, cfg.model.cache_dir, progress=progress)
    args = LlamaArgs.from_hf(load_hf_config(resolved.hf_dir))
    device = resolve_device(cfg.model.device)
    with torch.device("meta"):  # skip random init: every weight is loaded below
        model = Llama(args, cfg.cache.max_seq_len)
    model.load_hf_state_dict(load_state_dict(resolved.hf_dir))
    model.eval().requires_grad_(False)
    name = cfg.model.dtype
    if name == "auto":
        name = choose_dtype(lambda d: _measure_dtype(cfg, model, resolved, device, d), device,
                            cfg.model.quantization, resolved.hf_dir)
    return _build_target(model, resolved, device, name, cfg.model.quantization)


def _build_target(model: Llama, resolved, device: torch.device, dtype_name: str, quantization: str) -> Target:
    dtype = DTYPES[dtype_name]
    model = model.to(device=device, dtype=dtype)
    quantize_model(model, quantization, dtype, gguf=resolved.gguf)
    tune_linear([w for w in model.matmul_weights() if isinstance(w, torch.Tensor)], resolved.hf_dir)
    return Target(model, resolved.model_id, device, dtype, resolved.hf_dir)


def _measure_dtype(cfg: EngineConfig, model: Llama, resolved, device: torch.device, dtype_name: str) -> dict:
    """T(rows) for ``model.dtype: auto``: a copy of the model in ``dtype_name``, plain decoding, one slot, after up
    to 300 cached tokens (fewer when the configured context is shorter: the copy's RoPE table has that length)."""
    rows = AUTO_ROWS if cfg.cache.max_seq_len >= 1 + max(AUTO_ROWS) + 1 else (1,)
    cached = max(1, min(300, cfg.cache.max_seq_len - max(rows) - 1))
    c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype_name),
                            cache=dataclasses.replace(cfg.cache, num_slots=1, max_seq_len=cached + max(rows) + 1),
                            drafter=dataclasses.replace(cfg.drafter, name="none"))
    target = _build_target(copy.deepcopy(model), resolved, device, dtype_name, cfg.model.quantization)
    return step_curve(Engine(c, target=target), rows, cached=cached, repeats=5)


class Engine:
    def __init__(self, cfg: EngineConfig, drafter: Drafter | None = None, target: Target | None = None):
        self.cfg = cfg
        self.target = target = target or load_target(cfg)
        self.model = target.model
        a = self.model.args
        self.device, self.dtype = target.device, target.dtype
        slots = cfg.cache.num_slots or auto_num_slots(bytes_per_slot(
            a.num_layers, a.num_kv_heads, cfg.cache.max_seq_len, a.head_dim, a.hidden_size, self.dtype), self.device)
        self.pool = KVCachePool(a.num_layers, slots, a.num_kv_heads, cfg.cache.max_seq_len,
                                a.head_dim, a.hidden_size, self.dtype, self.device)
        self.drafter = drafter or create_drafter(cfg.drafter.name, target, cfg.drafter.options_for())
        self.max_seq_len = cfg.cache.max_seq_len
        self._ids = itertools.count()

    # -- admission ---------------------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], sampling: SamplingParams | None = None, max_new_tokens: int = 16,
            stop_token_ids: tuple[int, ...] | list[int] | None = None, seq_id: int | None = None) -> Sequence:
        """Validate a request and give it a KV slot (raises NoFreeSlotError when every slot is taken)."""
        if not prompt_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        if len(prompt_ids) >= self.max_seq_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_seq_len} "
                               "(prompt + at least one generated token)")
        V = self.model.args.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < V for t in prompt_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {V})")
        if max_new_tokens < 1:
            raise RequestError("max_new_tokens must be >= 1")
        sampling = sampling or SamplingParams()
        slot = self.pool.allocate()
        gen = request_generator(sampling, self.device)
        return Sequence(seq_id=next(self._ids) if seq_id is None else seq_id, slot=slot,
                        prompt_len=len(prompt_ids), token_ids=list(prompt_ids), sampling=sampling,
                        max_new_tokens=max_new_tokens, stop_token_ids=frozenset(stop_token_ids or ()),
                        generator=gen)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's KV slot and the drafter's state (finish or abort)."""
        self.drafter.release(seq.seq_id)
        self.pool.free(seq.slot)

    def view(self, seq: Sequence) -> SeqView:
        return SeqView(seq, self.pool, self.target)

    # -- target forwards ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, seq: Sequence, tokens: list[int], positions: torch.Tensor, tree_mask: torch.Tensor | None):
        """T new rows of one sequence after its cached prefix -> hidden [T, hidden]."""
        return self._forward_rows([(seq, tokens, positions, tree_mask)])

    @torch.inference_mode()
    def _forward_rows(self, parts: list[tuple[Sequence, list[int], torch.Tensor, "torch.Tensor | None"]]):
        """One target forward over the new rows of several sequences, back to back: [(seq, tokens, positions,
        tree_mask)] -> hidden [sum of rows, hidden]. Each part's K/V go into its own slot after its cached prefix."""
        if self.device.type == "cuda" and len(parts) > 1:  # every row of the step: one kernel launch per layer
            segments, group = [], self._kernel_group(parts)
        else:  # CPU: decode steps of several sequences attend in one call (per-sequence calls cost a few dozen
            # small ops per layer each); trees and prompt chunks attend per sequence
            batch_decodes = sum(len(p[1]) == 1 for p in parts) > 1
            segments, decodes, start = [], [], 0
            for seq, tokens, _, tree_mask in parts:
                n = len(tokens)
                if batch_decodes and n == 1:
                    decodes.append((start, seq))
                else:
                    attn = make_attention(self.device, seq.cache_len, n, tree_mask, self.dtype, self.max_seq_len)
                    segments.append(Segment(start, start + n, self.pool.k[:, seq.slot], self.pool.v[:, seq.slot],
                                            seq.cache_len, tree_mask, attn))
                start += n
            group = None
            if decodes:
                slots, lens = [s.slot for _, s in decodes], [s.cache_len for _, s in decodes]
                group = RowGroup(torch.tensor([r for r, _ in decodes], device=self.device),
                                 torch.tensor(slots, device=self.device), torch.tensor(lens, device=self.device),
                                 self.pool.k, self.pool.v,
                                 make_decode_group_attention(slots, lens, self.dtype, self.max_seq_len, self.device))
        tokens = parts[0][1] if len(parts) == 1 else [t for p in parts for t in p[1]]
        positions = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts])
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.model(ids, positions, segments, group)  # [T, hidden]

    def _kernel_group(self, parts) -> RowGroup:
        """Every row of a multi-sequence forward for the batched Triton kernel: per-row slot and cache row, and the
        per-sequence layout (slot, cache length, row offsets, causal flag, tree bits) built once for all layers."""
        slots, lens, starts, causal, masks, row_slots, row_pos = [], [], [0], [], [], [], []
        for seq, tokens, _, tree_mask in parts:
            n = len(tokens)
            slots.append(seq.slot)
            lens.append(seq.cache_len)
            starts.append(starts[-1] + n)
            causal.append(tree_mask is None and n > 1)
            masks.append(tree_mask if tree_mask is not None else torch.ones(n, dtype=torch.long, device=self.device))
            row_slots += [seq.slot] * n
            row_pos += range(seq.cache_len, seq.cache_len + n)
        t = self._long
        return RowGroup(torch.arange(starts[-1], device=self.device), t(row_slots), t(row_pos), self.pool.k,
                        self.pool.v, make_batched_kernel_attention(t(slots), t(lens), t(starts), torch.cat(masks),
                                                                  t(causal).bool()))

    def prefill(self, seq: Sequence) -> list[int]:
        """Cache the whole prompt's KV and sample the first token; returns the tokens emitted."""
        return self.run([], [(seq, seq.prompt_len)])[seq.seq_id]

    @torch.inference_mode()
    def verify(self, seq: Sequence, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the tree rows; returns (logits [T+1, V], hidden [T+1, hidden]).

        Rows are written to cache rows [cache_len, cache_len + T + 1) at positions cache_len + depth.
        """
        hidden = self._forward_rows([self._tree_rows(seq, tree)])
        return self.model.logits(hidden), hidden

    def _tree_rows(self, seq: Sequence, tree: DraftTree):
        depths = torch.tensor(tree.depths(), dtype=torch.long, device=self.device)
        mask = ancestor_bitmask(tree.parents).to(self.device) if tree.num_rows > 1 else None
        return seq, tree.tokens, seq.cache_len + depths, mask

    def commit(self, seq: Sequence, rows: list[int], hidden: torch.Tensor) -> None:
        """Keep the accepted rows' KV (and hidden states) at [cache_len, cache_len + len(rows)); drop the rest."""
        self._compact_many([(seq, rows)])
        self._advance(seq, hidden[rows])

    def _advance(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The rows whose KV now sits at [cache_len, cache_len + n) are cached: keep their hidden states [n, hidden]
        and move the cache length past them."""
        n = hidden.shape[0]
        self.pool.hidden[seq.slot, seq.cache_len:seq.cache_len + n] = hidden
        seq.cache_len += n
        self.pool.set_length(seq.slot, seq.cache_len)

    def _long(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    # -- one step: speculative steps and prefill chunks in one target forward ------------------------------------
    @torch.inference_mode()
    def step(self, seq: Sequence) -> list[int]:
        """Draft, verify, accept, compact; returns the tokens emitted (at least one unless already finished)."""
        return self.run([seq])[seq.seq_id]

    @torch.inference_mode()
    def run(self, steps: list[Sequence], prefills: list[tuple[Sequence, int]] = (),
            max_rows: dict[int, int] | None = None) -> dict[int, list[int]]:
        """One target forward for a batch: a speculative step (draft, verify, accept, compact) for each sequence of
        ``steps`` and the next ``n`` prompt tokens of each (sequence, n) of ``prefills``; returns {seq_id: tokens
        emitted} (a prompt's first token comes with its last chunk).

        ``max_rows`` caps a sequence's tree rows (root included; default MAX_TREE_ROWS): at 1 the drafter is not
        asked at all and the step is a plain decode step. The drafter sees the cap (``SequenceView.max_rows``), which
        also stops at the tokens the request still wants and at the context's end. A seeded request's tokens are a
        function of its seed and the target's distributions (``core.sampling``), so neither the batch nor the draft
        changes them.
        """
        out: dict[int, list[int]] = {}
        parts, trees = [], []
        for seq in steps:
            if seq.finish_reason is not None:
                out[seq.seq_id] = []
                continue
            # rows past the context, past the tokens the request still wants (a step emits at most its rows), or past
            # the budget's allowance would be verified for nothing
            cap = min(MAX_TREE_ROWS, self.max_seq_len - seq.cache_len, seq.max_new_tokens - seq.num_generated,
                      (max_rows or {}).get(seq.seq_id, MAX_TREE_ROWS))
            seq.max_rows = cap
            tree = self._propose(seq) if cap > 1 else DraftTree.root_only(seq.token_ids[-1])
            trees.append((seq, tree.truncate(cap), cap > 1))
            parts.append(self._tree_rows(seq, trees[-1][1]))
        chunks = []
        for seq, n in prefills:
            start = seq.cache_len
            n = min(n, seq.prompt_len - start)
            if n < 1:
                raise ValueError(f"sequence {seq.seq_id} has no prompt tokens left to prefill")
            chunks.append((seq, start, n))
            parts.append((seq, seq.token_ids[start:start + n], torch.arange(start, start + n, device=self.device),
                          None))
        if not parts:
            return out
        t0 = time.perf_counter()
        hidden = self._forward_rows(parts)
        # logits for every tree row, and for the last prompt row of a prompt that is now fully cached
        logit_rows, at = [], 0
        for _, tree, _ in trees:
            logit_rows.extend(range(at, at + tree.num_rows))
            at += tree.num_rows
        for seq, start, n in chunks:
            if start + n == seq.prompt_len:
                logit_rows.append(at + n - 1)
            at += n
        logits = self.model.logits(hidden if len(logit_rows) == hidden.shape[0] else hidden[logit_rows])
        seconds = time.perf_counter() - t0
        at, accepted = 0, []
        for seq, tree, _ in trees:  # acceptance per sequence, each with its own seed or generator
            n, sp = tree.num_rows, seq.sampling
            if sp.greedy:
                accepted.append(accept_greedy(tree, logits[at:at + n]))
            elif sp.seed is not None:
                accepted.append(accept_seeded(tree, target_probs(logits[at:at + n], sp), sp.seed, len(seq.token_ids)))
            else:
                accepted.append(accept_sampling(tree, target_probs(logits[at:at + n], sp), seq.generator))
            at += n
        self._compact_many([(seq, rows) for (seq, _, _), (rows, _) in zip(trees, accepted)])
        at = 0
        for (seq, tree, drafted), (rows, tokens) in zip(trees, accepted):
            out[seq.seq_id] = self._finish_step(seq, tree, rows, tokens, hidden[at:at + tree.num_rows], seconds,
                                                drafted)
            at += tree.num_rows
        li = at
        for seq, start, n in chunks:
            self._advance(seq, hidden[at:at + n])
            at += n
            if seq.cache_len < seq.prompt_len:
                out[seq.seq_id] = []
                continue
            out[seq.seq_id] = self._first_token(seq, logits[li:li + 1])
            li += 1
        return out

    def _propose(self, seq: Sequence) -> DraftTree:
        t0 = time.perf_counter()
        tree = self.drafter.propose(self.view(seq))
        seq.stats.draft_seconds += time.perf_counter() - t0
        tree.validate(self.model.args.vocab_size)
        if tree.tokens[0] != seq.token_ids[-1]:
            raise RuntimeError(f"drafter {self.drafter.name!r} rooted its tree at {tree.tokens[0]}, "
                               f"not at the last accepted token {seq.token_ids[-1]}")
        return tree

    def _compact_many(self, accepted: list[tuple[Sequence, list[int]]]) -> None:
        """Move every sequence's accepted rows into place (before any drafter reads the cache): one launch for the
        whole step on CUDA, one per sequence elsewhere. Rows already in place (a prefix) are not moved."""
        moves = [(seq, rows) for seq, rows in accepted if rows != list(range(len(rows)))]
        if not moves:
            return
        if self.device.type == "cuda" and len(moves) > 1:
            starts = [0]
            for _, rows in moves:
                starts.append(starts[-1] + len(rows))
            kv_compact_batched(self.pool.k, self.pool.v, self._long([s.slot for s, _ in moves]),
                               self._long([s.cache_len + r for s, rows in moves for r in rows]),
                               self._long([s.cache_len for s, _ in moves]), self._long(starts),
                               max_rows=max(len(r) for _, r in moves))
            return
        for seq, rows in moves:
            src = self._long(rows) + seq.cache_len
            compact_kv(self.pool.k, self.pool.v, seq.slot, src, seq.cache_len)

    def _finish_step(self, seq: Sequence, tree: DraftTree, rows: list[int], tokens: list[int], hidden: torch.Tensor,
                     seconds: float, drafted: bool) -> list[int]:
        """After compaction: the accepted rows' hidden states, the cache length, the emitted tokens, the stats, and
        the drafter's observe."""
        self._advance(seq, hidden[rows])
        result = VerifyResult(rows, tokens, tree.num_draft)
        emitted = self._append(seq, tokens)
        s = seq.stats
        s.verify_steps += 1
        s.draft_tokens += tree.num_draft
        s.max_draft = max(s.max_draft, tree.num_draft)
        s.accepted_tokens += result.num_accepted
        s.step_tokens += len(emitted)
        s.verify_seconds += seconds
        if drafted and seq.finish_reason is None:
            self.drafter.observe(self.view(seq), result)
        return emitted

    def _first_token(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """The prompt is cached: sample the first token from the last prompt row's logits [1, V]."""
        sp = seq.sampling
        if sp.greedy:
            tok = int(logits.argmax(-1).item())
        elif sp.seed is not None:
            tok = race(target_probs(logits, sp)[0], token_clocks(sp.seed, len(seq.token_ids), logits.shape[-1]))[0]
        else:
            tok = int(torch.multinomial(target_probs(logits, sp)[0], 1, generator=seq.generator).item())
        emitted = self._append(seq, [tok])
        if seq.finish_reason is None:
            self.drafter.prefill(self.view(seq))
        return emitted

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append emitted tokens, stopping at a stop token, max_new_tokens or the end of the context."""
        out = []
        for t in tokens:
            seq.token_ids.append(t)
            out.append(t)
            if t in seq.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.num_generated >= seq.max_new_tokens or len(seq.token_ids) >= self.max_seq_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        return out

    # -- offline ---------------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, max_new_tokens: int = 16,
                 stop_token_ids: tuple[int, ...] | list[int] | None = None) -> "GenerationOutput":
        seq = self.add(prompt_ids, sampling, max_new_tokens, stop_token_ids)
        try:
            t0 = time.perf_counter()
            self.prefill(seq)
            t1 = time.perf_counter()
            while seq.finish_reason is None:
                self.step(seq)
            t2 = time.perf_counter()
        finally:
            self.release(seq)
        return GenerationOutput(seq.output_ids, seq.finish_reason, seq.stats, prefill_s=t1 - t0, decode_s=t2 - t1)


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str
    stats: SeqStats
    prefill_s: float = 0.0
    decode_s: float = 0.0


__all__ = ["Engine", "GenerationOutput", "NoFreeSlotError", "RequestError", "SamplingParams", "Sequence",
           "load_target"]
