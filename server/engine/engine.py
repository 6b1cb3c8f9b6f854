"""The batched step: the draft -> verify -> accept -> compact loop over a ``StepPlan``.

The loaded target is ``server.engine.target``, a sequence's state ``server.engine.sequence``, the plan and result types
``server.engine.step``. One step of one sequence (see ``Engine.run``):
  tree = drafter.propose(seq)            # row 0 = root = last accepted token
  logits = verify(seq, tree)             # one target forward over all tree rows (prefix + ancestors + self)
  path, tokens = accept(tree, logits)    # greedy or lossless speculative sampling
  commit(seq, path)                      # compact the accepted rows' KV to [cache_len, cache_len + len(path))
  drafter.observe(seq, result)
Sequences are independent: one step runs any number of them (and prompt chunks of others) in one target forward.
KV slots and prefix admission: ``slots.py``; attention metadata: ``rows.py``; log probabilities: ``logprobs.py``.
"""
from __future__ import annotations

import itertools
import time
from itertools import accumulate

import torch

from core.grammar import GrammarError, GrammarTokenizer
from core.ops import top1
from core.sampling import SamplingParams, Shaper, race, request_generator, target_probs, token_clocks
from core.tree import MAX_TREE_ROWS, DraftTree, VerifyResult
from drafters.base import Drafter, create_drafter
from specserve_kernels import cpu as cpu_kernels
from specserve_kernels.kv_compact import kv_compact_batched
from specserve_kernels.tree_mask import ancestor_bitmask
from server.config import EngineConfig
from server.engine.acceptance import ShapedRows, accept_greedy, accept_sampling, accept_seeded
from server.engine.backend import compact_kv
from server.engine.constrained import constrain_tree
from server.engine.faults import FaultPlan, isolate
from server.engine.kv_cache import KVCachePool, auto_num_slots, bytes_per_slot
from server.engine.kv_events import AllBlocksCleared, BlockLedger, EventPublisher, KVEventsConfig
from server.engine.logprobs import prompt_logprobs, token_logprobs
from server.engine.prefix_cache import Hit, PrefixCache
from server.engine.rows import RowLayout
from server.engine.sequence import GenerationOutput, RequestError, Sequence, SeqView
from server.engine.slots import Slots
from server.engine.step import SeqStep, StepPlan, StepResult
from server.engine.target import Target


class Engine:
    def __init__(self, cfg: EngineConfig, drafter: Drafter | None = None, target: Target | None = None):
        """An engine on ``target`` (``server.engine.load_target``), drafting with ``drafter`` (default: the config's)."""
        if target is None:
            raise TypeError("Engine needs a loaded target: server.engine.load_engine(cfg) loads one")
        self.cfg, self.target, self.model = cfg, target, target.model
        a = self.model.args
        self.device, self.dtype = target.device, target.dtype
        # the quantized CPU target in float32 (Llama's layer): every row through the row-invariant C++ attention, K/V kept in float16
        # (the C++ attention knows no sliding window: a windowed model's rows take the PyTorch forms)
        self.exact_cpu = (self.device.type == "cpu" and self.dtype == torch.float32 and target.kernels == "qlinear"
                          and a.plain_block and a.window is None)  # the fused C++ decoder computes Llama's layer only
        kv_dtype = torch.float16 if self.exact_cpu else self.dtype
        # a 16-bit CPU target where the C++ kernels load: every row after a cached prefix (decode steps, draft trees,
        # later prompt chunks) of every sequence through their row-invariant attention, one call per layer
        self.row_kernel = (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
                           and a.window is None and cpu_kernels.load() is not None)
        self.drafter = drafter or create_drafter(cfg.drafter.name, target, cfg.drafter.options_for())
        # lower layers the drafter reads: their residual stream is kept beside the last layer's, per cached token
        self.taps = tuple(getattr(self.drafter, "target_taps", ()))
        if any(not 0 < n < a.num_layers for n in self.taps):
            raise ValueError(f"drafter {cfg.drafter.name!r} reads target layers {self.taps}; the target has "
                             f"{a.num_layers}")
        width = a.hidden_size * (1 + len(self.taps))
        slots = cfg.cache.num_slots or auto_num_slots(bytes_per_slot(
            a.num_layers, a.num_kv_heads, cfg.cache.max_seq_len, a.head_dim, width, self.dtype, kv_dtype),
            self.device)
        self.pool = KVCachePool(a.num_layers, slots, a.num_kv_heads, cfg.cache.max_seq_len,
                                a.head_dim, width, self.dtype, self.device, kv_dtype)
        self.max_seq_len = cfg.cache.max_seq_len
        self.layout = RowLayout(self.pool, self.device, self.dtype, self.max_seq_len, self.row_kernel, a.window)
        self._ids = itertools.count()
        self.events: EventPublisher | None = None  # KV-cache events (server.kv_events), published from a thread
        ledger = None
        if cfg.server.kv_events is not None:
            events_cfg = KVEventsConfig.from_dict(cfg.server.kv_events)
            self.events = EventPublisher(events_cfg)
            self.events.publish([AllBlocksCleared()])  # a starting engine's cache is empty
            # "GPU": vLLM's name for the engine's own KV cache on any device ("CPU" means an offloaded tier, which
            # routers credit less: vLLM's kv_aware policy at 0.8)
            ledger = BlockLedger(events_cfg.block_size, "GPU")
        self.prefix = PrefixCache(cfg.cache.prefix_caching, ledger, self.events.publish if self.events else None)
        self.slots = Slots(self.pool, self.prefix)
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self.faults: FaultPlan | None = None  # a test hook (server.engine.faults): None in production

    def close(self) -> None:
        """Stop what the engine runs beside its steps (the KV-event publisher's thread and sockets)."""
        if self.events is not None:
            self.events.close()
            self.events = None

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The model's tokenizer for the grammar engine, built on the first request with a grammar."""
        if self._grammar_tokenizer is None:
            from server.model_files import load_tokenizer
            from server.tokenization import stop_token_ids

            if self.target.hf_dir is None:
                raise RequestError("this target has no tokenizer files: grammars are not available")
            tok = load_tokenizer(self.target.hf_dir)
            self._grammar_tokenizer = GrammarTokenizer(tok, self.model.args.vocab_size,
                                                       stop_token_ids(tok, self.model.args.eos_token_ids))
        return self._grammar_tokenizer

    # -- admission ---------------------------------------------------------------------------------------------
    def add(self, prompt_ids: list[int], sampling: SamplingParams | None = None, max_new_tokens: int = 16,
            stop_token_ids: tuple[int, ...] | list[int] | None = None, seq_id: int | None = None,
            namespace: str | None = None) -> Sequence:
        """Validate a request and give it a KV slot (raises NoFreeSlotError when every slot runs a sequence).

        With a cached prefix (``prefix_hit``) the slot starts with those rows: an idle slot that holds them is adopted
        as it is, else they are copied from their slot; only the rest of the prompt is prefilled. ``namespace`` is the
        prefix cache's partition (None: the default one; with ``cache.prefix_caching`` off, None looks nothing up)."""
        if not prompt_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        if len(prompt_ids) >= self.max_seq_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_seq_len} "
                               "(prompt + at least one generated token)")
        V = self.model.args.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < V for t in prompt_ids):
            raise RequestError(f"prompt token ids must be integers in [0, {V})")
        sampling = sampling or SamplingParams()
        if max_new_tokens < 1 and not (max_new_tokens == 0 and sampling.prompt_logprobs is not None):
            raise RequestError("max_new_tokens must be >= 1 (0 only to score the prompt: with prompt logprobs)")
        shaper = None
        if sampling.shaped:
            try:
                matcher = None if sampling.grammar is None else self.grammar_tokenizer.matcher(sampling.grammar)
                shaper = Shaper(sampling, prompt_ids, V, self.device, matcher)
            except (GrammarError, ValueError) as e:
                raise RequestError(str(e)) from None
        ns = "" if namespace is None else namespace
        # prompt logprobs need every prompt row's logits: nothing cached is reused
        hit = Hit(None, 0) if sampling.prompt_logprobs is not None else self.prefix_hit(prompt_ids, namespace)
        slot = self.slots.take(hit, ns, prompt_ids)
        try:
            gen = request_generator(sampling, self.device)
            if self.faults:
                self.faults.check("admit", [prompt_ids])
        except BaseException:  # nothing runs in the slot: free it
            self.slots.free(slot)
            raise
        seq = Sequence(seq_id=next(self._ids) if seq_id is None else seq_id, slot=slot,
                       prompt_len=len(prompt_ids), token_ids=list(prompt_ids), sampling=sampling,
                       max_new_tokens=max_new_tokens, stop_token_ids=frozenset(stop_token_ids or ()),
                       generator=gen, cache_len=hit.length, cached_tokens=hit.length, namespace=ns, shaper=shaper,
                       prompt_logprobs=None if sampling.prompt_logprobs is None else [None])
        self.slots.running[slot] = seq
        return seq

    def prefix_hit(self, prompt_ids: list[int], namespace: str | None = None) -> Hit:
        """The longest prefix of the prompt whose KV rows a slot holds now (``Slots.hit``)."""
        return self.slots.hit(prompt_ids, namespace)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """The sequence is done (finished or aborted): free the drafter's state and its slot (``Slots.release``)."""
        self.drafter.release(seq.seq_id)
        self.slots.release(seq, cache)

    @property
    def slots_running(self) -> int:
        """Slots held by running sequences (idle prefix-cache slots are free to take)."""
        return len(self.slots.running)

    @property
    def slots_available(self) -> int:
        return self.pool.num_slots - len(self.slots.running)

    def kv_usage(self) -> tuple[float, float]:  # (running sequences', idle cached slots') share of the KV capacity
        return self.slots.usage()

    def view(self, seq: Sequence) -> SeqView:
        return SeqView(seq, self.pool, self.target)

    # -- target forwards ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq: Sequence, tokens: list[int], positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """T new rows of one sequence after its cached prefix (causal, unless ``tree_mask``; positions default to
        the rows after the prefix) -> hidden [T, hidden]. Writes their K/V past the prefix and commits nothing: the
        cache length stays (as after a rejected draft)."""
        if positions is None:
            positions = torch.arange(seq.cache_len, seq.cache_len + len(tokens), device=self.device)
        return self.forward_rows([(seq, tokens, positions, tree_mask)])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``forward``'s output (the last layer's states, then any taps) -> logits [T, V]."""
        if self.taps:
            hidden = hidden[:, :self.model.args.hidden_size].contiguous()
        return self.model.logits(hidden)

    @torch.inference_mode()
    def forward_rows(self, parts: list[tuple[Sequence, list[int], torch.Tensor, "torch.Tensor | None"]]):
        """One target forward over the new rows of several sequences, back to back: [(seq, tokens, positions,
        tree_mask)] -> hidden [sum of rows, hidden], followed by the residual stream after each of ``taps``' layer
        counts where the drafter reads them ([rows, hidden x (1 + taps)]: ``logits`` takes the first part). Each part's
        K/V go into its own slot after its cached prefix."""
        if self.taps:
            tapped = dict.fromkeys(self.taps)
            hidden = self._forward_rows(parts, tapped)
            return torch.cat([hidden] + [tapped[n] for n in self.taps], dim=-1)
        return self._forward_rows(parts, None)

    def _forward_rows(self, parts, taps: dict | None) -> torch.Tensor:
        tokens = parts[0][1] if len(parts) == 1 else [t for p in parts for t in p[1]]
        positions = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts])
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if self.exact_cpu:  # every row of the step: one C++ call per layer for RoPE, K/V writes and attention
            return self.model(ids, positions, [], None, self.layout.cpu_rows(parts), taps)
        segments, group = self.layout.attention(parts)
        return self.model(ids, positions, segments, group, taps=taps)  # [T, hidden]

    def prefill(self, seq: Sequence) -> list[int]:
        """Cache the whole prompt's KV and sample the first token; returns the tokens emitted."""
        return self._one(seq, StepPlan(prefill=[(seq, seq.prompt_len)]))

    @torch.inference_mode()
    def verify(self, seq: Sequence, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the tree rows; returns (logits [T+1, V], hidden [T+1, hidden]).

        Rows are written to cache rows [cache_len, cache_len + T + 1) at positions cache_len + depth.
        """
        hidden = self.forward_rows([self._tree_rows(seq, tree)])
        return self.logits(hidden), hidden

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

    def _long(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    # -- one step: speculative steps and prefill chunks in one target forward ------------------------------------
    @torch.inference_mode()
    def step(self, seq: Sequence) -> list[int]:
        """Draft, verify, accept, compact; returns the tokens emitted (at least one unless already finished)."""
        return self._one(seq, StepPlan([seq]))

    def _one(self, seq: Sequence, plan: StepPlan) -> list[int]:
        """A plan of one sequence: its tokens, or the fault that ended it raised here (offline callers see it)."""
        result = self.run(plan)
        if seq.seq_id in result.failed:
            raise result.failed[seq.seq_id]
        return result.emitted[seq.seq_id]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """One target forward for a batch: a speculative step (draft, verify, accept, compact) for each sequence of
        ``plan.decode`` and the next prompt chunk of each of ``plan.prefill``.

        A sequence's tree rows are capped by ``plan.max_rows`` (default MAX_TREE_ROWS), by the tokens the request
        still wants (a step emits at most its rows) and by the context's end; the drafter sees the cap
        (``SequenceView.max_rows``). A seeded request's tokens are a function of its seed and the target's
        distributions (``core.sampling``), so neither the batch nor the draft changes them.
        """
        out: dict[int, list[int]] = {}
        failed: dict[int, BaseException] = {}  # a sequence whose own part of the step raised: out of the step
        trees = []  # (seq, tree, drafted, propose seconds)
        for seq in plan.decode:
            if seq.finish_reason is not None:
                out[seq.seq_id] = []
                continue
            item = isolate(failed, seq.seq_id, self._plan_tree, seq, plan.max_rows.get(seq.seq_id, MAX_TREE_ROWS))
            if item is not None:
                trees.append(item)
        chunks = []  # (seq, first prompt row, rows)
        for seq, n in plan.prefill:
            start = seq.cache_len
            n = min(n, seq.prompt_len - start)
            if n < 1:
                failed[seq.seq_id] = ValueError(f"sequence {seq.seq_id} has no prompt tokens left to prefill")
                continue
            chunks.append((seq, start, n))
        parts = [self._tree_rows(seq, tree) for seq, tree, _, _ in trees]
        parts += [(seq, seq.token_ids[start:start + n], torch.arange(start, start + n, device=self.device), None)
                  for seq, start, n in chunks]
        if not parts:
            return StepResult(out, {}, failed=failed)
        if self.faults:
            self.faults.check("forward", [seq.token_ids[:seq.prompt_len] for seq, *_ in parts])
        ends = list(accumulate(len(p[1]) for p in parts))
        spans = list(zip([0] + ends[:-1], ends))  # each part's rows of the forward: trees first, then chunks
        tree_spans, chunk_spans = spans[:len(trees)], spans[len(trees):]
        tree_rows = tree_spans[-1][1] if trees else 0
        t0 = time.perf_counter()
        hidden = self.forward_rows(parts)
        # logits for every tree row, then for the last row of each chunk that completes its prompt
        completing = [(seq, b - 1) for (seq, start, n), (_, b) in zip(chunks, chunk_spans)
                      if start + n == seq.prompt_len]
        logit_rows = list(range(tree_rows)) + [row for _, row in completing]
        logits = self.logits(hidden if len(logit_rows) == hidden.shape[0] else hidden[logit_rows])
        seconds = time.perf_counter() - t0
        accepted = [isolate(failed, seq.seq_id, self._accept, seq, tree, logits[a:b])
                    for (seq, tree, _, _), (a, b) in zip(trees, tree_spans)]
        self._compact_many([(seq, acc[0]) for (seq, _, _, _), acc in zip(trees, accepted) if acc is not None])
        steps = {}
        for (seq, tree, drafted, draft_s), acc, (a, b) in zip(trees, accepted, tree_spans):
            if acc is None:
                continue
            rows, tokens, lps = acc
            done = isolate(failed, seq.seq_id, self._finish_step, seq, tree, rows, tokens, lps, hidden[a:b], seconds,
                           drafted)
            if done is not None:
                out[seq.seq_id] = done[0]
                steps[seq.seq_id] = SeqStep(tree.num_draft, done[1], draft_s)
        for (seq, start, n), (a, b) in zip(chunks, chunk_spans):
            if isolate(failed, seq.seq_id, self._prefilled, seq, start, hidden[a:b]) is not None:
                out[seq.seq_id] = []
        for row, (seq, _) in enumerate(completing, start=tree_rows):  # the prompt is cached: its first token
            if seq.seq_id not in failed:
                first = isolate(failed, seq.seq_id, self._first_token, seq, logits[row:row + 1])
                if first is not None:
                    out[seq.seq_id] = first
        return StepResult(out, steps, seconds, failed)

    def _plan_tree(self, seq: Sequence, max_rows: int) -> tuple[Sequence, DraftTree, bool, float]:
        """The tree one decoding sequence verifies this step: its drafter's proposal capped at ``max_rows`` (and by
        what the request and the context still hold), grammar-constrained -> (seq, tree, drafted, draft seconds)."""
        room = min(MAX_TREE_ROWS, self.max_seq_len - seq.cache_len, seq.max_new_tokens - seq.num_generated)
        cap = min(room, max_rows)
        seq.max_rows = cap
        before = seq.stats.draft_seconds
        tree = self._propose(seq) if cap > 1 else DraftTree.root_only(seq.token_ids[-1])
        if seq.matcher is not None and room > 1:
            # grammar-invalid drafts out, forced tokens in: a step the budget keeps plain (cap 1) still
            # verifies the tokens the grammar forces, drafts accepted but for a different tokenization
            cap = cap if cap > 1 else room
            tree = constrain_tree(tree, seq.matcher, cap)
        if self.faults:
            self.faults.check("propose", [seq.token_ids[:seq.prompt_len]])
        tree = tree.truncate(cap).depth_first()  # the likeliest chain first (DraftTree.depth_first)
        return seq, tree, seq.max_rows > 1, seq.stats.draft_seconds - before

    def _prefilled(self, seq: Sequence, start: int, hidden: torch.Tensor) -> bool:
        """A prompt chunk [start, start + n) was computed: its prompt logprobs (when asked for), its rows cached."""
        if seq.prompt_logprobs is not None:
            prompt_logprobs(self.logits, seq, start, hidden)
        self._advance(seq, hidden)
        return True

    def _accept(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor
                ) -> tuple[list[int], list[int], list | None]:
        """(accepted rows, emitted tokens, their logprobs or None) of one tree, with the sequence's own seed or
        generator, every row the walk reads shaped with its own path's state."""
        sp, shaper = seq.sampling, seq.shaper
        if self.faults:
            self.faults.check("accept", [seq.token_ids[:seq.prompt_len]])
        if sp.greedy:
            rows = logits if shaper is None else ShapedRows(tree, logits, shaper)
            path, tokens = accept_greedy(tree, rows)
        else:
            rows = ShapedRows(tree, logits, shaper, sp)  # the rows the walk reads, each when it does
            if sp.seed is not None:
                path, tokens = accept_seeded(tree, rows, sp.seed, len(seq.token_ids))
            else:
                path, tokens = accept_sampling(tree, rows, seq.generator)
        if sp.logprobs is None:
            return path, tokens, None
        return path, tokens, token_logprobs(self.cfg.server.logprobs_mode, seq, logits, rows, path, tokens)

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

    def _finish_step(self, seq: Sequence, tree: DraftTree, rows: list[int], tokens: list[int], logprobs: list | None,
                     hidden: torch.Tensor, seconds: float, drafted: bool) -> tuple[list[int], int]:
        """After compaction: the accepted rows' hidden states, the cache length, the emitted tokens (and their
        logprobs), the stats, and the drafter's observe -> (tokens emitted, draft tokens accepted)."""
        self._advance(seq, hidden[rows])
        result = VerifyResult(rows, tokens, tree.num_draft)
        emitted = seq.append(tokens, logprobs, self.max_seq_len)
        s = seq.stats
        s.verify_steps += 1
        s.draft_tokens += tree.num_draft
        s.max_draft = max(s.max_draft, tree.num_draft)
        s.accepted_tokens += result.num_accepted
        s.step_tokens += len(emitted)
        s.verify_seconds += seconds
        if drafted and seq.finish_reason is None:
            self.drafter.observe(self.view(seq), result)
        return emitted, result.num_accepted

    def _first_token(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """The prompt is cached: sample the first token from the last prompt row's logits [1, V] (a request for 0
        tokens, which only scores its prompt, ends here)."""
        if seq.max_new_tokens == 0:
            seq.finish_reason = "length"
            return []
        if self.faults:
            self.faults.check("first", [seq.token_ids[:seq.prompt_len]])
        sp = seq.sampling
        rows = logits if seq.shaper is None else seq.shaper(logits[0])[None]
        if sp.greedy:
            tok = int(top1(rows).item())
        else:
            rows = target_probs(rows, sp)
            if sp.seed is not None:
                tok = race(rows[0], token_clocks(sp.seed, len(seq.token_ids), logits.shape[-1]))[0]
            else:
                tok = int(torch.multinomial(rows[0], 1, generator=seq.generator).item())
        mode = self.cfg.server.logprobs_mode
        lps = None if sp.logprobs is None else token_logprobs(mode, seq, logits, rows, [0], [tok])
        emitted = seq.append([tok], lps, self.max_seq_len)
        if seq.finish_reason is None:
            self.drafter.prefill(self.view(seq))
        return emitted

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
        return GenerationOutput(seq.output_ids, seq.finish_reason, seq.stats, prefill_s=t1 - t0, decode_s=t2 - t1,
                                logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs)
