// AdamW step over float32 CPU parameters (float32 or bfloat16 gradients): one OpenMP loop
// over every element of every tensor, each element read and written once (param, grad,
// exp_avg, exp_avg_sq, and optionally a bfloat16 copy of the result), with the
// arithmetic in the same order as torch.optim.AdamW's single-tensor path so the two agree
// to float32 rounding.

// ATen and torch's pybind11 casters only: torch/extension.h adds the whole C++ frontend
// (autograd, nn, optim), which these kernels never use and which doubles the build time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per work item: amortizes scheduling

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's cast
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Item {
  float* p; const void* g; float* m; float* v; uint16_t* out; int64_t len; bool g_bf16;
};

// One tensor's elements [0, it.len): the update, in torch.optim.AdamW's order of operations.
template <typename G>
inline void update(const Item& it, const G* g, float decay, float w1, float b2, float w2,
                   float bc2, float feps, float neg_step) {
#pragma omp simd
  for (int64_t i = 0; i < it.len; ++i) {
    float gi;
    if constexpr (std::is_same_v<G, uint16_t>) gi = bf16_to_float(g[i]); else gi = g[i];
    const float p = it.p[i] * decay;                     // decoupled weight decay
    const float m = it.m[i] + w1 * (gi - it.m[i]);       // exp_avg.lerp_(grad, 1 - beta1)
    const float v = it.v[i] * b2 + w2 * gi * gi;         // exp_avg_sq.mul_(b2).addcmul_
    const float denom = std::sqrt(v) / bc2 + feps;
    it.p[i] = p + neg_step * (m / denom);
    it.m[i] = m;
    it.v[i] = v;
  }
  if (it.out != nullptr)
    for (int64_t i = 0; i < it.len; ++i) it.out[i] = float_to_bf16(it.p[i]);
}

// params, exp_avgs, exp_avg_sqs: contiguous float32 CPU tensors. grads: float32 or
// bfloat16. outs: empty, or one bfloat16 tensor per parameter that receives the updated
// parameter rounded to bfloat16 (the copy an offloaded step sends back to the GPU).
void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                double step_size, double bias_correction2_sqrt,
                const std::vector<at::Tensor>& outs) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adamw_step: lists must have one length");
  TORCH_CHECK(outs.empty() || outs.size() == n, "adamw_step: outs must be empty or one per param");
  // Flatten (tensor, chunk) into one list so that one parallel loop covers many small
  // tensors as well as a few large ones.
  std::vector<Item> items;
  for (size_t t = 0; t < n; ++t) {
    const auto& p = params[t];
    for (const auto* x : {&p, &exp_avgs[t], &exp_avg_sqs[t]}) {
      TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->is_contiguous(),
                  "adamw_step: parameters and moments must be contiguous float32 on the CPU");
      TORCH_CHECK(x->numel() == p.numel(), "adamw_step: sizes differ within one parameter");
    }
    const auto& g = grads[t];
    const bool g_bf16 = g.scalar_type() == at::kBFloat16;
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.numel() == p.numel() &&
                    (g_bf16 || g.scalar_type() == at::kFloat),
                "adamw_step: a gradient must be a contiguous float32 or bfloat16 CPU tensor "
                "of its parameter's size");
    uint16_t* op = nullptr;
    if (!outs.empty()) {
      const auto& o = outs[t];
      TORCH_CHECK(o.device().is_cpu() && o.scalar_type() == at::kBFloat16 && o.is_contiguous() &&
                      o.numel() == p.numel(),
                  "adamw_step: outs must be contiguous bfloat16 CPU tensors of the params' sizes");
      op = reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>());
    }
    float* pp = p.data_ptr<float>();
    float* mp = exp_avgs[t].data_ptr<float>();
    float* vp = exp_avg_sqs[t].data_ptr<float>();
    const char* gp = static_cast<const char*>(g.data_ptr());
    const int64_t gsize = g_bf16 ? 2 : 4;
    for (int64_t s = 0; s < p.numel(); s += kChunk)
      items.push_back({pp + s, gp + s * gsize, mp + s, vp + s, op ? op + s : nullptr,
                       std::min(kChunk, p.numel() - s), g_bf16});
  }
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float w1 = static_cast<float>(1.0 - beta1);
  const float b2 = static_cast<float>(beta2), w2 = static_cast<float>(1.0 - beta2);
  const float bc2 = static_cast<float>(bias_correction2_sqrt);
  const float feps = static_cast<float>(eps), neg_step = static_cast<float>(-step_size);
  const int64_t count = static_cast<int64_t>(items.size());
  // The loop touches no Python object: other threads (autograd's, the copy streams')
  // run while it does.
  pybind11::gil_scoped_release no_gil;
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < count; ++k) {
    const Item& it = items[k];
    if (it.g_bf16)
      update(it, static_cast<const uint16_t*>(it.g), decay, w1, b2, w2, bc2, feps, neg_step);
    else
      update(it, static_cast<const float*>(it.g), decay, w1, b2, w2, bc2, feps, neg_step);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "meshlab CPU AdamW step (float32, OpenMP)";
  m.def("adamw_step", &adamw_step, pybind11::arg("params"), pybind11::arg("grads"),
        pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"), pybind11::arg("lr"),
        pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"),
        pybind11::arg("weight_decay"), pybind11::arg("step_size"),
        pybind11::arg("bias_correction2_sqrt"), pybind11::arg("outs") = std::vector<at::Tensor>{});
}
