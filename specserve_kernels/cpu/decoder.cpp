// The decoder layers of the quantized CPU target in one call per forward: per layer the fused QKV projection
// (RMSNorm prologue), RoPE + K/V writes + attention, the output projection (+ residual), gate/up (RMSNorm prologue)
// and down (SwiGLU prologue, + residual). The same kernels as the per-call path, in the same order: only the Python
// between them is gone (on a 2-core CPU, 150 calls from Python cost about as much as the attention of a step).
#include <torch/extension.h>

#include <vector>

torch::Tensor qlinear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                      const torch::Tensor& m, int64_t N, int64_t bits, const c10::optional<torch::Tensor>& norm,
                      double eps, bool swiglu, const c10::optional<torch::Tensor>& residual);
torch::Tensor rope_attend(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& slot,
                          const torch::Tensor& pos, const torch::Tensor& cached, const torch::Tensor& base,
                          const torch::Tensor& bits, int64_t H);

struct QMatrix {
  torch::Tensor codes, d, m;
  int64_t n, bits;
};

// Built once from the model's packed matrices: per layer [qkv, o, gate_up, down] and its two norm weights.
class Decoder {
 public:
  Decoder(const std::vector<std::vector<torch::Tensor>>& layers, const std::vector<std::vector<int64_t>>& shapes,
          double eps, int64_t heads)
      : eps_(eps), heads_(heads) {
    TORCH_CHECK(layers.size() == shapes.size(), "Decoder: one shape list per layer");
    for (size_t l = 0; l < layers.size(); ++l) {
      // layers[l]: codes, d, m of the 4 matrices, then attn_norm, mlp_norm; shapes[l]: (n, bits) of the 4
      TORCH_CHECK(layers[l].size() == 14 && shapes[l].size() == 8, "Decoder: layer ", l, " is incomplete");
      for (int i = 0; i < 4; ++i)
        mats_.push_back({layers[l][3 * i], layers[l][3 * i + 1], layers[l][3 * i + 2], shapes[l][2 * i],
                         shapes[l][2 * i + 1]});
      attn_norm_.push_back(layers[l][12]);
      mlp_norm_.push_back(layers[l][13]);
    }
  }

  // x [T, hidden] float32 -> the last layer's output; k, v: the whole pool [L, slots, H_kv, S, D]
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& slot, const torch::Tensor& pos,
                        const torch::Tensor& cached, const torch::Tensor& base, const torch::Tensor& bits) {
    TORCH_CHECK(k.dim() == 5 && k.size(0) == static_cast<int64_t>(attn_norm_.size()), "Decoder: the KV pool");
    for (size_t l = 0; l < attn_norm_.size(); ++l) {
      const QMatrix& qkv_w = mats_[4 * l];
      const QMatrix& o_w = mats_[4 * l + 1];
      const QMatrix& gu_w = mats_[4 * l + 2];
      const QMatrix& down_w = mats_[4 * l + 3];
      auto qkv = qlinear(x, qkv_w.codes, qkv_w.d, qkv_w.m, qkv_w.n, qkv_w.bits, attn_norm_[l], eps_, false,
                         c10::nullopt);
      auto o = rope_attend(qkv, cos, sin, k.select(0, l), v.select(0, l), slot, pos, cached, base, bits, heads_);
      x = qlinear(o, o_w.codes, o_w.d, o_w.m, o_w.n, o_w.bits, c10::nullopt, 0.0, false, x);
      auto gate_up = qlinear(x, gu_w.codes, gu_w.d, gu_w.m, gu_w.n, gu_w.bits, mlp_norm_[l], eps_, false,
                             c10::nullopt);
      x = qlinear(gate_up, down_w.codes, down_w.d, down_w.m, down_w.n, down_w.bits, c10::nullopt, 0.0, true, x);
    }
    return x;
  }

 private:
  std::vector<QMatrix> mats_;
  std::vector<torch::Tensor> attn_norm_, mlp_norm_;
  double eps_;
  int64_t heads_;
};

void bind_decoder(pybind11::module& mod) {
  pybind11::class_<Decoder>(mod, "Decoder")
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&, const std::vector<std::vector<int64_t>>&,
                          double, int64_t>())
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
