"""A Llama-family decoder written for tree verification: Llama 2 / 3, SmolLM, Mistral, Qwen2 / 2.5, Qwen3, Gemma 3.

Reimplements transformers' ``LlamaForCausalLM`` forward (RMSNorm, RoPE with the model's theta and scaling, GQA
attention, SwiGLU MLP, tied or untied LM head) and what the other families change from it (``core.ops.LlamaArgs``:
q/k/v biases, q/k norms, GeGLU, norms around each sublayer, scaled embeddings, a second RoPE table for sliding
layers, another softmax scale) so that attention can go through our own kernels: every forward
takes a set of new rows (1 = decode, many + causal = prefill, a draft tree = verification), writes their K/V into
the sequence's KV slot right after the cached prefix, and attends to prefix + visible new rows.

Projections are fused (one QKV matmul, one gate/up matmul) and the layers call their weights directly rather than
through nn.Module: on a 2-core CPU the per-op overhead of a 30-layer model is a large share of a decode step.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from core.ops import LlamaArgs, Rope, apply_rope, linear, rms_norm
from specserve_kernels import cpu as cpu_kernels
from specserve_kernels.cpu import BlockQuantWeight

# attention(q [T,H,D], k_cache [H_kv,S,D], v_cache, cache_len, tree_mask | None) -> [T,H,D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]


@dataclass
class Segment:
    """One sequence's new rows in a forward: rows ``start:end`` of the batch, after its ``cache_len`` cached tokens
    in its KV slot (all layers). ``tree_mask``: int64 ancestor bits per row, or None for causal rows. ``local``: the
    attention of the model's sliding-window layers, where their window hides keys from these rows."""

    start: int
    end: int
    k: torch.Tensor  # [L, H_kv, S, D]
    v: torch.Tensor
    cache_len: int
    tree_mask: torch.Tensor | None
    attention: AttentionFn
    local: AttentionFn | None = None


@dataclass
class RowGroup:
    """Rows of several sequences whose K/V writes and attention run as one call per layer: row ``rows[i]`` of the
    batch goes to cache row ``positions[i]`` of slot ``slots[i]``. On CPU the decode steps of a batch (16-bit targets
    with the C++ attention: every row after a cached prefix); on CUDA every row of a multi-sequence step (the batched
    Triton kernel)."""

    rows: "torch.Tensor | slice"  # [n] long, or a slice of the batch
    slots: torch.Tensor      # [n] long
    positions: torch.Tensor  # [n] long
    k: torch.Tensor          # [L, num_slots, H_kv, S, D], the whole pool
    v: torch.Tensor
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q [n,H,D], k/v [slots,H_kv,S,D]
    local: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # sliding-window layers


@dataclass
class CpuRows:
    """Every row of a forward of the quantized CPU target (float32), for ``specserve_kernels.cpu.decoder``: row t's K/V go
    to cache row ``pos[t]`` of slot ``slot[t]``, and it attends to rows 0 .. cached[t] - 1 of that slot, then to rows
    base[t] + j for each bit j of bits[t] (a draft row's ancestors). One call per layer for all sequences."""

    k: torch.Tensor  # [L, num_slots, H_kv, S, D], the whole pool
    v: torch.Tensor
    slot: torch.Tensor    # [T] long, each on the CPU
    pos: torch.Tensor
    cached: torch.Tensor
    base: torch.Tensor
    bits: torch.Tensor


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.a = a
        qkv_out = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.attn_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.wqkv = nn.Linear(a.hidden_size, qkv_out, bias=False)
        self.wo = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.w_gate_up = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.w_down = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        if a.qkv_bias:
            self.qkv_bias = nn.Parameter(torch.zeros(qkv_out))
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))
        if a.sandwich_norms:  # Gemma: the attention and MLP outputs are normed before each residual add
            self.attn_out_norm = nn.Parameter(torch.ones(a.hidden_size))
            self.mlp_out_norm = nn.Parameter(torch.ones(a.hidden_size))
        # q's factor that makes the kernels' head_dim ** -0.5 softmax scale the family's own
        self.q_factor = None if a.attn_scale is None else a.attn_scale * a.head_dim ** 0.5

    def forward(self, x, cos, sin, layer: int, segments: list[Segment], group: RowGroup | None = None):
        a = self.a
        T, H, H_kv = x.shape[0], a.num_heads, a.num_kv_heads
        # the CPU block-quantized kernel takes the norms, SwiGLU and residual adds into its calls (float32 rows)
        fused = isinstance(self.wqkv.weight, BlockQuantWeight) and x.dtype == torch.float32
        if fused:
            qkv = self.wqkv.weight.fused(x, self.attn_norm, a.rms_norm_eps)
        else:
            qkv = linear(rms_norm(x, self.attn_norm, a.rms_norm_eps), self.wqkv.weight)  # [T, (H + 2 H_kv) D]
        if a.qkv_bias:
            qkv = qkv + self.qkv_bias
        qkv = qkv.view(T, H + 2 * H_kv, a.head_dim)
        qk = qkv[:, :H + H_kv]
        if a.qk_norm:  # per head, before RoPE
            qk = torch.cat([rms_norm(qk[:, :H], self.q_norm, a.rms_norm_eps),
                            rms_norm(qk[:, H:], self.k_norm, a.rms_norm_eps)], dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k heads are adjacent: one rotation for both
        if self.q_factor is not None:
            qk = torch.cat([qk[:, :H] * self.q_factor, qk[:, H:]], dim=1)
        # one attention call gives every row's output: a lone segment, or a group of the whole batch
        whole_group = group is not None and not segments and isinstance(group.rows, slice)
        o = None if (len(segments) == 1 and group is None) or whole_group else qkv.new_empty(T, H, a.head_dim)
        local = layer in a.sliding_layers  # a sliding-window layer: its rows' own attention where the window hides keys
        if group is not None:
            k_layer, v_layer = group.k[layer], group.v[layer]  # [num_slots, H_kv, S, D]
            k_layer[group.slots, :, group.positions] = qk[group.rows, H:]
            v_layer[group.slots, :, group.positions] = qkv[group.rows, H + H_kv:]
            attend = group.local if local and group.local is not None else group.attention
            out = attend(qk[group.rows, :H], k_layer, v_layer)
            if o is None:
                o = out
            else:
                o[group.rows] = out
        for s in segments:  # attention reads each sequence's own KV; the matmuls around it take every row at once
            k_cache, v_cache, n = s.k[layer], s.v[layer], s.end - s.start
            # New rows go right after the prefix; acceptance later compacts the accepted ones into place.
            k_cache[:, s.cache_len:s.cache_len + n] = qk[s.start:s.end, H:].transpose(0, 1)
            v_cache[:, s.cache_len:s.cache_len + n] = qkv[s.start:s.end, H + H_kv:].transpose(0, 1)
            attend = s.local if local and s.local is not None else s.attention
            out = attend(qk[s.start:s.end, :H], k_cache, v_cache, s.cache_len, s.tree_mask)  # [n, H, D]
            if o is None:
                o = out
            else:
                o[s.start:s.end] = out
        if fused and a.plain_block:
            x = self.wo.weight.fused(o.reshape(T, -1), residual=x)
            gate_up = self.w_gate_up.weight.fused(x, self.mlp_norm, a.rms_norm_eps)
            return self.w_down.weight.fused(gate_up, swiglu=True, residual=x)
        if a.sandwich_norms:
            x = x + rms_norm(linear(o.reshape(T, -1), self.wo.weight), self.attn_out_norm, a.rms_norm_eps)
        else:
            x = x + linear(o.reshape(T, -1), self.wo.weight, any_layout=True)  # the sum takes x's (row) layout
        gate, up = linear(rms_norm(x, self.mlp_norm, a.rms_norm_eps), self.w_gate_up.weight,
                          any_layout=True).chunk(2, dim=-1)
        act = F.silu(gate) if a.act == "silu" else F.gelu(gate, approximate="tanh")
        if a.sandwich_norms:
            return x + rms_norm(linear(act * up, self.w_down.weight), self.mlp_out_norm, a.rms_norm_eps)
        return x + linear(act * up, self.w_down.weight, any_layout=True)


_CPU_DECODERS: "weakref.WeakKeyDictionary[Llama, dict]" = weakref.WeakKeyDictionary()  # (start, end) -> decoder


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs, max_len: int):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = Rope(args, max_len)
        # the sliding layers' own RoPE base (Gemma 3), and which layers take it
        self.local_rope = Rope(_local_rope_args(args), max_len) if any(args.layer_rope) else None

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding of ``tokens`` [T] -> [T, hidden] (Gemma scales it by sqrt(hidden) in its dtype)."""
        x = self.embed(tokens)
        if self.args.embed_scale is not None:
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
        return x

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                group: RowGroup | None = None, rows: CpuRows | None = None,
                taps: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the new rows of one or more sequences; returns the last layer's hidden states (before the final
        norm), [T, hidden].

        tokens, positions: [T], the sequences' rows back to back (positions = each sequence's cache length + depth);
        ``segments`` and ``group`` (rows attended together) say whose rows are where.
        taps: {n: None, ...} gets, for each n, the residual stream after the first n layers ([T, hidden]).
        """
        x = self.embed_tokens(tokens)  # [T, hidden]
        cos, sin = self.rope.table(positions, x.dtype)  # [T, 1, D] each, shared by every layer
        tables = [(cos, sin)] * len(self.layers)
        if self.local_rope is not None:
            local = self.local_rope.table(positions, x.dtype)
            tables = [local if is_local else (cos, sin) for is_local in self.args.layer_rope]
        if rows is not None:
            cos, sin = cos[:, 0], sin[:, 0]  # [T, D]
            start = 0  # the compiled layer loop, in one call per range between taps
            for end in sorted({n for n in taps or () if 0 < n < len(self.layers)} | {len(self.layers)}):
                x = self._cpu_decoder(start, end).forward(x, cos, sin, rows.k[start:end], rows.v[start:end],
                                                          rows.slot, rows.pos, rows.cached, rows.base, rows.bits)
                if taps is not None and end in taps:
                    taps[end] = x
                start = end
            return x
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, *tables[i], i, segments, group)  # .forward: skip hook dispatch
            if taps is not None and i + 1 in taps:
                taps[i + 1] = x
        return x

    def _cpu_decoder(self, start: int, end: int):
        """Layers [start, end) of the quantized CPU target in one C++ call (``specserve_kernels.cpu.decoder``), built on first
        use (kept beside the model, not in it, so the model stays deep-copyable)."""
        decs = _CPU_DECODERS.setdefault(self, {})
        dec = decs.get((start, end))
        if dec is None:
            dec = cpu_kernels.decoder([(b.wqkv.weight, b.wo.weight, b.w_gate_up.weight, b.w_down.weight, b.attn_norm,
                                        b.mlp_norm) for b in self.layers[start:end]], self.args.rms_norm_eps,
                                      self.args.num_heads)
            decs[(start, end)] = dec
        return dec

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] pre-norm hidden states -> [T, V] logits."""
        w = self.lm_head.weight
        if isinstance(w, BlockQuantWeight) and hidden.dtype == torch.float32:
            return w.fused(hidden, self.norm, self.args.rms_norm_eps)
        return linear(rms_norm(hidden, self.norm, self.args.rms_norm_eps), w)

    def matmul_weights(self) -> list:
        """The weights ``linear`` multiplies by (tensors, or packed quantized matrices)."""
        per_layer = [getattr(layer, n).weight for layer in self.layers for n in ("wqkv", "wo", "w_gate_up", "w_down")]
        return per_layer + [self.lm_head.weight]

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load transformers' weight names (every supported family's) into the fused layout. ``state`` is consumed:
        each tensor leaves it as it is placed, so fusing q/k/v and gate/up never holds a layer's weights twice."""
        take = state.pop
        a = self.args
        # Gemma's RMSNorm scales by (1 + w), computed in float32 as transformers does: stored as that sum
        norm = (lambda w: 1.0 + w.float()) if a.norm_plus_one else (lambda w: w)
        own = {"embed.weight": take("model.embed_tokens.weight"), "norm": norm(take("model.norm.weight"))}
        if not a.tie_word_embeddings:
            own["lm_head.weight"] = take("lm_head.weight")
        for i in range(a.num_layers):
            p, o = f"model.layers.{i}.", f"layers.{i}."
            own[o + "attn_norm"] = norm(take(p + "input_layernorm.weight"))
            if a.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
                own[o + "attn_out_norm"] = norm(take(p + "post_attention_layernorm.weight"))
                own[o + "mlp_norm"] = norm(take(p + "pre_feedforward_layernorm.weight"))
                own[o + "mlp_out_norm"] = norm(take(p + "post_feedforward_layernorm.weight"))
            else:
                own[o + "mlp_norm"] = take(p + "post_attention_layernorm.weight")
            own[o + "wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            if a.qkv_bias:
                own[o + "qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            if a.qk_norm:
                own[o + "q_norm"] = norm(take(p + "self_attn.q_norm.weight"))
                own[o + "k_norm"] = norm(take(p + "self_attn.k_norm.weight"))
            own[o + "wo.weight"] = take(p + "self_attn.o_proj.weight")
            own[o + "w_gate_up.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            own[o + "w_down.weight"] = take(p + "mlp.down_proj.weight")
        # assign=True: the module may have been built on the meta device to skip random init.
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not (a.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weight mismatch: missing={missing} unexpected={unexpected}")
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if self.rope.cos.is_meta:
            self.rope = Rope(a, self.rope.cos.shape[0])
        if self.local_rope is not None and self.local_rope.cos.is_meta:
            self.local_rope = Rope(_local_rope_args(a), self.local_rope.cos.shape[0])


def _local_rope_args(a: LlamaArgs) -> LlamaArgs:
    """The sliding layers' RoPE: their own base, no scaling (Gemma 3)."""
    return dataclasses.replace(a, rope_theta=a.local_rope_theta, rope_scaling=None)

