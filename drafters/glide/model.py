"""The GLIDE draft model (Du et al., ICML 2024): a small decoder that glimpses the target's KV cache.

Each draft layer m is
    x = x + SelfAttn(norm(x))                  # over the drafter's own KV cache, causal
    x = x + CrossAttn(norm(x), K_l, V_l)       # into the target's post-RoPE KV of layer l = N_T - N_D + m,
                                               # or read_layers[m] when set
    x = x + SwiGLU(norm(x))
The cross-attention projects each draft row to one query per *target* head, rotates it at its absolute position with
the target's RoPE settings (theta and scaling come from the target's config), attends to the target's cached K/V (GQA
by head grouping) and projects back. The embedding and the LM head are the target's, frozen and never saved; the LM
head may be restricted to a frequency-ranked subset of the vocabulary (``vocab_ids``), which makes a draft step several
times cheaper on CPU and stays lossless because the target verifies every token.

``cross_attention=False`` gives the paper's "vanilla drafter" ablation: the same network without the cross sub-layer.

Visibility of target keys is a boolean mask [T, n_target]: at inference row i at position p sees target keys < min(p,
cache_len) (only verified tokens are cached); in training the paper's block-wise mask (``block_mask``) simulates the
KV delay. A row that sees no key gets a zero cross-attention output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from core.ops import Rope, apply_rope, linear, rms_norm

from drafters.checkpoint import check_target, default_path, read_model, save_checkpoint


class GlideCheckpointError(RuntimeError):
    """A GLIDE checkpoint is missing or does not fit the target."""


@dataclass
class GlideConfig:
    target_id: str
    vocab_size: int            # the target's vocabulary
    target_hidden: int
    target_num_layers: int
    target_num_heads: int
    target_num_kv_heads: int
    head_dim: int              # the target's head dim; also the drafter's self-attention head dim
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_size: int           # drafter width
    num_layers: int = 1
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    cross_attention: bool = True
    vocab_subset: int = 0      # LM head rows kept (0: the whole vocabulary)
    read_layers: list | None = None  # the target layer each draft layer reads (None: the top num_layers, in order)
    extra: dict = field(default_factory=dict)  # free-form notes (training recipe)

    @classmethod
    def for_target(cls, target_args, target_id: str, **overrides) -> "GlideConfig":
        """Defaults: one layer as wide as the target, the target's head layout and FFN width."""
        a = target_args
        base = dict(target_id=target_id, vocab_size=a.vocab_size, target_hidden=a.hidden_size,
                    target_num_layers=a.num_layers, target_num_heads=a.num_heads,
                    target_num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, rope_theta=a.rope_theta,
                    rope_scaling=a.rope_scaling, rms_norm_eps=a.rms_norm_eps,
                    max_position_embeddings=a.max_position_embeddings, hidden_size=a.hidden_size,
                    num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size)
        base.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**base)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"glide: num_heads * head_dim ({self.num_heads} x {self.head_dim}) must equal "
                             f"hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads or self.target_num_heads % self.target_num_kv_heads:
            raise ValueError("glide: heads must be a multiple of kv heads")
        if not 1 <= self.num_layers <= self.target_num_layers:
            raise ValueError(f"glide: num_layers must be in [1, {self.target_num_layers}]")
        if self.read_layers is not None:
            if len(self.read_layers) != self.num_layers or \
                    not all(0 <= int(n) < self.target_num_layers for n in self.read_layers):
                raise ValueError(f"glide: read_layers needs one target layer in [0, {self.target_num_layers - 1}] "
                                 f"per draft layer ({self.num_layers}), got {self.read_layers}")

    def target_layer(self, m: int) -> int:
        """The target layer draft layer m reads: ``read_layers[m]``, by default the top N_D layers in order."""
        if self.read_layers is not None:
            return int(self.read_layers[m])
        return self.target_num_layers - self.num_layers + m

    def rope_args(self) -> SimpleNamespace:
        return SimpleNamespace(head_dim=self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)


def block_mask(n_query: int, n_key: int, block_len: int, offset: int = 0) -> torch.Tensor:
    """The paper's training mask [n_query, n_key]: query j sees target key k iff block(j) > block(k).

    block(i) = (i + offset) // block_len; ``offset`` shifts the block boundaries (data augmentation).
    """
    bq = (torch.arange(n_query) + offset) // block_len
    bk = (torch.arange(n_key) + offset) // block_len
    return bq[:, None] > bk[None, :]


def causal_visibility(positions: torch.Tensor, n_target: int) -> torch.Tensor:
    """Inference mask [T, n_target]: a row at position p sees the verified target keys k < p."""
    return torch.arange(n_target, device=positions.device)[None, :] < positions[:, None]


class GlideLayer(nn.Module):
    def __init__(self, c: GlideConfig):
        super().__init__()
        self.c = c
        W, D = c.hidden_size, c.head_dim
        self.attn_norm = nn.Parameter(torch.ones(W))
        self.wqkv = nn.Parameter(torch.empty((c.num_heads + 2 * c.num_kv_heads) * D, W))
        self.wo = nn.Parameter(torch.empty(W, c.num_heads * D))
        if c.cross_attention:
            self.cross_norm = nn.Parameter(torch.ones(W))
            self.cq = nn.Parameter(torch.empty(c.target_num_heads * D, W))
            self.co = nn.Parameter(torch.empty(W, c.target_num_heads * D))
        self.mlp_norm = nn.Parameter(torch.ones(W))
        self.w_gate_up = nn.Parameter(torch.empty(2 * c.intermediate_size, W))
        self.w_down = nn.Parameter(torch.empty(W, c.intermediate_size))

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, torch.Tensor] | None, cache_len: int,
                target_kv: tuple[torch.Tensor, torch.Tensor] | None, visible: torch.Tensor | None,
                kv_only: bool = False):
        c = self.c
        T, H, Hkv, D = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = linear(rms_norm(x, self.attn_norm, c.rms_norm_eps), self.wqkv).view(T, H + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :H + Hkv], cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]
        if cache is not None:  # inference: append to the drafter's own cache, attend to prefix + new rows
            kc, vc = cache
            kc[:, cache_len:cache_len + T] = k.transpose(0, 1)
            vc[:, cache_len:cache_len + T] = v.transpose(0, 1)
            k, v = kc[:, :cache_len + T], vc[:, :cache_len + T]
            if kv_only:
                return None
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        x = x + linear(_self_attention(q, k, v, cache_len).reshape(T, -1), self.wo)
        if c.cross_attention and target_kv is not None:
            tq = linear(rms_norm(x, self.cross_norm, c.rms_norm_eps), self.cq).view(T, c.target_num_heads, D)
            o = _cross_attention(apply_rope(tq, cos, sin), *target_kv, visible)
            x = x + linear(o.reshape(T, -1), self.co)
        gate, up = linear(rms_norm(x, self.mlp_norm, c.rms_norm_eps), self.w_gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.w_down)


def _self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_len: int) -> torch.Tensor:
    """q [T, H, D]; k, v [H_kv, cache_len + T, D]; causal over the new rows -> [T, H, D]."""
    T, H, D = q.shape
    g = H // k.shape[0]
    qh = q.transpose(0, 1)  # [H, T, D]
    kh, vh = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    if T == 1:
        o = F.scaled_dot_product_attention(qh, kh, vh)
    elif cache_len == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        n = cache_len + T
        mask = torch.arange(n, device=q.device)[None, :] <= (cache_len + torch.arange(T, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return o.transpose(0, 1)


def _cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """q [T, H_t, D] (rotated); k, v [H_kv_t, n, D] post-RoPE target cache; visible [T, n] bool or None (all)."""
    T, H, D = q.shape
    Hkv, n = k.shape[0], k.shape[1]
    if n == 0:
        return q.new_zeros(T, H, D)
    g = H // Hkv
    qg = q.view(T, Hkv, g, D).permute(1, 0, 2, 3).reshape(Hkv, T * g, D)  # rows of one kv head together
    if visible is None:
        o = F.scaled_dot_product_attention(qg, k, v)
    else:
        # A finite fill keeps rows that see nothing free of NaNs (their output is zeroed below).
        scores = (qg @ k.transpose(1, 2)).float() * (1.0 / math.sqrt(D))  # [Hkv, T*g, n]
        m = visible.repeat_interleave(g, 0)  # [T*g, n]
        p = torch.softmax(scores.masked_fill(~m, -1e30), dim=-1).to(v.dtype)
        o = (p @ v) * m.any(-1, keepdim=True).to(v.dtype)
    return o.view(Hkv, T, g, D).permute(1, 0, 2, 3).reshape(T, H, D)


class GlideModel(nn.Module):
    """The draft network. ``attach`` hands it the target's frozen embedding and LM head before use."""

    def __init__(self, c: GlideConfig):
        super().__init__()
        c.check()
        self.c = c
        self.layers = nn.ModuleList(GlideLayer(c) for _ in range(c.num_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        if c.hidden_size != c.target_hidden:
            self.in_proj = nn.Parameter(torch.empty(c.hidden_size, c.target_hidden))
            self.out_proj = nn.Parameter(torch.empty(c.target_hidden, c.hidden_size))
        n_vocab = c.vocab_subset or c.vocab_size
        self.register_buffer("vocab_ids", torch.arange(n_vocab), persistent=True)
        self.rope = Rope(c.rope_args(), c.max_position_embeddings)
        self.embed_weight: torch.Tensor | None = None  # [V, target_hidden], the target's
        self.head_weight: torch.Tensor | None = None   # [len(vocab_ids), target_hidden], rows of the target's head
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif "norm" in name:
                nn.init.ones_(p)

    def attach(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> "GlideModel":
        """Share the target's embedding [V, hidden] and LM head [V, hidden] (frozen; rows of ``vocab_ids`` kept)."""
        if tuple(embed_weight.shape) != (self.c.vocab_size, self.c.target_hidden):
            raise GlideCheckpointError(f"target embedding {tuple(embed_weight.shape)} does not fit the drafter "
                                       f"({self.c.vocab_size}, {self.c.target_hidden})")
        self.embed_weight = embed_weight.detach()
        self.head_weight = head_weight.detach()[self.vocab_ids.to(head_weight.device)].contiguous()
        return self

    def init_from_target(self, target_model) -> None:
        """Start from the target's top layer (self-attention, FFN, norms) and, for the cross-attention, the query
        and output projections of the target layer it reads. Needs the drafter's width and heads to match."""
        c, a = self.c, target_model.args
        if (c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size) != \
                (a.hidden_size, a.num_heads, a.num_kv_heads, a.intermediate_size):
            return  # a differently shaped drafter starts from random weights
        top = target_model.layers[-1]
        with torch.no_grad():
            self.norm.copy_(target_model.norm)
            for m, layer in enumerate(self.layers):
                layer.attn_norm.copy_(top.attn_norm)
                layer.wqkv.copy_(top.wqkv.weight)
                layer.wo.copy_(top.wo.weight)
                layer.mlp_norm.copy_(top.mlp_norm)
                layer.w_gate_up.copy_(top.w_gate_up.weight)
                layer.w_down.copy_(top.w_down.weight)
                if c.cross_attention:
                    src = target_model.layers[c.target_layer(m)]
                    layer.cross_norm.copy_(src.attn_norm)
                    layer.cq.copy_(src.wqkv.weight[:a.num_heads * a.head_dim])
                    layer.co.copy_(src.wo.weight * 0.5)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None, cache_len: int,
                target_kv: list[tuple[torch.Tensor, torch.Tensor]] | None,
                visible: torch.Tensor | None, kv_only: bool = False) -> torch.Tensor | None:
        """T new rows -> hidden states [T, target_hidden] (apply ``logits`` for the LM head).

        cache: the drafter's (k, v) [num_layers, H_kv, S, D] or None (training: the rows are the whole sequence);
        target_kv: per draft layer, the target's post-RoPE (K, V) [H_kv_t, n, D] of the layer it reads;
        visible: [T, n] bool (which target keys each row sees) or None for all;
        kv_only: only fill the drafter's cache (prompt prefill): the last layer stops after writing its K/V.
        """
        if self.embed_weight is None:
            raise RuntimeError("GlideModel.attach(target embedding, LM head) must be called first")
        x = F.embedding(ids, self.embed_weight)
        if self.c.hidden_size != self.c.target_hidden:
            x = linear(x, self.in_proj)
        cos, sin = self.rope.table(positions, x.dtype)
        for m, layer in enumerate(self.layers):
            layer_cache = (cache[0][m], cache[1][m]) if cache is not None else None
            tkv = target_kv[m] if target_kv is not None else None
            x = layer(x, cos, sin, layer_cache, cache_len, tkv, visible,
                      kv_only=kv_only and m == len(self.layers) - 1)
            if x is None:
                return None
        x = rms_norm(x, self.norm, self.c.rms_norm_eps)
        if self.c.hidden_size != self.c.target_hidden:
            x = linear(x, self.out_proj)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, target_hidden] -> logits [T, len(vocab_ids)] over the kept vocabulary."""
        return linear(hidden, self.head_weight)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save(self, path: Path, card: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        """Weights (``dtype``) + config in one safetensors file; ``card`` goes next to it as JSON."""
        save_checkpoint(path, self.state_dict(), "glide_config", self.c, card, dtype,
                        skip=lambda k: k.startswith("rope."))

    @classmethod
    def load(cls, path: Path) -> "GlideModel":
        return read_model(cls, GlideConfig, path, "glide_config", GlideCheckpointError, "GLIDE checkpoint")


def default_checkpoint(target_id: str, name: str = "glide") -> Path:
    return default_path(target_id, name)


def check_fits(c: GlideConfig, target_args, target_id: str, path: Path) -> None:
    """Fail clearly when a checkpoint was trained for another target."""
    how = (f"train one with `specserve train glide` (see training/glide.py) or point the drafter's "
           f"`checkpoint` option at a checkpoint trained for {target_id!r}")
    a = target_args
    check_target(path, GlideCheckpointError, how, c.target_id, target_id,
                 "vocab, hidden, layers, heads, kv heads, head dim",
                 (c.vocab_size, c.target_hidden, c.target_num_layers, c.target_num_heads, c.target_num_kv_heads,
                  c.head_dim),
                 (a.vocab_size, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim))
