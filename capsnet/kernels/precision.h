#pragma once
// Compute precision of the convolutions and the decoder's linear layers.
// bf16 runs those GEMM-shaped layers on oneDNN's bf16 kernels (AVX512_BF16 / AMX) with the weights
// cast per call from their fp32 masters; everything that reduces (squash norms, routing softmax and
// logits, the losses) stays fp32, as published mixed-precision practice asks. Checkpoints hold fp32.
// A library-wide vocabulary type (namespace capsnet): parsed once from text at the edge (options, flags).

#include <torch/torch.h>

#include <string>

namespace capsnet {

enum class Precision { kFloat32, kBFloat16 };

/// "fp32" | "bf16" -> Precision; "auto" -> bf16 where the CPU has native bf16 arithmetic, else fp32.
/// std::invalid_argument naming the option for anything else, and for "bf16" on a CPU without it.
Precision parse_precision(const std::string& name);
std::string precision_name(Precision precision);

/// True when this CPU executes bf16 dot products natively (AVX512_BF16 or AMX-BF16), so that
/// oneDNN's bf16 kernels are faster than fp32 rather than emulated.
bool cpu_has_native_bf16();

/// dtype of the layer inputs and weights under `precision`.
inline torch::ScalarType compute_dtype(Precision precision) {
  return precision == Precision::kBFloat16 ? torch::kBFloat16 : torch::kFloat32;
}

}  // namespace capsnet
