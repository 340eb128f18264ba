// Helpers shared by meshlab's C++ CPU kernels (ops_cpu.cpp, attention_cpu.cpp): bfloat16
// loads and stores, a vectorizable exp, argument checks, dtype dispatch, OpenMP queries.
// Each kernel file is its own extension, so these are inline and file-local in use.
#pragma once

// ATen and torch's pybind11 casters only: torch/extension.h adds the whole C++ frontend
// (autograd, nn, optim), which these kernels never use and which doubles the build time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace meshlab_cpu {

using bf16 = uint16_t;

inline float ld(float v) { return v; }
inline float ld(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T> inline T st(float f);
template <> inline float st<float>(float f) { return f; }
template <> inline bf16 st<bf16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // NaN stays a quiet NaN; everything else rounds to nearest, ties to even.
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? bf16(0x7FC0) : bf16(rounded);
}

// exp(x) in plain float arithmetic, so that loops calling it vectorize (a call to expf
// does not without -ffast-math). Cephes' expf: x = n ln2 + r with |r| <= ln2/2 (ln2 split in
// two for an exact n ln2), a degree-6 polynomial for e^r, and 2^n put in the exponent bits.
// Within 2 ulp of expf over the clamped range; beyond it e^x is 0 or inf in float anyway
// and the clamp keeps 2^n representable.
inline float exp_f(float x) {
  x = std::fmin(std::fmax(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return e * scale;
}

inline int num_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline void check_act(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat, name,
              " must be a contiguous float32 CPU tensor");
}

// A weight or bias in any floating dtype, as the contiguous float32 the kernels read (a
// bfloat16 norm weight is cast here, once per call, rather than by every caller).
inline at::Tensor as_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && at::isFloatingType(t.scalar_type()), name,
              " must be a floating CPU tensor, got ", t.scalar_type(), " on ", t.device());
  return t.to(at::kFloat).contiguous();
}

// Calls f.template operator()<T>() with T = float or bf16 after the activation dtype.
template <typename F> void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) f(float{});
  else f(bf16{});
}

template <typename T> T* ptr(at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
template <typename T> const T* cptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

}  // namespace meshlab_cpu
