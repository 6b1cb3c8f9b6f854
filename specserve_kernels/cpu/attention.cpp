// Attention for CPU rows whose result is a function of the row's own query and key list only: a decode step, a
// draft-tree row, a prompt row of a prefill chunk and a decode step batched with other sequences' all compute a
// row the same way from the same keys, so each gets the same bits as the decode step at its position.
//
// Row t reads, from KV slot slot[t] of one layer of the pool ([slots, H_kv, S, D]), first the cache rows
// 0 .. cached[t] - 1 in place, then the cache rows base[t] + j for every bit j set in bits[t] (a draft row's
// ancestors and itself, in tree order). A decode step at position p has cached = p + 1 and no bits; a draft row at
// depth d after c cached tokens has cached = c and its d + 1 path bits: the same keys in the same order.
// Per query head: scores q.k / sqrt(D) in float32, softmax with the row's maximum, output sum_j p_j v_j / sum_j p_j.
// The pool holds float32, float16 or bfloat16 K/V (each row widened exactly on load); the arithmetic is float32
// whatever the pool's type, and so is the query (a 16-bit query is widened exactly, the output rounded once).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// 16 lanes of a K or V row, as float32: the pool stores float32, float16 or bfloat16 (converted exactly on load;
// a bfloat16 is the top half of its float32)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const at::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 maskload16(__mmask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 maskload16(__mmask16 m, const at::Half* p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 maskload16(__mmask16 m, const at::BFloat16* p) { return widen_bf16(_mm256_maskz_loadu_epi16(m, p)); }

template <typename E>
inline float dot(const float* a, const E* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
  if (i < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), maskload16(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// out[0:D] += p * v[0:D]
template <typename E>
inline void axpy(float* out, float p, const E* v, int64_t D) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= D; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(out + i)));
  if (i < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - i)) - 1u);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(pv, maskload16(m, v + i), _mm512_maskz_loadu_ps(m, out + i)));
  }
}

// p[0:n] <- exp(p - max(p)) in place; returns 1 / sum (lane sums added in a fixed order)
inline float softmax_numerators(float* p, int64_t n, float mx) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(mx);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p + j), mv));
    _mm512_storeu_ps(p + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), mv)));
    _mm512_mask_storeu_ps(p + j, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// Sixteen vectors to one: lane j holds the sum of v[j]'s 16 lanes. Every lane goes through the same addition tree
// (pairs within 128-bit lanes, then quads, then across the 128-bit lanes), so a key's score has the same bits at any
// place in a block; 45 instructions for 16 sums against about 8 per horizontal sum.
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// The key rows of one task: cache rows 0 .. cached - 1 in place, then the listed extra rows (tree order).
struct Keys {
  int64_t cached, n_extra;
  const int64_t* extra;
  inline int64_t row(int64_t j) const { return j < cached ? j : extra[j - cached]; }
  template <typename F>
  inline void each(F f) const {
    for (int64_t j = 0; j < cached; ++j) f(j, j);
    for (int64_t e = 0; e < n_extra; ++e) f(cached + e, extra[e]);
  }
};

// D = 64: NH query heads of one KV head together, so each K and V row is loaded (and converted) once for all of
// them. Every head's arithmetic is the one-head sequence: scores, softmax, weighted sum in key order.
template <typename E, int NH>
void heads64(const float* q, float* o, const E* kh, const E* vh, int64_t ks2, int64_t vs2, const Keys& keys,
             int64_t n, float scale, float* p, int64_t np) {
  __m512 qr[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < 4; ++i) qr[h][i] = _mm512_loadu_ps(q + h * 64 + 16 * i);
  // scores 16 keys at a time: the 16 partial vectors of a block summed across lanes together (sum16); float16 keys
  // are widened once per block for all the heads
  alignas(64) float wide[16 * 64];
  __m512 mxv[NH];
  for (int h = 0; h < NH; ++h) mxv[h] = _mm512_set1_ps(-INFINITY);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int nb = static_cast<int>(std::min<int64_t>(16, n - j0));
    const float* kr[16];
    for (int i = 0; i < nb; ++i) {
      const E* src = kh + keys.row(j0 + i) * ks2;
      if constexpr (std::is_same_v<E, float>) {
        kr[i] = src;
      } else {
        for (int c = 0; c < 4; ++c) _mm512_store_ps(wide + 64 * i + 16 * c, load16(src + 16 * c));
        kr[i] = wide + 64 * i;
      }
    }
    const __mmask16 live = static_cast<__mmask16>(nb == 16 ? 0xFFFFu : (1u << nb) - 1u);
    for (int h = 0; h < NH; ++h) {
      __m512 v[16];
      for (int i = 0; i < 16; ++i) {
        if (i >= nb) {
          v[i] = _mm512_setzero_ps();
          continue;
        }
        __m512 a = _mm512_mul_ps(qr[h][0], _mm512_loadu_ps(kr[i]));
        __m512 b = _mm512_mul_ps(qr[h][1], _mm512_loadu_ps(kr[i] + 16));
        a = _mm512_fmadd_ps(qr[h][2], _mm512_loadu_ps(kr[i] + 32), a);
        b = _mm512_fmadd_ps(qr[h][3], _mm512_loadu_ps(kr[i] + 48), b);
        v[i] = _mm512_add_ps(a, b);
      }
      const __m512 sc = _mm512_mul_ps(sum16(v), sv);
      _mm512_storeu_ps(p + h * np + j0, sc);  // p has 16 spare floats past n
      mxv[h] = _mm512_mask_max_ps(mxv[h], live, mxv[h], sc);
    }
  }
  float inv[NH];
  for (int h = 0; h < NH; ++h) inv[h] = softmax_numerators(p + h * np, n, _mm512_reduce_max_ps(mxv[h]));
  __m512 acc[NH][4];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < 4; ++i) acc[h][i] = _mm512_setzero_ps();
  keys.each([&](int64_t j, int64_t row) {
    const E* vr = vh + row * vs2;
    const __m512 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
    for (int h = 0; h < NH; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h * np + j]);
      acc[h][0] = _mm512_fmadd_ps(pj, v0, acc[h][0]);
      acc[h][1] = _mm512_fmadd_ps(pj, v1, acc[h][1]);
      acc[h][2] = _mm512_fmadd_ps(pj, v2, acc[h][2]);
      acc[h][3] = _mm512_fmadd_ps(pj, v3, acc[h][3]);
    }
  });
  for (int h = 0; h < NH; ++h) {
    const __m512 iv = _mm512_set1_ps(inv[h]);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(o + h * 64 + 16 * i, _mm512_mul_ps(acc[h][i], iv));
  }
}

// Any head size, one head at a time.
template <typename E>
void head_any(const float* q, float* o, const E* kh, const E* vh, int64_t ks2, int64_t vs2, const Keys& keys,
              int64_t n, int64_t D, float scale, float* p) {
  float mx = -INFINITY;
  keys.each([&](int64_t j, int64_t row) {
    p[j] = dot(q, kh + row * ks2, D) * scale;
    mx = std::fmax(mx, p[j]);
  });
  const float inv = softmax_numerators(p, n, mx);
  for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
  keys.each([&](int64_t j, int64_t row) { axpy(o, p[j], vh + row * vs2, D); });
  const __m512 iv = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(o + i), iv));
  for (; i < D; ++i) o[i] *= inv;
}

void check_rows(const torch::Tensor& k, const torch::Tensor& v, int64_t T, const torch::Tensor& slot,
                const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "attend: k and v [slots, H_kv, S, D]");
  TORCH_CHECK((k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kHalf ||
               k.scalar_type() == torch::kBFloat16) && v.scalar_type() == k.scalar_type(),
              "attend: k and v both float32, float16 or bfloat16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(), "attend: k and v rows");
  for (const auto* t : {&slot, &cached, &base, &bits})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->numel() == T && t->is_contiguous(), "attend: row specs");
  const int64_t S = k.size(2);
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  const int64_t* cached_p = cached.data_ptr<int64_t>();
  const int64_t* base_p = base.data_ptr<int64_t>();
  const int64_t* bits_p = bits.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t b = static_cast<uint64_t>(bits_p[t]);
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < k.size(0) && cached_p[t] >= 0 && cached_p[t] <= S,
                "attend: row ", t, " reads outside the pool");
    TORCH_CHECK(b == 0 || (base_p[t] >= 0 && base_p[t] + 64 - __builtin_clzll(b) <= S), "attend: row ", t,
                " bits past the slot");
  }
}

// q [T, H, D] (contiguous float32) -> out [T, H, D]; the rows' specs checked by check_rows
template <typename E>
void attend_rows(const float* qp, int64_t T, int64_t H, int64_t D, const torch::Tensor& k, const torch::Tensor& v,
                 const int64_t* slot_p, const int64_t* cached_p, const int64_t* base_p, const int64_t* bits_p,
                 float* op) {
  const int64_t Hkv = k.size(1);
  const int64_t g = H / Hkv;
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) work += cached_p[t] + __builtin_popcountll(static_cast<uint64_t>(bits_p[t]));
  const E* kp = k.data_ptr<E>();
  const E* vp = v.data_ptr<E>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  // One task per (KV head, row), head-major: a thread's consecutive tasks read the same head of a slot, which stays
  // in its cache. A thread is worth waking from a few thousand key reads.
  const int64_t tasks = T * Hkv;
  const int64_t grain = std::max<int64_t>(1, 2048 * tasks / std::max<int64_t>(1, work * Hkv));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> p;
    int64_t extra[64];
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t hk = task / T, t = task % T;
      int64_t n_extra = 0;
      for (uint64_t b = static_cast<uint64_t>(bits_p[t]); b; b &= b - 1) extra[n_extra++] = base_p[t] + __builtin_ctzll(b);
      const Keys keys{cached_p[t], n_extra, extra};
      const int64_t n = keys.cached + n_extra;
      const E* kh = kp + slot_p[t] * ks0 + hk * ks1;
      const E* vh = vp + slot_p[t] * vs0 + hk * vs1;
      const float* q = qp + (t * H + hk * g) * D;
      float* o = op + (t * H + hk * g) * D;
      if (n == 0) {
        for (int64_t i = 0; i < g * D; ++i) o[i] = 0.f;
        continue;
      }
      const int64_t np = n + 16;
      p.resize(std::min<int64_t>(g, 3) * np);
      if (D == 64) {  // the common head size: queries and outputs in registers, up to 3 heads per K/V load
        for (int64_t h = 0; h < g; h += 3) {
          const int64_t nh = std::min<int64_t>(3, g - h);
          const float* qh = q + h * 64;
          float* oh = o + h * 64;
          if (nh == 3) heads64<E, 3>(qh, oh, kh, vh, ks2, vs2, keys, n, scale, p.data(), np);
          else if (nh == 2) heads64<E, 2>(qh, oh, kh, vh, ks2, vs2, keys, n, scale, p.data(), np);
          else heads64<E, 1>(qh, oh, kh, vh, ks2, vs2, keys, n, scale, p.data(), np);
        }
      } else {
        for (int64_t h = 0; h < g; ++h) head_any(q + h * D, o + h * D, kh, vh, ks2, vs2, keys, n, D, scale, p.data());
      }
    }
  });
}

void attend_any(const float* qp, int64_t T, int64_t H, int64_t D, const torch::Tensor& k, const torch::Tensor& v,
                const int64_t* slot_p, const int64_t* cached_p, const int64_t* base_p, const int64_t* bits_p,
                float* op) {
  if (k.scalar_type() == torch::kHalf)
    attend_rows<at::Half>(qp, T, H, D, k, v, slot_p, cached_p, base_p, bits_p, op);
  else if (k.scalar_type() == torch::kBFloat16)
    attend_rows<at::BFloat16>(qp, T, H, D, k, v, slot_p, cached_p, base_p, bits_p, op);
  else
    attend_rows<float>(qp, T, H, D, k, v, slot_p, cached_p, base_p, bits_p, op);
}

// A row's K (after RoPE) or V into the pool, rounded to the pool's type there
inline void store_row(float* dst, const float* src, int64_t D) { std::copy(src, src + D, dst); }
inline void store_row(at::Half* dst, const float* src, int64_t D) {
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<at::Half>(src[i]);
}
inline void store_row(at::BFloat16* dst, const float* src, int64_t D) {
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

template <typename E>
void write_rows(const float* x, const float* c, const float* s, float* qp, const torch::Tensor& k,
                const torch::Tensor& v, const int64_t* slot_p, const int64_t* pos_p, int64_t T, int64_t H,
                int64_t Hkv, int64_t D) {
  E* kp = k.data_ptr<E>();
  E* vp = v.data_ptr<E>();
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
  std::vector<float> rot(D);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * width;
    const float* ct = c + t * D;
    const float* st = s + t * D;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      const float* in = row + h * D;
      float* o = h < H ? qp + (t * H + h) * D : rot.data();
      for (int64_t i = 0; i < D; ++i) {
        const float rolled = in[i < half ? i + half : i - half];
        o[i] = in[i] * ct[i] + rolled * st[i];
      }
      if (h >= H)
        store_row(kp + slot_p[t] * k.stride(0) + (h - H) * k.stride(1) + pos_p[t] * k.stride(2), rot.data(), D);
    }
    for (int64_t h = 0; h < Hkv; ++h)
      store_row(vp + slot_p[t] * v.stride(0) + h * v.stride(1) + pos_p[t] * v.stride(2), row + (H + Hkv + h) * D, D);
  }
}

}  // namespace

// q [T, H, D] float32, float16 or bfloat16 (the output's type); k, v [slots, H_kv, S, D] all float32, float16 or
// bfloat16 (rows of D contiguous); slot, cached, base, bits [T] int64
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                     const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kHalf ||
                               q.scalar_type() == torch::kBFloat16), "attend: q [T, H, D] float32, float16 or bfloat16");
  const auto qc = q.to(torch::kFloat).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  check_rows(k, v, T, slot, cached, base, bits);
  TORCH_CHECK(k.size(3) == D && H % k.size(1) == 0, "attend: head sizes");
  auto out = torch::empty({T, H, D}, qc.options());
  attend_any(qc.data_ptr<float>(), T, H, D, k, v, slot.data_ptr<int64_t>(), cached.data_ptr<int64_t>(),
             base.data_ptr<int64_t>(), bits.data_ptr<int64_t>(), out.data_ptr<float>());
  return q.scalar_type() == torch::kFloat ? out : out.to(q.scalar_type());
}

// One layer's attention block after the QKV projection, for every row of a forward: RoPE on the q and k heads
// (x cos + roll(x, D / 2) sin, with Rope.table's signed sin), each row's k and v written to cache row pos[t] of slot
// slot[t], then attend as above. qkv [T, (H + 2 H_kv) D], cos, sin [T, D] -> [T, H D].
torch::Tensor rope_attend(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                          const torch::Tensor& pos, const torch::Tensor& cached, const torch::Tensor& base,
                          const torch::Tensor& bits, int64_t H) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat, "rope_attend: qkv");
  const int64_t T = qkv.size(0), Hkv = k.size(1), D = k.size(3);
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && H % Hkv == 0 && D % 2 == 0, "rope_attend: head sizes");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "rope_attend: cos, sin");
  check_rows(k, v, T, slot, cached, base, bits);
  TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.numel() == T && pos.is_contiguous(), "rope_attend: pos");
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  const int64_t* pos_p = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos_p[t] >= 0 && pos_p[t] < k.size(2), "rope_attend: row ", t, " writes outside the slot");
  auto q = torch::empty({T, H, D}, qkv.options());
  if (k.scalar_type() == torch::kHalf)
    write_rows<at::Half>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), k,
                         v, slot_p, pos_p, T, H, Hkv, D);
  else if (k.scalar_type() == torch::kBFloat16)
    write_rows<at::BFloat16>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
                             k, v, slot_p, pos_p, T, H, Hkv, D);
  else
    write_rows<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), k, v,
                      slot_p, pos_p, T, H, Hkv, D);
  auto out = torch::empty({T, H * D}, qkv.options());
  attend_any(q.data_ptr<float>(), T, H, D, k, v, slot_p, cached.data_ptr<int64_t>(), base.data_ptr<int64_t>(),
             bits.data_ptr<int64_t>(), out.data_ptr<float>());
  return out;
}
