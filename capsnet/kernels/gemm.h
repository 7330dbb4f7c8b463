#pragma once
// Matrix products into strided views, by oneDNN's sgemm for fp32.
//
// Why: a LibTorch built against OpenBLAS runs torch::mm / bmm in fp32 on OpenBLAS, whose kernels can reach
// well under half the rate of oneDNN's sgemm (the libdnnl LibTorch itself links) on the spectral
// convolution's per-frequency products ([100, 256] x [256, 256]); docs/kernels.md, "GEMM into strided
// views on oneDNN sgemm", has the measurements. bf16 operands go to oneDNN's matmul
// primitive (fp32 accumulation, out in fp32 or bf16). Other dtypes (float64 references and gradchecks) use ATen.

#include <torch/torch.h>

namespace capsnet::kernels {

/// out = alpha * a @ b + beta * out, for 2-D views a: [M, K], b: [K, N], out: [M, N] of one dtype, or
/// bfloat16 a and b with a float32 out. Each of a and b must be row- or column-major (one stride 1); out
/// row-major (stride 1 on its last axis).
/// beta = 0 ignores out's contents (NaN included).
void gemm_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha = 1.0,
               double beta = 0.0);

/// The same product per leading index: a: [F..., M, K], b: [F..., K, N], out: [F..., M, N] with one or more
/// leading batch axes of any strides (each matrix as above); a batch axis of a or b may have size 1, broadcast
/// over out's. bf16 operands: one oneDNN matmul over all of them.
void batched_gemm_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha = 1.0,
                       double beta = 0.0);

}  // namespace capsnet::kernels
