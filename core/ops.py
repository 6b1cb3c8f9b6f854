"""Model vocabulary shared by the target model and the drafters: the Llama config, RoPE, RMSNorm, the linear layer
with its CPU kernel choice, and the serving dtype table.

Both ``server.engine.model`` (the target) and the drafters' own networks (``drafters.glide.model``) build on these, so
a drafter's RoPE or norm is the target's, bit for bit, without either side importing the other.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Serving dtypes by config name.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# The decoder families that load, by config.json's ``model_type`` (a GGUF file's ``general.architecture`` maps onto
# these when it is converted). Each is the Llama decoder plus the changes ``LlamaArgs`` names; this is the one place
# that says which family changes what (``_family_changes``).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


class UnsupportedModel(ValueError):
    """A checkpoint this server cannot run: the message names what and, for an architecture, the supported list."""


@dataclass(frozen=True)
class LlamaArgs:
    """A decoder's shape, plus what its family changes from Llama (defaults: Llama, SmolLM, Mistral)."""

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
    family: str = "llama"
    qkv_bias: bool = False        # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False         # Qwen3, Gemma 3: RMSNorm over each query and key head before RoPE
    act: str = "silu"             # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # Gemma 3: RMSNorm on the attention and MLP outputs too, before each residual add
    norm_plus_one: bool = False   # Gemma: RMSNorm scales by (1 + w); folded into the weights at load
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None   # the softmax scale where it is not head_dim ** -0.5 (Gemma 3)
    sliding_window: int | None = None  # keys further back than this are not attended to, on ``sliding_layers``
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding layers, where it differs (Gemma 3)

    @property
    def plain_block(self) -> bool:
        """Every layer is Llama's: what the quantized CPU target's fused C++ decoder computes."""
        return not (self.qkv_bias or self.qk_norm or self.act != "silu" or self.sandwich_norms
                    or self.attn_scale is not None)

    @property
    def layer_rope(self) -> tuple[bool, ...]:
        """Per layer: True where it takes the local (sliding layers') RoPE table."""
        local = set(self.sliding_layers) if self.local_rope_theta is not None else set()
        return tuple(i in local for i in range(self.num_layers))

    @property
    def window(self) -> int | None:
        """The sliding layers' window in tokens (None where every layer attends to the whole context)."""
        return self.sliding_window if self.sliding_layers else None

    def check_context(self, max_seq_len: int) -> None:
        """A clear error where ``cache.max_seq_len`` is longer than the model's trained positions."""
        if max_seq_len > self.max_position_embeddings:
            raise UnsupportedModel(
                f"cache.max_seq_len {max_seq_len} is longer than the model's context ({self.max_position_embeddings} "
                "positions, max_position_embeddings): set cache.max_seq_len to at most that")

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaArgs":
        family = c.get("model_type", "llama")
        if family not in FAMILIES:
            raise UnsupportedModel(f"unsupported architecture: model_type={family!r} "
                                   f"(supported: {', '.join(FAMILIES)})")
        n_heads = c["num_attention_heads"]
        n_layers = c["num_hidden_layers"]
        rope = dict(c.get("rope_parameters") or {})
        local_rope = None
        if "full_attention" in rope or "sliding_attention" in rope:  # per layer type (transformers 5: Gemma 3)
            local_rope = dict(rope.get("sliding_attention") or {})
            rope = dict(rope.get("full_attention") or {})
        theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        shape = dict(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_layers=n_layers, num_heads=n_heads, num_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", family == "gemma3_text")),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos_ids, family=family)
        return cls(**shape, **_family_changes(family, c, shape, local_rope))


def _family_changes(family: str, c: dict, shape: dict, local_rope: dict | None) -> dict:
    """What ``family`` changes from the Llama decoder, read from its config.json (``c``)."""
    if c.get("mlp_bias") or (c.get("attention_bias") and family != "qwen2"):
        raise UnsupportedModel(f"unsupported {family} variant: attention_bias / mlp_bias on every projection")
    act = c.get("hidden_act") or c.get("hidden_activation") or "silu"
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in acts:
        raise UnsupportedModel(f"unsupported {family} activation hidden_act={act!r} "
                               "(supported: silu, gelu_pytorch_tanh)")
    n_layers = shape["num_layers"]
    types = c.get("layer_types")
    if types is None and family in ("qwen2", "qwen3") and c.get("use_sliding_window"):
        first = int(c.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if types is None and family == "mistral" and c.get("sliding_window") is not None:
        types = ["sliding_attention"] * n_layers
    if types is None and family == "gemma3_text":
        pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    sliding = tuple(i for i, t in enumerate(types or ()) if t == "sliding_attention")
    out = dict(act=acts[act], sliding_layers=sliding, sliding_window=c.get("sliding_window") if sliding else None)
    if family == "qwen2":
        out["qkv_bias"] = True
    if family == "qwen3":
        out["qk_norm"] = True
    if family == "gemma3_text":
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if c.get(cap) is not None:
                raise UnsupportedModel(f"unsupported gemma3_text variant: {cap}={c[cap]}")
        if c.get("use_bidirectional_attention"):
            raise UnsupportedModel("unsupported gemma3_text variant: use_bidirectional_attention")
        local = (local_rope or {}).get("rope_theta", c.get("rope_local_base_freq", 10000.0))
        if (local_rope or {}).get("rope_type", "default") != "default":
            raise UnsupportedModel("unsupported gemma3_text variant: a scaled RoPE on the sliding layers")
        scalar = float(c.get("query_pre_attn_scalar", shape["head_dim"]))
        out.update(qk_norm=True, sandwich_norms=True, norm_plus_one=True, embed_scale=shape["hidden_size"] ** 0.5,
                   local_rope_theta=float(local),
                   attn_scale=None if scalar == shape["head_dim"] else scalar ** -0.5)
    return out


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


def top1(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the same indices (the first of tied maxima; a NaN wins as it does there) through
    ``max(-1)``, whose CPU kernel runs several times faster than argmax's in bfloat16 and float32 (a verify step's
    greedy acceptance reads every row's top token)."""
    return x.max(-1).indices


def _mv_mm(x: torch.Tensor, w: torch.Tensor, any_layout: bool = False) -> torch.Tensor:
    T = x.shape[0]
    if T == 1:
        return torch.mv(w, x[0]).unsqueeze(0)
    if T <= MAX_TUNED_ROWS:  # x as the row-invariance measurement ran it (contiguous: a no-op unless it is not)
        y = torch.mm(w, x.contiguous().t()).t()
        return y if any_layout else y.contiguous()  # contiguous: later ops' bits depend on the layout
    return F.linear(x, w)


def _mv_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mv(w, x[0]).unsqueeze(0) if x.shape[0] == 1 else F.linear(x, w)


# Dense kernels for x [T, K] @ W[N, K].T, T up to MAX_TUNED_ROWS; past that every one is F.linear.
LINEAR_KERNELS = {"mv+mm": _mv_mm, "mv+linear": _mv_linear, "linear": F.linear}
MAX_TUNED_ROWS = 64  # the engine's verification row limit
_chosen: dict[tuple, str] = {}  # linear_key(w) -> kernel name, set by use_linear_kernel


def linear_key(w: torch.Tensor) -> tuple:
    return w.device.type, str(w.dtype).removeprefix("torch."), *w.shape


def default_linear_kernel(w: torch.Tensor) -> str:
    """Before (or without) a measurement: on CPU in bfloat16 mv for one row and weight @ x.T up to 64 rows (oneDNN's
    x @ W.T was slow for small M there), else mv for one row and F.linear for more."""
    return "mv+mm" if w.device.type == "cpu" and w.dtype == torch.bfloat16 else "mv+linear"


def use_linear_kernel(key: tuple, name: str) -> None:
    if name not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {name!r}; valid: {', '.join(LINEAR_KERNELS)}")
    _chosen[key] = name


def linear(x: torch.Tensor, weight: "torch.Tensor | Int8Weight | Int4Weight",
           any_layout: bool = False) -> torch.Tensor:
    """x [T, in] @ weight[out, in].T -> [T, out].

    A weight-only quantized matrix runs its packed kernel; a dense one the kernel chosen for its shape and dtype
    (``measure_linear_kernels``), else ``default_linear_kernel``. ``any_layout``: the caller only reads the result
    elementwise (a residual add, SwiGLU), whose bits do not depend on the layout, so ``weight @ x.T`` may hand it
    over transposed instead of paying a copy into rows (1-2% of a 3-row bfloat16 verify on a 2-core Xeon with AMX,
    most of it the gate/up output's).
    """
    if not isinstance(weight, torch.Tensor):  # a weight-only quantized matrix (Int8Weight, Int4Weight)
        return weight.matmul(x)
    name = _chosen.get(linear_key(weight)) or default_linear_kernel(weight)
    if name == "mv+mm":
        return _mv_mm(x, weight, any_layout)
    # In rows, as measure_linear_kernels checked it: oneDNN's bfloat16 F.linear on a transposed x (a SwiGLU output
    # handed over by weight @ x.T) or a strided one gave a row other bits at 5 rows than alone, on a 2-core EPYC
    return LINEAR_KERNELS[name](x.contiguous(), weight)


def measure_linear_kernels(weights: list[torch.Tensor], margin: float = 0.1) -> tuple[str, dict[str, dict]]:
    """The dense kernel for ``weights`` (one shape and dtype, e.g. every layer's gate/up matrix): the fastest of those
    that give each row the same bits whatever the row count (1..64).

    Row invariance is what lets a verified draft row get exactly the logits and KV a decode step would; which kernels
    have it depends on the CPU and the shape (on a 2-core EPYC with avx512_bf16, oneDNN's bfloat16 F.linear had it
    for K = 576 and lost it past 4 rows for K = 1536), so it is checked here, on random data of the weights' shape.
    Speed: median ms of one pass over all the weights (as a forward streams them from memory; one matrix alone
    would sit in cache) at 1 row (decode) plus at 8 rows (a typical verification). The default kernel stays unless
    another is ``margin`` faster (or it alone is not row-invariant), so noise does not flip the choice, and with it
    the bits, between starts. Where no kernel is row-invariant (float32 everywhere measured; bfloat16 on AMX Xeons),
    the fastest is used.
    """
    w = weights[0]
    if w.device.type != "cpu":
        return "linear", {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MAX_TUNED_ROWS, w.shape[1], generator=g).to(w.dtype)
    w_ = (torch.randn(tuple(w.shape), generator=g) * w.float().std()).to(w.dtype)
    report = {}
    for name, fn in LINEAR_KERNELS.items():
        one = torch.cat([fn(x[i:i + 1], w_) for i in range(MAX_TUNED_ROWS)])
        invariant = all(torch.equal(fn(x[:t], w_), one[:t]) for t in range(2, MAX_TUNED_ROWS + 1))
        report[name] = {"ms": round(_median_ms(fn, x[:1], weights) + _median_ms(fn, x[:8], weights), 4),
                        "row_invariant": invariant}
    pool = [n for n in report if report[n]["row_invariant"]] or list(report)
    default = default_linear_kernel(w)
    best = min(pool, key=lambda n: report[n]["ms"])
    if default in pool and report[default]["ms"] <= (1 + margin) * report[best]["ms"]:
        best = default
    return best, report


def _median_ms(fn, x: torch.Tensor, weights: list[torch.Tensor], repeats: int = 5) -> float:
    for w in weights:
        fn(x, w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


# -- weight-only quantization -------------------------------------------------------------------------------------
# A quantized matrix stands where a weight tensor stood: ``linear`` calls its ``matmul``. Activations stay in the
# serving dtype; the packed kernels are the ones PyTorch ships for CPU. Elsewhere (CUDA; untested here, no GPU was
# lent) the weight is dequantized per call: the same numbers, without the bandwidth saving.


@dataclass
class Int8Weight:
    """Weight-only int8, symmetric per output channel: W ~= q * scale[:, None], q in [-127, 127]."""

    q: torch.Tensor      # [N, K] int8
    scale: torch.Tensor  # [N], the activations' dtype

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype) -> "Int8Weight":
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.to(dtype))

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        return F.linear(x, self.dequantize())


def minmax_int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of ``group`` input columns from each group's min and max (GGUF Q4_1's
    quantizer without an importance matrix): w [N, K] -> q [N, K] int32 in 0..15, scale and min [N, K / group]
    float32, W ~= scale * q + min."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"int4: {K} input columns are not a multiple of the group size {group}")
    wg = w.float().view(N, K // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K / group]
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(N, K)
    return q, scale, lo


INT4_FORMS = ("packed", "dense")


@dataclass
class Int4Weight:
    """Weight-only 4-bit, asymmetric per group of ``group`` input columns: W = scale * q + low, q in [0, 15] (GGUF
    Q4_1's block, d * q + m).

    Two forms of the same matrix. "packed": PyTorch's packed int4 CPU kernel, which takes (q - 8) * scale + zero with
    zero = low + 8 * scale. "dense": W itself in the activations' dtype, multiplied by ``linear``'s dense kernels
    (4-8x the memory; on CPUs where the packed kernel is slower for the serving dtype, e.g. float32 activations on
    a 2-core EPYC with AVX2, 11.7x slower per matrix). ``quantize_model`` measures which at load."""

    packed: torch.Tensor       # CPU: [N, K / 2] uint8 from _convert_weight_to_int4pack_for_cpu (empty unless packed)
    scale_zero: torch.Tensor   # [K / group, N, 2] (scale, zero), the activations' dtype
    group: int
    shape: tuple[int, int]     # (N, K)
    q: torch.Tensor | None = None  # [N, K] int32, kept only where the packed CPU kernel does not apply (dequantized
                                   # per call: off CPU, or N not a multiple of 16)
    dense: torch.Tensor | None = None  # [N, K] the "dense" form: scale * q + low, computed once in float32

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype, group: int = 32, form: str = "packed") -> "Int4Weight":
        q, scale, lo = minmax_int4(w, group)
        return cls.from_groups(q, scale, lo, dtype, group, form)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype,
                    group: int, form: str = "packed") -> "Int4Weight":
        """q [N, K] in [0, 15], scale and low [N, K / group]: W = scale * q + low."""
        if form not in INT4_FORMS:
            raise ValueError(f"unknown int4 form {form!r}; valid: {', '.join(INT4_FORMS)}")
        N, K = q.shape
        zero = low + 8.0 * scale
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [K / group, N, 2]
        empty = torch.empty(0, dtype=torch.uint8, device=q.device)
        if form == "dense":
            w = q.float().view(N, K // group, group) * scale.float()[..., None] + low.float()[..., None]
            return cls(empty, scale_zero, group, (N, K), dense=w.view(N, K).to(dtype).contiguous())
        if q.device.type == "cpu" and N % 16 == 0:  # the packed CPU layout takes rows in tiles of 16
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
            return cls(packed, scale_zero, group, (N, K))
        return cls(empty, scale_zero, group, (N, K), q.to(torch.int32))

    @property
    def form(self) -> str:
        return "dense" if self.dense is not None else "packed"

    def dequantize(self) -> torch.Tensor:
        N, K = self.shape
        if self.dense is not None:
            return self.dense
        scale, zero = self.scale_zero[..., 0].t(), self.scale_zero[..., 1].t()  # [N, K / group]
        if self.q is None:  # unpack through the kernel itself: W.T = identity @ W.T
            return self.matmul(torch.eye(K, dtype=self.scale_zero.dtype)).t().contiguous()
        qg = (self.q.view(N, K // self.group, self.group) - 8).to(scale.dtype)
        return (qg * scale[..., None] + zero[..., None]).view(N, K)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.dense is not None:
            return linear(x, self.dense)
        if self.q is None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group,
                                                               self.scale_zero)
        return F.linear(x, self.dequantize())


def measure_int4_forms(shape: tuple[int, int], dtype: torch.dtype, group: int = 32,
                       margin: float = 0.1) -> tuple[str, dict[str, float]]:
    """Which ``Int4Weight`` form multiplies faster on this CPU: median ms of 1 row (decode) plus 8 rows (a typical
    verification) on a random matrix of ``shape`` [N, K], activations in ``dtype``. "packed" (a quarter or less of
    the memory) stays unless "dense" is ``margin`` faster, so noise does not flip the choice, and the bits, between
    starts."""
    N, K = shape
    if N % 16:
        return "packed", {}
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.02
    x = torch.randn(8, K, generator=g).to(dtype)
    report = {}
    for form in INT4_FORMS:
        m = Int4Weight.quantize(w, dtype, group, form)
        report[form] = round(_median_ms(lambda a, b: b.matmul(a), x[:1], [m])
                             + _median_ms(lambda a, b: b.matmul(a), x, [m]), 4)
    best = "dense" if report["dense"] * (1 + margin) < report["packed"] else "packed"
    return best, report


QUANTIZATIONS = ("none", "int8", "int4")
