#pragma once
// Linear layers' products on oneDNN's sgemm (gemm.h) rather than ATen's.
//
// Why: a LibTorch built against OpenBLAS runs torch::linear in fp32 on OpenBLAS, which can be several
// times slower than oneDNN's sgemm on the CapsNet decoder's three layers at batch 100 (forward and both
// gradients); docs/kernels.md, "GEMM into strided views on oneDNN sgemm", has the measurements.

#include <torch/torch.h>

namespace capsnet::kernels {

/// y = x w^T + b with autograd (dx = dy w, dw = dy^T x, db = the sum of dy over rows).
/// x: [N, I]; w: [O, I]; b: [O] or undefined -> y: [N, O], all one floating dtype on the CPU. float32 goes
/// to oneDNN's sgemm, float64 to ATen (the tests' reference path).
torch::Tensor linear_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

}  // namespace capsnet::kernels
