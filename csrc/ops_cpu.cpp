// CPU kernels of meshlab's fused ops: rms_norm (and its residual add), rotary, swiglu/geglu,
// layer_norm (forward and backward), and the softmax cross-entropy gradient of
// linear_cross_entropy. One translation unit on purpose: building torch/extension.h
// dominates the compile time, so five files would cost five times as long.
//
// Conventions, shared by every kernel here:
//  * tensors arrive contiguous, already flattened by the Python side to rows of the last dim;
//  * outputs are allocated contiguous (never with an input's strides, which for a size-1
//    dim may be anything): the ops' fake kernels promise contiguous outputs to torch.compile;
//  * activations are float32 or bfloat16; norm weights come in any floating dtype and are
//    read as float32 (as_f32), cos/sin and saved statistics are float32;
//  * every sum is in float32, and bfloat16 is rounded to nearest-even exactly as
//    c10::BFloat16 does, so the kernels agree with the references up to summation order;
//  * rows are split across OpenMP threads; the inner loops are plain, unit-stride loops
//    that the compiler turns into SIMD code.

#include "cpu_common.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using namespace meshlab_cpu;

// Sums per-thread partial vectors (threads x H) into out (H), in parallel over H.
void reduce_partials(const std::vector<float>& part, int nt, int64_t H, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < H; ++i) {
    float s = 0.f;
    for (int t = 0; t < nt; ++t) s += part[static_cast<size_t>(t) * H + i];
    out[i] = s;
  }
}

// ---------------------------------------------------------------- rms_norm
// y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)                x: (N, H), w: (H,)

// Rows of y = rms_norm(x), or of y = rms_norm(s) with s = x + q stored in sp where q is
// given (rounded to T first, as a separate add would round it).
template <typename T>
void rms_rows(const T* xp, const T* qp, T* sp, T* yp, const float* wp, float* rp, int64_t N,
              int64_t H, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < N; ++r) {
    const T* in = xp + r * H;
    if (qp != nullptr) {
      const T* xr = in;
      const T* qr = qp + r * H;
      T* sr = sp + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) sr[i] = st<T>(ld(xr[i]) + ld(qr[i]));
      in = sr;
    }
    T* yr = yp + r * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) {
      float v = ld(in[i]);
      ss += v * v;
    }
    const float rs = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    rp[r] = rs;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) yr[i] = st<T>(ld(in[i]) * rs * wp[i]);
  }
}

std::vector<at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                     double eps) {
  check_act(x, "x");
  const at::Tensor w = as_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm_fwd: bad shapes");
  const int64_t N = x.size(0), H = x.size(1);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto rstd = at::empty({N}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(cptr<T>(x), nullptr, nullptr, ptr<T>(y), w.data_ptr<float>(),
                rstd.data_ptr<float>(), N, H, static_cast<float>(eps));
  });
  return {y, rstd};
}

// ---------------------------------------------------------------- add_rms_norm
// s = x + r, rounded to the activations' dtype as a separate add would round it; y =
// rms_norm(s). The backward is rms_norm_bwd with ds, the gradient reaching s directly.

std::vector<at::Tensor> add_rms_norm_fwd(const at::Tensor& x, const at::Tensor& res,
                                         const at::Tensor& weight, double eps) {
  check_act(x, "x");
  check_act(res, "residual");
  const at::Tensor w = as_f32(weight, "weight");
  TORCH_CHECK(res.scalar_type() == x.scalar_type() && res.sizes() == x.sizes(),
              "add_rms_norm_fwd: residual must match x");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1),
              "add_rms_norm_fwd: bad shapes");
  const int64_t N = x.size(0), H = x.size(1);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto s = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto rstd = at::empty({N}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(cptr<T>(x), cptr<T>(res), ptr<T>(s), ptr<T>(y), w.data_ptr<float>(),
                rstd.data_ptr<float>(), N, H, static_cast<float>(eps));
  });
  return {y, s, rstd};
}

// dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * w,  xhat = x * rstd;  dw = sum_rows dy * xhat
std::vector<at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& weight, const at::Tensor& rstd,
                                     const c10::optional<at::Tensor>& ds) {
  check_act(dy, "grad");
  check_act(x, "x");
  const at::Tensor w = as_f32(weight, "weight");
  if (ds.has_value()) {
    check_act(*ds, "ds");
    TORCH_CHECK(ds->scalar_type() == x.scalar_type() && ds->sizes() == x.sizes(),
                "rms_norm_bwd: ds must match x");
  }
  check_f32(rstd, "rstd");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() && dy.sizes() == x.sizes(),
              "rms_norm_bwd: grad must match x");
  const int64_t N = x.size(0), H = x.size(1);
  auto dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto dw = at::empty({H}, w.options());
  const int nt = num_threads();
  // Each thread accumulates its own dw row: no atomics, and a fixed order per thread.
  std::vector<float> part(static_cast<size_t>(nt) * H, 0.f);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = cptr<T>(dy);
    const T* xp = cptr<T>(x);
    T* dxp = ptr<T>(dx);
    const float* wp = w.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    const T* dsp = ds.has_value() ? cptr<T>(*ds) : nullptr;
#pragma omp parallel
    {
      float* acc = part.data() + static_cast<size_t>(thread_id()) * H;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < N; ++r) {
        const T* dyr = dyp + r * H;
        const T* xr = xp + r * H;
        T* dxr = dxp + r * H;
        const float rs = rp[r];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < H; ++i) dot += ld(dyr[i]) * wp[i] * ld(xr[i]);
        const float c = dot * rs / static_cast<float>(H);  // mean(g * xhat)
        // ds: the gradient reaching x around the norm (a residual's), added once
        const T* dsr = dsp != nullptr ? dsp + r * H : nullptr;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          const float g = ld(dyr[i]) * wp[i];
          const float xh = ld(xr[i]) * rs;
          dxr[i] = st<T>((g - xh * c) * rs + (dsr != nullptr ? ld(dsr[i]) : 0.f));
          acc[i] += ld(dyr[i]) * xh;
        }
      }
    }
  });
  reduce_partials(part, nt, H, dw.data_ptr<float>());
  return {dx, dw};
}

// ---------------------------------------------------------------- layer_norm
// y = (x - mean) * rstd * w + b                                    x: (N, H), w, b: (H,)

std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                       const at::Tensor& bias, double eps) {
  check_act(x, "x");
  const at::Tensor w = as_f32(weight, "weight"), b = as_f32(bias, "bias");
  TORCH_CHECK(x.dim() == 2 && w.size(0) == x.size(1) && b.size(0) == x.size(1),
              "layer_norm_fwd: bad shapes");
  const int64_t N = x.size(0), H = x.size(1);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto mean = at::empty({N}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({N}, x.options().dtype(at::kFloat));
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    T* yp = ptr<T>(y);
    const float* wp = w.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    float* mp = mean.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    const float feps = static_cast<float>(eps);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
      const T* xr = xp + r * H;
      T* yr = yp + r * H;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < H; ++i) s += ld(xr[i]);
      const float mu = s / static_cast<float>(H);
      // Two passes (mean, then squared deviations): one-pass E[x^2]-E[x]^2 cancels badly
      // when |mean| >> std, which activations with a large offset do hit.
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        const float d = ld(xr[i]) - mu;
        ss += d * d;
      }
      const float rs = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      mp[r] = mu;
      rp[r] = rs;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) yr[i] = st<T>((ld(xr[i]) - mu) * rs * wp[i] + bp[i]);
    }
  });
  return {y, mean, rstd};
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w;  dw = sum dy*xhat;  db = sum dy
std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& weight, const at::Tensor& mean,
                                       const at::Tensor& rstd) {
  check_act(dy, "grad");
  check_act(x, "x");
  const at::Tensor w = as_f32(weight, "weight");
  check_f32(mean, "mean");
  check_f32(rstd, "rstd");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() && dy.sizes() == x.sizes(),
              "layer_norm_bwd: grad must match x");
  const int64_t N = x.size(0), H = x.size(1);
  auto dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto dw = at::empty({H}, w.options());
  auto db = at::empty({H}, w.options());
  const int nt = num_threads();
  std::vector<float> pw(static_cast<size_t>(nt) * H, 0.f), pb(static_cast<size_t>(nt) * H, 0.f);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = cptr<T>(dy);
    const T* xp = cptr<T>(x);
    T* dxp = ptr<T>(dx);
    const float* wp = w.data_ptr<float>();
    const float* mp = mean.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
#pragma omp parallel
    {
      float* aw = pw.data() + static_cast<size_t>(thread_id()) * H;
      float* ab = pb.data() + static_cast<size_t>(thread_id()) * H;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < N; ++r) {
        const T* dyr = dyp + r * H;
        const T* xr = xp + r * H;
        T* dxr = dxp + r * H;
        const float mu = mp[r], rs = rp[r];
        float sg = 0.f, sgx = 0.f;
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t i = 0; i < H; ++i) {
          const float g = ld(dyr[i]) * wp[i];
          sg += g;
          sgx += g * (ld(xr[i]) - mu) * rs;
        }
        const float mg = sg / static_cast<float>(H), mgx = sgx / static_cast<float>(H);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) {
          const float d = ld(dyr[i]);
          const float xh = (ld(xr[i]) - mu) * rs;
          dxr[i] = st<T>((d * wp[i] - mg - xh * mgx) * rs);
          aw[i] += d * xh;
          ab[i] += d;
        }
      }
    }
  });
  reduce_partials(pw, nt, H, dw.data_ptr<float>());
  reduce_partials(pb, nt, H, db.data_ptr<float>());
  return {dx, dw, db};
}

// ---------------------------------------------------------------- rotary
// x: (B, S, NH, D) with D even; cos, sin: (S, D/2).  Halves convention (Llama, NeoX):
//   out[:D/2] = x1 * cos - x2 * sin,  out[D/2:] = x2 * cos + x1 * sin.
// The backward is the same rotation by -angle, so Python calls this with -sin.

// Any layout in, as the Triton forward: x, and the tables as float32, made contiguous here.
at::Tensor rotary_fwd(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous();
  const at::Tensor sin = sin_in.to(at::kFloat).contiguous();
  check_act(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "rotary_fwd: x must be (B, S, NH, D), D even");
  const int64_t B = x.size(0), S = x.size(1), NH = x.size(2), D = x.size(3), half = D / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == S && cos.size(1) == half && sin.sizes() == cos.sizes(),
              "rotary_fwd: cos and sin must be (S, D/2)");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = cptr<T>(x);
    T* op = ptr<T>(out);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t rows = B * S * NH;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = (r / NH) % S;
      const T* x1 = xp + r * D;
      const T* x2 = x1 + half;
      T* o1 = op + r * D;
      T* o2 = o1 + half;
      const float* c = cp + s * half;
      const float* si = sp + s * half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = ld(x1[i]), b = ld(x2[i]);
        o1[i] = st<T>(a * c[i] - b * si[i]);
        o2[i] = st<T>(b * c[i] + a * si[i]);
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------- swiglu / geglu
// y = act(a) * b, elementwise; a, b: any shape, flattened. act: 0 SiLU (SwiGLU), 1 GELU
// with the tanh approximation (GeGLU, as F.gelu(approximate="tanh")).

constexpr int64_t kChunk = 1 << 14;  // elements per OpenMP task: large enough to amortize

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

// act(x) and act'(x).
template <int ACT> inline float gate_act(float x) {
  if constexpr (ACT == 0) {
    return x / (1.f + exp_f(-x));
  } else {
    const float t = 1.f - 2.f / (exp_f(2.f * kGeluK * (x + kGeluC * x * x * x)) + 1.f);
    return 0.5f * x * (1.f + t);
  }
}

template <int ACT> inline float gate_grad(float x) {
  if constexpr (ACT == 0) {
    const float sg = 1.f / (1.f + exp_f(-x));
    return sg * (1.f + x * (1.f - sg));
  } else {
    const float t = 1.f - 2.f / (exp_f(2.f * kGeluK * (x + kGeluC * x * x * x)) + 1.f);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * x * x);
  }
}

template <int ACT, typename T>
void gated_fwd_rows(const T* ap, const T* bp, T* yp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk);
#pragma omp simd
    for (int64_t i = c0; i < c1; ++i) yp[i] = st<T>(gate_act<ACT>(ld(ap[i])) * ld(bp[i]));
  }
}

template <int ACT, typename T>
void gated_bwd_rows(const T* gp, const T* ap, const T* bp, T* dap, T* dbp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk);
#pragma omp simd
    for (int64_t i = c0; i < c1; ++i) {
      const float x = ld(ap[i]), g = ld(gp[i]);
      dap[i] = st<T>(g * ld(bp[i]) * gate_grad<ACT>(x));
      dbp[i] = st<T>(g * gate_act<ACT>(x));
    }
  }
}

void check_gate(int64_t act) {
  TORCH_CHECK(act == 0 || act == 1, "gated activation must be 0 (silu) or 1 (gelu_tanh), got ",
              act);
}

// Any layout in, as the Triton forward (the halves of a merged gate/up product are strided).
at::Tensor swiglu_fwd(const at::Tensor& a_in, const at::Tensor& b_in, int64_t act) {
  const at::Tensor a = a_in.contiguous();
  const at::Tensor b = b_in.contiguous();
  check_act(a, "a");
  check_act(b, "b");
  check_gate(act);
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(),
              "swiglu_fwd: a and b must match in shape and dtype");
  auto y = at::empty_like(a, at::MemoryFormat::Contiguous);
  dispatch(a, [&](auto tag) {
    using T = decltype(tag);
    if (act == 0) {
      gated_fwd_rows<0, T>(cptr<T>(a), cptr<T>(b), ptr<T>(y), a.numel());
    } else {
      gated_fwd_rows<1, T>(cptr<T>(a), cptr<T>(b), ptr<T>(y), a.numel());
    }
  });
  return y;
}

// da = dy * b * act'(a),  db = dy * act(a)
std::vector<at::Tensor> swiglu_bwd(const at::Tensor& dy, const at::Tensor& a, const at::Tensor& b,
                                   int64_t act) {
  check_act(dy, "grad");
  check_act(a, "a");
  check_act(b, "b");
  check_gate(act);
  TORCH_CHECK(a.sizes() == b.sizes() && dy.sizes() == a.sizes() &&
                  a.scalar_type() == b.scalar_type() && dy.scalar_type() == a.scalar_type(),
              "swiglu_bwd: grad, a and b must match in shape and dtype");
  auto da = at::empty_like(a, at::MemoryFormat::Contiguous);
  auto db = at::empty_like(b, at::MemoryFormat::Contiguous);
  dispatch(a, [&](auto tag) {
    using T = decltype(tag);
    if (act == 0) {
      gated_bwd_rows<0, T>(cptr<T>(dy), cptr<T>(a), cptr<T>(b), ptr<T>(da), ptr<T>(db),
                           a.numel());
    } else {
      gated_bwd_rows<1, T>(cptr<T>(dy), cptr<T>(a), cptr<T>(b), ptr<T>(da), ptr<T>(db),
                           a.numel());
    }
  });
  return {da, db};
}

// ---------------------------------------------------------------- cross-entropy gradient
// For each row of logits (c, V): lse = log(sum(exp(z))), loss = lse - z[target], and the
// row is overwritten by d loss / d z = softmax(z) - onehot(target). Rows whose target is
// ignore_index get loss 0 and gradient 0. Two reads and one write of the logits, in place.
at::Tensor ce_grad_inplace(at::Tensor logits, const at::Tensor& target, int64_t ignore_index) {
  check_act(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be 2-D (tokens, vocab)");
  TORCH_CHECK(target.device().is_cpu() && target.is_contiguous() &&
                  target.scalar_type() == at::kLong && target.numel() == logits.size(0),
              "target must be a contiguous int64 CPU tensor with one entry per row");
  const int64_t n = logits.size(0), V = logits.size(1);
  auto loss = at::zeros({n}, logits.options().dtype(at::kFloat));
  float* lp = loss.data_ptr<float>();
  const int64_t* tp = target.data_ptr<int64_t>();
  // Checked before the parallel loop: an exception must not leave an OpenMP region.
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(tp[r] == ignore_index || (tp[r] >= 0 && tp[r] < V), "target ", tp[r],
                " out of range for a vocabulary of ", V, " (ignore_index is ", ignore_index, ")");
  dispatch(logits, [&](auto tag) {
    using T = decltype(tag);
    T* zp = ptr<T>(logits);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      T* z = zp + r * V;
      const int64_t t = tp[r];
      if (t == ignore_index) {
        for (int64_t j = 0; j < V; ++j) z[j] = st<T>(0.f);
        continue;
      }
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < V; ++j) m = std::fmax(m, ld(z[j]));
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < V; ++j) sum += exp_f(ld(z[j]) - m);
      const float lse = m + std::log(sum);
      lp[r] = lse - ld(z[t]);
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) z[j] = st<T>(exp_f(ld(z[j]) - lse));
      z[t] = st<T>(ld(z[t]) - 1.f);
    }
  });
  return loss;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "meshlab fused ops, CPU kernels (float32 and bfloat16, float32 accumulation)";
  m.def("rms_norm_fwd", &rms_norm_fwd);
  m.def("rms_norm_bwd", &rms_norm_bwd, pybind11::arg("dy"), pybind11::arg("x"),
        pybind11::arg("w"), pybind11::arg("rstd"), pybind11::arg("ds") = pybind11::none());
  m.def("add_rms_norm_fwd", &add_rms_norm_fwd);
  m.def("layer_norm_fwd", &layer_norm_fwd);
  m.def("layer_norm_bwd", &layer_norm_bwd);
  m.def("rotary_fwd", &rotary_fwd);
  m.def("swiglu_fwd", &swiglu_fwd, pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("act") = 0);
  m.def("swiglu_bwd", &swiglu_bwd, pybind11::arg("dy"), pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("act") = 0);
  m.def("ce_grad_inplace", &ce_grad_inplace);
  m.def("num_threads", &num_threads);
}
