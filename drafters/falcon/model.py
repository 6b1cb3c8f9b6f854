"""The Falcon drafting head (Gao et al., AAAI 2025): a semi-autoregressive (SAR) drafter over the target's features.

Inputs, per position p >= 1: the target's feature of the token before it, f_{p-1}, and the embedding of token t_p.
A feature is the target's last hidden state *after* its final norm (the paper regresses post-norm features; the
engine caches pre-norm ones, ``TargetView.final_norm`` converts). The head is

    x = Linear([embed(t_p); f_{p-1}])            # 2 x hidden -> hidden
    x = x + SelfAttn(norm(x))                   # relaxed causal mask, RoPE at position p
    x = x + SwiGLU(norm(x))
    f_hat = RMSNorm(x)                          # the predicted post-norm feature
    logits = f_hat @ W_head.T                   # the target's frozen LM head (a frequency-ranked row subset)

**Blocks and the relaxed causal mask.** Positions form blocks of ``k``. A row sees every row of earlier blocks and
every row of its own block. The row at position j of a block [b, b + k) predicts the feature f_{j+k-1}, hence the
token t_{j+k}: one forward over a block of k known inputs emits the next k features and tokens. For k = 2 the inputs
(f_1, t_2), (f_2, t_3) give f_3, f_4 and so t_4, t_5 (the paper's example). No row sees its label: a block's labels
are t_{b+k} .. t_{b+2k-1}, the tokens of the next block, which none of its rows can see.

**Drafting.** The last k verified positions form the first block (its inputs are all known: true features and
accepted tokens); its outputs are the drafted features and tokens of the next k positions, which become the inputs
of the next block, and so on. One decoder layer, so a cached row's K/V depend only on its own input, never on the
mask it was computed under: the drafter's cache holds the verified rows once, and drafted rows live past them until
the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from core.ops import Rope, apply_rope, linear, rms_norm

from drafters.checkpoint import check_target, default_path, read_model, save_checkpoint
from specserve_kernels import cpu as cpu_kernels


class FalconCheckpointError(RuntimeError):
    """A Falcon checkpoint is missing or does not fit the target."""


@dataclass
class FalconConfig:
    target_id: str
    vocab_size: int
    hidden_size: int           # the target's width (features and embeddings)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_position_embeddings: int
    k: int = 2                 # tokens per block (per drafter forward)
    vocab_subset: int = 0      # LM head rows kept (0: the whole vocabulary)
    taps: list[int] = field(default_factory=list)  # lower target layers read beside the top feature (below)
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, a, target_id: str, **overrides) -> "FalconConfig":
        base = dict(target_id=target_id, vocab_size=a.vocab_size, hidden_size=a.hidden_size, num_heads=a.num_heads,
                    num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, intermediate_size=a.intermediate_size,
                    rope_theta=a.rope_theta, rope_scaling=a.rope_scaling, rms_norm_eps=a.rms_norm_eps,
                    max_position_embeddings=a.max_position_embeddings)
        base.update({key: v for key, v in overrides.items() if v is not None})
        c = cls(**base)
        c.check()
        return c

    def check(self) -> None:
        if self.num_heads * self.head_dim != self.hidden_size or self.num_heads % self.num_kv_heads:
            raise ValueError("falcon: heads x head_dim must equal the width, heads a multiple of kv heads")
        if not 1 <= self.k <= 8:
            raise ValueError("falcon: k (tokens per block) must be in [1, 8]")
        if any(not isinstance(n, int) or n < 1 for n in self.taps) or len(set(self.taps)) != len(self.taps):
            raise ValueError("falcon: taps must be distinct layer counts >= 1")

    def rope_args(self) -> SimpleNamespace:
        return SimpleNamespace(head_dim=self.head_dim, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)


def block_ids(positions: torch.Tensor, k: int, offset: int = 0) -> torch.Tensor:
    """The block of each position: (p + offset) // k (``offset`` shifts the boundaries)."""
    return torch.div(positions + offset, k, rounding_mode="floor")


def relaxed_mask(blocks: torch.Tensor) -> torch.Tensor:
    """[n, n] bool: row i sees row j iff block(j) <= block(i) (every earlier block and its own), for rows in
    position order."""
    return blocks[None, :] <= blocks[:, None]


class FalconModel(nn.Module):
    """The head. ``attach`` hands it the target's frozen embedding and LM head before use."""

    def __init__(self, c: FalconConfig):
        super().__init__()
        c.check()
        self.c = c
        W, D = c.hidden_size, c.head_dim
        self.fuse = nn.Parameter(torch.empty(W, 2 * W))
        self.attn_norm = nn.Parameter(torch.ones(W))
        self.wqkv = nn.Parameter(torch.empty((c.num_heads + 2 * c.num_kv_heads) * D, W))
        self.wo = nn.Parameter(torch.empty(W, c.num_heads * D))
        self.mlp_norm = nn.Parameter(torch.ones(W))
        self.w_gate_up = nn.Parameter(torch.empty(2 * c.intermediate_size, W))
        self.w_down = nn.Parameter(torch.empty(W, c.intermediate_size))
        self.out_norm = nn.Parameter(torch.ones(W))
        n_vocab = c.vocab_subset or c.vocab_size
        self.register_buffer("vocab_ids", torch.arange(n_vocab), persistent=True)
        self.rope = Rope(c.rope_args(), c.max_position_embeddings)
        self.embed_weight: torch.Tensor | None = None
        self.head_weight: torch.Tensor | None = None
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        n_taps = len(c.taps)
        if n_taps:  # zero-initialised: a head that gains taps starts as the head it was
            self.tap_norm = nn.Parameter(torch.ones(n_taps * W))  # flat: one RMSNorm weight per tapped layer
            self.tap_fuse = nn.Parameter(torch.zeros(W, n_taps * W))

    def attach(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> "FalconModel":
        """Share the target's embedding [V, hidden] and LM head [V, hidden] (frozen; rows of ``vocab_ids`` kept)."""
        if tuple(embed_weight.shape) != (self.c.vocab_size, self.c.hidden_size):
            raise FalconCheckpointError(f"target embedding {tuple(embed_weight.shape)} does not fit the drafter "
                                        f"({self.c.vocab_size}, {self.c.hidden_size})")
        self.embed_weight = embed_weight.detach()
        self.head_weight = head_weight.detach()[self.vocab_ids.to(head_weight.device)].contiguous()
        return self

    def init_from_target(self, target_model) -> None:
        """Start the norms from the target's (the output norm from its final norm, so predicted features start at the
        scale of the ones they regress); the matrices stay random. Measured: starting the decoder layer from the
        target's top layer as well learned slower (held-out agreement 19% against 27% after 60 steps, k = 1)."""
        top = target_model.layers[-1]
        with torch.no_grad():
            self.attn_norm.copy_(top.attn_norm)
            self.mlp_norm.copy_(top.mlp_norm)
            self.out_norm.copy_(target_model.norm)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor | None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache_len: int = 0, kv_only: bool = False, taps: torch.Tensor | None = None) -> torch.Tensor | None:
        """T rows -> predicted post-norm features [T, hidden] (``logits`` applies the LM head).

        ids [T]: token t_p of each row; feats [T, hidden]: the post-norm feature f_{p-1} before it; positions [T]: p.
        visible: [T, cache_len + T] bool, which keys each row sees (None: all of them).
        cache: the drafter's (k, v) [H_kv, S, D]; the rows' K/V are written at [cache_len, cache_len + T) (inference).
        kv_only: stop once the rows' K/V are in the cache (verified rows whose outputs nobody reads).
        taps: [T, len(c.taps), hidden] the target's residual stream after each tapped layer count at p - 1, added to
        the feature through ``tap_fuse`` (all zero for a row whose feature the drafter predicted: no target layer ran
        there); None reads no taps.
        """
        if self.embed_weight is None:
            raise RuntimeError("FalconModel.attach(target embedding, LM head) must be called first")
        c = self.c
        T, H, Hkv, D = ids.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        if taps is not None and c.taps:
            feats = feats + self.read_taps(taps)
        x = linear(torch.cat([F.embedding(ids, self.embed_weight).to(feats.dtype), feats], dim=-1), self.fuse)
        cos, sin = self.rope.table(positions, x.dtype)
        qkv = linear(rms_norm(x, self.attn_norm, c.rms_norm_eps), self.wqkv).view(T, H + 2 * Hkv, D)
        qk = apply_rope(qkv[:, :H + Hkv], cos, sin)
        q, k, v = qk[:, :H], qk[:, H:].transpose(0, 1), qkv[:, H + Hkv:].transpose(0, 1)
        o = None
        if cache is not None:
            kc, vc = cache
            kc[:, cache_len:cache_len + T] = k
            vc[:, cache_len:cache_len + T] = v
            if kv_only:
                return None
            o = _cache_attention(q, kc, vc, cache_len + T, visible)
            k, v = kc[:, :cache_len + T], vc[:, :cache_len + T]
        if o is None:
            g = H // Hkv
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(g, 0),
                                               v.repeat_interleave(g, 0), attn_mask=visible).transpose(0, 1)
        x = x + linear(o.reshape(T, -1), self.wo)
        gate, up = linear(rms_norm(x, self.mlp_norm, c.rms_norm_eps), self.w_gate_up).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, self.w_down)
        return rms_norm(x, self.out_norm, c.rms_norm_eps)

    def read_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, n_taps, hidden] residual streams -> [T, hidden]: each RMS-normed with its own weight, then mixed."""
        W = self.c.hidden_size
        normed = rms_norm(taps, self.tap_norm.view(-1, W).to(taps.dtype), self.c.rms_norm_eps)
        return linear(normed.reshape(len(taps), -1), self.tap_fuse)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """[T, hidden] post-norm features (predicted or the target's) -> logits [T, len(vocab_ids)]."""
        return linear(feats, self.head_weight)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save(self, path: Path, card: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
        save_checkpoint(path, self.state_dict(), "falcon_config", self.c, card, dtype,
                        skip=lambda k: k.startswith("rope."))

    @classmethod
    def load(cls, path: Path) -> "FalconModel":
        return read_model(cls, FalconConfig, path, "falcon_config", FalconCheckpointError, "Falcon checkpoint")


def _cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int,
                     visible: torch.Tensor | None) -> torch.Tensor | None:
    """Drafting's attention on CPU through ``specserve_kernels.cpu.attend`` (float32 arithmetic, no copies of the cache per
    head; SDPA's CPU path for a boolean mask cost about a quarter of a drafter forward): q [T, H, D] over the cache
    rows [0, n_keys) of k, v [H_kv, S, D] that ``visible`` [T, n_keys] shows each row (None: all of them) -> [T, H, D].
    None where the kernel does not serve: not a CPU, not loaded, or a row sees more than 63 rows past the keys that
    every row sees (the kernel lists those as bits)."""
    if q.device.type != "cpu" or cpu_kernels.load() is None:
        return None
    T = q.shape[0]
    if visible is None:
        shared, bits = n_keys, torch.zeros(T, dtype=torch.long)
    else:
        shared = int(visible.all(0).cumprod(0).sum())  # the leading keys every row sees, read in place
        if n_keys - shared > 63:
            return None
        bits = (visible[:, shared:].long() << torch.arange(n_keys - shared)).sum(1)
    cached = torch.full((T,), shared, dtype=torch.long)
    return cpu_kernels.attend(q, k[None], v[None], torch.zeros(T, dtype=torch.long), cached, cached, bits)


def default_checkpoint(target_id: str) -> Path:
    return default_path(target_id, "falcon")


def check_fits(c: FalconConfig, target_args, target_id: str, path: Path) -> None:
    """Fail clearly when a checkpoint was trained for another target."""
    how = (f"train one with `specserve train falcon` or point the drafter's `checkpoint` option at a checkpoint "
           f"trained for {target_id!r}")
    a = target_args
    check_target(path, FalconCheckpointError, how, c.target_id, target_id, "vocab, hidden, heads, kv heads, head dim",
                 (c.vocab_size, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim),
                 (a.vocab_size, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim))

