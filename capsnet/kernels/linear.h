#pragma once
// Linear layers' products on oneDNN's sgemm (gemm.h) rather than ATen's.
//
// Why: LibTorch 1.13's torch::linear in fp32 runs on OpenBLAS, whose kernels on these CPUs (with the
// OPENBLAS_CORETYPE=Haswell this machine's environment presets) took 8.9-27 ms for the CapsNet decoder's
// three layers at batch 100 (forward and both gradients), oneDNN's sgemm 2.8 ms (docs/kernels.md,
// "GEMM into strided views on oneDNN sgemm").

#include <torch/torch.h>

namespace capsnet::kernels {

/// y = x w^T + b with autograd (dx = dy w, dw = dy^T x, db = the sum of dy over rows).
/// x: [N, I]; w: [O, I]; b: [O] or undefined -> y: [N, O], all one floating dtype on the CPU. float32 goes
/// to oneDNN's sgemm, float64 to ATen (the tests' reference path).
torch::Tensor linear_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

}  // namespace capsnet::kernels
