// Block-quantized linear layer for x86 CPUs with AVX-512 VNNI: out[T, N] = x[T, K] @ W[N, K].T where W is stored as
// unsigned codes per block of 32 input columns, W[n, k] = d[n, b] * q[n, k] + m[n, b] (b = k / 32):
//   - 4-bit codes (GGUF Q4_1 as stored: q in 0..15),
//   - 8-bit codes (a signed int8 weight w with scale d stored as q = w + 128, m = -128 d: GGUF Q8_0 and per-channel
//     int8 both fit).
// Each row of x is quantized to int8 per block of 32 (scale a_d = max|x| / 127, as llama.cpp's Q8_1 activations),
// so a block's dot product is an exact integer (vpdpbusd: u8 x s8, summed in int32), scaled once per block:
//   out[t, n] = sum_b  d[n, b] * a_d[t, b] * sum_k q[n, k] a[t, k]  +  m[n, b] * a_d[t, b] * sum_k a[t, k]
//
// Layout (packed once at load by kernels/cpu/__init__.py): output columns in groups of 16, one zmm of int32 / float
// lanes, lane j = column 16 g + j. For group g and block b, the codes form 8 "quads" (input columns 4i..4i+3 of the
// block) of 64 bytes: [col 0: 4 codes, col 1: 4 codes, ..., col 15: 4 codes]. One vpdpbusd with the row's 4 matching
// activation bytes broadcast to every lane advances all 16 columns by 4 input columns, so no horizontal sum is ever
// needed and each weight byte is unpacked once per step for all the rows of that step. 4-bit codes hold quads i and
// i + 4 in the low and high nibbles of one 64-byte chunk (256 bytes per group and block); 8-bit codes take the 8
// quads as they are (512 bytes).
//
// Every row runs the same instruction sequence whatever the number of rows or threads (the column split never splits
// a sum, the float accumulation order over blocks is fixed): a row's result is bit for bit independent of the other
// rows, which is what lets a verified draft row stand for a decode step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t QK = 32;   // input columns per block
constexpr int64_t NC = 16;   // output columns per group
constexpr int64_t MAX_RT = 8;  // rows per register tile
#ifndef GRAIN_BYTES
#define GRAIN_BYTES 8192
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

// x [T, K] -> codes [T, K] int8, per block a_d [T, B] and a_s = a_d * sum(codes) [T, B]
template <typename In>
void quantize_rows(const In* x, int64_t T, int64_t K, int8_t* q, float* ad, float* as) {
  const int64_t B = K / QK;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const In* xb = x + t * K + b * QK;
      float v[QK];
      float amax = 0.f;
      for (int64_t i = 0; i < QK; ++i) {
        v[i] = static_cast<float>(xb[i]);
        amax = std::fmax(amax, std::fabs(v[i]));
      }
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      int8_t* qb = q + t * K + b * QK;
      for (int64_t i = 0; i < QK; ++i) {
        const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * id));
        qb[i] = static_cast<int8_t>(c);
        sum += c;
      }
      ad[t * B + b] = d;
      as[t * B + b] = d * static_cast<float>(sum);
    }
  }
}

// The codes of one group and block as 8 quad vectors of 64 unsigned bytes.
template <int BITS>
inline void load_block(const uint8_t* w, __m512i* quad) {
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512(w + 64 * i);
      quad[i] = _mm512_and_si512(v, low);
      quad[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  } else {
    for (int i = 0; i < 8; ++i) quad[i] = _mm512_loadu_si512(w + 64 * i);
  }
}

// R rows (R <= MAX_RT) of one column group: acc[r] lanes = the group's 16 outputs of row r.
template <int BITS, int R>
inline void group_tile(const uint8_t* w, const float* dw, const float* mw, int64_t B, const int8_t* aq,
                       const float* ad, const float* as, int64_t K, float* out, int64_t ldo, __mmask16 store_mask) {
  constexpr int64_t block_bytes = BITS == 4 ? 256 : 512;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512i quad[8];
  for (int64_t b = 0; b < B; ++b) {
    // ahead of the hardware prefetcher: the codes (and scales) a few blocks on, into the next group's if need be
    const char* ahead = reinterpret_cast<const char*>(w + b * block_bytes) + PREFETCH_BYTES;
    for (int64_t c = 0; c < block_bytes; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dw + b * NC) + PREFETCH_BYTES / 4, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(mw + b * NC) + PREFETCH_BYTES / 4, _MM_HINT_T0);
    load_block<BITS>(w + b * block_bytes, quad);
    // quads outer, rows inner: R independent integer chains in flight instead of one 8-long chain per row
    __m512i dot[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* a = reinterpret_cast<const int32_t*>(aq + r * K + b * QK);
        dot[r] = _mm512_dpbusd_epi32(dot[r], quad[i], _mm512_set1_epi32(a[i]));
      }
    }
    const __m512 d = _mm512_loadu_ps(dw + b * NC);
    const __m512 m = _mm512_loadu_ps(mw + b * NC);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(ad[r * B + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(as[r * B + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo, store_mask, acc[r]);
}

template <int BITS>
void group_rows(const uint8_t* w, const float* dw, const float* mw, int64_t B, const int8_t* aq, const float* ad,
                const float* as, int64_t K, int64_t T, float* out, int64_t ldo, __mmask16 mask) {
  int64_t t = 0;
  for (; t + MAX_RT <= T; t += MAX_RT)
    group_tile<BITS, MAX_RT>(w, dw, mw, B, aq + t * K, ad + t * B, as + t * B, K, out + t * ldo, ldo, mask);
  const int64_t rest = T - t;
  const int8_t* a = aq + t * K;
  float* o = out + t * ldo;
  switch (rest) {
    case 0: break;
    case 1: group_tile<BITS, 1>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
    case 2: group_tile<BITS, 2>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
    case 3: group_tile<BITS, 3>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
    case 4: group_tile<BITS, 4>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
    case 5: group_tile<BITS, 5>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
    case 6: group_tile<BITS, 6>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
    default: group_tile<BITS, 7>(w, dw, mw, B, a, ad + t * B, as + t * B, K, o, ldo, mask); break;
  }
}

// x [T, K] float32 or bfloat16; codes [G, B, block_bytes] uint8; d, m [G, B, 16] float32 -> [T, N] float32
// The row the matmul reads, from a float32 row of the caller: RMSNorm with its weight (``norm``), else SwiGLU of a
// [gate | up] row (silu(gate) * up). Rows without a prologue are quantized as they are.
void prepare_row(const float* x, int64_t K, const float* norm, float eps, float* out) {
  if (norm != nullptr) {
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    for (int64_t i = 0; i < K; ++i) out[i] = (x[i] * inv) * norm[i];
  } else {
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
      const __m512 g = _mm512_loadu_ps(x + i);
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(x + K + i)));
    }
    for (; i < K; ++i) out[i] = x[i] / (1.f + std::exp(-x[i])) * x[K + i];
  }
}

}  // namespace

// x [T, K] float32 or bfloat16 ([T, 2K] float32 with swiglu); codes [G, B, block_bytes] uint8; d, m [G, B, 16]
// float32 -> [T, N] float32 (+ residual [T, N] where given)
torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                      const torch::Tensor& m, int64_t N, int64_t bits, const c10::optional<torch::Tensor>& norm,
                      double eps, bool swiglu, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "qlinear: x must be a contiguous [T, K] matrix");
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: bits must be 4 or 8");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 3, "qlinear: codes");
  TORCH_CHECK(d.scalar_type() == torch::kFloat && m.scalar_type() == torch::kFloat && d.is_contiguous() &&
              m.is_contiguous(), "qlinear: d and m must be contiguous float32");
  const int64_t T = x.size(0), G = codes.size(0), B = codes.size(1), K = B * QK;
  TORCH_CHECK(x.size(1) == (swiglu ? 2 * K : K), "qlinear: x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(codes.size(2) == (bits == 4 ? 256 : 512), "qlinear: codes block size");
  TORCH_CHECK(G * NC >= N && (G - 1) * NC < N, "qlinear: ", G, " column groups cannot hold ", N, " columns");
  const bool prologue = norm.has_value() || swiglu;
  TORCH_CHECK(!(norm.has_value() && swiglu), "qlinear: norm or swiglu, not both");
  TORCH_CHECK(!prologue || x.scalar_type() == torch::kFloat, "qlinear: a fused norm or SwiGLU takes float32 rows");
  if (norm.has_value())
    TORCH_CHECK(norm->scalar_type() == torch::kFloat && norm->numel() == K && norm->is_contiguous(), "qlinear: norm");
  if (residual.has_value())
    TORCH_CHECK(residual->scalar_type() == torch::kFloat && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == T && residual->size(1) == N, "qlinear: residual must be float32 [T, N]");
  auto out = torch::empty({T, N}, x.options().dtype(torch::kFloat));
  if (T == 0) return out;
  std::vector<int8_t> aq(T * K);
  std::vector<float> ad(T * B), as(T * B);
  if (prologue) {
    std::vector<float> row(K);
    const float* xp = x.data_ptr<float>();
    const float* np = norm.has_value() ? norm->data_ptr<float>() : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      prepare_row(xp + t * x.size(1), K, np, static_cast<float>(eps), row.data());
      quantize_rows(row.data(), 1, K, aq.data() + t * K, ad.data() + t * B, as.data() + t * B);
    }
  } else if (x.scalar_type() == torch::kFloat) {
    quantize_rows(x.data_ptr<float>(), T, K, aq.data(), ad.data(), as.data());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "qlinear: x must be float32 or bfloat16");
    quantize_rows(x.data_ptr<at::BFloat16>(), T, K, aq.data(), ad.data(), as.data());
  }
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const float* dw = d.data_ptr<float>();
  const float* mw = m.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t block_bytes = codes.size(2);
  // grain: a thread's share is worth waking it for from about 8 KB of codes (or that much work at several rows)
  const int64_t grain = std::max<int64_t>(1, GRAIN_BYTES / (B * block_bytes * std::min<int64_t>(T, 4)));
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cols = std::min<int64_t>(NC, N - g * NC);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
      const uint8_t* wg = w + g * B * block_bytes;
      if (bits == 4)
        group_rows<4>(wg, dw + g * B * NC, mw + g * B * NC, B, aq.data(), ad.data(), as.data(), K, T, o + g * NC, N,
                      mask);
      else
        group_rows<8>(wg, dw + g * B * NC, mw + g * B * NC, B, aq.data(), ad.data(), as.data(), K, T, o + g * NC, N,
                      mask);
    }
  });
  if (residual.has_value()) {
    const float* r = residual->data_ptr<float>();
    for (int64_t i = 0; i < T * N; ++i) o[i] += r[i];
  }
  return out;
}

// The int8 codes, per-block scales and scaled sums qlinear gives a row of x (for tests and the reference).
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: contiguous float32 [T, K]");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32");
  auto q = torch::empty({T, K}, x.options().dtype(torch::kInt8));
  auto ad = torch::empty({T, K / QK}, x.options());
  auto as = torch::empty({T, K / QK}, x.options());
  quantize_rows(x.data_ptr<float>(), T, K, q.data_ptr<int8_t>(), ad.data_ptr<float>(), as.data_ptr<float>());
  return {q, ad, as};
}


// attention.cpp
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                     const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits);
torch::Tensor rope_attend(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                          const torch::Tensor& pos, const torch::Tensor& cached, const torch::Tensor& base,
                          const torch::Tensor& bits, int64_t H);
void bind_decoder(pybind11::module& mod);  // decoder.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  bind_decoder(mod);
  mod.def("attend", &attend, "row-invariant float32 attention over listed cache rows (AVX-512)");
  mod.def("rope_attend", &rope_attend, "RoPE, the rows' K/V written into the pool, then attend (one layer)");
  mod.def("qlinear", &qlinear, "block-quantized x @ W.T (AVX-512 VNNI), with an optional fused RMSNorm or SwiGLU "
          "before and residual after", pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("d"),
          pybind11::arg("m"), pybind11::arg("N"), pybind11::arg("bits"), pybind11::arg("norm") = pybind11::none(),
          pybind11::arg("eps") = 0.0, pybind11::arg("swiglu") = false, pybind11::arg("residual") = pybind11::none());
  mod.def("quantize_activations", &quantize_activations, "per-block int8 activations as qlinear takes them");
}
