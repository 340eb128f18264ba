// CPU kernels of meshlab::attention: softmax(q k^T * scale [+ causal mask]) v, forward and
// backward, flash-attention style (the S x Skv score matrix never exists in full).
//
// Layout as torch SDPA: q, out, dout, dq (B, Hq, S, D); k, v, dk, dv (B, Hkv, Skv, D);
// lse, delta (B, Hq, S) float32. Query head h reads kv head h / (Hq / Hkv) (grouped-query
// attention). Causal masking is aligned top-left like SDPA's is_causal: query i sees keys
// j <= i (the Python side requires S == Skv then). Segment masking (packed and padded
// batches): with int64 segment ids qseg (B, S) and kseg (B, Skv), query i of row b sees key
// j only where qseg[b][i] == kseg[b][j] (and the causal mask allows it). A row that sees
// no key gets out 0 and lse -inf; its probabilities in the backward are 0.
//
// Conventions, as in ops_cpu.cpp: inputs arrive contiguous and outputs are allocated
// contiguous; activations are float32 or bfloat16 (all of one dtype); every product and sum
// is in float32, bfloat16 is rounded to nearest-even once, on the way out.
//
// Tiling: a task is one (batch, head, block of kBQ queries) or one (batch, kv head, block of
// kBK keys). A task copies its tiles into float32 thread-local buffers (keys and values also
// transposed, for the products against them), and every product is the register-blocked
// loop nest of gemm_tile, which the compiler turns into broadcast-and-FMA SIMD code.
//
// forward   per (b, h, query block): stream over key blocks with an online softmax (running
//           max m and sum l per row, the accumulator rescaled by exp(m_old - m_new));
//           key blocks entirely above the causal diagonal are skipped, and so are key
//           blocks whose segment ids cannot meet the query block's (disjoint id ranges).
//           out = acc / l, lse = m + log(l).
// backward  P = exp(S - lse) recomputed from the saved lse; delta_i = rowsum(dout * out);
//           dS = P * (dP - delta), dP = dout v^T. Two passes, so no two threads write the
//           same row of a gradient:
//           1. per (b, kv head, key block): dv = sum P^T dout, dk = sum dS^T q * scale over
//              every query head of the group and every query block;
//           2. per (b, h, query block): dq = sum dS k * scale over the key blocks.

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using namespace meshlab_cpu;

constexpr int64_t kBQ = 64;  // queries per tile
constexpr int64_t kBK = 64;  // keys per tile
constexpr int kR = 4;        // rows of a product computed together (see gemm_tile)
// Columns of a product held in registers: 4 rows x 64 floats is 16 of AVX-512's 32 vector
// registers; with 16 (AVX2) registers, 4 x 32.
#if defined(__AVX512F__)
constexpr int64_t kW = 64;
#else
constexpr int64_t kW = 32;
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_4d(const at::Tensor& t, const char* name) {
  check_act(t, name);
  TORCH_CHECK(t.dim() == 4, name, " must be (B, H, S, D), got ", t.sizes());
}

void check_stat(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat, name,
              " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) &&
                  t.size(2) == q.size(2),
              name, " must be (B, Hq, S) = ", q.sizes().slice(0, 3), ", got ", t.sizes());
}

struct Dims {
  int64_t B, Hq, Hkv, S, Skv, D, G;  // G = Hq / Hkv query heads per kv head
};

Dims dims_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_4d(q, "q");
  check_4d(k, "k");
  check_4d(v, "v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must share one dtype");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ",
              v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "k must be (B, Hkv, Skv, D) with q's B and D");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "Hq must be a multiple of Hkv, got ", q.size(1), " and ", k.size(1));
  return {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3),
          q.size(1) / k.size(1)};
}

// dst (n x stride) = src (n x D) * mul in float32; columns D.. are left as they are (zero).
template <typename T>
inline void load_rows(const T* src, int64_t n, int64_t D, float mul, float* dst,
                      int64_t stride) {
  for (int64_t i = 0; i < n; ++i) {
    const T* s = src + i * D;
    float* d = dst + i * stride;
#pragma omp simd
    for (int64_t c = 0; c < D; ++c) d[c] = ld(s[c]) * mul;
  }
}

// dst (D x kBK) = src (n x D) transposed; the columns n..kBK-1 are zero.
template <typename T>
inline void load_transposed(const T* src, int64_t n, int64_t D, float* dst) {
  for (int64_t c = 0; c < D; ++c) {
    float* d = dst + c * kBK;
    for (int64_t j = 0; j < n; ++j) d[j] = ld(src[j * D + c]);
    for (int64_t j = n; j < kBK; ++j) d[j] = 0.f;
  }
}

// The one matrix product every step is made of, on float32 tiles:
//   C[i][c] (+)= sum_k A(i, k) * B[k][c]      i < m, k < kk, c < n (n a multiple of 16)
// with A(i, k) = a[i * ars + k * acs] (so A may be read transposed), B and C row-major.
// R rows x W columns of C stay in registers while k runs: each loaded row of B serves R
// rows of A, each broadcast element of A a full W-wide row of B.
template <int R, int W>
inline void gemm_tile(const float* a, int64_t ars, int64_t acs, int64_t kk, const float* b,
                      int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  float acc[R][W];
  for (int r = 0; r < R; ++r) {
#pragma omp simd
    for (int w = 0; w < W; ++w) acc[r][w] = accumulate ? c[r * ldc + w] : 0.f;
  }
  for (int64_t k = 0; k < kk; ++k) {
    const float* br = b + k * ldb;
    for (int r = 0; r < R; ++r) {
      const float x = a[r * ars + k * acs];
#pragma omp simd
      for (int w = 0; w < W; ++w) acc[r][w] += x * br[w];
    }
  }
  for (int r = 0; r < R; ++r) {
#pragma omp simd
    for (int w = 0; w < W; ++w) c[r * ldc + w] = acc[r][w];
  }
}

template <int W>
inline void gemm_cols(const float* a, int64_t ars, int64_t acs, int64_t m, int64_t kk,
                      const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + kR <= m; i += kR)
    gemm_tile<kR, W>(a + i * ars, ars, acs, kk, b, ldb, c + i * ldc, ldc, accumulate);
  for (; i < m; ++i)
    gemm_tile<1, W>(a + i * ars, ars, acs, kk, b, ldb, c + i * ldc, ldc, accumulate);
}

inline void gemm(const float* a, int64_t ars, int64_t acs, int64_t m, int64_t kk, const float* b,
                 int64_t ldb, float* c, int64_t ldc, int64_t n, bool accumulate) {
  int64_t c0 = 0;
  for (; c0 + kW <= n; c0 += kW)
    gemm_cols<kW>(a, ars, acs, m, kk, b + c0, ldb, c + c0, ldc, accumulate);
  if (kW > 32 && c0 + 32 <= n) {
    gemm_cols<32>(a, ars, acs, m, kk, b + c0, ldb, c + c0, ldc, accumulate);
    c0 += 32;
  }
  for (; c0 + 16 <= n; c0 += 16)
    gemm_cols<16>(a, ars, acs, m, kk, b + c0, ldb, c + c0, ldc, accumulate);
}

// Whether a block of query segment ids qs[0, qn) and one of key segment ids ks[0, kn)
// cannot share a segment (their [min, max] ranges are disjoint): the block pair is skipped.
// Without segments (nullptr) every pair may meet.
inline bool segments_apart(const int64_t* qs, int64_t qn, const int64_t* ks, int64_t kn) {
  if (qs == nullptr) return false;
  const auto [qlo, qhi] = std::minmax_element(qs, qs + qn);
  const auto [klo, khi] = std::minmax_element(ks, ks + kn);
  return *qhi < *klo || *khi < *qlo;
}

// Segment ids of row b as int64 pointers (nullptr without segments).
inline const int64_t* seg_row(const std::optional<at::Tensor>& seg, int64_t b, int64_t n) {
  return seg.has_value() ? seg->data_ptr<int64_t>() + b * n : nullptr;
}

void check_segments(const std::optional<at::Tensor>& qseg, const std::optional<at::Tensor>& kseg,
                    const Dims& d) {
  TORCH_CHECK(qseg.has_value() == kseg.has_value(),
              "query and key segment ids come together or not at all");
  if (!qseg.has_value()) return;
  for (const auto* t : {&*qseg, &*kseg}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kLong &&
                    t->dim() == 2 && t->size(0) == d.B,
                "segment ids must be contiguous int64 CPU tensors (B, S)");
  }
  TORCH_CHECK(qseg->size(1) == d.S && kseg->size(1) == d.Skv, "segment ids must be (B, S) = (",
              d.B, ", ", d.S, ") for the queries and (B, Skv) = (", d.B, ", ", d.Skv,
              ") for the keys, got ", qseg->sizes(), " and ", kseg->sizes());
}

// Number of keys of the block starting at k0 (kn of them) that query row qi may see.
inline int64_t visible(bool causal, int64_t qi, int64_t k0, int64_t kn) {
  return causal ? std::clamp<int64_t>(qi + 1 - k0, 0, kn) : kn;
}

// Keys a block of queries [q0, q0 + qn) needs at all: with the causal mask none past the last.
inline int64_t key_end(bool causal, int64_t q0, int64_t qn, int64_t Skv) {
  return causal ? std::min(Skv, q0 + qn) : Skv;
}

// Thread-local float32 tiles. Rows of D values are stored Dp = D rounded up to 16 apart,
// the padding zero, so that every product runs on whole SIMD widths.
struct Tiles {
  int64_t Dp;
  std::vector<float> q, o, kt, vt, k, v, s, dp, acc, acc2, m, l;
  explicit Tiles(int64_t D)
      : Dp((D + 15) / 16 * 16), q(kBQ * Dp), o(kBQ * Dp), kt(D * kBK), vt(D * kBK),
        k(kBK * Dp), v(kBK * Dp), s(kBQ * kBK), dp(kBQ * kBK), acc(std::max(kBQ, kBK) * Dp),
        acc2(std::max(kBQ, kBK) * Dp), m(kBQ), l(kBQ) {}
};

// ---------------------------------------------------------------------------- forward

std::vector<at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, bool causal, double scale,
                                      const std::optional<at::Tensor>& qseg,
                                      const std::optional<at::Tensor>& kseg) {
  const Dims d = dims_of(q, k, v);
  check_segments(qseg, kseg, d);
  TORCH_CHECK(!causal || d.S == d.Skv, "causal attention needs S == Skv, got ", d.S, " and ",
              d.Skv);
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto lse = at::empty({d.B, d.Hq, d.S}, q.options().dtype(at::kFloat));
  const int64_t nqb = (d.S + kBQ - 1) / kBQ;
  const int64_t tasks = d.B * d.Hq * nqb;
  const float fscale = static_cast<float>(scale);
  const int64_t D = d.D;
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    const T* qp = cptr<T>(q);
    const T* kp = cptr<T>(k);
    const T* vp = cptr<T>(v);
    T* op = ptr<T>(out);
    float* lp = lse.data_ptr<float>();
#pragma omp parallel
    {
      Tiles t(D);
      const int64_t Dp = t.Dp;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < tasks; ++task) {
        const int64_t qb = task % nqb, bh = task / nqb;
        const int64_t b = bh / d.Hq, h = bh % d.Hq, hk = h / d.G;
        const int64_t q0 = qb * kBQ, qn = std::min(kBQ, d.S - q0);
        const T* kbase = kp + (b * d.Hkv + hk) * d.Skv * D;
        const T* vbase = vp + (b * d.Hkv + hk) * d.Skv * D;
        const int64_t* qs = seg_row(qseg, b, d.S);
        const int64_t* ks = seg_row(kseg, b, d.Skv);
        if (qs != nullptr) qs += q0;
        // q pre-multiplied by scale: the scores come out scaled.
        load_rows(qp + (bh * d.S + q0) * D, qn, D, fscale, t.q.data(), Dp);
        std::fill(t.acc.begin(), t.acc.begin() + qn * Dp, 0.f);
        std::fill(t.m.begin(), t.m.end(), kNegInf);
        std::fill(t.l.begin(), t.l.end(), 0.f);
        const int64_t kend = key_end(causal, q0, qn, d.Skv);
        for (int64_t k0 = 0; k0 < kend; k0 += kBK) {
          const int64_t kn = std::min(kBK, kend - k0);
          const int64_t* kb = ks == nullptr ? nullptr : ks + k0;
          if (segments_apart(qs, qn, kb, kn)) continue;  // no query here sees these keys
          load_transposed(kbase + k0 * D, kn, D, t.kt.data());
          load_rows(vbase + k0 * D, kn, D, 1.f, t.v.data(), Dp);
          // S = (q * scale) k^T
          gemm(t.q.data(), Dp, 1, qn, D, t.kt.data(), kBK, t.s.data(), kBK, kBK, false);
          for (int64_t i = 0; i < qn; ++i) {
            float* sr = t.s.data() + i * kBK;
            const int64_t jn = visible(causal, q0 + i, k0, kn);
            if (qs != nullptr) {  // keys of another segment: -inf, as past the diagonal
              const int64_t own = qs[i];
              for (int64_t j = 0; j < jn; ++j)
                if (kb[j] != own) sr[j] = kNegInf;
            }
            float mx = kNegInf;
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < kBK; ++j) mx = std::fmax(mx, j < jn ? sr[j] : kNegInf);
            if (jn == 0 || mx == kNegInf) {  // the row sees none of these keys: it keeps its state
              std::fill(sr, sr + kBK, 0.f);
              continue;
            }
            const float m_new = std::fmax(t.m[i], mx);
            const float alpha = t.m[i] == kNegInf ? 0.f : exp_f(t.m[i] - m_new);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < kBK; ++j) {
              const float p = j < jn && sr[j] != kNegInf ? exp_f(sr[j] - m_new) : 0.f;
              sr[j] = p;
              sum += p;
            }
            t.l[i] = t.l[i] * alpha + sum;
            t.m[i] = m_new;
            if (alpha != 1.f) {
              float* a = t.acc.data() + i * Dp;
#pragma omp simd
              for (int64_t c = 0; c < Dp; ++c) a[c] *= alpha;
            }
          }
          // acc += P v
          gemm(t.s.data(), kBK, 1, qn, kn, t.v.data(), Dp, t.acc.data(), Dp, Dp, true);
        }
        T* obase = op + (bh * d.S + q0) * D;
        float* lrow = lp + bh * d.S + q0;
        for (int64_t i = 0; i < qn; ++i) {
          const float l = t.l[i];
          // No visible key (Skv == 0, or no key of its segment): 0 and lse -inf.
          const float inv = l > 0.f ? 1.f / l : 0.f;
          const float* a = t.acc.data() + i * Dp;
          T* o = obase + i * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) o[c] = st<T>(a[c] * inv);
          lrow[i] = l > 0.f ? t.m[i] + std::log(l) : kNegInf;
        }
      }
    }
  });
  return {out, lse};
}

// ---------------------------------------------------------------------------- backward

// For one (query block, key block) pair: P = exp(S - lse) into t.s and dS into t.dp, from
// t.q (q * scale), t.o (dout), t.kt, t.vt.
inline void probs_and_dscores(Tiles& t, int64_t qn, int64_t kn, int64_t D, const float* lse,
                              const float* delta, bool causal, int64_t q0, int64_t k0,
                              const int64_t* qs, const int64_t* ks) {
  const int64_t Dp = t.Dp;
  gemm(t.q.data(), Dp, 1, qn, D, t.kt.data(), kBK, t.s.data(), kBK, kBK, false);   // S
  gemm(t.o.data(), Dp, 1, qn, D, t.vt.data(), kBK, t.dp.data(), kBK, kBK, false);  // dP
  for (int64_t i = 0; i < qn; ++i) {
    float* sr = t.s.data() + i * kBK;
    float* dr = t.dp.data() + i * kBK;
    const int64_t jn = visible(causal, q0 + i, k0, kn);
    const float l = lse[i], dl = delta[i];
    if (qs == nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < kBK; ++j) {
        const float p = j < jn ? exp_f(sr[j] - l) : 0.f;
        sr[j] = p;
        dr[j] = p * (dr[j] - dl);
      }
      continue;
    }
    const int64_t own = qs[i];
    for (int64_t j = 0; j < kBK; ++j) {  // keys of another segment: probability 0
      const float p = j < jn && ks[j] == own ? exp_f(sr[j] - l) : 0.f;
      sr[j] = p;
      dr[j] = p * (dr[j] - dl);
    }
  }
}

std::vector<at::Tensor> attention_bwd(const at::Tensor& dout, const at::Tensor& q,
                                      const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& out, const at::Tensor& lse, bool causal,
                                      double scale, const std::optional<at::Tensor>& qseg,
                                      const std::optional<at::Tensor>& kseg) {
  const Dims d = dims_of(q, k, v);
  check_segments(qseg, kseg, d);
  check_4d(dout, "dout");
  check_4d(out, "out");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "dout and out must match q in shape and dtype");
  check_stat(lse, "lse", q);
  TORCH_CHECK(!causal || d.S == d.Skv, "causal attention needs S == Skv, got ", d.S, " and ",
              d.Skv);
  auto dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  auto dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  auto delta = at::empty({d.B, d.Hq, d.S}, q.options().dtype(at::kFloat));
  const float fscale = static_cast<float>(scale);
  const int64_t D = d.D;
  const int64_t nqb = (d.S + kBQ - 1) / kBQ, nkb = (d.Skv + kBK - 1) / kBK;
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = cptr<T>(dout);
    const T* qp = cptr<T>(q);
    const T* kp = cptr<T>(k);
    const T* vp = cptr<T>(v);
    const T* op = cptr<T>(out);
    const float* lp = lse.data_ptr<float>();
    float* dl = delta.data_ptr<float>();
    T* dqp = ptr<T>(dq);
    T* dkp = ptr<T>(dk);
    T* dvp = ptr<T>(dv);
    const int64_t rows = d.B * d.Hq * d.S;

    // delta_i = rowsum(dout * out): the softmax Jacobian's term, one dot product per row.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gp + r * D;
      const T* o = op + r * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < D; ++c) s += ld(g[c]) * ld(o[c]);
      dl[r] = s;
    }

    // Pass 1: dk and dv, one (b, kv head, key block) per task, over every query head of the
    // group and every query block.
    const int64_t ktasks = d.B * d.Hkv * nkb;
#pragma omp parallel
    {
      Tiles t(D);
      const int64_t Dp = t.Dp;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < ktasks; ++task) {
        const int64_t kb = task % nkb, bhk = task / nkb;
        const int64_t b = bhk / d.Hkv, hk = bhk % d.Hkv;
        const int64_t k0 = kb * kBK, kn = std::min(kBK, d.Skv - k0);
        const int64_t* qrow = seg_row(qseg, b, d.S);
        const int64_t* ks = seg_row(kseg, b, d.Skv);
        if (ks != nullptr) ks += k0;
        load_transposed(kp + (bhk * d.Skv + k0) * D, kn, D, t.kt.data());
        load_transposed(vp + (bhk * d.Skv + k0) * D, kn, D, t.vt.data());
        float* dK = t.acc.data();
        float* dV = t.acc2.data();
        std::fill(dK, dK + kn * Dp, 0.f);
        std::fill(dV, dV + kn * Dp, 0.f);
        // With the causal mask, queries before k0 see none of these keys.
        const int64_t qstart = causal ? k0 / kBQ * kBQ : 0;
        for (int64_t h = hk * d.G; h < (hk + 1) * d.G; ++h) {
          const int64_t bh = b * d.Hq + h;
          for (int64_t q0 = qstart; q0 < d.S; q0 += kBQ) {
            const int64_t qn = std::min(kBQ, d.S - q0);
            const int64_t* qs = qrow == nullptr ? nullptr : qrow + q0;
            if (segments_apart(qs, qn, ks, kn)) continue;
            load_rows(qp + (bh * d.S + q0) * D, qn, D, fscale, t.q.data(), Dp);
            load_rows(gp + (bh * d.S + q0) * D, qn, D, 1.f, t.o.data(), Dp);
            probs_and_dscores(t, qn, kn, D, lp + bh * d.S + q0, dl + bh * d.S + q0, causal, q0,
                              k0, qs, ks);
            // dv += P^T dout, dk += dS^T (q * scale): A read transposed (rows 1, columns kBK).
            gemm(t.s.data(), 1, kBK, kn, qn, t.o.data(), Dp, dV, Dp, Dp, true);
            gemm(t.dp.data(), 1, kBK, kn, qn, t.q.data(), Dp, dK, Dp, Dp, true);
          }
        }
        T* dkb = dkp + (bhk * d.Skv + k0) * D;
        T* dvb = dvp + (bhk * d.Skv + k0) * D;
        for (int64_t j = 0; j < kn; ++j) {
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) {
            dkb[j * D + c] = st<T>(dK[j * Dp + c]);
            dvb[j * D + c] = st<T>(dV[j * Dp + c]);
          }
        }
      }
    }

    // Pass 2: dq, one (b, h, query block) per task, over the key blocks it sees.
    const int64_t qtasks = d.B * d.Hq * nqb;
#pragma omp parallel
    {
      Tiles t(D);
      const int64_t Dp = t.Dp;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < qtasks; ++task) {
        const int64_t qb = task % nqb, bh = task / nqb;
        const int64_t b = bh / d.Hq, h = bh % d.Hq, hk = h / d.G;
        const int64_t q0 = qb * kBQ, qn = std::min(kBQ, d.S - q0);
        load_rows(qp + (bh * d.S + q0) * D, qn, D, fscale, t.q.data(), Dp);
        load_rows(gp + (bh * d.S + q0) * D, qn, D, 1.f, t.o.data(), Dp);
        float* dQ = t.acc.data();
        std::fill(dQ, dQ + qn * Dp, 0.f);
        const T* kbase = kp + (b * d.Hkv + hk) * d.Skv * D;
        const T* vbase = vp + (b * d.Hkv + hk) * d.Skv * D;
        const int64_t* qs = seg_row(qseg, b, d.S);
        const int64_t* krow = seg_row(kseg, b, d.Skv);
        if (qs != nullptr) qs += q0;
        const int64_t kend = key_end(causal, q0, qn, d.Skv);
        for (int64_t k0 = 0; k0 < kend; k0 += kBK) {
          const int64_t kn = std::min(kBK, kend - k0);
          const int64_t* ks = krow == nullptr ? nullptr : krow + k0;
          if (segments_apart(qs, qn, ks, kn)) continue;
          load_transposed(kbase + k0 * D, kn, D, t.kt.data());
          load_transposed(vbase + k0 * D, kn, D, t.vt.data());
          load_rows(kbase + k0 * D, kn, D, fscale, t.k.data(), Dp);
          probs_and_dscores(t, qn, kn, D, lp + bh * d.S + q0, dl + bh * d.S + q0, causal, q0,
                            k0, qs, ks);
          // dq += dS (k * scale)
          gemm(t.dp.data(), kBK, 1, qn, kn, t.k.data(), Dp, dQ, Dp, Dp, true);
        }
        T* dqb = dqp + (bh * d.S + q0) * D;
        for (int64_t i = 0; i < qn; ++i) {
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) dqb[i * D + c] = st<T>(dQ[i * Dp + c]);
        }
      }
    }
  });
  return {dq, dk, dv};
}

// ---------------------------------------------------------------------------------------
// Paged attention for decoding (meshlab::paged_attention): packed queries q (T, Hq, D) over
// a cache (blocks, block_size, Hkv, D) addressed through block tables (S, W). Query t
// belongs to sequence seq[t] and sees that sequence's first keys[t] keys (its causal
// prefix). One task per (query, kv head), for the query heads that share it: the scores of
// its keys (read through the table, one dot product per head, in float32), their softmax,
// then the weighted sum of the values. Each key and value row is read once per query;
// the loop streams over the cache rows, vectorized over D.

at::Tensor paged_attention_fwd(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                               const at::Tensor& tables, const at::Tensor& seq,
                               const at::Tensor& keys, double scale) {
  check_act(q, "q");
  check_act(kc, "k_cache");
  check_act(vc, "v_cache");
  TORCH_CHECK(q.dim() == 3, "q must be (T, Hq, D), got ", q.sizes());
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes(),
              "k_cache and v_cache must both be (blocks, block_size, Hkv, D), got ",
              kc.sizes(), " and ", vc.sizes());
  TORCH_CHECK(kc.scalar_type() == q.scalar_type() && vc.scalar_type() == q.scalar_type(),
              "q and the caches must share one dtype");
  for (const at::Tensor* t : {&tables, &seq, &keys}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kLong,
                "block tables, sequence and key counts must be contiguous int64 CPU tensors");
  }
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kc.size(0), BS = kc.size(1), Hkv = kc.size(2);
  TORCH_CHECK(kc.size(3) == D && Hq % Hkv == 0, "q has ", Hq, " heads of ", D,
              ", the cache ", Hkv, " heads of ", kc.size(3));
  TORCH_CHECK(tables.dim() == 2 && seq.numel() == T && keys.numel() == T,
              "one sequence index and one key count per query, and a 2-D block table");
  const int64_t S = tables.size(0), W = tables.size(1), G = Hq / Hkv;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = seq.data_ptr<int64_t>();
  const int64_t* np = keys.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t t = 0; t < T; ++t) {  // every address checked before any is read
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "query ", t, " names sequence ", sp[t], " of ", S);
    TORCH_CHECK(np[t] >= 1 && np[t] <= W * BS, "query ", t, " sees ", np[t],
                " keys; its table holds ", W * BS);
    for (int64_t b = 0; b < (np[t] + BS - 1) / BS; ++b) {
      const int64_t blk = tp[sp[t] * W + b];
      TORCH_CHECK(blk >= 0 && blk < NB, "block table entry ", blk, " is outside the ", NB,
                  " cache blocks");
    }
    longest = std::max(longest, np[t]);
  }
  at::Tensor out = at::empty_like(q);
  const float fscale = static_cast<float>(scale);
  dispatch(q, [&](auto tag) {
    using T_ = decltype(tag);
    const T_* qp = cptr<T_>(q);
    const T_* kp = cptr<T_>(kc);
    const T_* vp = cptr<T_>(vc);
    T_* op = ptr<T_>(out);
#pragma omp parallel
    {
      // the G query heads that share a kv head run together: each key and value row is
      // read once for all of them
      std::vector<float> qf(G * D), acc(G * D), sc(G * longest), m(G), l(G);
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < T * Hkv; ++i) {
        const int64_t t = i / Hkv, hk = i % Hkv, n = np[t];
        const int64_t* row = tp + sp[t] * W;
        const T_* qrow = qp + (t * Hq + hk * G) * D;
        for (int64_t c = 0; c < G * D; ++c) qf[c] = ld(qrow[c]) * fscale;
        std::fill(m.begin(), m.end(), kNegInf);
        for (int64_t j = 0; j < n; ++j) {
          const T_* krow = kp + ((row[j / BS] * BS + j % BS) * Hkv + hk) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t c = 0; c < D; ++c) dot += qg[c] * ld(krow[c]);
            sc[g * n + j] = dot;
            m[g] = std::max(m[g], dot);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float sum = 0.f;
          float* sg = sc.data() + g * n;
          for (int64_t j = 0; j < n; ++j) {
            sg[j] = exp_f(sg[j] - m[g]);
            sum += sg[j];
          }
          l[g] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < n; ++j) {
          const T_* vrow = vp + ((row[j / BS] * BS + j % BS) * Hkv + hk) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = sc[g * n + j];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t c = 0; c < D; ++c) ag[c] += p * ld(vrow[c]);
          }
        }
        T_* orow = op + (t * Hq + hk * G) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float inv = 1.f / l[g];
          for (int64_t c = 0; c < D; ++c) orow[g * D + c] = st<T_>(acc[g * D + c] * inv);
        }
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "meshlab::attention and meshlab::paged_attention CPU kernels (float32 and "
            "bfloat16, float32 accumulation)";
  m.def("attention_fwd", &attention_fwd, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("causal"), py::arg("scale"), py::arg("qseg") = py::none(),
        py::arg("kseg") = py::none());
  m.def("attention_bwd", &attention_bwd, py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("causal"), py::arg("scale"),
        py::arg("qseg") = py::none(), py::arg("kseg") = py::none());
  m.def("paged_attention_fwd", &paged_attention_fwd);
  m.def("num_threads", &num_threads);
}
