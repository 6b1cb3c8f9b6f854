// Attention for CPU rows whose result is a function of the row's own query and key list only: a decode step, a
// draft-tree row, a prompt row of a prefill chunk and a decode step batched with other sequences' all compute a
// row the same way from the same keys, so each gets the same bits as the decode step at its position.
//
// Row t reads, from KV slot slot[t] of one layer of the pool ([slots, H_kv, S, D]), first the cache rows
// 0 .. cached[t] - 1 in place, then the cache rows base[t] + j for every bit j set in bits[t] (a draft row's
// ancestors and itself, in tree order). A decode step at position p has cached = p + 1 and no bits; a draft row at
// depth d after c cached tokens has cached = c and its d + 1 path bits: the same keys in the same order.
// Per query head: scores q.k / sqrt(D) in float32, softmax with the row's maximum, output sum_j p_j v_j / sum_j p_j.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// out[0:D] += p * v[0:D]
inline void axpy(float* out, float p, const float* v, int64_t D) {
  const __m512 pv = _mm512_set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= D; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
  if (i < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - i)) - 1u);
    _mm512_mask_storeu_ps(out + i, m, _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, v + i),
                                                       _mm512_maskz_loadu_ps(m, out + i)));
  }
}

}  // namespace

namespace {

void check_rows(const torch::Tensor& k, const torch::Tensor& v, int64_t T, const torch::Tensor& slot,
                const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, "attend: k and v [slots, H_kv, S, D]");
  TORCH_CHECK(k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat, "attend: float32 only");
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
void attend_rows(const float* qp, int64_t T, int64_t H, int64_t D, const torch::Tensor& k, const torch::Tensor& v,
                 const int64_t* slot_p, const int64_t* cached_p, const int64_t* base_p, const int64_t* bits_p,
                 float* op) {
  const int64_t Hkv = k.size(1);
  const int64_t g = H / Hkv;
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) work += cached_p[t] + __builtin_popcountll(static_cast<uint64_t>(bits_p[t]));
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  // one task per (row, KV head); a thread is worth waking from a few thousand key reads
  const int64_t tasks = T * Hkv;
  const int64_t grain = std::max<int64_t>(1, 2048 * tasks / std::max<int64_t>(1, work * Hkv));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> p;
    int64_t extra[64];
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t t = task / Hkv, hk = task % Hkv;
      // keys: cache rows 0 .. cached - 1, then the rows of the set bits (tree order)
      const int64_t cached_n = cached_p[t];
      int64_t n_extra = 0;
      for (uint64_t b = static_cast<uint64_t>(bits_p[t]); b; b &= b - 1) extra[n_extra++] = base_p[t] + __builtin_ctzll(b);
      const int64_t n = cached_n + n_extra;
      auto key_row = [&](int64_t j) { return j < cached_n ? j : extra[j - cached_n]; };
      const float* kh = kp + slot_p[t] * ks0 + hk * ks1;
      const float* vh = vp + slot_p[t] * vs0 + hk * vs1;
      p.resize(n + 16);
      for (int64_t h = hk * g; h < (hk + 1) * g; ++h) {
        const float* qh = qp + (t * H + h) * D;
        float* oh = op + (t * H + h) * D;
        if (n == 0) {
          for (int64_t i = 0; i < D; ++i) oh[i] = 0.f;
          continue;
        }
        float mx = -INFINITY;
        if (D == 64) {  // the common head size: the query and the output in registers
          const __m512 q0 = _mm512_loadu_ps(qh), q1 = _mm512_loadu_ps(qh + 16), q2 = _mm512_loadu_ps(qh + 32),
                       q3 = _mm512_loadu_ps(qh + 48);
          for (int64_t j = 0; j < n; ++j) {
            const float* kr = kh + key_row(j) * ks2;
            __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(kr));
            __m512 b = _mm512_mul_ps(q1, _mm512_loadu_ps(kr + 16));
            a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kr + 32), a);
            b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kr + 48), b);
            p[j] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
            mx = std::fmax(mx, p[j]);
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            p[j] = dot(qh, kh + key_row(j) * ks2, D) * scale;
            mx = std::fmax(mx, p[j]);
          }
        }
        // exponentials 16 at a time; lane sums added in a fixed order
        __m512 sum = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(mx);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
          const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p.data() + j), mv));
          _mm512_storeu_ps(p.data() + j, e);
          sum = _mm512_add_ps(sum, e);
        }
        if (j < n) {
          const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
          const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.data() + j), mv)));
          _mm512_mask_storeu_ps(p.data() + j, m, e);
          sum = _mm512_add_ps(sum, e);
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(sum);
        if (D == 64) {
          __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
          for (int64_t jj = 0; jj < n; ++jj) {
            const float* vr = vh + key_row(jj) * vs2;
            const __m512 pj = _mm512_set1_ps(p[jj]);
            o0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr), o0);
            o1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16), o1);
            o2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 32), o2);
            o3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 48), o3);
          }
          const __m512 iv = _mm512_set1_ps(inv);
          _mm512_storeu_ps(oh, _mm512_mul_ps(o0, iv));
          _mm512_storeu_ps(oh + 16, _mm512_mul_ps(o1, iv));
          _mm512_storeu_ps(oh + 32, _mm512_mul_ps(o2, iv));
          _mm512_storeu_ps(oh + 48, _mm512_mul_ps(o3, iv));
          continue;
        }
        for (int64_t i = 0; i < D; ++i) oh[i] = 0.f;
        for (int64_t jj = 0; jj < n; ++jj) axpy(oh, p[jj], vh + key_row(jj) * vs2, D);
        const __m512 iv = _mm512_set1_ps(inv);
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) _mm512_storeu_ps(oh + i, _mm512_mul_ps(_mm512_loadu_ps(oh + i), iv));
        for (; i < D; ++i) oh[i] *= inv;
      }
    }
  });
}

}  // namespace

// q [T, H, D] float32; k, v [slots, H_kv, S, D] float32 (rows of D contiguous); slot, cached, base, bits [T] int64
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                     const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat, "attend: q [T, H, D] float32");
  const auto qc = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  check_rows(k, v, T, slot, cached, base, bits);
  TORCH_CHECK(k.size(3) == D && H % k.size(1) == 0, "attend: head sizes");
  auto out = torch::empty({T, H, D}, q.options());
  attend_rows(qc.data_ptr<float>(), T, H, D, k, v, slot.data_ptr<int64_t>(), cached.data_ptr<int64_t>(),
              base.data_ptr<int64_t>(), bits.data_ptr<int64_t>(), out.data_ptr<float>());
  return out;
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
  const float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * width;
    const float* ct = c + t * D;
    const float* st = s + t * D;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      const float* in = row + h * D;
      float* o = h < H ? qp + (t * H + h) * D : kp + slot_p[t] * k.stride(0) + (h - H) * k.stride(1) +
                                                  pos_p[t] * k.stride(2);
      for (int64_t i = 0; i < D; ++i) {
        const float rolled = in[i < half ? i + half : i - half];
        o[i] = in[i] * ct[i] + rolled * st[i];
      }
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* in = row + (H + Hkv + h) * D;
      float* o = vp + slot_p[t] * v.stride(0) + h * v.stride(1) + pos_p[t] * v.stride(2);
      for (int64_t i = 0; i < D; ++i) o[i] = in[i];
    }
  }
  auto out = torch::empty({T, H * D}, qkv.options());
  attend_rows(qp, T, H, D, k, v, slot_p, cached.data_ptr<int64_t>(), base.data_ptr<int64_t>(),
              bits.data_ptr<int64_t>(), out.data_ptr<float>());
  return out;
}
