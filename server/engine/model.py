"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral-style GQA) written for tree verification.

Reimplements transformers' ``LlamaForCausalLM`` forward (RMSNorm, RoPE with the model's theta and scaling, GQA
attention, SwiGLU MLP, tied or untied LM head) so that attention can go through our own kernels: every forward
takes a set of new rows (1 = decode, many + causal = prefill, a draft tree = verification), writes their K/V into
the sequence's KV slot right after the cached prefix, and attends to prefix + visible new rows.

Projections are fused (one QKV matmul, one gate/up matmul) and the layers call their weights directly rather than
through nn.Module: on a 2-core CPU the per-op overhead of a 30-layer model is a large share of a decode step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaArgs":
        if c.get("model_type", "llama") != "llama" or c.get("attention_bias") \
                or c.get("mlp_bias"):
            raise ValueError(f"unsupported architecture: model_type={c.get('model_type')!r} "
                             "(a Llama-family decoder without biases is supported)")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {c.get('hidden_act')!r}")
        rope = dict(c.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        n_heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"], num_heads=n_heads,
            num_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos_ids,
        )


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies [D/2] with the model's rope scaling (default, linear, llama3), as in transformers."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = args.rope_scaling
    kind = (s or {}).get("rope_type", (s or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(s["factor"])
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


class Rope(nn.Module):
    """cos/sin tables [max_len, D] (halves duplicated, transformers' rotate_half layout), built once in float32.

    ``sin`` has rotate_half's sign folded in (first half negated): x * cos + roll(x, D/2) * sin is then the same
    products as transformers' x * cos + rotate_half(x) * sin, bit for bit (negation is exact), in fewer ops.
    """

    def __init__(self, args: LlamaArgs, max_len: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(args))  # [S, D/2]
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos(), persistent=False)  # [S, D]
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], dim=-1), persistent=False)  # [S, D]

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] for positions [T], cast once per forward (as transformers casts them)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, D] at absolute positions [T]."""
        return apply_rope(x, *self.table(positions, x.dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with Rope.table's cos and signed sin [T, 1, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order of operations (normalize in float32, cast back, then scale), so float32 matches it bit for
    # bit; F.rms_norm computes x * rsqrt(mean(x^2) + eps) like transformers, in fewer Python-level ops.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ weight[out, in].T -> [T, out].

    CPU kernel choice, measured on the default model (bf16, 2 cores; see tests/engine/test_perf_paths.py):
    - one row (decode): torch.mv, ~1.4x faster than addmm with M = 1 in bfloat16, same bits in float32;
    - bfloat16, 2..64 rows (draft verification, short prompts): weight @ x.T, ~1.4x faster than F.linear even with
      the transposing copy (oneDNN's x @ W.T is slow for small M; past ~100 rows it wins again);
    - more rows, or float32: F.linear.
    In bfloat16 mv and weight @ x.T give every row the same bits whatever the row count (F.linear only up to 32
    rows), so a verified draft row gets exactly the logits and KV a decode step would.
    """
    T = x.shape[0]
    if T == 1:
        return torch.mv(weight, x[0]).unsqueeze(0)
    if x.dtype == torch.bfloat16 and T <= 64 and x.device.type == "cpu":
        return torch.mm(weight, x.t()).t().contiguous()  # contiguous: later ops' bits depend on the layout
    return F.linear(x, weight)


# attention(q [T,H,D], k_cache [H_kv,S,D], v_cache, cache_len, tree_mask | None) -> [T,H,D]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]


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

    def forward(self, x, cos, sin, k_cache, v_cache, cache_len: int, tree_mask, attention: AttentionFn):
        a = self.a
        T, H, H_kv = x.shape[0], a.num_heads, a.num_kv_heads
        qkv = linear(rms_norm(x, self.attn_norm, a.rms_norm_eps), self.wqkv.weight)  # [T, (H + 2 H_kv) D]
        qkv = qkv.view(T, H + 2 * H_kv, a.head_dim)
        qk = apply_rope(qkv[:, :H + H_kv], cos, sin)  # q and k heads are adjacent: one rotation for both
        # New rows go right after the prefix; acceptance later compacts the accepted ones into place.
        k_cache[:, cache_len:cache_len + T] = qk[:, H:].transpose(0, 1)
        v_cache[:, cache_len:cache_len + T] = qkv[:, H + H_kv:].transpose(0, 1)
        o = attention(qk[:, :H], k_cache, v_cache, cache_len, tree_mask)  # [T, H, D]
        x = x + linear(o.reshape(T, -1), self.wo.weight)
        gate, up = linear(rms_norm(x, self.mlp_norm, a.rms_norm_eps), self.w_gate_up.weight).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.w_down.weight)


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

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_len: int, tree_mask: torch.Tensor | None, attention: AttentionFn) -> torch.Tensor:
        """Run T new rows; returns the last layer's hidden states (before the final norm), [T, hidden].

        tokens, positions: [T]; k_cache, v_cache: [L, H_kv, S, D] (one sequence's slot, all layers);
        tree_mask: int64 ancestor bitmask [T] (bit j of row i: new row j visible to row i) or None for causal.
        """
        x = self.embed(tokens)  # [T, hidden]
        cos, sin = self.rope.table(positions, x.dtype)  # [T, 1, D] each, shared by every layer
        for layer, k, v in zip(self.layers, k_cache.unbind(0), v_cache.unbind(0)):
            x = layer.forward(x, cos, sin, k, v, cache_len, tree_mask, attention)  # .forward: skip hook dispatch
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] pre-norm hidden states -> [T, V] logits."""
        return linear(rms_norm(hidden, self.norm, self.args.rms_norm_eps), self.lm_head.weight)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load transformers' Llama weight names into the fused layout."""
        a = self.args
        own = {"embed.weight": state["model.embed_tokens.weight"], "norm": state["model.norm.weight"]}
        if not a.tie_word_embeddings:
            own["lm_head.weight"] = state["lm_head.weight"]
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            own[f"layers.{i}.attn_norm"] = state[p + "input_layernorm.weight"]
            own[f"layers.{i}.mlp_norm"] = state[p + "post_attention_layernorm.weight"]
            own[f"layers.{i}.wqkv.weight"] = torch.cat(
                [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], dim=0)
            own[f"layers.{i}.wo.weight"] = state[p + "self_attn.o_proj.weight"]
            own[f"layers.{i}.w_gate_up.weight"] = torch.cat(
                [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]], dim=0)
            own[f"layers.{i}.w_down.weight"] = state[p + "mlp.down_proj.weight"]
        # assign=True: the module may have been built on the meta device to skip random init.
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        missing = [m for m in missing if not (a.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weight mismatch: missing={missing} unexpected={unexpected}")
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if self.rope.cos.is_meta:
            self.rope = Rope(a, self.rope.cos.shape[0])
