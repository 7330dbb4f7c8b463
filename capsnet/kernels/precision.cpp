#include "capsnet/kernels/precision.h"

#include <cpuid.h>
#include <fmt/format.h>

#include <stdexcept>

namespace capsnet {

bool cpu_has_native_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const bool avx512f = ebx & (1u << 16), amx_bf16 = edx & (1u << 22);
  __cpuid_count(7, 1, eax, ebx, ecx, edx);
  const bool avx512_bf16 = eax & (1u << 5);
  return (avx512f && avx512_bf16) || amx_bf16;
#else
  return false;
#endif
}

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::kFloat32;
  if (name == "auto") return cpu_has_native_bf16() ? Precision::kBFloat16 : Precision::kFloat32;
  if (name == "bf16") {
    if (!cpu_has_native_bf16())
      throw std::invalid_argument(
          "precision bf16: this CPU has no native bf16 arithmetic (AVX512_BF16 or AMX); use fp32 or auto");
    return Precision::kBFloat16;
  }
  throw std::invalid_argument(fmt::format("precision must be fp32, bf16 or auto, got '{}'", name));
}

std::string precision_name(Precision precision) { return precision == Precision::kBFloat16 ? "bf16" : "fp32"; }

}  // namespace capsnet
