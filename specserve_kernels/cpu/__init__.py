"""The CPU kernels, in C++ with AVX-512, of the quantized target (and the attention of 16-bit targets):

- ``qlinear.cpp``, the block-quantized linear layer: int4 / int8 weight codes per block of 32 input columns, times
  activations quantized to int8 per row and block, for every row of a step in one pass over the weights;
- ``attention.cpp``, attention computed in float32 whose result for a row depends on that row's query and keys only
  (``attend``; float32, float16 or bfloat16 K/V and queries: the 16-bit targets' engine calls it), and with RoPE and
  the K/V writes before it (``rope_attend``, which the decoder calls);
- ``decoder.cpp``, the decoder layers of such a model in one call per forward (``decoder``).

Both give a row the same bits whatever else shares the call, which is what lets a verified draft row stand for a
decode step. The C++ sources are compiled with ``torch.utils.cpp_extension`` on first use (cached in PyTorch's extensions directory,
``$TORCH_EXTENSIONS_DIR``, so later starts load it in a fraction of a second; ``make setup`` builds it ahead). It needs
an x86 CPU with AVX-512 VNNI and a C++ compiler; where either is missing, ``load()`` returns None with the reason in
``unavailable_reason()`` and the caller keeps PyTorch's own packed kernels.
"""
from __future__ import annotations

import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from core.ops import minmax_int4

QK = 32  # input columns per block
NC = 16  # output columns per group (the kernel's lanes)
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_DIR = Path(__file__).parent
_SOURCES = [str(_DIR / n) for n in ("qlinear.cpp", "attention.cpp", "decoder.cpp")]
_FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma"]

_lock = threading.Lock()
_state: dict = {}  # "module" or "reason", set once by load()


def _cpuinfo(field: str) -> str | None:
    """The first processor's ``field`` in /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    """The processor's model name (``AMD EPYC``, ``Intel(R) Xeon(R) ...``), else what ``platform`` says."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def load():
    """The compiled kernel module, or None where it cannot run here (``unavailable_reason`` says why).

    ``SPECSERVE_QLINEAR=0`` turns it off (PyTorch's packed kernels then serve every quantized matrix)."""
    with _lock:
        if "module" in _state or "reason" in _state:
            return _state.get("module")
        reason = _why_not()
        if reason is None:
            try:
                _state["module"] = _build()
                return _state["module"]
            except Exception as e:  # a compiler missing or failing: the ATen kernels still serve
                reason = f"the kernel did not build ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300]})"
        _state["reason"] = reason
        return None


def unavailable_reason() -> str | None:
    load()
    return _state.get("reason")


def _why_not() -> str | None:
    if os.environ.get("SPECSERVE_QLINEAR", "1") == "0":
        return "turned off by SPECSERVE_QLINEAR=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU (this is {platform.machine()})"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


def _build():
    from torch.utils.cpp_extension import load as load_extension

    import hashlib

    # the name carries a hash of every source and header, so an edited header rebuilds too
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_DIR.glob("*.[ch]*")))).hexdigest()[:12]
    return load_extension(name=f"specserve_cpu_{digest}", sources=_SOURCES, extra_cflags=_FLAGS,
                          extra_ldflags=["-fopenmp"], verbose=False)


@dataclass(eq=False)
class BlockQuantWeight:
    """A matrix W [N, K] as unsigned codes per block of 32 input columns: W[n, k] = d[n, b] * q[n, k] + m[n, b].

    ``bits`` 4: q in 0..15 (GGUF Q4_1 as stored; asymmetric int4 re-quantized from a dense matrix the same way).
    ``bits`` 8: q = w + 128 for a signed int8 code w with scale d, m = -128 d (GGUF Q8_0; symmetric int8 per block).
    ``matmul`` runs the AVX-512 VNNI kernel with the activations quantized to int8 per row and block."""

    codes: torch.Tensor  # [G, B, 256 | 512] uint8, the kernel's interleaved layout
    d: torch.Tensor      # [G, B, 16] float32
    m: torch.Tensor      # [G, B, 16] float32
    bits: int
    shape: tuple[int, int]  # (N, K)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> "BlockQuantWeight":
        """q [N, K] unsigned codes (uint8), d and m [N, K / 32] float32."""
        N, K = q.shape
        if K % QK:
            raise ValueError(f"qlinear: {K} input columns are not a multiple of {QK}")
        if bits not in (4, 8):
            raise ValueError(f"qlinear: bits must be 4 or 8, not {bits}")
        if bits == 4 and int(q.max()) > 15:
            raise ValueError("qlinear: 4-bit codes must lie in 0..15")
        B, G = K // QK, -(-N // NC)
        pad = G * NC - N  # padded columns have zero codes, scale and offset: they add exactly 0 and are never stored
        q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))
        d, m = (torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) for t in (d, m))
        # [G, 16 cols, B, 8 quads, 4] -> [G, B, 8 quads, 16 cols, 4]
        quads = q.view(G, NC, B, 8, 4).permute(0, 2, 3, 1, 4).reshape(G, B, 8, NC * 4)
        if bits == 4:  # quads i and i + 4 share a byte: low and high nibble
            codes = quads[:, :, :4] | (quads[:, :, 4:] << 4)
        else:
            codes = quads
        codes = codes.reshape(G, B, -1).contiguous()
        d, m = (t.view(G, NC, B).transpose(1, 2).contiguous() for t in (d, m))
        return cls(codes, d, m, bits, (N, K))

    @classmethod
    def from_int8_blocks(cls, w: torch.Tensor, d: torch.Tensor) -> "BlockQuantWeight":
        """Signed codes w [N, K] (int8) with per-block scales d [N, K / 32] (GGUF Q8_0)."""
        return cls.from_blocks((w.to(torch.int16) + 128).to(torch.uint8), d, -128.0 * d.float(), 8)

    @classmethod
    def quantize(cls, w: torch.Tensor, bits: int) -> "BlockQuantWeight":
        """A dense matrix, per block of 32: bits 4 asymmetric (min and max, as GGUF Q4_1), bits 8 symmetric (as
        GGUF Q8_0)."""
        N, K = w.shape
        if K % QK:
            raise ValueError(f"qlinear: {K} input columns are not a multiple of {QK}")
        if bits == 4:
            q, d, lo = minmax_int4(w, QK)
            return cls.from_blocks(q.to(torch.uint8), d, lo, 4)
        wg = w.float().view(N, K // QK, QK)
        d = wg.abs().amax(-1) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(wg * inv[..., None]).clamp_(-127, 127).view(N, K)
        return cls.from_int8_blocks(q.to(torch.int8), d)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes q [N, K] (uint8) and d, m [N, K / 32] as ``from_blocks`` took them."""
        N, K = self.shape
        G, B = self.codes.shape[:2]
        if self.bits == 4:
            c = self.codes.view(G, B, 4, NC * 4)
            quads = torch.cat([c & 0x0F, c >> 4], dim=2)  # [G, B, 8, 64]
        else:
            quads = self.codes.view(G, B, 8, NC * 4)
        q = quads.view(G, B, 8, NC, 4).permute(0, 3, 1, 2, 4).reshape(G * NC, K)[:N]
        d, m = (t.transpose(1, 2).reshape(G * NC, B)[:N] for t in (self.d, self.m))
        return q, d, m

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32, exactly the matrix the codes stand for: d * q + m for 4-bit codes (as GGUF Q4_1),
        d * (q - 128) + (m + 128 d) for 8-bit ones (as GGUF Q8_0, d * w, where m = -128 d)."""
        q, d, m = self.unpack()
        N, K = self.shape
        q = q.float().view(N, K // QK, QK)
        if self.bits == 8:
            q, m = q - 128.0, m + 128.0 * d
        return (q * d[..., None] + m[..., None]).view(N, K)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] (float32 or bfloat16) -> [T, N] in x's dtype."""
        mod = load()
        if mod is None:
            raise RuntimeError(f"the qlinear kernel is unavailable: {unavailable_reason()}")
        out = mod.qlinear(x.contiguous(), self.codes, self.d, self.m, self.shape[0], self.bits)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def fused(self, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0, swiglu: bool = False,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """float32 rows, in one call: ``residual + (prologue(x) @ W.T)`` where the prologue is RMSNorm with weight
        ``norm`` (x [T, K]) or SwiGLU, silu(gate) * up of x = [gate | up] [T, 2K], or nothing."""
        return load().qlinear(x.contiguous(), self.codes, self.d, self.m, self.shape[0], self.bits, norm, eps,
                              swiglu, residual)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, cached: torch.Tensor,
           base: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], one layer of the KV pool k, v [slots, H_kv, S, D] (float32, float16 or bfloat16) -> [T, H, D] in
    q's dtype (float32, float16 or bfloat16; the arithmetic is float32 whatever the types). Row t
    attends to the cache rows 0 .. cached[t] - 1 of slot slot[t], then to rows base[t] + j for each bit j of bits[t]
    (int64 [T] each)."""
    return load().attend(q, k, v, slot, cached, base, bits)


def decoder(layers: list[tuple], eps: float, num_heads: int):
    """The compiled layer loop for a model whose every layer is (qkv, o, gate_up, down: BlockQuantWeight,
    attn_norm, mlp_norm: float32 tensors): ``.forward(x, cos, sin, k_pool, v_pool, slot, pos, cached, base, bits)``
    runs ``qlinear`` and ``rope_attend`` (RoPE, K/V writes, ``attend``) layer after layer."""
    tensors, shapes = [], []
    for *mats, attn_norm, mlp_norm in layers:
        tensors.append([t for w in mats for t in (w.codes, w.d, w.m)] + [attn_norm.detach(), mlp_norm.detach()])
        shapes.append([x for w in mats for x in (w.shape[0], w.bits)])
    return load().Decoder(tensors, shapes, eps, num_heads)


def qlinear_reference(x: torch.Tensor, weight: BlockQuantWeight) -> torch.Tensor:
    """What ``weight.matmul(x)`` computes, in float64 from the kernel's own int8 activations: the exact value its
    float32 accumulation approximates (tests bound the difference)."""
    mod = load()
    q, ad, _ = mod.quantize_activations(x.float().contiguous())
    T, K = q.shape
    xa = (q.double().view(T, K // QK, QK) * ad.double()[..., None]).view(T, K)
    return xa @ weight.dequantize().double().t()
