#pragma once
// Fast path of the fused routing kernels (the general ones: routing_kernels.cuh) for the shapes of every
// CapsNet here: parent poses of D = 16 (half a warp), child capsules of Din = 8, at most 16 parents, float
// accumulation (float, half or bfloat16 storage). A lane owns the outputs x = 32 k + lane for the slots
// k < kSlots = ceil(J / 2); the parent of slot k is j = 2 k + lane / 16, so each agreement u_hat_j . a_j
// reduces over one half-warp in four shuffles, and the child's rows of W, its prediction vectors and its
// coupling coefficients stay in registers (the general kernels go through shared memory for each).
// Same passes, same launch structure and same results to rounding as the general kernels; selected by
// routing_cuda.cu (fast_path) and held to the CPU op by tests/ops/test_cuda_ops.py (the model shapes).

#include "capsnet/ops/cuda/routing_kernels.cuh"

namespace capsnet::ops::cuda {

constexpr int kFastD = 16;
constexpr int kFastDin = 8;

__device__ __forceinline__ float half_warp_sum(float v) {
  for (int o = kFastD / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// c[k] = softmax over the parents of uh . a for the lane's slots (a: [JD] in shared memory). Whole warp.
template <int kSlots>
__device__ __forceinline__ void fast_coupling(const float (&uh)[kSlots], const float* a, int JD, int lane,
                                              float (&c)[kSlots]) {
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int x = 32 * k + lane;
    c[k] = half_warp_sum(x < JD ? uh[k] * a[x] : 0.f);
    if (x < JD) m = fmaxf(m, c[k]);
  }
  m = warp_max(m);
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int x = 32 * k + lane;
    c[k] = x < JD ? expf(c[k] - m) : 0.f;
    sum += c[k];
  }
  sum = warp_sum(sum) * (1.f / kFastD);  // each parent's term is held by the 16 lanes of its half-warp
  const float inv = 1.f / sum;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) c[k] *= inv;
}

// gb[k] = c (gc - sum_j c_j gc_j), gc = uh . gs (dL/dc), for the lane's slots. Whole warp.
template <int kSlots>
__device__ __forceinline__ void fast_coupling_grad(const float (&uh)[kSlots], const float* gs, const float (&c)[kSlots],
                                                   int JD, int lane, float (&gb)[kSlots]) {
  float cgc = 0.f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int x = 32 * k + lane;
    gb[k] = half_warp_sum(x < JD ? uh[k] * gs[x] : 0.f);
    cgc += c[k] * gb[k];  // c = 0 past JD
  }
  cgc = warp_sum(cgc) * (1.f / kFastD);
#pragma unroll
  for (int k = 0; k < kSlots; ++k) gb[k] = c[k] * (gb[k] - cgc);
}

// The child's rows of W for the lane's slots: wr[k][q] = W[i, 32 k + lane, q] (0 past JD).
template <typename T, int kSlots>
__device__ __forceinline__ void fast_load_w(const T* w, int64_t i, int JD, int lane, float (&wr)[kSlots][kFastDin]) {
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int x = 32 * k + lane;
#pragma unroll
    for (int q = 0; q < kFastDin; ++q) wr[k][q] = x < JD ? static_cast<float>(w[(i * JD + x) * kFastDin + q]) : 0.f;
  }
}

// u_hat of one (example, child) for the lane's slots, and the child's u in uv.
template <typename T, int kSlots>
__device__ __forceinline__ void fast_predict(const T* ub, const float (&wr)[kSlots][kFastDin], float (&uv)[kFastDin],
                                             float (&uh)[kSlots]) {
#pragma unroll
  for (int q = 0; q < kFastDin; ++q) uv[q] = static_cast<float>(ub[q]);
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < kFastDin; ++q) s += uv[q] * wr[k][q];
    uh[k] = s;
  }
}

// routing_pass_kernel (routing_kernels.cuh) on the fast path: the same parts[b, chunk, x].
// Shared (float): [eb * JD] A rows, [eb * JD] gs rows (grad pass), then per warp [eb * JD] sums.
template <typename T, int kSlots>
__global__ void fast_pass_kernel(const T* u, const T* w, RoutingDims n, int64_t t, bool grad_pass,
                                 const float* a_state, const float* gs_state, int64_t state_stride, int64_t chunk_size,
                                 int64_t eb, float* parts) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  const int JD = static_cast<int>(n.JD);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * eb;
  const int nb = static_cast<int>(n.B - b0 < eb ? n.B - b0 : eb);
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * chunk_size;
  const int64_t i1 = n.I < i0 + chunk_size ? n.I : i0 + chunk_size;
  float* s_a = smem;
  float* s_gs = s_a + eb * JD;
  float* warp_base = s_gs + (grad_pass ? eb * JD : 0);
  float* acc = warp_base + warp * eb * JD;
  const bool uniform = !grad_pass && t == 0;
  for (int e = threadIdx.x; e < nb * JD; e += blockDim.x) {
    const int bb = e / JD, x = e - bb * JD;
    s_a[e] = uniform ? 0.f : a_state[(b0 + bb) * state_stride + x];
    if (grad_pass) s_gs[e] = gs_state[(b0 + bb) * state_stride + x];
  }
  for (int e = lane; e < eb * JD; e += kWarp) acc[e] = 0.f;
  __syncthreads();

  for (int64_t i = i0 + warp; i < i1; i += nwarps) {
    float wr[kSlots][kFastDin];
    fast_load_w<T, kSlots>(w, i, JD, lane, wr);
    for (int bb = 0; bb < nb; ++bb) {
      float uv[kFastDin], uh[kSlots], c[kSlots];
      fast_predict<T, kSlots>(u + ((b0 + bb) * n.I + i) * kFastDin, wr, uv, uh);
      float* acc_b = acc + bb * JD;
      if (uniform) {
#pragma unroll
        for (int k = 0; k < kSlots; ++k)
          if (32 * k + lane < JD) acc_b[32 * k + lane] += uh[k];
        continue;
      }
      fast_coupling<kSlots>(uh, s_a + bb * JD, JD, lane, c);
      if (grad_pass) {
        float gb[kSlots];
        fast_coupling_grad<kSlots>(uh, s_gs + bb * JD, c, JD, lane, gb);
#pragma unroll
        for (int k = 0; k < kSlots; ++k)
          if (32 * k + lane < JD) acc_b[32 * k + lane] += gb[k] * uh[k];
      } else {
#pragma unroll
        for (int k = 0; k < kSlots; ++k)
          if (32 * k + lane < JD) acc_b[32 * k + lane] += c[k] * uh[k];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < nb * JD; e += blockDim.x) {
    float s = 0.f;
    for (int q = 0; q < nwarps; ++q) s += warp_base[q * eb * JD + e];
    const int bb = e / JD;
    parts[((b0 + bb) * gridDim.x + blockIdx.x) * JD + (e - bb * JD)] = s;
  }
}

// child_grad_kernel (routing_kernels.cuh) with weights, on the fast path: du written per (b, i), dW summed
// over the block's examples in shared memory ([Din, JD] per warp) and written to dw_parts[group, i, JD, Din].
// Shared (float): [nt * JD] A rows, [nt * JD] gs rows, then per warp [Din * JD].
template <typename T, int kSlots>
__global__ void fast_child_kernel(const T* u, const T* w, RoutingDims n, bool full, int64_t per_group,
                                  const float* a_all, const float* gs_all, T* grad_u, float* dw_parts) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* smem = reinterpret_cast<float*>(smem_raw);
  const int JD = static_cast<int>(n.JD);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
  const int64_t r = n.r, t_first = full ? 0 : r - 1;
  const int nt = static_cast<int>(r - t_first);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * nwarps + warp;
  const bool active = i < n.I;
  const int64_t b_begin = static_cast<int64_t>(blockIdx.y) * per_group;
  const int64_t b_end = n.B < b_begin + per_group ? n.B : b_begin + per_group;
  float* s_a = smem;
  float* s_gs = s_a + nt * JD;
  float* dw = s_gs + nt * JD + warp * kFastDin * JD;  // [Din, JD]
  for (int e = lane; e < kFastDin * JD; e += kWarp) dw[e] = 0.f;
  float wr[kSlots][kFastDin];
  fast_load_w<T, kSlots>(w, active ? i : 0, JD, lane, wr);
  const float inv_j = 1.f / static_cast<float>(n.J);

  for (int64_t b = b_begin; b < b_end; ++b) {
    __syncthreads();  // every warp is done with the previous example's rows
    for (int e = threadIdx.x; e < nt * JD; e += blockDim.x) {
      const int64_t row = (b * r + t_first) * JD + e;
      s_a[e] = a_all[row];
      s_gs[e] = gs_all[row];
    }
    __syncthreads();
    if (!active) continue;
    float uv[kFastDin], uh[kSlots], gu[kSlots], c[kSlots], gb[kSlots];
    fast_predict<T, kSlots>(u + (b * n.I + i) * kFastDin, wr, uv, uh);
#pragma unroll
    for (int k = 0; k < kSlots; ++k) gu[k] = 0.f;
    for (int tt = 0; tt < nt; ++tt) {
      const float* a = s_a + tt * JD;
      const float* gs = s_gs + tt * JD;
      if (t_first + tt == 0) {  // c = 1/J constant, A^0 = 0
#pragma unroll
        for (int k = 0; k < kSlots; ++k)
          if (32 * k + lane < JD) gu[k] += inv_j * gs[32 * k + lane];
        continue;
      }
      fast_coupling<kSlots>(uh, a, JD, lane, c);
      if (full) {
        fast_coupling_grad<kSlots>(uh, gs, c, JD, lane, gb);
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
          const int x = 32 * k + lane;
          if (x < JD) gu[k] += c[k] * gs[x] + gb[k] * a[x];
        }
      } else {
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
          const int x = 32 * k + lane;
          if (x < JD) gu[k] += c[k] * gs[x];
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int x = 32 * k + lane;
      if (x < JD) {
#pragma unroll
        for (int q = 0; q < kFastDin; ++q) dw[q * JD + x] += gu[k] * uv[q];
      }
    }
    float mine = 0.f;  // du_q = sum_x W[i, x, q] gu_x, lane q keeps its own
#pragma unroll
    for (int q = 0; q < kFastDin; ++q) {
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < kSlots; ++k) s += wr[k][q] * gu[k];
      s = warp_sum(s);
      if (lane == q) mine = s;
    }
    if (lane < kFastDin) grad_u[(b * n.I + i) * kFastDin + lane] = static_cast<T>(mine);
  }
  if (active) {
    __syncwarp();
    float* out = dw_parts + (static_cast<int64_t>(blockIdx.y) * n.I + i) * JD * kFastDin;
    for (int e = lane; e < JD * kFastDin; e += kWarp) out[e] = dw[(e % kFastDin) * JD + e / kFastDin];
  }
}

}  // namespace capsnet::ops::cuda
