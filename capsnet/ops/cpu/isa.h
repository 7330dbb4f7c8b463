#pragma once
// Which instruction-set copy of a CPU kernel runs. Kernels are compiled three times (baseline,
// AVX2+FMA, AVX-512) by wrappers with __attribute__((target(...))) around always_inline templates;
// CAPSNET_ISA_CALL picks the copy that selected_isa() names.

#include "capsnet/ops/routing.h"

namespace capsnet::ops::cpu {

/// The widest copy the CPU runs, capped by ops::set_cpu_isa (read per call: tests switch it).
/// Defined in routing_kernel.cpp.
CpuIsa selected_isa();

}  // namespace capsnet::ops::cpu

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define CAPSNET_HAVE_X86_COPIES 1
#define CAPSNET_ISA_CALL(isa, name, ...)                          \
  ((isa) == CpuIsa::avx512 ? name##_avx512<scalar_t>(__VA_ARGS__) \
   : (isa) == CpuIsa::avx2 ? name##_avx2<scalar_t>(__VA_ARGS__)   \
                           : name##_baseline<scalar_t>(__VA_ARGS__))
#else
#define CAPSNET_HAVE_X86_COPIES 0
#define CAPSNET_ISA_CALL(isa, name, ...) name##_baseline<scalar_t>(__VA_ARGS__)
#endif
