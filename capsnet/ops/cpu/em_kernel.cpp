// CPU kernels of EM routing's vote passes (schemas in ../library.cpp, math in ../em.h).
//
// Layouts (contiguous, row-major; T = float or double), per routing problem b:
//   weights [I, J], votes [I, J, D], mean / variance [J, D], distance [I, J].
// One problem's votes (I*J*D values: 18k-37k for the paper's small model) stay in L2 between the two
// loops over them, so each kernel reads the votes from memory about once.
// Slow reference: the composite ATen form in tests/ops/em_ops_test.cpp and
// capsnet::detail::reference_em_routing (nn/em_routing.cpp).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "capsnet/ops/cpu/isa.h"
#include "capsnet/ops/cpu/vec.h"
#include "capsnet/ops/em_checks.h"

namespace capsnet::ops::cpu {
namespace {

struct Dims {
  int64_t B, I, J, D;
  int64_t problem() const { return I * J * D; }
};

Dims dims_of(const at::Tensor& votes) { return {votes.size(0), votes.size(1), votes.size(2), votes.size(3)}; }

// Problems per task: enough work (~64k values) that a task is worth handing to a thread.
int64_t grain(const Dims& n) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, n.problem())); }

// The per-problem kernels below are always_inline templates, compiled once per instruction set inside
// the *_range wrappers (isa.h). Their loops over d are contiguous and free of aliasing (restrict) and
// get vectorised; the sums over d are `omp simd` reductions (the compiler's lane order, fixed per
// copy), the sums over i run in order.
#define CAPSNET_RESTRICT __restrict__

// mean_jd = sum_i w_ij V_ijd; variance_jd = sum_i w_ij (V_ijd - mean_jd)^2.
template <typename T>
CAPSNET_INLINE void moments_forward(const T* CAPSNET_RESTRICT w, const T* CAPSNET_RESTRICT V, T* CAPSNET_RESTRICT mean,
                                    T* CAPSNET_RESTRICT var, const Dims& n) {
  const int64_t J = n.J, D = n.D;
  std::fill(mean, mean + J * D, T(0));
  std::fill(var, var + J * D, T(0));
  for (int64_t i = 0; i < n.I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      const T wij = w[i * J + j];
      const T* CAPSNET_RESTRICT v = V + (i * J + j) * D;
      T* CAPSNET_RESTRICT m = mean + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) m[d] += wij * v[d];
    }
  for (int64_t i = 0; i < n.I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      const T wij = w[i * J + j];
      const T* CAPSNET_RESTRICT v = V + (i * J + j) * D;
      const T* CAPSNET_RESTRICT m = mean + j * D;
      T* CAPSNET_RESTRICT s = var + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const T e = v[d] - m[d];
        s[d] += wij * e * e;
      }
    }
}

// With W_j = sum_i w_ij, mean = sum_i w_i V_i gives d variance / d mean = -2 (mean - W_j mean), so the
// mean's total gradient is gm_total = grad_mean - 2 grad_variance mean (1 - W_j); then
//   grad_w_ij = sum_d gm_total V_ijd + grad_variance (V_ijd - mean)^2,
//   grad_V_ijd = w_ij (gm_total + 2 grad_variance (V_ijd - mean)).
// gm_total: scratch [J, D].
template <typename T>
CAPSNET_INLINE void moments_backward(const T* CAPSNET_RESTRICT gm, const T* CAPSNET_RESTRICT gv,
                                     const T* CAPSNET_RESTRICT w, const T* CAPSNET_RESTRICT V,
                                     const T* CAPSNET_RESTRICT mean, T* CAPSNET_RESTRICT gw, T* CAPSNET_RESTRICT gV,
                                     T* CAPSNET_RESTRICT gm_total, const Dims& n) {
  const int64_t J = n.J, D = n.D;
  for (int64_t j = 0; j < J; ++j) {
    T total = 0;
    for (int64_t i = 0; i < n.I; ++i) total += w[i * J + j];
    for (int64_t d = 0; d < D; ++d)
      gm_total[j * D + d] = gm[j * D + d] - T(2) * gv[j * D + d] * mean[j * D + d] * (T(1) - total);
  }
  for (int64_t i = 0; i < n.I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      const T wij = w[i * J + j];
      const T* CAPSNET_RESTRICT v = V + (i * J + j) * D;
      const T *CAPSNET_RESTRICT m = mean + j * D, *CAPSNET_RESTRICT g1 = gm_total + j * D,
                                *CAPSNET_RESTRICT g2 = gv + j * D;
      T* CAPSNET_RESTRICT out = gV + (i * J + j) * D;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) {
        const T e = v[d] - m[d];
        acc += g1[d] * v[d] + g2[d] * e * e;
        out[d] = wij * (g1[d] + T(2) * g2[d] * e);
      }
      gw[i * J + j] = acc;
    }
}

// distance_ij = sum_d (V_ijd - mean_jd)^2 / variance_jd. inv: scratch [J, D].
template <typename T>
CAPSNET_INLINE void distance_forward(const T* CAPSNET_RESTRICT V, const T* CAPSNET_RESTRICT mean,
                                     const T* CAPSNET_RESTRICT var, T* CAPSNET_RESTRICT dist, T* CAPSNET_RESTRICT inv,
                                     const Dims& n) {
  const int64_t J = n.J, D = n.D;
  for (int64_t k = 0; k < J * D; ++k) inv[k] = T(1) / var[k];
  for (int64_t i = 0; i < n.I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      const T* CAPSNET_RESTRICT v = V + (i * J + j) * D;
      const T *CAPSNET_RESTRICT m = mean + j * D, *CAPSNET_RESTRICT s = inv + j * D;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) {
        const T e = v[d] - m[d];
        acc += e * e * s[d];
      }
      dist[i * J + j] = acc;
    }
}

// grad_V_ijd = 2 g_ij (V_ijd - mean_jd) / variance_jd; grad_mean_jd = -sum_i grad_V_ijd;
// grad_variance_jd = -sum_i g_ij (V_ijd - mean_jd)^2 / variance_jd^2. inv: scratch [J, D].
template <typename T>
CAPSNET_INLINE void distance_backward(const T* CAPSNET_RESTRICT g, const T* CAPSNET_RESTRICT V,
                                      const T* CAPSNET_RESTRICT mean, const T* CAPSNET_RESTRICT var,
                                      T* CAPSNET_RESTRICT gV, T* CAPSNET_RESTRICT gmean, T* CAPSNET_RESTRICT gvar,
                                      T* CAPSNET_RESTRICT inv, const Dims& n) {
  const int64_t J = n.J, D = n.D;
  for (int64_t k = 0; k < J * D; ++k) inv[k] = T(1) / var[k];
  std::fill(gmean, gmean + J * D, T(0));
  std::fill(gvar, gvar + J * D, T(0));
  for (int64_t i = 0; i < n.I; ++i)
    for (int64_t j = 0; j < J; ++j) {
      const T gij = g[i * J + j];
      const T* CAPSNET_RESTRICT v = V + (i * J + j) * D;
      const T *CAPSNET_RESTRICT m = mean + j * D, *CAPSNET_RESTRICT s = inv + j * D;
      T *CAPSNET_RESTRICT out = gV + (i * J + j) * D, *CAPSNET_RESTRICT gmj = gmean + j * D,
                          *CAPSNET_RESTRICT gsj = gvar + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        const T e = v[d] - m[d], es = e * s[d];
        out[d] = T(2) * gij * es;
        gmj[d] -= T(2) * gij * es;
        gsj[d] -= gij * es * es;
      }
    }
}

// Problems [b0, b1) of each kernel, once per instruction set. Scratch: [J, D] per call.
#define CAPSNET_DEFINE_EM_WRAPPERS(SUFFIX, ATTRIBUTE)                                                               \
  template <typename T>                                                                                             \
  ATTRIBUTE void moments_forward_range_##SUFFIX(const T* w, const T* V, T* mean, T* var, const Dims& n, int64_t b0, \
                                                int64_t b1) {                                                       \
    const int64_t IJ = n.I * n.J, JD = n.J * n.D;                                                                   \
    for (int64_t b = b0; b < b1; ++b)                                                                               \
      moments_forward(w + b * IJ, V + b * n.problem(), mean + b * JD, var + b * JD, n);                             \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  ATTRIBUTE void moments_backward_range_##SUFFIX(const T* gm, const T* gv, const T* w, const T* V, const T* mean,   \
                                                 T* gw, T* gV, T* scratch, const Dims& n, int64_t b0, int64_t b1) { \
    const int64_t IJ = n.I * n.J, JD = n.J * n.D;                                                                   \
    for (int64_t b = b0; b < b1; ++b)                                                                               \
      moments_backward(gm + b * JD, gv + b * JD, w + b * IJ, V + b * n.problem(), mean + b * JD, gw + b * IJ,       \
                       gV + b * n.problem(), scratch, n);                                                           \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  ATTRIBUTE void distance_forward_range_##SUFFIX(const T* V, const T* mean, const T* var, T* dist, T* scratch,      \
                                                 const Dims& n, int64_t b0, int64_t b1) {                           \
    const int64_t IJ = n.I * n.J, JD = n.J * n.D;                                                                   \
    for (int64_t b = b0; b < b1; ++b)                                                                               \
      distance_forward(V + b * n.problem(), mean + b * JD, var + b * JD, dist + b * IJ, scratch, n);                \
  }                                                                                                                 \
  template <typename T>                                                                                             \
  ATTRIBUTE void distance_backward_range_##SUFFIX(const T* g, const T* V, const T* mean, const T* var, T* gV,       \
                                                  T* gmean, T* gvar, T* scratch, const Dims& n, int64_t b0,         \
                                                  int64_t b1) {                                                     \
    const int64_t IJ = n.I * n.J, JD = n.J * n.D;                                                                   \
    for (int64_t b = b0; b < b1; ++b)                                                                               \
      distance_backward(g + b * IJ, V + b * n.problem(), mean + b * JD, var + b * JD, gV + b * n.problem(),         \
                        gmean + b * JD, gvar + b * JD, scratch, n);                                                 \
  }

CAPSNET_DEFINE_EM_WRAPPERS(baseline, )
#if CAPSNET_HAVE_X86_COPIES
CAPSNET_DEFINE_EM_WRAPPERS(avx2, __attribute__((target("avx2,fma"))))
CAPSNET_DEFINE_EM_WRAPPERS(avx512, __attribute__((target("avx512f,avx2,fma"))))
#endif

constexpr const char* kMomentsOp = "capsnet::em_weighted_moments";
constexpr const char* kDistanceOp = "capsnet::em_scaled_distance";

std::tuple<at::Tensor, at::Tensor> em_weighted_moments_cpu(const at::Tensor& weights_in, const at::Tensor& votes_in) {
  detail::check_moments_inputs(kMomentsOp, weights_in, votes_in);
  const auto w = weights_in.contiguous(), V = votes_in.contiguous();
  const Dims n = dims_of(V);
  auto mean = at::empty({n.B, n.J, n.D}, V.options()), var = at::empty({n.B, n.J, n.D}, V.options());
  AT_DISPATCH_FLOATING_TYPES(V.scalar_type(), "em_weighted_moments_cpu", [&] {
    const auto *pw = w.data_ptr<scalar_t>(), *pV = V.data_ptr<scalar_t>();
    auto *pm = mean.data_ptr<scalar_t>(), *ps = var.data_ptr<scalar_t>();
    const CpuIsa isa = selected_isa();
    at::parallel_for(0, n.B, grain(n), [&](int64_t b0, int64_t b1) {
      CAPSNET_ISA_CALL(isa, moments_forward_range, pw, pV, pm, ps, n, b0, b1);
    });
  });
  return {mean, var};
}

std::tuple<at::Tensor, at::Tensor> em_weighted_moments_backward_cpu(const at::Tensor& grad_mean,
                                                                    const at::Tensor& grad_variance,
                                                                    const at::Tensor& weights_in,
                                                                    const at::Tensor& votes_in,
                                                                    const at::Tensor& mean_in) {
  const auto in = detail::moments_grad_inputs(kMomentsOp, grad_mean, grad_variance, weights_in, votes_in, mean_in);
  const auto &w = in.weights, &V = in.votes, &mean = in.mean, &gm = in.grad_mean, &gv = in.grad_variance;
  const Dims n = dims_of(V);
  auto gw = at::empty_like(w), gV = at::empty_like(V);
  AT_DISPATCH_FLOATING_TYPES(V.scalar_type(), "em_weighted_moments_backward_cpu", [&] {
    const auto *pw = w.data_ptr<scalar_t>(), *pV = V.data_ptr<scalar_t>(), *pm = mean.data_ptr<scalar_t>();
    const auto *pgm = gm.data_ptr<scalar_t>(), *pgv = gv.data_ptr<scalar_t>();
    auto *pgw = gw.data_ptr<scalar_t>(), *pgV = gV.data_ptr<scalar_t>();
    const CpuIsa isa = selected_isa();
    at::parallel_for(0, n.B, grain(n), [&](int64_t b0, int64_t b1) {
      std::vector<scalar_t> scratch(static_cast<size_t>(n.J * n.D));
      CAPSNET_ISA_CALL(isa, moments_backward_range, pgm, pgv, pw, pV, pm, pgw, pgV, scratch.data(), n, b0, b1);
    });
  });
  return {gw, gV};
}

at::Tensor em_scaled_distance_cpu(const at::Tensor& votes_in, const at::Tensor& mean_in, const at::Tensor& var_in) {
  const auto in = detail::distance_inputs(kDistanceOp, votes_in, mean_in, var_in);
  const auto &V = in.votes, &mean = in.mean, &var = in.variance;
  const Dims n = dims_of(V);
  auto dist = at::empty({n.B, n.I, n.J}, V.options());
  AT_DISPATCH_FLOATING_TYPES(V.scalar_type(), "em_scaled_distance_cpu", [&] {
    const auto *pV = V.data_ptr<scalar_t>(), *pm = mean.data_ptr<scalar_t>(), *ps = var.data_ptr<scalar_t>();
    auto* pd = dist.data_ptr<scalar_t>();
    const CpuIsa isa = selected_isa();
    at::parallel_for(0, n.B, grain(n), [&](int64_t b0, int64_t b1) {
      std::vector<scalar_t> scratch(static_cast<size_t>(n.J * n.D));
      CAPSNET_ISA_CALL(isa, distance_forward_range, pV, pm, ps, pd, scratch.data(), n, b0, b1);
    });
  });
  return dist;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_scaled_distance_backward_cpu(const at::Tensor& grad_distance,
                                                                               const at::Tensor& votes_in,
                                                                               const at::Tensor& mean_in,
                                                                               const at::Tensor& var_in) {
  const auto in = detail::distance_inputs(kDistanceOp, votes_in, mean_in, var_in, &grad_distance);
  const auto &V = in.votes, &mean = in.mean, &var = in.variance, &g = in.grad_distance;
  const Dims n = dims_of(V);
  auto gV = at::empty_like(V), gmean = at::empty_like(mean), gvar = at::empty_like(var);
  AT_DISPATCH_FLOATING_TYPES(V.scalar_type(), "em_scaled_distance_backward_cpu", [&] {
    const auto *pg = g.data_ptr<scalar_t>(), *pV = V.data_ptr<scalar_t>(), *pm = mean.data_ptr<scalar_t>(),
               *ps = var.data_ptr<scalar_t>();
    auto *pgV = gV.data_ptr<scalar_t>(), *pgm = gmean.data_ptr<scalar_t>(), *pgs = gvar.data_ptr<scalar_t>();
    const CpuIsa isa = selected_isa();
    at::parallel_for(0, n.B, grain(n), [&](int64_t b0, int64_t b1) {
      std::vector<scalar_t> scratch(static_cast<size_t>(n.J * n.D));
      CAPSNET_ISA_CALL(isa, distance_backward_range, pg, pV, pm, ps, pgV, pgm, pgs, scratch.data(), n, b0, b1);
    });
  });
  return {gV, gmean, gvar};
}

}  // namespace
}  // namespace capsnet::ops::cpu

TORCH_LIBRARY_IMPL(capsnet, CPU, m) {
  using namespace capsnet::ops::cpu;
  m.impl("em_weighted_moments", &em_weighted_moments_cpu);
  m.impl("_em_weighted_moments_backward", &em_weighted_moments_backward_cpu);
  m.impl("em_scaled_distance", &em_scaled_distance_cpu);
  m.impl("_em_scaled_distance_backward", &em_scaled_distance_backward_cpu);
}
