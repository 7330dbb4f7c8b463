#pragma once
// Example-lane kernels of capsule_routing (the fused op): one SIMD lane per example, so every inner
// loop of Procedure 1 (predictions, agreements, softmax, weighted sums, their gradients) is a plain
// vector multiply-add over L = VB / sizeof(T) examples at once, with no horizontal reduction except
// for dW (a sum over examples). The fused op's default for every batch, with vectors as narrow as the
// batch allows (routing_kernel.cpp, lane_bytes). Only routing_kernel.cpp
// includes this file: the bodies are always_inline and generated inside its per-ISA wrappers.
//
// Layouts (T = float or double; nblk = ceil(B / L); lane l of block q is example q * L + l, lanes past
// B hold zeros: u = 0 gives u_hat = 0, s = 0, v = 0 and contributes exactly 0 to every gradient):
//   w      [I, J*D, Din]        W as stored ([I, J, D, Din]): the Din weights of output x of child i
//   ul     [nblk, I, Din, L]    u in lanes
//   sl     [nblk, r, J*D, L]    s^t in lanes (backward input, packed from s_all)
//   al     [nblk, r, J*D, L]    A^t = sum_{t'<t} squash(s^t')    (backward scratch)
//   gsl    [nblk, r, J*D, L]    dL/ds^t                          (backward scratch)
//   gvl    [nblk, J*D, L]       dL/dv in lanes
//   gul    [nblk, I, Din, L]    dL/du in lanes (backward output, unpacked by the caller)
//   grad_w [I, J*D, Din]        dL/dW, the layout of W
// The math is the per-example kernels' (derivation in docs/kernels.md); the summation order differs in
// places (dot products in four partial sums, exp by polynomial), so the two agree to rounding; the
// tests hold both to the float64 oracle.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "capsnet/ops/cpu/vec.h"
#include "capsnet/ops/routing.h"  // kSquashEps

namespace capsnet::ops::cpu::lanes {

#if CAPSNET_OPS_VEC

struct LaneDims {
  int64_t B, I, J, D, Din, r;
  int64_t JD() const { return J * D; }
};

// Per-thread scratch of Vt vectors, aligned to the vector size (std::vector<T> is only aligned to T).
template <typename T, int VB>
class Scratch {
 public:
  using Vt = vec::V<T, VB>;
  explicit Scratch(int64_t vectors) : storage_((vectors + 1) * kLanes) {}
  Vt* data() {
    auto p = reinterpret_cast<std::uintptr_t>(storage_.data());
    return reinterpret_cast<Vt*>((p + VB - 1) / VB * VB);
  }

 private:
  static constexpr int64_t kLanes = VB / sizeof(T);
  std::vector<T> storage_;
};

// DIN: the number of child dimensions Din when known at compile time (8 in every CapsNet here, so the loops over k
// unroll and their accumulators stay in registers), 0 when only known at run time.
template <int DIN>
CAPSNET_INLINE int64_t child_dims(int64_t Din) {
  return DIN > 0 ? DIN : Din;
}

// uh[x] (+)= sum_k w_i[x, k] u_i[k] for x < JD: u_hat_{.|i} of the block's L examples. Eight outputs at a time so eight
// independent FMA chains hide the FMA latency; the sum over k runs in order, as in the per-example kernel.
template <typename T, int VB, int DIN, bool Accumulate>
CAPSNET_INLINE void predict_child(const T* __restrict__ w_i, const vec::V<T, VB>* __restrict__ u_i, int64_t JD,
                                  int64_t Din_runtime, vec::V<T, VB>* __restrict__ uh) {
  using Vt = vec::V<T, VB>;
  const int64_t Din = child_dims<DIN>(Din_runtime);
  int64_t x = 0;
  for (; x + 8 <= JD; x += 8) {
    Vt a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
    const T* w = w_i + x * Din;
    for (int64_t k = 0; k < Din; ++k) {
      const Vt uk = u_i[k];
      a0 += w[0 * Din + k] * uk;
      a1 += w[1 * Din + k] * uk;
      a2 += w[2 * Din + k] * uk;
      a3 += w[3 * Din + k] * uk;
      a4 += w[4 * Din + k] * uk;
      a5 += w[5 * Din + k] * uk;
      a6 += w[6 * Din + k] * uk;
      a7 += w[7 * Din + k] * uk;
    }
    if (Accumulate) {
      uh[x] += a0, uh[x + 1] += a1, uh[x + 2] += a2, uh[x + 3] += a3;
      uh[x + 4] += a4, uh[x + 5] += a5, uh[x + 6] += a6, uh[x + 7] += a7;
    } else {
      uh[x] = a0, uh[x + 1] = a1, uh[x + 2] = a2, uh[x + 3] = a3;
      uh[x + 4] = a4, uh[x + 5] = a5, uh[x + 6] = a6, uh[x + 7] = a7;
    }
  }
  for (; x < JD; ++x) {
    Vt a{};
    for (int64_t k = 0; k < Din; ++k) a += w_i[x * Din + k] * u_i[k];
    uh[x] = Accumulate ? uh[x] + a : a;
  }
}

// sum_d x[d] y[d] per lane, d < D, in four interleaved partial sums: a single chain of D dependent FMAs was the
// forward's hottest instruction (FMA latency, not throughput).
template <typename T, int VB>
CAPSNET_INLINE vec::V<T, VB> dot_lanes(const vec::V<T, VB>* __restrict__ x, const vec::V<T, VB>* __restrict__ y,
                                       int64_t D) {
  using Vt = vec::V<T, VB>;
  Vt a0{}, a1{}, a2{}, a3{};
  int64_t d = 0;
  for (; d + 4 <= D; d += 4) {
    a0 += x[d] * y[d];
    a1 += x[d + 1] * y[d + 1];
    a2 += x[d + 2] * y[d + 2];
    a3 += x[d + 3] * y[d + 3];
  }
  for (; d < D; ++d) a0 += x[d] * y[d];
  return (a0 + a1) + (a2 + a3);
}

// c[j] = softmax_j(uh_j . a_j) per lane; uh, a: [J, D]. Max-subtracted like at::softmax.
template <typename T, int VB>
CAPSNET_INLINE void coupling(const vec::V<T, VB>* uh, const vec::V<T, VB>* a, int64_t J, int64_t D, vec::V<T, VB>* c) {
  using Vt = vec::V<T, VB>;
  for (int64_t j = 0; j < J; ++j) c[j] = dot_lanes<T, VB>(uh + j * D, a + j * D, D);
  Vt m = c[0];
  for (int64_t j = 1; j < J; ++j) m = vec::max<T, VB>(m, c[j]);
  Vt sum{};
  for (int64_t j = 0; j < J; ++j) {
    c[j] = vec::exp<VB>(c[j] - m);
    sum += c[j];
  }
  const Vt inv = T(1) / sum;
  for (int64_t j = 0; j < J; ++j) c[j] *= inv;
}

// v = squash(s) per lane: v_j = s_j (n / (1 + n)) / sqrt(n + eps), n = |s_j|^2 (capsnet::squash).
template <typename T, int VB>
CAPSNET_INLINE void squash_forward(const vec::V<T, VB>* s, int64_t J, int64_t D, vec::V<T, VB>* v) {
  using Vt = vec::V<T, VB>;
  constexpr int64_t L = VB / sizeof(T);
  for (int64_t j = 0; j < J; ++j) {
    Vt n{};
    for (int64_t d = 0; d < D; ++d) n += s[j * D + d] * s[j * D + d];
    Vt scale{};
    for (int64_t l = 0; l < L; ++l) scale[l] = (n[l] / (1 + n[l])) / std::sqrt(n[l] + T(kSquashEps));
    for (int64_t d = 0; d < D; ++d) v[j * D + d] = s[j * D + d] * scale;
  }
}

// gs = dL/ds given gv = dL/dv (the per-example kernel's squash_backward, per lane).
template <typename T, int VB>
CAPSNET_INLINE void squash_backward(const vec::V<T, VB>* s, const vec::V<T, VB>* gv, int64_t J, int64_t D,
                                    vec::V<T, VB>* gs) {
  using Vt = vec::V<T, VB>;
  constexpr int64_t L = VB / sizeof(T);
  const T eps = T(kSquashEps);
  for (int64_t j = 0; j < J; ++j) {
    Vt n{}, sg{};
    for (int64_t d = 0; d < D; ++d) {
      n += s[j * D + d] * s[j * D + d];
      sg += s[j * D + d] * gv[j * D + d];
    }
    Vt g{}, k{};
    for (int64_t l = 0; l < L; ++l) {
      const T q = std::sqrt(n[l] + eps);
      g[l] = n[l] / ((1 + n[l]) * q);
      const T gprime = (n[l] + 2 * eps - n[l] * n[l]) / (2 * q * q * q * (1 + n[l]) * (1 + n[l]));
      k[l] = 2 * gprime * sg[l];
    }
    for (int64_t d = 0; d < D; ++d) gs[j * D + d] = g * gv[j * D + d] + k * s[j * D + d];
  }
}

// Children per chunk of the forward's sum over i. Each (block, chunk) pair is one parallel task: with
// several chunks per block a single example (B = 1) keeps both cores busy and B = 100 (7 blocks) splits
// evenly. Partial sums are added in chunk order, so the summation order of s never depends on the
// batch size or the thread count.
constexpr int64_t kChildChunk = 128;

inline int64_t child_chunks(int64_t I) { return (I + kChildChunk - 1) / kChildChunk; }

// Forward, iteration t, tasks [task_begin, task_end) of (block q, chunk k) = (task / nchunk, task % nchunk):
// parts[q, k] = sum over the chunk's children of c^t_ij u_hat_ij (t = 0: of u_hat_ij, c = 1/J applied in
// forward_finish). a: [nblk, J*D] A^t per block; parts: [nblk, nchunk, J*D].
// uh_cache: [nblk, I, J*D, L] or null. When given, iteration 0 stores every u_hat_{.|i} there and later
// iterations read it instead of recomputing it: the same values (predict_child is deterministic), so the
// outputs are bit-identical with or without it; the caller gives one only when it is small (small batches).
template <typename T, int VB, int DIN>
CAPSNET_INLINE void forward_chunks(const T* w, const T* ul, const LaneDims& n, int64_t t, int64_t task_begin,
                                   int64_t task_end, const T* a, T* parts, T* uh_cache) {
  using Vt = vec::V<T, VB>;
  const int64_t JD = n.JD(), J = n.J, D = n.D, Din = child_dims<DIN>(n.Din), nchunk = child_chunks(n.I);
  Scratch<T, VB> scratch(JD + J);
  Vt* const uh = scratch.data();  // u_hat_{.|i}
  Vt* const c = uh + JD;          // c^t_i
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t q = task / nchunk, k = task % nchunk;
    const Vt* uq = reinterpret_cast<const Vt*>(ul) + q * n.I * Din;
    const Vt* aq = reinterpret_cast<const Vt*>(a) + q * JD;
    Vt* s = reinterpret_cast<Vt*>(parts) + task * JD;
    std::fill(s, s + JD, Vt{});
    for (int64_t i = k * kChildChunk; i < std::min(n.I, (k + 1) * kChildChunk); ++i) {
      const T* w_i = w + i * JD * Din;
      Vt* const cached = uh_cache ? reinterpret_cast<Vt*>(uh_cache) + (q * n.I + i) * JD : nullptr;
      if (t == 0) {  // c_ij = 1/J: sum the predictions, scale once in forward_finish
        if (cached) {
          predict_child<T, VB, DIN, false>(w_i, uq + i * Din, JD, Din, cached);
          for (int64_t x = 0; x < JD; ++x) s[x] += cached[x];
        } else {
          predict_child<T, VB, DIN, true>(w_i, uq + i * Din, JD, Din, s);
        }
        continue;
      }
      const Vt* uh_i = cached;
      if (!cached) {
        predict_child<T, VB, DIN, false>(w_i, uq + i * Din, JD, Din, uh);
        uh_i = uh;
      }
      coupling<T, VB>(uh_i, aq, J, D, c);
      for (int64_t j = 0; j < J; ++j)
        for (int64_t d = 0; d < D; ++d) s[j * D + d] += c[j] * uh_i[j * D + d];
    }
  }
}

// Forward, end of iteration t for blocks [q_begin, q_end): s^t = the chunks' partial sums in chunk order
// (scaled by 1/J when t = 0), v^t = squash(s^t), A^(t+1) = A^t + v^t; writes s_all [B, r, J*D] and, for
// t = r-1, v [B, J*D] for the block's real examples.
template <typename T, int VB>
CAPSNET_INLINE void forward_finish(const LaneDims& n, int64_t t, int64_t q_begin, int64_t q_end, const T* parts, T* a,
                                   T* s_all, T* v) {
  using Vt = vec::V<T, VB>;
  constexpr int64_t L = VB / sizeof(T);
  const int64_t JD = n.JD(), J = n.J, D = n.D, r = n.r, nchunk = child_chunks(n.I);
  Scratch<T, VB> scratch(2 * JD);
  Vt* const s = scratch.data();
  Vt* const vt = s + JD;
  for (int64_t q = q_begin; q < q_end; ++q) {
    const Vt* pq = reinterpret_cast<const Vt*>(parts) + q * nchunk * JD;
    std::copy(pq, pq + JD, s);
    for (int64_t k = 1; k < nchunk; ++k)
      for (int64_t x = 0; x < JD; ++x) s[x] += pq[k * JD + x];
    if (t == 0)
      for (int64_t x = 0; x < JD; ++x) s[x] *= T(1) / T(J);
    squash_forward<T, VB>(s, J, D, vt);
    Vt* aq = reinterpret_cast<Vt*>(a) + q * JD;
    for (int64_t x = 0; x < JD; ++x) aq[x] += vt[x];
    for (int64_t l = 0; l < std::min(L, n.B - q * L); ++l) {
      const int64_t b = q * L + l;
      T* st = s_all + (b * r + t) * JD;
      for (int64_t x = 0; x < JD; ++x) st[x] = s[x][l];
      if (t + 1 == r)
        for (int64_t x = 0; x < JD; ++x) v[b * JD + x] = vt[x][l];
    }
  }
}

// Backward phase 1 for blocks [q_begin, q_end): A^t and gs^t = dL/ds^t of every iteration (one pass over the children
// per t = r-1..1 in full mode, none with grad_through_routing = false).
template <typename T, int VB, int DIN>
CAPSNET_INLINE void state_blocks(const T* w, const T* ul, const LaneDims& n, bool full, int64_t q_begin, int64_t q_end,
                                 const T* gvl, const T* sl, T* al, T* gsl) {
  using Vt = vec::V<T, VB>;
  const int64_t JD = n.JD(), J = n.J, D = n.D, r = n.r, Din = child_dims<DIN>(n.Din);
  Scratch<T, VB> scratch(4 * JD + 2 * J);
  Vt* const g_later = scratch.data();  // G^t = sum_{t'>t} dL/dA^t'
  Vt* const ga = g_later + JD;         // dL/dA^t
  Vt* const uh = ga + JD;
  Vt* const gv = uh + JD;
  Vt* const c = gv + JD;
  Vt* const gc = c + J;
  for (int64_t q = q_begin; q < q_end; ++q) {
    const Vt* uq = reinterpret_cast<const Vt*>(ul) + q * n.I * Din;
    const Vt* gvq = reinterpret_cast<const Vt*>(gvl) + q * JD;
    const Vt* sq = reinterpret_cast<const Vt*>(sl) + q * r * JD;
    Vt* aq = reinterpret_cast<Vt*>(al) + q * r * JD;
    Vt* gsq = reinterpret_cast<Vt*>(gsl) + q * r * JD;
    std::fill(aq, aq + JD, Vt{});  // A^0 = 0
    for (int64_t t = 1; t < r; ++t) {
      squash_forward<T, VB>(sq + (t - 1) * JD, J, D, gv);
      for (int64_t x = 0; x < JD; ++x) aq[t * JD + x] = aq[(t - 1) * JD + x] + gv[x];
    }
    if (!full) {
      squash_backward<T, VB>(sq + (r - 1) * JD, gvq, J, D, gsq + (r - 1) * JD);
      continue;
    }
    std::fill(g_later, g_later + JD, Vt{});
    for (int64_t t = r - 1; t >= 0; --t) {
      for (int64_t x = 0; x < JD; ++x) gv[x] = t + 1 == r ? g_later[x] + gvq[x] : g_later[x];
      squash_backward<T, VB>(sq + t * JD, gv, J, D, gsq + t * JD);
      if (t == 0) break;  // A^0 = 0 is a constant: nothing flows further back
      std::fill(ga, ga + JD, Vt{});
      const Vt* gs = gsq + t * JD;
      for (int64_t i = 0; i < n.I; ++i) {
        predict_child<T, VB, DIN, false>(w + i * JD * Din, uq + i * Din, JD, Din, uh);
        coupling<T, VB>(uh, aq + t * JD, J, D, c);
        Vt cgc{};                          // sum_k c_ik gc_ik
        for (int64_t j = 0; j < J; ++j) {  // gc_ij = dL/dc_ij = u_hat_ij . gs_j
          gc[j] = dot_lanes<T, VB>(uh + j * D, gs + j * D, D);
          cgc += c[j] * gc[j];
        }
        for (int64_t j = 0; j < J; ++j) {
          const Vt gb = c[j] * (gc[j] - cgc);  // dL/db_ij through the softmax
          for (int64_t d = 0; d < D; ++d) ga[j * D + d] += gb * uh[j * D + d];
        }
      }
      for (int64_t x = 0; x < JD; ++x) g_later[x] += ga[x];
    }
  }
}

// gu = dL/du_hat_{.|i} = sum_t c^t_i gs^t + gb^t_i A^t for the block's lanes (only t = r-1 and no gb term when
// grad_through_routing = false). aq, gsq: [r, J*D] of the block.
template <typename T, int VB>
CAPSNET_INLINE void grad_prediction(const vec::V<T, VB>* uh, const vec::V<T, VB>* aq, const vec::V<T, VB>* gsq,
                                    const LaneDims& n, bool full, vec::V<T, VB>* c, vec::V<T, VB>* gc,
                                    vec::V<T, VB>* gu) {
  using Vt = vec::V<T, VB>;
  const int64_t JD = n.JD(), J = n.J, D = n.D, r = n.r;
  std::fill(gu, gu + JD, Vt{});
  for (int64_t t = full ? 0 : r - 1; t < r; ++t) {
    const Vt* gs = gsq + t * JD;
    const Vt* a = aq + t * JD;
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
    Vt cgc{};
    for (int64_t j = 0; j < J; ++j) {
      gc[j] = dot_lanes<T, VB>(uh + j * D, gs + j * D, D);
      cgc += c[j] * gc[j];
    }
    for (int64_t j = 0; j < J; ++j) {
      const Vt cj = c[j], gb = c[j] * (gc[j] - cgc);
      for (int64_t d = 0; d < D; ++d) gu[j * D + d] += cj * gs[j * D + d] + gb * a[j * D + d];
    }
  }
}

// du[k] = sum_x w_i[x, k] gu[x] for k < Din: dL/du_i of the block's lanes (one pass over gu, Din accumulators).
template <typename T, int VB, int DIN>
CAPSNET_INLINE void child_input_grad(const T* __restrict__ w_i, const vec::V<T, VB>* __restrict__ gu, int64_t JD,
                                     int64_t Din_runtime, vec::V<T, VB>* __restrict__ du) {
  using Vt = vec::V<T, VB>;
  if constexpr (DIN > 0) {
    Vt acc[DIN] = {};
    for (int64_t x = 0; x < JD; ++x) {
      const Vt g = gu[x];
      for (int64_t k = 0; k < DIN; ++k) acc[k] += w_i[x * DIN + k] * g;
    }
    for (int64_t k = 0; k < DIN; ++k) du[k] = acc[k];
  } else {
    std::fill(du, du + Din_runtime, Vt{});
    for (int64_t x = 0; x < JD; ++x)
      for (int64_t k = 0; k < Din_runtime; ++k) du[k] += w_i[x * Din_runtime + k] * gu[x];
  }
}

// gw[x, k] = sum over the examples of gu[x] u[k] = sum_q hsum(gu_all[q][x] * u_q[k]): dW_i, summed over the blocks in
// order, then over the lanes. Two outputs x at a time share the loads of u.
template <typename T, int VB, int DIN>
CAPSNET_INLINE void child_weight_grad(const vec::V<T, VB>* __restrict__ gu_all, const vec::V<T, VB>* __restrict__ u_i,
                                      int64_t u_block_stride, int64_t nblk, int64_t JD, int64_t Din_runtime,
                                      T* __restrict__ gw) {
  using Vt = vec::V<T, VB>;
  const int64_t Din = child_dims<DIN>(Din_runtime);
  int64_t x = 0;
  if constexpr (DIN > 0) {
    for (; x + 2 <= JD; x += 2) {
      Vt a0[DIN] = {}, a1[DIN] = {};
      for (int64_t q = 0; q < nblk; ++q) {
        const Vt g0 = gu_all[q * JD + x], g1 = gu_all[q * JD + x + 1];
        const Vt* u = u_i + q * u_block_stride;
        for (int64_t k = 0; k < DIN; ++k) {
          a0[k] += g0 * u[k];
          a1[k] += g1 * u[k];
        }
      }
      for (int64_t k = 0; k < DIN; ++k) {
        gw[x * DIN + k] = vec::hsum<T, VB>(a0[k]);
        gw[(x + 1) * DIN + k] = vec::hsum<T, VB>(a1[k]);
      }
    }
  }
  for (; x < JD; ++x)
    for (int64_t k = 0; k < Din; ++k) {
      Vt sum{};
      for (int64_t q = 0; q < nblk; ++q) sum += gu_all[q * JD + x] * u_i[q * u_block_stride + k];
      gw[x * Din + k] = vec::hsum<T, VB>(sum);
    }
}

// Backward phase 2 for children [i_begin, i_end): per child, per block, recompute u_hat_i and gu_hat_i, then du_i =
// W_i^T gu_hat_i (lanes) and dW_i = sum over examples of gu_hat_i (x) u_i. Parallel over i: every thread owns its rows
// of dW and of du, and each element is summed in a fixed order (blocks in order, then lanes), so results do not depend
// on the thread count.
template <typename T, int VB, int DIN>
CAPSNET_INLINE void weight_grad_children(const T* w, const T* ul, const LaneDims& n, bool full, int64_t i_begin,
                                         int64_t i_end, const T* al, const T* gsl, T* gul, T* grad_w) {
  using Vt = vec::V<T, VB>;
  constexpr int64_t L = VB / sizeof(T);
  const int64_t JD = n.JD(), J = n.J, r = n.r, Din = child_dims<DIN>(n.Din), nblk = (n.B + L - 1) / L;
  Scratch<T, VB> scratch(JD + 2 * J + nblk * JD);
  Vt* const uh = scratch.data();
  Vt* const c = uh + JD;
  Vt* const gc = c + J;
  Vt* const gu_all = gc + J;  // [nblk, J*D]: gu_hat_i of every block, for dW_i
  const Vt* u_lanes = reinterpret_cast<const Vt*>(ul);
  Vt* gu_lanes = reinterpret_cast<Vt*>(gul);
  for (int64_t i = i_begin; i < i_end; ++i) {
    const T* w_i = w + i * JD * Din;
    for (int64_t q = 0; q < nblk; ++q) {
      const Vt* ui = u_lanes + (q * n.I + i) * Din;
      predict_child<T, VB, DIN, false>(w_i, ui, JD, Din, uh);
      Vt* gu = gu_all + q * JD;
      grad_prediction<T, VB>(uh, reinterpret_cast<const Vt*>(al) + q * r * JD,
                             reinterpret_cast<const Vt*>(gsl) + q * r * JD, n, full, c, gc, gu);
      child_input_grad<T, VB, DIN>(w_i, gu, JD, Din, gu_lanes + (q * n.I + i) * Din);
    }
    child_weight_grad<T, VB, DIN>(gu_all, u_lanes + i * Din, n.I * Din, nblk, JD, Din, grad_w + i * JD * Din);
  }
}

#endif  // CAPSNET_OPS_VEC

}  // namespace capsnet::ops::cpu::lanes
