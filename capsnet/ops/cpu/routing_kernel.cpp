// CPU kernels of the fused routing operators (schemas in ../library.cpp, derivation in docs/kernels.md).
//
// Layouts (all contiguous, row-major; T = float or double):
//   u      [B, I, Din]        child capsules u_i
//   W      [I, J, D, Din]     as stored by the module; the kernels read wt = W transposed to [I, Din, J*D]
//                             so that u_hat_i = sum_k u_ik wt[i, k, :] is Din contiguous axpys of length J*D
//   u_hat  [B, I, J, D]       only in the *_from_predictions variant (never built by the fused op)
//   s_all  [B, r, J, D]       s_j^t of every iteration t (the only state saved for backward)
//   v      [B, J, D]          output v^(r-1)
//   a_all  [B, r, J, D]       backward scratch: A^t = sum_{t'<t} squash(s^t')
//   gs_all [B, r, J, D]       backward scratch: dL/ds^t
// Slow reference: capsnet::detail::reference_routing (nn/functional.cpp); tests/ops hold them equal.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "capsnet/ops/cpu/isa.h"
#include "capsnet/ops/cpu/routing_lanes.h"
#include "capsnet/ops/cpu/vec.h"
#include "capsnet/ops/routing.h"
#include "capsnet/ops/routing_checks.h"

namespace capsnet::ops::cpu {
namespace {

std::atomic<CpuIsa> forced_isa{CpuIsa::automatic};           // ops::set_cpu_isa
std::atomic<CpuKernel> forced_kernel{CpuKernel::automatic};  // ops::set_cpu_kernel
std::atomic<int64_t> prediction_cache_bytes{kPredictionCacheBytes};  // ops::set_prediction_cache_bytes

// Examples routed together per pass over i: the Din x J*D block of W_i is loaded once for all of them.
constexpr int64_t kExampleBlock = 8;
// Child capsules per block in the dW pass: their dW rows and W rows (16 x 2 x 5 KB for the paper's sizes)
// stay in L2 while the pass walks the batch.
constexpr int64_t kChildBlock = 16;
// Minimum multiply-adds per parallel task (like ATen's GRAIN_SIZE).
constexpr int64_t kGrainFlops = 1 << 16;

struct Dims {
  int64_t B, I, J, D, Din, r;
  int64_t JD() const { return J * D; }
};

int64_t grain(int64_t flops_per_item) {
  return std::max<int64_t>(1, kGrainFlops / std::max<int64_t>(1, flops_per_item));
}

// The kernel bodies below are CAPSNET_INLINE (always_inline, vec.h): they are generated inside one
// wrapper per instruction set (end of file), so the same source is compiled for the baseline ISA and for
// AVX2+FMA, chosen at run time.
using vec::dot;  // dot<T, VB>: VB = vector bytes of the instruction set being generated

// u_hat_{.|i} of example b computed from u and wt: out[J*D] = sum_k u[b, i, k] * wt[i, k, :] (never stored
// beyond this J*D buffer).
template <typename T>
struct WeightPredictor {
  const T* u;   // [B, I, Din]
  const T* wt;  // [I, Din, J*D]
  int64_t I, Din, JD;
  template <int VB>
  CAPSNET_INLINE const T* get(int64_t b, int64_t i, T* out) const {
    vec::combine_rows<T, VB>(u + (b * I + i) * Din, wt + i * Din * JD, Din, JD, JD, out);  // W_i u_i
    return out;
  }
};

// u_hat_{.|i} of example b read from a stored u_hat [B, I, J, D].
template <typename T>
struct StoredPredictor {
  const T* u_hat;
  int64_t I, JD;
  template <int VB>
  CAPSNET_INLINE const T* get(int64_t b, int64_t i, T* /*unused*/) const {
    return u_hat + (b * I + i) * JD;
  }
};

// c[J] = softmax_j(uh_j . a_j), uh and a: [J, D]. Max-subtracted like at::softmax.
template <typename T, int VB>
CAPSNET_INLINE void coupling(const T* uh, const T* a, int64_t J, int64_t D, T* c) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < J; ++j) {
    c[j] = dot<T, VB>(uh + j * D, a + j * D, D);
    m = std::max(m, c[j]);
  }
  T sum = 0;
  for (int64_t j = 0; j < J; ++j) {
    c[j] = std::exp(c[j] - m);
    sum += c[j];
  }
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < J; ++j) c[j] *= inv;
}

// v_j = s_j * (n / (1 + n)) / sqrt(n + eps), n = |s_j|^2; s, v: [J, D]. Same expression as capsnet::squash.
template <typename T>
CAPSNET_INLINE void squash_forward(const T* s, int64_t J, int64_t D, T* v) {
  for (int64_t j = 0; j < J; ++j) {
    T n = 0;
    for (int64_t d = 0; d < D; ++d) n += s[j * D + d] * s[j * D + d];
    const T scale = (n / (1 + n)) / std::sqrt(n + T(kSquashEps));
    for (int64_t d = 0; d < D; ++d) v[j * D + d] = s[j * D + d] * scale;
  }
}

// gs = dL/ds given gv = dL/dv for v = g(n) s: gs = g gv + 2 g'(n) (s . gv) s with
// g = n / ((1 + n) q), q = sqrt(n + eps), g' = (n + 2 eps - n^2) / (2 q^3 (1 + n)^2) (finite at n = 0).
template <typename T>
CAPSNET_INLINE void squash_backward(const T* s, const T* gv, int64_t J, int64_t D, T* gs) {
  const T eps = T(kSquashEps);
  for (int64_t j = 0; j < J; ++j) {
    T n = 0, sg = 0;
    for (int64_t d = 0; d < D; ++d) {
      n += s[j * D + d] * s[j * D + d];
      sg += s[j * D + d] * gv[j * D + d];
    }
    const T q = std::sqrt(n + eps);
    const T g = n / ((1 + n) * q);
    const T gprime = (n + 2 * eps - n * n) / (2 * q * q * q * (1 + n) * (1 + n));
    const T k = 2 * gprime * sg;
    for (int64_t d = 0; d < D; ++d) gs[j * D + d] = g * gv[j * D + d] + k * s[j * D + d];
  }
}

// ---------------------------------------------------------------------------------------------------
// Forward: examples [b_begin, b_end) in blocks of kExampleBlock; per block r passes over i.
// s_all: [B, r, J*D] written; v: [B, J*D] written.
template <typename T, int VB, typename Predict>
CAPSNET_INLINE void forward_range(const Predict& predict, const Dims& n, int64_t b_begin, int64_t b_end, T* s_all,
                                  T* v) {
  const int64_t JD = n.JD(), J = n.J, D = n.D, r = n.r;
  std::vector<T> uh_buf(JD), c(J), vt(JD);
  std::vector<T> s_acc(kExampleBlock * JD), a(kExampleBlock * JD);  // per example of the block: s^t, A^t
  for (int64_t b0 = b_begin; b0 < b_end; b0 += kExampleBlock) {
    const int64_t nb = std::min(kExampleBlock, b_end - b0);
    std::fill(a.begin(), a.end(), T(0));
    for (int64_t t = 0; t < r; ++t) {
      std::fill(s_acc.begin(), s_acc.end(), T(0));
      for (int64_t i = 0; i < n.I; ++i) {
        for (int64_t bb = 0; bb < nb; ++bb) {
          const T* uh = predict.template get<VB>(b0 + bb, i, uh_buf.data());  // [J, D]
          T* s = s_acc.data() + bb * JD;
          if (t == 0) {  // b = 0: c_ij = 1/J, applied once after the sum
            for (int64_t x = 0; x < JD; ++x) s[x] += uh[x];
          } else {
            coupling<T, VB>(uh, a.data() + bb * JD, J, D, c.data());
            for (int64_t j = 0; j < J; ++j) {
              const T cj = c[j];
              for (int64_t d = 0; d < D; ++d) s[j * D + d] += cj * uh[j * D + d];
            }
          }
        }
      }
      const T scale = t == 0 ? T(1) / T(J) : T(1);
      for (int64_t bb = 0; bb < nb; ++bb) {
        const int64_t b = b0 + bb;
        T* st = s_all + (b * r + t) * JD;
        for (int64_t x = 0; x < JD; ++x) st[x] = s_acc[bb * JD + x] * scale;
        T* out = t + 1 == r ? v + b * JD : vt.data();
        squash_forward(st, J, D, out);
        T* ab = a.data() + bb * JD;
        for (int64_t x = 0; x < JD; ++x) ab[x] += out[x];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward phase 1 (per example): A^t for every t, and gs^t = dL/ds^t. In full mode gs^t needs
// G^t = sum_{t'>t} dL/dA^t' (A^t' contains v^t), with dL/dA_j^t = sum_i gb_ij^t u_hat_ij: one pass over i
// per t = r-1..1. With grad_through_routing = false only gs^(r-1) is needed (no pass over i).
// grad_v: [B, J*D]; s_all, a_all, gs_all: [B, r, J*D].
template <typename T, int VB, typename Predict>
CAPSNET_INLINE void backward_state_range(const Predict& predict, const Dims& n, bool full, int64_t b_begin,
                                         int64_t b_end, const T* grad_v, const T* s_all, T* a_all, T* gs_all) {
  const int64_t JD = n.JD(), J = n.J, D = n.D, r = n.r;
  std::vector<T> uh_buf(JD), c(J), gc(J), vt(JD), gv(JD);
  std::vector<T> g_later(kExampleBlock * JD), ga(kExampleBlock * JD);  // G^t and dL/dA^t per example
  for (int64_t b0 = b_begin; b0 < b_end; b0 += kExampleBlock) {
    const int64_t nb = std::min(kExampleBlock, b_end - b0);
    for (int64_t b = b0; b < b0 + nb; ++b) {
      T* ab = a_all + b * r * JD;
      std::fill(ab, ab + JD, T(0));  // A^0 = 0
      for (int64_t t = 1; t < r; ++t) {
        squash_forward(s_all + (b * r + t - 1) * JD, J, D, vt.data());
        for (int64_t x = 0; x < JD; ++x) ab[t * JD + x] = ab[(t - 1) * JD + x] + vt[x];
      }
    }
    if (!full) {
      for (int64_t b = b0; b < b0 + nb; ++b)
        squash_backward(s_all + (b * r + r - 1) * JD, grad_v + b * JD, J, D, gs_all + (b * r + r - 1) * JD);
      continue;
    }
    std::fill(g_later.begin(), g_later.end(), T(0));
    for (int64_t t = r - 1; t >= 0; --t) {
      for (int64_t bb = 0; bb < nb; ++bb) {  // gs^t = squash'(s^t)^T (dL/dv^t), dL/dv^t = [t = r-1] grad_v + G^t
        const int64_t b = b0 + bb;
        for (int64_t x = 0; x < JD; ++x) gv[x] = g_later[bb * JD + x] + (t + 1 == r ? grad_v[b * JD + x] : T(0));
        squash_backward(s_all + (b * r + t) * JD, gv.data(), J, D, gs_all + (b * r + t) * JD);
      }
      if (t == 0) break;  // A^0 = 0 is a constant: nothing flows further back
      std::fill(ga.begin(), ga.end(), T(0));
      for (int64_t i = 0; i < n.I; ++i) {
        for (int64_t bb = 0; bb < nb; ++bb) {
          const int64_t b = b0 + bb;
          const T* uh = predict.template get<VB>(b, i, uh_buf.data());
          const T* gs = gs_all + (b * r + t) * JD;
          coupling<T, VB>(uh, a_all + (b * r + t) * JD, J, D, c.data());
          T cgc = 0;  // sum_k c_ik gc_ik
          for (int64_t j = 0; j < J; ++j) {
            gc[j] = dot<T, VB>(uh + j * D, gs + j * D, D);  // gc_ij = dL/dc_ij = u_hat_ij . gs_j
            cgc += c[j] * gc[j];
          }
          T* gab = ga.data() + bb * JD;
          for (int64_t j = 0; j < J; ++j) {
            const T gb = c[j] * (gc[j] - cgc);  // dL/db_ij through the softmax
            for (int64_t d = 0; d < D; ++d) gab[j * D + d] += gb * uh[j * D + d];
          }
        }
      }
      for (int64_t x = 0; x < nb * JD; ++x) g_later[x] += ga[x];
    }
  }
}

// Backward phase 2 for one (b, i): gu[J*D] = dL/du_hat_{.|i} = sum_t c^t_i * gs^t + gb^t_i * A^t
// (only t = r-1 and no gb term when grad_through_routing = false). a_b, gs_b: [r, J*D] of example b.
template <typename T, int VB>
CAPSNET_INLINE void grad_prediction(const T* uh, const T* a_b, const T* gs_b, const Dims& n, bool full, T* c, T* gc,
                                    T* gu) {
  const int64_t JD = n.JD(), J = n.J, D = n.D, r = n.r;
  std::fill(gu, gu + JD, T(0));
  for (int64_t t = full ? 0 : r - 1; t < r; ++t) {
    const T* gs = gs_b + t * JD;
    const T* a = a_b + t * JD;
    if (t == 0) {  // c = 1/J constant, A^0 = 0
      const T c0 = T(1) / T(J);
      for (int64_t x = 0; x < JD; ++x) gu[x] += c0 * gs[x];
      continue;
    }
    coupling<T, VB>(uh, a, J, D, c);
    if (!full) {
      for (int64_t j = 0; j < J; ++j)
        for (int64_t d = 0; d < D; ++d) gu[j * D + d] += c[j] * gs[j * D + d];
      continue;
    }
    T cgc = 0;
    for (int64_t j = 0; j < J; ++j) {
      gc[j] = dot<T, VB>(uh + j * D, gs + j * D, D);
      cgc += c[j] * gc[j];
    }
    for (int64_t j = 0; j < J; ++j) {
      const T cj = c[j], gb = c[j] * (gc[j] - cgc);
      for (int64_t d = 0; d < D; ++d) gu[j * D + d] += cj * gs[j * D + d] + gb * a[j * D + d];
    }
  }
}

// Backward phase 2 of the fused op, children [i_begin, i_end): recompute u_hat_i, gu_hat_i, then
// dW_i += gu_hat_i (x) u_i and du_i = W_i^T gu_hat_i. Parallel over i, so every thread owns its rows of dW
// (no races, no per-thread copies to reduce); children in blocks of kChildBlock, the batch inside.
// u: [B, I, Din]; wt, grad_wt: [I, Din, J*D]; a_all, gs_all: [B, r, J*D]; grad_u: [B, I, Din].
template <typename T, int VB>
CAPSNET_INLINE void weight_grad_range(const WeightPredictor<T>& predict, const Dims& n, bool full, int64_t i_begin,
                                      int64_t i_end, const T* a_all, const T* gs_all, T* grad_u, T* grad_wt) {
  const int64_t JD = n.JD(), Din = n.Din;
  std::vector<T> uh_buf(JD), gu(JD), c(n.J), gc(n.J);
  for (int64_t i0 = i_begin; i0 < i_end; i0 += kChildBlock) {
    const int64_t i1 = std::min(i_end, i0 + kChildBlock);
    for (int64_t b = 0; b < n.B; ++b) {
      for (int64_t i = i0; i < i1; ++i) {
        const T* uh = predict.template get<VB>(b, i, uh_buf.data());
        grad_prediction<T, VB>(uh, a_all + b * n.r * JD, gs_all + b * n.r * JD, n, full, c.data(), gc.data(),
                               gu.data());
        const T* ub = predict.u + (b * n.I + i) * Din;
        const T* w = predict.wt + i * Din * JD;
        T* gw = grad_wt + i * Din * JD;
        T* gub = grad_u + (b * n.I + i) * Din;
        for (int64_t k = 0; k < Din; ++k) {
          const T uk = ub[k];
          T* gwk = gw + k * JD;
          for (int64_t x = 0; x < JD; ++x) gwk[x] += uk * gu[x];  // dW_i += gu_hat_i (x) u_i
          gub[k] = dot<T, VB>(w + k * JD, gu.data(), JD);         // du_i = W_i^T gu_hat_i
        }
      }
    }
  }
}

// Backward of routing_from_predictions, examples [b_begin, b_end): phase 1, then grad_u_hat row by row.
template <typename T, int VB>
CAPSNET_INLINE void prediction_grad_range(const StoredPredictor<T>& predict, const Dims& n, bool full, int64_t b_begin,
                                          int64_t b_end, const T* grad_v, const T* s_all, T* a_all, T* gs_all,
                                          T* grad_u_hat) {
  backward_state_range<T, VB>(predict, n, full, b_begin, b_end, grad_v, s_all, a_all, gs_all);
  const int64_t JD = n.JD();
  std::vector<T> c(n.J), gc(n.J);
  for (int64_t b = b_begin; b < b_end; ++b)
    for (int64_t i = 0; i < n.I; ++i)
      grad_prediction<T, VB>(predict.template get<VB>(b, i, nullptr), a_all + b * n.r * JD, gs_all + b * n.r * JD, n,
                             full, c.data(), gc.data(), grad_u_hat + (b * n.I + i) * JD);
}

// ---------------------------------------------------------------------------------------------------
// One out-of-line copy of each kernel body per instruction set. The baseline copy is compiled for the
// target's default ISA (SSE2 on x86-64); on x86 with GCC/Clang a second copy is compiled for AVX2+FMA
// via the target attribute and used when the CPU has both (the kernel bodies are always_inline, so they
// are generated inside each wrapper; nothing outside them is compiled for AVX2, no ODR hazard).
// A third copy for AVX-512 (64-byte vectors) serves the example-lane kernels best: 16 float32 examples per
// vector. ops::set_cpu_isa caps the copy (tests and benchmarks compare them).
#define CAPSNET_DEFINE_ISA_WRAPPERS(SUFFIX, VB, ATTRIBUTE)                                                            \
  template <typename T, typename Predict>                                                                             \
  ATTRIBUTE void forward_range_##SUFFIX(const Predict& predict, const Dims& n, int64_t b_begin, int64_t b_end,        \
                                        T* s_all, T* v) {                                                             \
    forward_range<T, VB>(predict, n, b_begin, b_end, s_all, v);                                                       \
  }                                                                                                                   \
  template <typename T, typename Predict>                                                                             \
  ATTRIBUTE void backward_state_range_##SUFFIX(const Predict& predict, const Dims& n, bool full, int64_t b_begin,     \
                                               int64_t b_end, const T* grad_v, const T* s_all, T* a_all, T* gs_all) { \
    backward_state_range<T, VB>(predict, n, full, b_begin, b_end, grad_v, s_all, a_all, gs_all);                      \
  }                                                                                                                   \
  template <typename T>                                                                                               \
  ATTRIBUTE void weight_grad_range_##SUFFIX(const WeightPredictor<T>& predict, const Dims& n, bool full,              \
                                            int64_t i_begin, int64_t i_end, const T* a_all, const T* gs_all,          \
                                            T* grad_u, T* grad_wt) {                                                  \
    weight_grad_range<T, VB>(predict, n, full, i_begin, i_end, a_all, gs_all, grad_u, grad_wt);                       \
  }                                                                                                                   \
  template <typename T>                                                                                               \
  ATTRIBUTE void prediction_grad_range_##SUFFIX(const StoredPredictor<T>& predict, const Dims& n, bool full,          \
                                                int64_t b_begin, int64_t b_end, const T* grad_v, const T* s_all,      \
                                                T* a_all, T* gs_all, T* grad_u_hat) {                                 \
    prediction_grad_range<T, VB>(predict, n, full, b_begin, b_end, grad_v, s_all, a_all, gs_all, grad_u_hat);         \
  }                                                                                                                   \
  CAPSNET_DEFINE_LANE_WRAPPERS(SUFFIX, VB, ATTRIBUTE)

// The example-lane kernels (routing_lanes.h), for lane vectors of VBL <= VB bytes (narrower vectors
// serve small batches with the same per-lane arithmetic, see lane_bytes), with the child dimension
// Din = 8 of every CapsNet here compiled as a constant (unrolled loops, register accumulators) and any
// other Din at run time.
#if CAPSNET_OPS_VEC
#define CAPSNET_DEFINE_LANE_WRAPPERS(SUFFIX, VB, ATTRIBUTE)                                                          \
  template <typename T, int VBL>                                                                                     \
  ATTRIBUTE void lanes_forward_chunks_##SUFFIX(const T* w, const T* ul, const lanes::LaneDims& n, int64_t t,         \
                                               int64_t task_begin, int64_t task_end, const T* a, T* parts,           \
                                               T* uh_cache) {                                                        \
    if (n.Din == 8)                                                                                                  \
      lanes::forward_chunks<T, VBL, 8>(w, ul, n, t, task_begin, task_end, a, parts, uh_cache);                       \
    else                                                                                                             \
      lanes::forward_chunks<T, VBL, 0>(w, ul, n, t, task_begin, task_end, a, parts, uh_cache);                       \
  }                                                                                                                  \
  template <typename T, int VBL>                                                                                     \
  ATTRIBUTE void lanes_forward_finish_##SUFFIX(const lanes::LaneDims& n, int64_t t, int64_t q_begin, int64_t q_end,  \
                                               const T* parts, T* a, T* s_all, T* v) {                               \
    lanes::forward_finish<T, VBL>(n, t, q_begin, q_end, parts, a, s_all, v);                                         \
  }                                                                                                                  \
  template <typename T, int VBL>                                                                                     \
  ATTRIBUTE void lanes_state_##SUFFIX(const T* w, const T* ul, const lanes::LaneDims& n, bool full, int64_t q_begin, \
                                      int64_t q_end, const T* gvl, const T* sl, T* al, T* gsl) {                     \
    if (n.Din == 8)                                                                                                  \
      lanes::state_blocks<T, VBL, 8>(w, ul, n, full, q_begin, q_end, gvl, sl, al, gsl);                              \
    else                                                                                                             \
      lanes::state_blocks<T, VBL, 0>(w, ul, n, full, q_begin, q_end, gvl, sl, al, gsl);                              \
  }                                                                                                                  \
  template <typename T, int VBL>                                                                                     \
  ATTRIBUTE void lanes_weight_grad_##SUFFIX(const T* w, const T* ul, const lanes::LaneDims& n, bool full,            \
                                            int64_t i_begin, int64_t i_end, const T* al, const T* gsl, T* gul,       \
                                            T* grad_w) {                                                             \
    if (n.Din == 8)                                                                                                  \
      lanes::weight_grad_children<T, VBL, 8>(w, ul, n, full, i_begin, i_end, al, gsl, gul, grad_w);                  \
    else                                                                                                             \
      lanes::weight_grad_children<T, VBL, 0>(w, ul, n, full, i_begin, i_end, al, gsl, gul, grad_w);                  \
  }
#else
#define CAPSNET_DEFINE_LANE_WRAPPERS(SUFFIX, VB, ATTRIBUTE)
#endif

CAPSNET_DEFINE_ISA_WRAPPERS(baseline, 16, )
#if CAPSNET_HAVE_X86_COPIES
CAPSNET_DEFINE_ISA_WRAPPERS(avx2, 32, __attribute__((target("avx2,fma"))))
CAPSNET_DEFINE_ISA_WRAPPERS(avx512, 64, __attribute__((target("avx512f,avx2,fma"))))
#endif

}  // namespace

// The widest copy the CPU runs, capped by ops::set_cpu_isa (read per call: tests switch it). Also
// used by the EM kernels (isa.h).
CpuIsa selected_isa() {
#if CAPSNET_HAVE_X86_COPIES
  static const CpuIsa best = __builtin_cpu_supports("avx512f")                                 ? CpuIsa::avx512
                             : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? CpuIsa::avx2
                                                                                               : CpuIsa::baseline;
#else
  static const CpuIsa best = CpuIsa::baseline;
#endif
  const CpuIsa cap = forced_isa.load(std::memory_order_relaxed);
  return cap == CpuIsa::automatic ? best : std::min(cap, best);
}

namespace {

int64_t vector_bytes(CpuIsa isa) { return isa == CpuIsa::avx512 ? 64 : isa == CpuIsa::avx2 ? 32 : 16; }

// The fused op runs the example-lane kernels unless set_cpu_kernel forces the per-example ones (or the
// compiler has no vector extensions).
bool use_lanes() {
  if (!CAPSNET_OPS_VEC) return false;
  return forced_kernel.load(std::memory_order_relaxed) != CpuKernel::per_example;
}

// Lane vector width for a batch: the narrowest of 16, 32, ... up to the ISA's widest whose lanes hold the
// whole batch. Every lane does the same operations in the same order whatever the width and whichever
// lane an example lands in, so an example's outputs do not depend on the batch it is in (predict in
// batches of 3 answers exactly as in one batch of 256: tested), while small batches idle fewer lanes
// (measured in docs/kernels.md).
int64_t lane_bytes(CpuIsa isa, int64_t batch, int64_t element_size) {
  int64_t bytes = vector_bytes(isa);
  while (bytes > 16 && batch * element_size <= bytes / 2) bytes /= 2;
  return bytes;
}

#if CAPSNET_HAVE_X86_COPIES
#define CAPSNET_LANES_CALL(isa, vbl, name, ...)                                                          \
  ((isa) == CpuIsa::avx512 ? ((vbl) == 64   ? name##_avx512<scalar_t, 64>(__VA_ARGS__)                   \
                              : (vbl) == 32 ? name##_avx512<scalar_t, 32>(__VA_ARGS__)                   \
                                            : name##_avx512<scalar_t, 16>(__VA_ARGS__))                  \
   : (isa) == CpuIsa::avx2                                                                               \
       ? ((vbl) == 32 ? name##_avx2<scalar_t, 32>(__VA_ARGS__) : name##_avx2<scalar_t, 16>(__VA_ARGS__)) \
       : name##_baseline<scalar_t, 16>(__VA_ARGS__))
#else
#define CAPSNET_LANES_CALL(isa, vbl, name, ...) name##_baseline<scalar_t, 16>(__VA_ARGS__)
#endif


// [B, M] -> [nblk, M, L] (lane l of block q = row q * L + l; rows past B are zero), and back.
template <typename T>
void pack_lanes(const T* src, int64_t B, int64_t M, int64_t L, T* dst) {
  const int64_t nblk = (B + L - 1) / L;
  at::parallel_for(0, nblk, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t b = q * L + l;
        T* out = dst + q * M * L + l;
        if (b < B)
          for (int64_t m = 0; m < M; ++m) out[m * L] = src[b * M + m];
        else
          for (int64_t m = 0; m < M; ++m) out[m * L] = T(0);
      }
  });
}
template <typename T>
void unpack_lanes(const T* src, int64_t B, int64_t M, int64_t L, T* dst) {
  const int64_t nblk = (B + L - 1) / L;
  at::parallel_for(0, nblk, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      for (int64_t l = 0; l < L && q * L + l < B; ++l) {
        const T* in = src + q * M * L + l;
        T* out = dst + (q * L + l) * M;
        for (int64_t m = 0; m < M; ++m) out[m] = in[m * L];
      }
  });
}
at::Tensor lanes_buffer(int64_t nblk, at::IntArrayRef inner, int64_t L, const at::TensorOptions& options) {
  std::vector<int64_t> sizes{nblk};
  sizes.insert(sizes.end(), inner.begin(), inner.end());
  sizes.push_back(L);
  return at::empty(sizes, options);  // ATen's CPU allocator aligns to 64 bytes, so every row of L is a vector
}

// ---------------------------------------------------------------------------------------------------
// Dispatcher kernels.

constexpr const char* kFusedOp = "capsnet::capsule_routing";
constexpr const char* kPredOp = "capsnet::routing_from_predictions";

std::tuple<at::Tensor, at::Tensor> capsule_routing_forward_cpu(const at::Tensor& u_in, const at::Tensor& W_in,
                                                               int64_t iterations) {
  detail::check_capsule_routing_inputs(kFusedOp, u_in, W_in);
  detail::check_iterations(kFusedOp, iterations);
  const auto u = u_in.contiguous();
  const Dims n{u.size(0), W_in.size(0), W_in.size(1), W_in.size(2), W_in.size(3), iterations};
  auto v = at::empty({n.B, n.J, n.D}, u.options());
  auto s_all = at::empty({n.B, n.r, n.J, n.D}, u.options());
  const CpuIsa isa = selected_isa();
  if (n.B > 0 && use_lanes()) {
#if CAPSNET_OPS_VEC
    const int64_t vbl = lane_bytes(isa, n.B, u.element_size());
    const int64_t L = vbl / u.element_size(), nblk = (n.B + L - 1) / L;
    const auto w = W_in.contiguous();  // [I, J, D, Din] = [I, J*D, Din]
    const int64_t nchunk = lanes::child_chunks(n.I);
    auto ul = lanes_buffer(nblk, {n.I, n.Din}, L, u.options());
    auto a = at::zeros({nblk, n.JD(), L}, u.options());                 // A^t per block, in lanes
    auto parts = lanes_buffer(nblk, {nchunk, n.JD()}, L, u.options());  // partial s^t per (block, chunk)
    // uh_cache: [nblk, I, J*D, L], u_hat of iteration 1 kept for the others (small batches only: at B = 100
    // it would be 82 MB, more than recomputing it costs; see set_prediction_cache_bytes).
    const bool cache = n.r > 1 && nblk * n.I * n.JD() * vbl <= prediction_cache_bytes.load(std::memory_order_relaxed);
    auto uh_cache = cache ? lanes_buffer(nblk, {n.I, n.JD()}, L, u.options()) : at::Tensor();
    const lanes::LaneDims ln{n.B, n.I, n.J, n.D, n.Din, n.r};
    AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "capsule_routing_forward_cpu", [&] {
      pack_lanes(u.data_ptr<scalar_t>(), n.B, n.I * n.Din, L, ul.data_ptr<scalar_t>());
      const scalar_t* w_ptr = w.data_ptr<scalar_t>();
      const scalar_t* ul_ptr = ul.data_ptr<scalar_t>();
      scalar_t* a_ptr = a.data_ptr<scalar_t>();
      scalar_t* parts_ptr = parts.data_ptr<scalar_t>();
      scalar_t* s_ptr = s_all.data_ptr<scalar_t>();
      scalar_t* v_ptr = v.data_ptr<scalar_t>();
      scalar_t* cache_ptr = cache ? uh_cache.data_ptr<scalar_t>() : nullptr;
      for (int64_t t = 0; t < n.r; ++t) {  // per iteration: the (block, chunk) sums in parallel, then per block
        at::parallel_for(0, nblk * nchunk, 1, [&](int64_t begin, int64_t end) {
          CAPSNET_LANES_CALL(isa, vbl, lanes_forward_chunks, w_ptr, ul_ptr, ln, t, begin, end, a_ptr, parts_ptr,
                             cache_ptr);
        });
        at::parallel_for(0, nblk, 1, [&](int64_t begin, int64_t end) {
          CAPSNET_LANES_CALL(isa, vbl, lanes_forward_finish, ln, t, begin, end, parts_ptr, a_ptr, s_ptr, v_ptr);
        });
      }
    });
#endif
    return {v, s_all};
  }
  const auto wt = W_in.reshape({n.I, n.JD(), n.Din}).transpose(1, 2).contiguous();  // [I, Din, J*D]
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "capsule_routing_forward_cpu", [&] {
    const WeightPredictor<scalar_t> predict{u.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(), n.I, n.Din, n.JD()};
    scalar_t* s_ptr = s_all.data_ptr<scalar_t>();
    scalar_t* v_ptr = v.data_ptr<scalar_t>();
    at::parallel_for(0, n.B, grain(n.I * n.JD() * (n.Din + 2 * n.D) * n.r), [&](int64_t begin, int64_t end) {
      CAPSNET_ISA_CALL(isa, forward_range, predict, n, begin, end, s_ptr, v_ptr);
    });
  });
  return {v, s_all};
}

// Backward with example lanes: pack u, grad_v and s_all into lanes, phase 1 over blocks, phase 2 over
// children (writing dW in W's own layout), unpack du.
std::tuple<at::Tensor, at::Tensor> capsule_routing_backward_lanes(CpuIsa isa, const Dims& n, const at::Tensor& grad_v,
                                                                  const at::Tensor& u, const at::Tensor& W_in,
                                                                  const at::Tensor& s_all, bool full) {
  auto grad_u = at::empty_like(u);  // [B, I, Din]
  auto grad_W = at::empty({n.I, n.J, n.D, n.Din}, u.options());
#if CAPSNET_OPS_VEC
  const int64_t vbl = lane_bytes(isa, n.B, u.element_size());
  const int64_t L = vbl / u.element_size(), nblk = (n.B + L - 1) / L;
  const auto w = W_in.contiguous();
  const auto opts = u.options();
  auto ul = lanes_buffer(nblk, {n.I, n.Din}, L, opts), gul = lanes_buffer(nblk, {n.I, n.Din}, L, opts);
  auto gvl = lanes_buffer(nblk, {n.JD()}, L, opts), sl = lanes_buffer(nblk, {n.r, n.JD()}, L, opts);
  auto al = lanes_buffer(nblk, {n.r, n.JD()}, L, opts), gsl = at::zeros_like(al);
  const lanes::LaneDims ln{n.B, n.I, n.J, n.D, n.Din, n.r};
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "capsule_routing_backward_cpu", [&] {
    pack_lanes(u.data_ptr<scalar_t>(), n.B, n.I * n.Din, L, ul.data_ptr<scalar_t>());
    pack_lanes(grad_v.data_ptr<scalar_t>(), n.B, n.JD(), L, gvl.data_ptr<scalar_t>());
    pack_lanes(s_all.data_ptr<scalar_t>(), n.B, n.r * n.JD(), L, sl.data_ptr<scalar_t>());
    const scalar_t* w_ptr = w.data_ptr<scalar_t>();
    const scalar_t* ul_ptr = ul.data_ptr<scalar_t>();
    scalar_t* al_ptr = al.data_ptr<scalar_t>();
    scalar_t* gsl_ptr = gsl.data_ptr<scalar_t>();
    const scalar_t* gvl_ptr = gvl.data_ptr<scalar_t>();
    const scalar_t* sl_ptr = sl.data_ptr<scalar_t>();
    scalar_t* gul_ptr = gul.data_ptr<scalar_t>();
    scalar_t* gw_ptr = grad_W.data_ptr<scalar_t>();
    at::parallel_for(0, nblk, 1, [&](int64_t begin, int64_t end) {
      CAPSNET_LANES_CALL(isa, vbl, lanes_state, w_ptr, ul_ptr, ln, full, begin, end, gvl_ptr, sl_ptr, al_ptr, gsl_ptr);
    });
    at::parallel_for(0, n.I, grain(n.B * n.JD() * (3 * n.Din + 3 * n.D) * n.r), [&](int64_t begin, int64_t end) {
      CAPSNET_LANES_CALL(isa, vbl, lanes_weight_grad, w_ptr, ul_ptr, ln, full, begin, end, al_ptr, gsl_ptr, gul_ptr,
                         gw_ptr);
    });
    unpack_lanes(gul.data_ptr<scalar_t>(), n.B, n.I * n.Din, L, grad_u.data_ptr<scalar_t>());
  });
#endif
  return {grad_u, grad_W};
}

std::tuple<at::Tensor, at::Tensor> capsule_routing_backward_cpu(const at::Tensor& grad_v_in, const at::Tensor& u_in,
                                                                const at::Tensor& W_in, const at::Tensor& s_all_in,
                                                                bool grad_through_routing) {
  detail::check_capsule_routing_inputs(kFusedOp, u_in, W_in);
  const auto u = u_in.contiguous();
  const Dims n{u.size(0),    W_in.size(0), W_in.size(1),
               W_in.size(2), W_in.size(3), s_all_in.dim() == 4 ? s_all_in.size(1) : 0};
  detail::check_backward_state(kFusedOp, grad_v_in, s_all_in, n.B, n.J, n.D, u);
  const auto grad_v = grad_v_in.contiguous();
  const auto s_all = s_all_in.contiguous();
  const bool full = grad_through_routing;
  const CpuIsa isa = selected_isa();
  if (n.B > 0 && use_lanes()) return capsule_routing_backward_lanes(isa, n, grad_v, u, W_in, s_all, full);
  const auto wt = W_in.reshape({n.I, n.JD(), n.Din}).transpose(1, 2).contiguous();  // [I, Din, J*D]
  auto a_all = at::empty_like(s_all);
  auto gs_all = at::zeros_like(s_all);
  auto grad_u = at::empty_like(u);                              // [B, I, Din]
  auto grad_wt = at::zeros({n.I, n.Din, n.JD()}, u.options());  // [I, Din, J*D]
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "capsule_routing_backward_cpu", [&] {
    const WeightPredictor<scalar_t> predict{u.data_ptr<scalar_t>(), wt.data_ptr<scalar_t>(), n.I, n.Din, n.JD()};
    const scalar_t* gv_ptr = grad_v.data_ptr<scalar_t>();
    const scalar_t* s_ptr = s_all.data_ptr<scalar_t>();
    scalar_t* a_ptr = a_all.data_ptr<scalar_t>();
    scalar_t* gs_ptr = gs_all.data_ptr<scalar_t>();
    scalar_t* gu_ptr = grad_u.data_ptr<scalar_t>();
    scalar_t* gwt_ptr = grad_wt.data_ptr<scalar_t>();
    // Phase 1 over examples (each writes only its own state rows).
    const int64_t state_flops = full ? n.I * n.JD() * (n.Din + 3 * n.D) * (n.r - 1) : n.JD() * n.r;
    at::parallel_for(0, n.B, grain(state_flops), [&](int64_t begin, int64_t end) {
      CAPSNET_ISA_CALL(isa, backward_state_range, predict, n, full, begin, end, gv_ptr, s_ptr, a_ptr, gs_ptr);
    });
    // Phase 2 over children i (each owns its rows of dW).
    at::parallel_for(0, n.I, grain(n.B * n.JD() * (3 * n.Din + 3 * n.D) * n.r), [&](int64_t begin, int64_t end) {
      CAPSNET_ISA_CALL(isa, weight_grad_range, predict, n, full, begin, end, a_ptr, gs_ptr, gu_ptr, gwt_ptr);
    });
  });
  auto grad_W = grad_wt.transpose(1, 2).contiguous().view({n.I, n.J, n.D, n.Din});
  return {grad_u, grad_W};
}

std::tuple<at::Tensor, at::Tensor> routing_from_predictions_forward_cpu(const at::Tensor& u_hat_in,
                                                                        int64_t iterations) {
  detail::check_predictions_input(kPredOp, u_hat_in);
  detail::check_iterations(kPredOp, iterations);
  const auto u_hat = u_hat_in.contiguous();
  const Dims n{u_hat.size(0), u_hat.size(1), u_hat.size(2), u_hat.size(3), 0, iterations};
  auto v = at::empty({n.B, n.J, n.D}, u_hat.options());
  auto s_all = at::empty({n.B, n.r, n.J, n.D}, u_hat.options());
  const CpuIsa isa = selected_isa();
  AT_DISPATCH_FLOATING_TYPES(u_hat.scalar_type(), "routing_from_predictions_forward_cpu", [&] {
    const StoredPredictor<scalar_t> predict{u_hat.data_ptr<scalar_t>(), n.I, n.JD()};
    scalar_t* s_ptr = s_all.data_ptr<scalar_t>();
    scalar_t* v_ptr = v.data_ptr<scalar_t>();
    at::parallel_for(0, n.B, grain(n.I * n.JD() * 4 * n.r), [&](int64_t begin, int64_t end) {
      CAPSNET_ISA_CALL(isa, forward_range, predict, n, begin, end, s_ptr, v_ptr);
    });
  });
  return {v, s_all};
}

at::Tensor routing_from_predictions_backward_cpu(const at::Tensor& grad_v_in, const at::Tensor& u_hat_in,
                                                 const at::Tensor& s_all_in, bool grad_through_routing) {
  detail::check_predictions_input(kPredOp, u_hat_in);
  const auto u_hat = u_hat_in.contiguous();
  const Dims n{
      u_hat.size(0), u_hat.size(1), u_hat.size(2), u_hat.size(3), 0, s_all_in.dim() == 4 ? s_all_in.size(1) : 0};
  detail::check_backward_state(kPredOp, grad_v_in, s_all_in, n.B, n.J, n.D, u_hat);
  const auto grad_v = grad_v_in.contiguous();
  const auto s_all = s_all_in.contiguous();
  auto a_all = at::empty_like(s_all);
  auto gs_all = at::zeros_like(s_all);
  auto grad_u_hat = at::empty_like(u_hat);  // [B, I, J, D]
  const bool full = grad_through_routing;
  const CpuIsa isa = selected_isa();
  AT_DISPATCH_FLOATING_TYPES(u_hat.scalar_type(), "routing_from_predictions_backward_cpu", [&] {
    const StoredPredictor<scalar_t> predict{u_hat.data_ptr<scalar_t>(), n.I, n.JD()};
    const scalar_t* gv_ptr = grad_v.data_ptr<scalar_t>();
    const scalar_t* s_ptr = s_all.data_ptr<scalar_t>();
    scalar_t* a_ptr = a_all.data_ptr<scalar_t>();
    scalar_t* gs_ptr = gs_all.data_ptr<scalar_t>();
    scalar_t* g_ptr = grad_u_hat.data_ptr<scalar_t>();
    // Both phases over examples: every example writes only its own rows of grad_u_hat.
    at::parallel_for(0, n.B, grain(n.I * n.JD() * 6 * n.r), [&](int64_t begin, int64_t end) {
      CAPSNET_ISA_CALL(isa, prediction_grad_range, predict, n, full, begin, end, gv_ptr, s_ptr, a_ptr, gs_ptr, g_ptr);
    });
  });
  return grad_u_hat;
}

// The public ops on CPU without autograd (reached under InferenceMode, or below Autograd).
at::Tensor capsule_routing_cpu(const at::Tensor& u, const at::Tensor& W, int64_t iterations,
                               bool /*grad_through_routing: forward values do not depend on it*/) {
  return std::get<0>(capsule_routing_forward_cpu(u, W, iterations));
}

at::Tensor routing_from_predictions_cpu(const at::Tensor& u_hat, int64_t iterations, bool /*grad_through_routing*/) {
  return std::get<0>(routing_from_predictions_forward_cpu(u_hat, iterations));
}

}  // namespace
}  // namespace capsnet::ops::cpu

namespace capsnet::ops {
void set_cpu_isa(CpuIsa isa) { cpu::forced_isa.store(isa, std::memory_order_relaxed); }
void set_cpu_kernel(CpuKernel kernel) { cpu::forced_kernel.store(kernel, std::memory_order_relaxed); }
void set_prediction_cache_bytes(int64_t bytes) {
  cpu::prediction_cache_bytes.store(bytes < 0 ? kPredictionCacheBytes : bytes, std::memory_order_relaxed);
}
}  // namespace capsnet::ops

TORCH_LIBRARY_IMPL(capsnet, CPU, m) {
  using namespace capsnet::ops::cpu;
  m.impl("capsule_routing", &capsule_routing_cpu);
  m.impl("routing_from_predictions", &routing_from_predictions_cpu);
  m.impl("_capsule_routing_forward", &capsule_routing_forward_cpu);
  m.impl("_capsule_routing_backward", &capsule_routing_backward_cpu);
  m.impl("_routing_from_predictions_forward", &routing_from_predictions_forward_cpu);
  m.impl("_routing_from_predictions_backward", &routing_from_predictions_backward_cpu);
}
