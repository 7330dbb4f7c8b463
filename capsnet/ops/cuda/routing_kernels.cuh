#pragma once
// CUDA device code of the fused routing operators (host side: routing_cuda.cu). Templates over the
// storage type T (float, double, c10::Half, c10::BFloat16) and the accumulation type A (float, or double
// for double): every sum, the coupling softmax and the routing state run in A, values are read as T.
// Same mathematics and the same order of the steps as the CPU kernels (../cpu/routing_kernel.cpp,
// derivation in docs/kernels.md); only the order of the sums over children differs.
//
// Layouts (contiguous; JD = J * D):
//   u      [B, I, Din]   W [I, J, D, Din] = [I, JD, Din]   u_hat [B, I, JD] (stored variant only)
//   s_all  [B, r, JD] (A)   a_all / gs_all [B, r, JD] (A, backward scratch: A^t and dL/ds^t)
//   parts  [B, nchunk, JD] (A): per chunk of children, the partial sums over i of one pass
// Like the CPU op, the fused forward never materialises u_hat: every pass recomputes u_hat_{.|i} of the
// (example, child) it works on into a per-warp buffer of JD values in shared memory.
//
// Work split: a warp handles one (example, child) pair at a time, its lanes over the JD outputs; a
// block is a group of examples x a chunk of children (the warps' rows of W stay in L1 across the
// examples of the group). Partial sums go through per-warp shared accumulators and a fixed-order
// reduction, so results do not depend on timing (no atomics).
//
// Kept free of ATen and CUDA headers so that scripts/check_cuda_syntax.sh can check it with clang on
// machines without nvcc.

#include <cstdint>

namespace capsnet::ops::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;

struct RoutingDims {
  int64_t B, I, J, D, Din, r, JD;
};

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float sqrt_acc(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrt_acc(double x) { return sqrt(x); }

template <typename A>
__device__ __forceinline__ A warp_sum(A v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
template <typename A>
__device__ __forceinline__ A warp_max(A v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const A other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// u_hat_{x|i} of example b recomputed from u and W (x = j * D + d).
template <typename T, typename A>
struct WeightPredictor {
  const T* u;  // [B, I, Din]
  const T* w;  // [I, JD, Din]
  int64_t I, JD, Din;
  __device__ __forceinline__ A operator()(int64_t b, int64_t i, int64_t x) const {
    const T* ub = u + (b * I + i) * Din;
    const T* wx = w + (i * JD + x) * Din;
    A acc = 0;
    for (int64_t k = 0; k < Din; ++k) acc += static_cast<A>(ub[k]) * static_cast<A>(wx[k]);
    return acc;
  }
};

// u_hat_{x|i} of example b read from a stored u_hat [B, I, JD].
template <typename T, typename A>
struct StoredPredictor {
  const T* u_hat;
  int64_t I, JD;
  __device__ __forceinline__ A operator()(int64_t b, int64_t i, int64_t x) const {
    return static_cast<A>(u_hat[(b * I + i) * JD + x]);
  }
};

// c[j] = softmax_j(uh_j . a_j) (max-subtracted); uh, a: [J, D] and c: [J] in shared memory. Whole warp.
template <typename A>
__device__ void warp_coupling(const A* uh, const A* a, int64_t J, int64_t D, A* c, int lane) {
  A m = -static_cast<A>(INFINITY);
  for (int64_t j = lane; j < J; j += kWarp) {
    A l = 0;
    for (int64_t d = 0; d < D; ++d) l += uh[j * D + d] * a[j * D + d];
    c[j] = l;
    m = l > m ? l : m;
  }
  m = warp_max(m);
  A sum = 0;
  for (int64_t j = lane; j < J; j += kWarp) {
    const A e = exp_acc(c[j] - m);
    c[j] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  const A inv = A(1) / sum;
  for (int64_t j = lane; j < J; j += kWarp) c[j] *= inv;
  __syncwarp();
}

// gb[j] = dL/db_ij = c_j (gc_j - sum_k c_k gc_k) with gc_j = uh_j . gs_j (dL/dc_ij). Whole warp.
template <typename A>
__device__ void warp_coupling_grad(const A* uh, const A* gs, const A* c, int64_t J, int64_t D, A* gb, int lane) {
  A cgc = 0;
  for (int64_t j = lane; j < J; j += kWarp) {
    A g = 0;
    for (int64_t d = 0; d < D; ++d) g += uh[j * D + d] * gs[j * D + d];
    gb[j] = g;
    cgc += c[j] * g;
  }
  cgc = warp_sum(cgc);
  for (int64_t j = lane; j < J; j += kWarp) gb[j] = c[j] * (gb[j] - cgc);
  __syncwarp();
}

// ---------------------------------------------------------------------------------------------------
// One pass over the children: parts[b, chunk, x] = sum_{i in chunk} k_ij u_hat_{x|i} with
//   forward (grad_pass = false): k = c^t_ij (A^t in `a_state`), k = 1 at t = 0 (1/J applied by the finish);
//   backward (grad_pass = true): k = gb^t_ij (A^t in `a_state`, dL/ds^t in `gs_state`): parts sum to dL/dA^t.
// State rows of example b: a_state + b * state_stride (and gs_state likewise).
// grid (nchunk, ceil(B / eb)); block: warps of 32 threads; dynamic shared memory (A):
//   [eb * JD] A rows, [eb * JD] gs rows (grad pass), then per warp [JD] uh, [J] c, [J] gb, [eb * JD] sums.
template <typename T, typename A, typename Pred>
__global__ void routing_pass_kernel(Pred pred, RoutingDims n, int64_t t, bool grad_pass, const A* a_state,
                                    const A* gs_state, int64_t state_stride, int64_t chunk_size, int64_t eb,
                                    A* parts) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* smem = reinterpret_cast<A*>(smem_raw);
  const int64_t JD = n.JD, J = n.J, D = n.D;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * eb;
  const int64_t nb = n.B - b0 < eb ? n.B - b0 : eb;
  const int64_t nchunk = gridDim.x;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * chunk_size;
  const int64_t i1 = n.I < i0 + chunk_size ? n.I : i0 + chunk_size;

  A* s_a = smem;
  A* s_gs = s_a + eb * JD;
  const int64_t per_warp = JD + 2 * J + eb * JD;
  A* warp_base = s_gs + (grad_pass ? eb * JD : 0);
  A* uh = warp_base + warp * per_warp;
  A* c = uh + JD;
  A* gb = c + J;
  A* acc = gb + J;

  const bool uniform = !grad_pass && t == 0;  // b = 0: c_ij = 1/J
  for (int64_t e = threadIdx.x; e < nb * JD; e += blockDim.x) {
    const int64_t bb = e / JD, x = e % JD;
    s_a[e] = uniform ? A(0) : a_state[(b0 + bb) * state_stride + x];
    if (grad_pass) s_gs[e] = gs_state[(b0 + bb) * state_stride + x];
  }
  for (int64_t e = lane; e < eb * JD; e += kWarp) acc[e] = 0;
  __syncthreads();

  for (int64_t i = i0 + warp; i < i1; i += nwarps) {
    for (int64_t bb = 0; bb < nb; ++bb) {
      for (int64_t x = lane; x < JD; x += kWarp) uh[x] = pred(b0 + bb, i, x);
      __syncwarp();
      A* acc_b = acc + bb * JD;
      if (uniform) {
        for (int64_t x = lane; x < JD; x += kWarp) acc_b[x] += uh[x];
      } else {
        warp_coupling(uh, s_a + bb * JD, J, D, c, lane);
        if (grad_pass) {
          warp_coupling_grad(uh, s_gs + bb * JD, c, J, D, gb, lane);
          for (int64_t x = lane; x < JD; x += kWarp) acc_b[x] += gb[x / D] * uh[x];
        } else {
          for (int64_t x = lane; x < JD; x += kWarp) acc_b[x] += c[x / D] * uh[x];
        }
      }
      __syncwarp();  // uh, c, gb are rewritten by the next pair
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < nb * JD; e += blockDim.x) {
    A s = 0;
    for (int w = 0; w < nwarps; ++w) s += warp_base[w * per_warp + JD + 2 * J + e];
    parts[((b0 + e / JD) * nchunk + blockIdx.x) * JD + e % JD] = s;
  }
}

// v_j = s_j * (|s_j|^2 / (1 + |s_j|^2)) / sqrt(|s_j|^2 + eps) for the rows of one example, by a block:
// scale[j] (shared) <- the factor; callers multiply. s: [JD] (shared or global).
template <typename A>
__device__ void block_squash_scale(const A* s, int64_t J, int64_t D, A eps, A* scale) {
  for (int64_t j = threadIdx.x; j < J; j += blockDim.x) {
    A nrm = 0;
    for (int64_t d = 0; d < D; ++d) nrm += s[j * D + d] * s[j * D + d];
    scale[j] = (nrm / (1 + nrm)) / sqrt_acc(nrm + eps);
  }
}

// gs = dL/ds for v = squash(s) given gv = dL/dv (one example, by a block): gs = g gv + 2 g'(n) (s . gv) s with
// g = n / ((1 + n) q), q = sqrt(n + eps), g' = (n + 2 eps - n^2) / (2 q^3 (1 + n)^2). coef: [2 J] shared.
template <typename A, typename G>
__device__ void block_squash_backward(const A* s, const G* gv, int64_t J, int64_t D, A eps, A* coef, A* gs) {
  for (int64_t j = threadIdx.x; j < J; j += blockDim.x) {
    A nrm = 0, sg = 0;
    for (int64_t d = 0; d < D; ++d) {
      nrm += s[j * D + d] * s[j * D + d];
      sg += s[j * D + d] * static_cast<A>(gv[j * D + d]);
    }
    const A q = sqrt_acc(nrm + eps);
    const A g = nrm / ((1 + nrm) * q);
    const A gprime = (nrm + 2 * eps - nrm * nrm) / (2 * q * q * q * (1 + nrm) * (1 + nrm));
    coef[2 * j] = g;
    coef[2 * j + 1] = 2 * gprime * sg;
  }
  __syncthreads();
  for (int64_t x = threadIdx.x; x < J * D; x += blockDim.x) {
    const int64_t j = x / D;
    gs[x] = coef[2 * j] * static_cast<A>(gv[x]) + coef[2 * j + 1] * s[x];
  }
}

// Forward, end of iteration t (grid B, one block per example): s^t = sum over chunks (x 1/J at t = 0),
// stored in s_all; v^t = squash(s^t); A += v^t, or v written at the last iteration.
// Shared: [JD] s, [J] scale.
template <typename T, typename A>
__global__ void forward_finish_kernel(RoutingDims n, int64_t t, int64_t nchunk, A eps, const A* parts, A* a_run,
                                      A* s_all, T* v) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* s = reinterpret_cast<A*>(smem_raw);
  A* scale = s + n.JD;
  const int64_t b = blockIdx.x, JD = n.JD;
  const A k = t == 0 ? A(1) / static_cast<A>(n.J) : A(1);
  for (int64_t x = threadIdx.x; x < JD; x += blockDim.x) {
    A sum = 0;
    for (int64_t ch = 0; ch < nchunk; ++ch) sum += parts[(b * nchunk + ch) * JD + x];
    s[x] = sum * k;
    s_all[(b * n.r + t) * JD + x] = s[x];
  }
  __syncthreads();
  block_squash_scale(s, n.J, n.D, eps, scale);
  __syncthreads();
  const bool last = t + 1 == n.r;
  for (int64_t x = threadIdx.x; x < JD; x += blockDim.x) {
    const A vx = s[x] * scale[x / n.D];
    if (last)
      v[b * JD + x] = static_cast<T>(vx);
    else
      a_run[b * JD + x] += vx;
  }
}

// Backward phase 1 start (one block per example): A^t for every t (A^0 = 0, A^t = A^(t-1) + squash(s^(t-1)))
// and gs^(r-1) = squash'(s^(r-1))^T grad_v. Shared: [J] scale, [2 J] coef.
template <typename T, typename A>
__global__ void backward_init_kernel(RoutingDims n, A eps, const A* s_all, const T* grad_v, A* a_all, A* gs_all) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* scale = reinterpret_cast<A*>(smem_raw);
  A* coef = scale + n.J;
  const int64_t b = blockIdx.x, JD = n.JD, r = n.r;
  for (int64_t x = threadIdx.x; x < JD; x += blockDim.x) a_all[b * r * JD + x] = 0;
  for (int64_t t = 1; t < r; ++t) {
    const A* s = s_all + (b * r + t - 1) * JD;
    block_squash_scale(s, n.J, n.D, eps, scale);
    __syncthreads();
    A* a = a_all + (b * r + t) * JD;
    for (int64_t x = threadIdx.x; x < JD; x += blockDim.x) a[x] = a[x - JD] + s[x] * scale[x / n.D];
    __syncthreads();
  }
  block_squash_backward(s_all + (b * r + r - 1) * JD, grad_v + b * JD, n.J, n.D, eps, coef,
                        gs_all + (b * r + r - 1) * JD);
}

// Backward phase 1 step after the pass at iteration t >= 1 (one block per example): G += dL/dA^t (the
// chunks' sum), then gs^(t-1) = squash'(s^(t-1))^T G. G: [B, JD]. Shared: [2 J] coef.
template <typename A>
__global__ void backward_step_kernel(RoutingDims n, int64_t t, int64_t nchunk, A eps, const A* parts, A* g_later,
                                     const A* s_all, A* gs_all) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* coef = reinterpret_cast<A*>(smem_raw);
  const int64_t b = blockIdx.x, JD = n.JD, r = n.r;
  A* g = g_later + b * JD;
  for (int64_t x = threadIdx.x; x < JD; x += blockDim.x) {
    A sum = 0;
    for (int64_t ch = 0; ch < nchunk; ++ch) sum += parts[(b * nchunk + ch) * JD + x];
    g[x] += sum;
  }
  __syncthreads();
  block_squash_backward(s_all + (b * r + t - 1) * JD, static_cast<const A*>(g), n.J, n.D, eps, coef,
                        gs_all + (b * r + t - 1) * JD);
}

// Backward phase 2: per (example b, child i) gu = dL/du_hat_{.|i} = sum_t c^t_i * gs^t + gb^t_i * A^t
// (t = r-1 only and no gb term when !full). With weights (fused op): dW_i += gu (x) u_bi accumulated in
// shared memory over the block's examples and written to dw_parts[group, i, JD, Din]; du_bi = W_i^T gu.
// Without (stored u_hat): grad_u_hat[b, i, :] = gu.
// grid (ceil(I / warps), groups); block: warps, one child per warp; examples [group * per_group, ...).
// Shared (A): [nt * JD] A rows, [nt * JD] gs rows of the current example (nt = iterations used), then per
// warp [JD] uh, [JD] gu, [J] c, [J] gb and, with weights, [Din * JD] dW (k-major).
template <typename T, typename A, typename Pred, bool kWeights>
__global__ void child_grad_kernel(Pred pred, RoutingDims n, bool full, int64_t per_group, const A* a_all,
                                  const A* gs_all, T* grad_u, A* dw_parts, T* grad_u_hat) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* smem = reinterpret_cast<A*>(smem_raw);
  const int64_t JD = n.JD, J = n.J, D = n.D, Din = n.Din, r = n.r;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  const int64_t t_first = full ? 0 : r - 1, nt = r - t_first;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * nwarps + warp;
  const bool active = i < n.I;
  const int64_t b_begin = static_cast<int64_t>(blockIdx.y) * per_group;
  const int64_t b_end = n.B < b_begin + per_group ? n.B : b_begin + per_group;

  A* s_a = smem;
  A* s_gs = s_a + nt * JD;
  const int64_t per_warp = 2 * JD + 2 * J + (kWeights ? Din * JD : 0);
  A* uh = s_gs + nt * JD + warp * per_warp;
  A* gu = uh + JD;
  A* c = gu + JD;
  A* gb = c + J;
  A* dw = gb + J;  // [Din, JD], with weights only
  if constexpr (kWeights) {
    for (int64_t e = lane; e < Din * JD; e += kWarp) dw[e] = 0;
  }
  const A inv_j = A(1) / static_cast<A>(J);

  for (int64_t b = b_begin; b < b_end; ++b) {
    __syncthreads();  // every warp is done with the previous example's rows
    for (int64_t e = threadIdx.x; e < nt * JD; e += blockDim.x) {
      const int64_t row = (b * r + t_first) * JD + e;
      s_a[e] = a_all[row];
      s_gs[e] = gs_all[row];
    }
    __syncthreads();
    if (!active) continue;
    for (int64_t x = lane; x < JD; x += kWarp) {
      uh[x] = pred(b, i, x);
      gu[x] = 0;
    }
    __syncwarp();
    for (int64_t tt = 0; tt < nt; ++tt) {
      const int64_t t = t_first + tt;
      const A* a = s_a + tt * JD;
      const A* gs = s_gs + tt * JD;
      if (t == 0) {  // c = 1/J constant, A^0 = 0
        for (int64_t x = lane; x < JD; x += kWarp) gu[x] += inv_j * gs[x];
        continue;
      }
      warp_coupling(uh, a, J, D, c, lane);
      if (full) {
        warp_coupling_grad(uh, gs, c, J, D, gb, lane);
        for (int64_t x = lane; x < JD; x += kWarp) gu[x] += c[x / D] * gs[x] + gb[x / D] * a[x];
      } else {
        for (int64_t x = lane; x < JD; x += kWarp) gu[x] += c[x / D] * gs[x];
      }
      __syncwarp();  // c, gb are rewritten by the next iteration
    }
    if constexpr (kWeights) {
      const T* ub = pred.u + (b * n.I + i) * Din;
      const T* wi = pred.w + i * JD * Din;
      for (int64_t x = lane; x < JD; x += kWarp)
        for (int64_t k = 0; k < Din; ++k) dw[k * JD + x] += gu[x] * static_cast<A>(ub[k]);
      for (int64_t k = 0; k < Din; ++k) {
        A p = 0;
        for (int64_t x = lane; x < JD; x += kWarp) p += static_cast<A>(wi[x * Din + k]) * gu[x];
        p = warp_sum(p);
        if (lane == 0) grad_u[(b * n.I + i) * Din + k] = static_cast<T>(p);
      }
    } else {
      for (int64_t x = lane; x < JD; x += kWarp) grad_u_hat[(b * n.I + i) * JD + x] = static_cast<T>(gu[x]);
    }
    __syncwarp();
  }
  if constexpr (kWeights) {
    if (active) {
      __syncwarp();
      A* out = dw_parts + (static_cast<int64_t>(blockIdx.y) * n.I + i) * JD * Din;
      for (int64_t e = lane; e < JD * Din; e += kWarp) out[e] = dw[(e % Din) * JD + e / Din];
    }
  }
}

}  // namespace capsnet::ops::cuda
