#pragma once
// Minimal fixed-width SIMD helpers for the CPU kernels: GCC/Clang vector extensions of VB bytes
// (VB = 16: SSE2 / NEON registers, the baseline; VB = 32: AVX registers, used under target("avx2");
// VB = 64: AVX-512 registers, used under target("avx512f")).
// VB must match the ISA the code is generated for: wider generic vectors are lowered through the stack.
// They keep accumulators in registers (plain arrays end up on the stack) and give reductions an
// explicit order (no -ffast-math needed). Other compilers get the scalar loops (CAPSNET_OPS_VEC = 0).

#include <cmath>
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
template <>
struct Vec<float, 64> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct Vec<double, 64> {
  typedef double type __attribute__((vector_size(64)));
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
// Sum of the lanes: wider vectors are folded in halves down to 16 bytes, then summed in lane order.
template <typename T, int VB>
CAPSNET_INLINE T hsum(V<T, VB> v) {
  if constexpr (VB > 16) {
    V<T, VB / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return hsum<T, VB / 2>(lo + hi);
  } else {
    T s = 0;
    for (int64_t l = 0; l < int64_t(VB / sizeof(T)); ++l) s += v[l];
    return s;
  }
}
template <typename T, int VB>
CAPSNET_INLINE V<T, VB> max(V<T, VB> a, V<T, VB> b) {
  return a > b ? a : b;
}

/// exp of every lane. float: Cephes' expf scheme (exp(x) = 2^n exp(g), |g| <= ln2 / 2, degree-6
/// polynomial, within 2 ulp of std::exp on [-87, 88]; inputs below -87 give exp(-87) ~ 1.6e-38, not 0 or a
/// subnormal, which only the softmax uses and where it is negligible against the largest term 1).
/// double: std::exp per lane (the float64 path only runs in tests, where exactness matters more).
template <int VB>
CAPSNET_INLINE V<float, VB> exp(V<float, VB> x) {
  using Vf = V<float, VB>;
  typedef int32_t Vi __attribute__((vector_size(VB)));
  x = x < Vf{} + 88.0f ? x : Vf{} + 88.0f;
  x = x > Vf{} - 87.0f ? x : Vf{} - 87.0f;
  // n = round(x / ln2): adding and subtracting 1.5 * 2^23 rounds to the nearest integer (|x / ln2| < 2^22).
  const Vf magic = Vf{} + 12582912.0f;
  const Vf n = (x * 1.44269504088896341f + magic) - magic;
  const Vf g = x - n * 0.693359375f - n * -2.12194440e-4f;  // x - n ln2, ln2 split in two for exactness
  Vf p = Vf{} + 1.9875691500e-4f;
  p = p * g + 1.3981999507e-3f;
  p = p * g + 8.3334519073e-3f;
  p = p * g + 4.1665795894e-2f;
  p = p * g + 1.6666665459e-1f;
  p = p * g + 5.0000001201e-1f;
  const Vf eg = p * g * g + g + 1.0f;
  const Vi bits = (__builtin_convertvector(n, Vi) + 127) << 23;  // 2^n as a float's bits (n in [-126, 127])
  Vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return eg * two_n;
}
template <int VB>
CAPSNET_INLINE V<double, VB> exp(V<double, VB> x) {
  for (int64_t l = 0; l < int64_t(VB / sizeof(double)); ++l) x[l] = std::exp(x[l]);
  return x;
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
