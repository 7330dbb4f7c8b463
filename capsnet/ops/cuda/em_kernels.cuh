#pragma once
// CUDA device code of EM routing's vote passes (host side: em_cuda.cu; the operators' contract: ../em.h;
// CPU kernels: ../cpu/em_kernel.cpp). Templates over the storage type T and the accumulation type A.
// Layouts (contiguous): weights [B, I, J], votes V [B, I, J, D], mean / variance [B, J, D],
// distance [B, I, J]. One thread per output element, grid-stride loops; the sums over children run
// in a fixed order per thread (no atomics). Kept free of ATen and CUDA headers (scripts/check_cuda_syntax.sh).

#include <cstdint>

namespace capsnet::ops::cuda {

struct EmDims {
  int64_t B, I, J, D;
};

#define CAPSNET_GRID_STRIDE(e, count) \
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < (count); \
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)

// mean_jd = sum_i w_ij V_ijd, variance_jd = sum_i w_ij (V_ijd - mean_jd)^2; a thread per (b, j, d).
template <typename T, typename A>
__global__ void em_moments_kernel(EmDims n, const T* w, const T* V, T* mean, T* var) {
  const int64_t JD = n.J * n.D;
  CAPSNET_GRID_STRIDE(e, n.B * JD) {
    const int64_t b = e / JD, jd = e % JD, j = jd / n.D;
    A m = 0;
    for (int64_t i = 0; i < n.I; ++i)
      m += static_cast<A>(w[(b * n.I + i) * n.J + j]) * static_cast<A>(V[(b * n.I + i) * JD + jd]);
    A s = 0;
    for (int64_t i = 0; i < n.I; ++i) {
      const A d = static_cast<A>(V[(b * n.I + i) * JD + jd]) - m;
      s += static_cast<A>(w[(b * n.I + i) * n.J + j]) * d * d;
    }
    mean[e] = static_cast<T>(m);
    var[e] = static_cast<T>(s);
  }
}

// Backward of the moments, step 1 (a thread per (b, j, d)): the mean's total gradient
// g1_jd = grad_mean_jd - 2 grad_var_jd mean_jd (1 - sum_i w_ij) (the variance depends on the mean).
template <typename T, typename A>
__global__ void em_moments_grad_mean_kernel(EmDims n, const T* gm, const T* gv, const T* w, const T* mean, A* g1) {
  const int64_t JD = n.J * n.D;
  CAPSNET_GRID_STRIDE(e, n.B * JD) {
    const int64_t b = e / JD, j = (e % JD) / n.D;
    A total = 0;
    for (int64_t i = 0; i < n.I; ++i) total += static_cast<A>(w[(b * n.I + i) * n.J + j]);
    g1[e] = static_cast<A>(gm[e]) - A(2) * static_cast<A>(gv[e]) * static_cast<A>(mean[e]) * (A(1) - total);
  }
}

// Step 2 (a thread per (b, i, j)): grad_w_ij = sum_d g1_jd V_ijd + gv_jd (V_ijd - mean_jd)^2,
// grad_V_ijd = w_ij (g1_jd + 2 gv_jd (V_ijd - mean_jd)).
template <typename T, typename A>
__global__ void em_moments_grad_kernel(EmDims n, const A* g1, const T* gv, const T* w, const T* V, const T* mean,
                                       T* gw, T* gV) {
  const int64_t IJ = n.I * n.J;
  CAPSNET_GRID_STRIDE(e, n.B * IJ) {
    const int64_t b = e / IJ, j = e % n.J;
    const A wij = static_cast<A>(w[e]);
    const int64_t row = (b * n.J + j) * n.D;
    A acc = 0;
    for (int64_t d = 0; d < n.D; ++d) {
      const A v = static_cast<A>(V[e * n.D + d]);
      const A diff = v - static_cast<A>(mean[row + d]);
      const A g2 = static_cast<A>(gv[row + d]);
      acc += g1[row + d] * v + g2 * diff * diff;
      gV[e * n.D + d] = static_cast<T>(wij * (g1[row + d] + A(2) * g2 * diff));
    }
    gw[e] = static_cast<T>(acc);
  }
}

// distance_ij = sum_d (V_ijd - mean_jd)^2 / variance_jd; a thread per (b, i, j).
template <typename T, typename A>
__global__ void em_distance_kernel(EmDims n, const T* V, const T* mean, const T* var, T* dist) {
  const int64_t IJ = n.I * n.J;
  CAPSNET_GRID_STRIDE(e, n.B * IJ) {
    const int64_t b = e / IJ, j = e % n.J;
    const int64_t row = (b * n.J + j) * n.D;
    A acc = 0;
    for (int64_t d = 0; d < n.D; ++d) {
      const A diff = static_cast<A>(V[e * n.D + d]) - static_cast<A>(mean[row + d]);
      acc += diff * diff * (A(1) / static_cast<A>(var[row + d]));
    }
    dist[e] = static_cast<T>(acc);
  }
}

// Backward of the distance, votes (a thread per (b, i, j)): grad_V_ijd = 2 g_ij (V_ijd - mean_jd) / var_jd.
template <typename T, typename A>
__global__ void em_distance_grad_votes_kernel(EmDims n, const T* g, const T* V, const T* mean, const T* var, T* gV) {
  const int64_t IJ = n.I * n.J;
  CAPSNET_GRID_STRIDE(e, n.B * IJ) {
    const int64_t b = e / IJ, j = e % n.J;
    const int64_t row = (b * n.J + j) * n.D;
    const A gij = static_cast<A>(g[e]);
    for (int64_t d = 0; d < n.D; ++d) {
      const A es = (static_cast<A>(V[e * n.D + d]) - static_cast<A>(mean[row + d])) *
                   (A(1) / static_cast<A>(var[row + d]));
      gV[e * n.D + d] = static_cast<T>(A(2) * gij * es);
    }
  }
}

// Backward of the distance, mean and variance (a thread per (b, j, d)):
// grad_mean_jd = -sum_i 2 g_ij e_ijd, grad_var_jd = -sum_i g_ij e_ijd^2 with e = (V - mean) / var.
template <typename T, typename A>
__global__ void em_distance_grad_moments_kernel(EmDims n, const T* g, const T* V, const T* mean, const T* var,
                                                T* gmean, T* gvar) {
  const int64_t JD = n.J * n.D;
  CAPSNET_GRID_STRIDE(e, n.B * JD) {
    const int64_t b = e / JD, jd = e % JD, j = jd / n.D;
    const A m = static_cast<A>(mean[e]), inv = A(1) / static_cast<A>(var[e]);
    A gm = 0, gs = 0;
    for (int64_t i = 0; i < n.I; ++i) {
      const A gij = static_cast<A>(g[(b * n.I + i) * n.J + j]);
      const A es = (static_cast<A>(V[(b * n.I + i) * JD + jd]) - m) * inv;
      gm -= A(2) * gij * es;
      gs -= gij * es * es;
    }
    gmean[e] = static_cast<T>(gm);
    gvar[e] = static_cast<T>(gs);
  }
}

#undef CAPSNET_GRID_STRIDE

}  // namespace capsnet::ops::cuda
