// AdamW step over float32 CPU parameters: one OpenMP loop over every element of every
// tensor, each element read and written once (param, grad, exp_avg, exp_avg_sq), with the
// arithmetic in the same order as torch.optim.AdamW's single-tensor path so the two agree
// to float32 rounding.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kChunk = 1 << 15;  // elements per work item: amortizes scheduling

void adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                double step_size, double bias_correction2_sqrt) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adamw_step: lists must have one length");
  struct Item { float* p; const float* g; float* m; float* v; int64_t len; };
  // Flatten (tensor, chunk) into one list so that one parallel loop covers many small
  // tensors as well as a few large ones.
  std::vector<Item> items;
  for (size_t t = 0; t < n; ++t) {
    const auto& p = params[t];
    for (const auto* x : {&p, &grads[t], &exp_avgs[t], &exp_avg_sqs[t]}) {
      TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->is_contiguous(),
                  "adamw_step: every tensor must be contiguous float32 on the CPU");
      TORCH_CHECK(x->numel() == p.numel(), "adamw_step: sizes differ within one parameter");
    }
    float* pp = p.data_ptr<float>();
    const float* gp = grads[t].data_ptr<float>();
    float* mp = exp_avgs[t].data_ptr<float>();
    float* vp = exp_avg_sqs[t].data_ptr<float>();
    for (int64_t s = 0; s < p.numel(); s += kChunk)
      items.push_back({pp + s, gp + s, mp + s, vp + s, std::min(kChunk, p.numel() - s)});
  }
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float w1 = static_cast<float>(1.0 - beta1);
  const float b2 = static_cast<float>(beta2), w2 = static_cast<float>(1.0 - beta2);
  const float bc2 = static_cast<float>(bias_correction2_sqrt);
  const float feps = static_cast<float>(eps), neg_step = static_cast<float>(-step_size);
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < count; ++k) {
    const Item it = items[k];
#pragma omp simd
    for (int64_t i = 0; i < it.len; ++i) {
      const float g = it.g[i];
      const float p = it.p[i] * decay;                     // decoupled weight decay
      const float m = it.m[i] + w1 * (g - it.m[i]);        // exp_avg.lerp_(grad, 1 - beta1)
      const float v = it.v[i] * b2 + w2 * g * g;           // exp_avg_sq.mul_(b2).addcmul_
      const float denom = std::sqrt(v) / bc2 + feps;
      it.p[i] = p + neg_step * (m / denom);
      it.m[i] = m;
      it.v[i] = v;
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "meshlab CPU AdamW step (float32, OpenMP)";
  m.def("adamw_step", &adamw_step);
}
