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

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// e^x for x <= 0 (softmax arguments), float32: Cody-Waite range reduction and a degree-6 polynomial (relative error
// ~2e-7); the same code for every lane and call, so its result depends on x alone.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

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

// q [T, H, D] float32; k, v [slots, H_kv, S, D] float32 (rows of D contiguous); slot, cached, base, bits [T] int64
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                     const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "attend: q [T, H, D], k and v [slots, H_kv, S, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
              v.scalar_type() == torch::kFloat, "attend: float32 only");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes(), "attend: k and v rows");
  const auto qc = q.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0, "attend: head sizes");
  const int64_t g = H / Hkv;
  for (const auto* t : {&slot, &cached, &base, &bits})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->numel() == T && t->is_contiguous(), "attend: row specs");
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  const int64_t* cached_p = cached.data_ptr<int64_t>();
  const int64_t* base_p = base.data_ptr<int64_t>();
  const int64_t* bits_p = bits.data_ptr<int64_t>();
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) {
    const uint64_t b = static_cast<uint64_t>(bits_p[t]);
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < k.size(0) && cached_p[t] >= 0 && cached_p[t] <= S,
                "attend: row ", t, " reads outside the pool");
    TORCH_CHECK(b == 0 || (base_p[t] >= 0 && base_p[t] + 64 - __builtin_clzll(b) <= S), "attend: row ", t,
                " bits past the slot");
    work += cached_p[t] + __builtin_popcountll(b);
  }
  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  // one task per (row, KV head); a thread is worth waking from a few thousand key reads
  const int64_t tasks = T * Hkv;
  const int64_t grain = std::max<int64_t>(1, 4096 * tasks / std::max<int64_t>(1, work * Hkv));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> rows;
    std::vector<float> p;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t t = task / Hkv, hk = task % Hkv;
      rows.clear();
      for (int64_t j = 0; j < cached_p[t]; ++j) rows.push_back(j);
      for (uint64_t b = static_cast<uint64_t>(bits_p[t]); b; b &= b - 1) rows.push_back(base_p[t] + __builtin_ctzll(b));
      const int64_t n = static_cast<int64_t>(rows.size());
      const float* kh = kp + slot_p[t] * ks0 + hk * ks1;
      const float* vh = vp + slot_p[t] * vs0 + hk * vs1;
      p.resize(n + 16);
      for (int64_t h = hk * g; h < (hk + 1) * g; ++h) {
        const float* qh = qp + (t * H + h) * D;
        float* oh = op + (t * H + h) * D;
        for (int64_t i = 0; i < D; ++i) oh[i] = 0.f;
        if (n == 0) continue;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          p[j] = dot(qh, kh + rows[j] * ks2, D) * scale;
          mx = std::fmax(mx, p[j]);
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
        for (int64_t jj = 0; jj < n; ++jj) axpy(oh, p[jj], vh + rows[jj] * vs2, D);
        const __m512 iv = _mm512_set1_ps(inv);
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) _mm512_storeu_ps(oh + i, _mm512_mul_ps(_mm512_loadu_ps(oh + i), iv));
        for (; i < D; ++i) oh[i] *= inv;
      }
    }
  });
  return out;
}
