// The precisions a CPU test runs in: fp32 always, bf16 where this CPU computes it natively (elsewhere ATen
// emulates it, too slowly for the suite, and the kernels under test take their fp32 forms anyway).
#pragma once
#include <torch/torch.h>

#include <vector>

#include "capsnet/kernels/precision.h"

namespace capsnet::testing {

/// Precision::kFloat32, then Precision::kBFloat16 where cpu_has_native_bf16().
inline std::vector<Precision> cpu_precisions() {
  std::vector<Precision> p{Precision::kFloat32};
  if (cpu_has_native_bf16()) p.push_back(Precision::kBFloat16);
  return p;
}

/// `always` (e.g. {kDouble, kFloat}), then torch::kBFloat16 where cpu_has_native_bf16().
inline std::vector<torch::ScalarType> with_native_bf16(std::vector<torch::ScalarType> always) {
  if (cpu_has_native_bf16()) always.push_back(torch::kBFloat16);
  return always;
}

}  // namespace capsnet::testing
