#pragma once
// ReLU's backward from one bit per element: where a fused ReLU lets its input go before the backward.

#include <torch/torch.h>

namespace capsnet::kernels {

/// Bit i of the result is 1 where x's i-th element (contiguous order) is not <= 0, as ReLU's backward reads
/// it (threshold_backward: a zero or negative input passes no gradient; a NaN input passes it, as ATen's).
/// x: any shape, float32, float64 or bfloat16, CPU -> [ceil(numel / 8)] uint8. Why: ReLU's backward
/// otherwise keeps its whole output (PrimaryCaps' input, bf16: 20.5 MB; as bits 1.3 MB).
torch::Tensor positive_bits(const torch::Tensor& x);

/// g where the bit is 1, zero elsewhere, in place: ReLU's backward. g: contiguous, float32, float64 or
/// bfloat16, CPU, with numel <= 8 * bits.numel(); bits: positive_bits of a tensor of g's numel.
void keep_where_positive_(torch::Tensor& g, const torch::Tensor& bits);

}  // namespace capsnet::kernels
