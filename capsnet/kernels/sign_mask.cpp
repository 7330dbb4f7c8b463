#include "capsnet/kernels/sign_mask.h"

#include "capsnet/ops/cpu/isa.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>

#if CAPSNET_HAVE_X86_COPIES
#include <immintrin.h>
#endif

namespace capsnet::kernels {
namespace {

// Elements per parallel task (a multiple of 16: whole 16-bit words of the mask per task).
constexpr int64_t kGrain = int64_t{1} << 16;

// The portable copies: one element at a time, without branches on the data (the signs are random: a
// branch per element measured 15-21 ms for PrimaryCaps' 10M elements).
template <typename T>
void bits_baseline(const T* in, uint8_t* out, int64_t begin, int64_t end) {  // begin: a multiple of 8
  for (int64_t byte = begin / 8; byte < (end + 7) / 8; ++byte) {
    uint8_t b = 0;
    for (int64_t k = 0; k < 8 && byte * 8 + k < end; ++k)
      b |= static_cast<uint8_t>(!(static_cast<float>(in[byte * 8 + k]) <= 0.0f)) << k;  // NaN: 1
    out[byte] = b;
  }
}

// The masking on the values' bits: AND with all ones or all zeros (+0.0, as threshold_backward writes).
template <typename T>
void keep_baseline(T* g, const uint8_t* bits, int64_t begin, int64_t end) {
  using U = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(U) == sizeof(T));
  for (int64_t i = begin; i < end; ++i) {
    U v;
    std::memcpy(&v, g + i, sizeof(U));
    v &= U(0) - static_cast<U>((bits[i / 8] >> (i % 8)) & 1);
    std::memcpy(g + i, &v, sizeof(U));
  }
}

#if CAPSNET_HAVE_X86_COPIES
// AVX-512F, 16 elements per step: one compare gives a 16-bit mask, which is the two bytes of bits for
// them (bit k = element k: little endian). bf16 is widened to fp32 exactly (its 16 bits on top).
__attribute__((target("avx512f"))) __m512 load16_avx512(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) __m512 load16_avx512(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
__attribute__((target("avx512f"))) void bits_avx512(const T* in, uint8_t* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = _mm512_cmp_ps_mask(load16_avx512(in + i), _mm512_setzero_ps(), _CMP_NLE_UQ);  // NaN: 1
    std::memcpy(out + i / 8, &m, 2);
  }
}

__attribute__((target("avx512f"))) void keep16_avx512(float* g, __mmask16 m) {
  _mm512_storeu_ps(g, _mm512_maskz_mov_ps(m, _mm512_loadu_ps(g)));
}
__attribute__((target("avx512f"))) void keep16_avx512(c10::BFloat16* g, __mmask16 m) {
  auto* p = reinterpret_cast<__m256i*>(g);
  const __m512i w = _mm512_maskz_mov_epi32(m, _mm512_cvtepu16_epi32(_mm256_loadu_si256(p)));
  _mm256_storeu_si256(p, _mm512_cvtepi32_epi16(w));
}

template <typename T>
__attribute__((target("avx512f"))) void keep_avx512(T* g, const uint8_t* bits, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 16) {
    __mmask16 m;
    std::memcpy(&m, bits + i / 8, 2);
    keep16_avx512(g + i, m);
  }
}
#endif

template <typename T>
constexpr bool kHasAvx512Copy = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// body(begin, end) over [0, whole) (a multiple of 16) in parallel, split at whole 16-element words only.
template <typename F>
void parallel_words(int64_t whole, const F& body) {
  at::parallel_for(0, whole, kGrain, [&](int64_t begin, int64_t end) {
    body(begin / 16 * 16, end == whole ? whole : end / 16 * 16);  // parallel_for splits anywhere
  });
}

}  // namespace

torch::Tensor positive_bits(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu() && !x_in.is_mkldnn(), "positive_bits: a dense CPU tensor, got ", x_in.device());
  const auto x = x_in.contiguous();
  const int64_t n = x.numel(), whole = n / 16 * 16;
  auto bits = torch::empty({(n + 7) / 8}, torch::TensorOptions().dtype(torch::kUInt8));
  uint8_t* out = bits.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "positive_bits", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    parallel_words(whole, [&](int64_t begin, int64_t end) {
#if CAPSNET_HAVE_X86_COPIES
      if constexpr (kHasAvx512Copy<scalar_t>) {
        if (ops::cpu::selected_isa() == ops::CpuIsa::avx512) return bits_avx512(in, out, begin, end);
      }
#endif
      bits_baseline(in, out, begin, end);
    });
    bits_baseline(in, out, whole, n);  // the tail: fewer than 16 elements
  });
  return bits;
}

void keep_where_positive_(torch::Tensor& g, const torch::Tensor& bits) {
  TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && !g.is_mkldnn(),
              "keep_where_positive_: g must be a contiguous dense CPU tensor");
  TORCH_CHECK(bits.scalar_type() == torch::kUInt8 && bits.dim() == 1 && bits.is_contiguous() &&
                  bits.numel() == (g.numel() + 7) / 8,
              "keep_where_positive_: bits must be positive_bits of a tensor of g's size (", (g.numel() + 7) / 8,
              " bytes), got ", bits.sizes(), " ", bits.scalar_type());
  const int64_t n = g.numel(), whole = n / 16 * 16;
  const uint8_t* in = bits.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, g.scalar_type(), "keep_where_positive_", [&] {
    scalar_t* out = g.data_ptr<scalar_t>();
    parallel_words(whole, [&](int64_t begin, int64_t end) {
#if CAPSNET_HAVE_X86_COPIES
      if constexpr (kHasAvx512Copy<scalar_t>) {
        if (ops::cpu::selected_isa() == ops::CpuIsa::avx512) return keep_avx512(out, in, begin, end);
      }
#endif
      keep_baseline(out, in, begin, end);
    });
    keep_baseline(out, in, whole, n);  // the tail
  });
}

}  // namespace capsnet::kernels
