#pragma once
// Minimal fixed-width SIMD helpers for the CPU kernels: GCC/Clang vector extensions of VB bytes
// (VB = 16: SSE2 / NEON registers, the baseline; VB = 32: AVX registers, used under target("avx2")).
// VB must match the ISA the code is generated for: wider generic vectors are lowered through the stack.
// They keep accumulators in registers (plain arrays end up on the stack) and give reductions an
// explicit order (no -ffast-math needed). Other compilers get the scalar loops (CAPSNET_OPS_VEC = 0).

#include <cstdint>
#include <cstring>

#if defined(__GNUC__)
#define CAPSNET_INLINE inline __attribute__((always_inline))
#define CAPSNET_OPS_VEC 1
#else
#define CAPSNET_INLINE inline
#define CAPSNET_OPS_VEC 0
#endif

#if CAPSNET_OPS_VEC && !defined(__clang__)
// 32-byte vectors are passed by value only between always_inline functions generated inside AVX2 code;
// GCC's note that their calling convention differs without AVX does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace capsnet::ops::cpu::vec {

#if CAPSNET_OPS_VEC
template <typename T, int VB>
struct Vec;
template <>
struct Vec<float, 16> {
  typedef float type __attribute__((vector_size(16)));
};
template <>
struct Vec<double, 16> {
  typedef double type __attribute__((vector_size(16)));
};
template <>
struct Vec<float, 32> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct Vec<double, 32> {
  typedef double type __attribute__((vector_size(32)));
};
template <typename T, int VB>
using V = typename Vec<T, VB>::type;

template <typename T, int VB>
CAPSNET_INLINE V<T, VB> load(const T* p) {
  V<T, VB> v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}
template <typename T, int VB>
CAPSNET_INLINE void store(T* p, V<T, VB> v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename T, int VB>
CAPSNET_INLINE V<T, VB> splat(T x) {
  return V<T, VB>{} + x;
}
template <typename T, int VB>
CAPSNET_INLINE T hsum(V<T, VB> v) {
  T s = 0;
  for (int64_t l = 0; l < int64_t(VB / sizeof(T)); ++l) s += v[l];
  return s;
}
#endif

/// sum_x a[x] b[x].
template <typename T, int VB>
CAPSNET_INLINE T dot(const T* a, const T* b, int64_t n) {
  int64_t x = 0;
  T sum = 0;
#if CAPSNET_OPS_VEC
  constexpr int64_t L = VB / sizeof(T);
  using Vt = V<T, VB>;
  Vt acc0{}, acc1{};
  for (; x + 2 * L <= n; x += 2 * L) {
    acc0 += load<T, VB>(a + x) * load<T, VB>(b + x);
    acc1 += load<T, VB>(a + x + L) * load<T, VB>(b + x + L);
  }
  if (x + L <= n) {
    acc0 += load<T, VB>(a + x) * load<T, VB>(b + x);
    x += L;
  }
  sum = hsum<T, VB>(acc0 + acc1);
#endif
  for (; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

/// out[0, n) = sum_k coef[k] * rows[k * stride + :] for k < m: a small [1, m] x [m, n] product with the
/// n outputs accumulated in registers (4 vectors at a time) over all k before they are stored.
template <typename T, int VB>
CAPSNET_INLINE void combine_rows(const T* coef, const T* rows, int64_t m, int64_t stride, int64_t n, T* out) {
  int64_t x = 0;
#if CAPSNET_OPS_VEC
  constexpr int64_t L = VB / sizeof(T);
  using Vt = V<T, VB>;
  for (; x + 4 * L <= n; x += 4 * L) {
    Vt a0{}, a1{}, a2{}, a3{};
    for (int64_t k = 0; k < m; ++k) {
      const Vt ck = splat<T, VB>(coef[k]);
      const T* r = rows + k * stride + x;
      a0 += ck * load<T, VB>(r);
      a1 += ck * load<T, VB>(r + L);
      a2 += ck * load<T, VB>(r + 2 * L);
      a3 += ck * load<T, VB>(r + 3 * L);
    }
    store<T, VB>(out + x, a0);
    store<T, VB>(out + x + L, a1);
    store<T, VB>(out + x + 2 * L, a2);
    store<T, VB>(out + x + 3 * L, a3);
  }
  for (; x + L <= n; x += L) {
    Vt a0{};
    for (int64_t k = 0; k < m; ++k) a0 += splat<T, VB>(coef[k]) * load<T, VB>(rows + k * stride + x);
    store<T, VB>(out + x, a0);
  }
#endif
  for (; x < n; ++x) {
    T acc = 0;
    for (int64_t k = 0; k < m; ++k) acc += coef[k] * rows[k * stride + x];
    out[x] = acc;
  }
}

}  // namespace capsnet::ops::cpu::vec

#if CAPSNET_OPS_VEC && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
