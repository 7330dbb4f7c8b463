#pragma once
// A 2-D convolution whose backward computes the weight gradient as a *forward* convolution with the
// batch and channel axes swapped. For y = conv2d(x, w) (stride s, padding p, dilation d, groups 1):
//
//   dW[o, c, kh, kw] = sum_{n, i, j} dy[n, o, i, j] * x[n, c, s*i + d*kh - p, s*j + d*kw - p]
//
// which is conv2d(x^T: [C, N, H, W] (batch C, channels N), dy^T: [O, N, P, Q] (O filters of N
// channels), stride d, dilation s) -> [C, O, K, K], transposed back to [O, C, K, K].
// Why: oneDNN's bf16 weight-gradient kernel can run the PrimaryCaps weight gradient (256 -> 256, 9x9,
// stride 2, 20x20 -> 6x6, batch 100) about 2x slower than its forward kernel on the same FLOPs; the
// swapped form runs on that forward kernel (docs/kernels.md, "Batch-swapped weight gradient and
// stride-phase input gradient").
// In fp32 and for few input channels (Conv1: 1) oneDNN's own weight gradient is as fast or faster,
// so kernels::conv2d_at uses this only for bf16 convolutions with many input channels.
//
// The input gradient of a strided convolution likewise, as one forward convolution per stride phase:
// input rows h = s*m + ph receive dy through the kernel taps kh = s*a + ph only, so
//
//   dX[n, c, s*m + ph, s*q + pw] = sum_{o, a, b} dy[n, o, m - a, q - b] * w[o, c, s*a + ph, s*b + pw]
//
// a full (zero-padded) correlation of dy with the phase's sub-kernel, flipped and with in/out swapped.
// Why: oneDNN's backward-data kernel can be markedly slower on PrimaryCaps' input gradient than its
// forward kernel on the four phases together (docs/kernels.md, same section, has the measurements).

#include <torch/torch.h>

namespace capsnet::kernels {

/// Geometry of a 2-D convolution: stride, zero padding and dilation per spatial axis (groups 1).
struct Conv2dGeometry {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
};

/// Bytes of x's transposed copy that conv2d_weight_grad_batch_swapped holds at a time (it goes through the
/// input channels in chunks): bounds that transient and oneDNN's blocked copy of it.
constexpr int64_t kBatchSwappedChunkBytes = int64_t{6} << 20;

/// dL/dw of y = conv2d(x, w) by the batch-swapped forward convolution.
/// dy: [N, O, P, Q]; x: [N, C, H, W] (same dtype); kernel: {K0, K1}. Returns [O, C, K0, K1] in x's dtype.
/// chunk_bytes: at most this many bytes of x's transposed copy at a time (at least one channel).
torch::Tensor conv2d_weight_grad_batch_swapped(const torch::Tensor& dy, const torch::Tensor& x,
                                               std::array<int64_t, 2> kernel, const Conv2dGeometry& geometry,
                                               int64_t chunk_bytes = kBatchSwappedChunkBytes);

/// The reference: dL/dw of the same convolution by ATen's convolution_backward. w: [O, C, K0, K1]
/// (only its shape matters). Returns [O, C, K0, K1].
torch::Tensor conv2d_weight_grad_reference(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w,
                                           const Conv2dGeometry& geometry);

/// dL/dx of y = conv2d(x, w) by one forward convolution per stride phase (dilation 1 only).
/// dy: [N, O, P, Q]; w: [O, C, K0, K1] (same dtype); input_size: {H, W} of x. Returns [N, C, H, W] in dy's dtype.
torch::Tensor conv2d_input_grad_by_phases(const torch::Tensor& dy, const torch::Tensor& w,
                                         std::array<int64_t, 2> input_size, const Conv2dGeometry& geometry);

/// The reference: dL/dx of the same convolution by ATen's convolution_backward. Returns [N, C, H, W].
torch::Tensor conv2d_input_grad_reference(const torch::Tensor& dy, const torch::Tensor& w,
                                          std::array<int64_t, 2> input_size, const Conv2dGeometry& geometry);

/// Which gradients conv2d_with_gradient_paths computes as forward convolutions (the rest: ATen's).
struct ConvGradientPaths {
  bool weight_batch_swapped = false;  ///< dW by conv2d_weight_grad_batch_swapped
  bool input_by_phases = false;       ///< dx by conv2d_input_grad_by_phases (dilation 1)
};

/// y = conv2d(x, w, b) (b may be undefined), differentiable in x, w and b, with the gradients computed
/// as `paths` says. x: [N, C, H, W]; w: [O, C, K0, K1]; b: [O]; all of one dtype. Returns y: [N, O, P, Q].
torch::Tensor conv2d_with_gradient_paths(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                         const Conv2dGeometry& geometry, ConvGradientPaths paths);

/// conv2d_with_gradient_paths with the batch-swapped weight gradient and ATen's input gradient.
torch::Tensor conv2d_batch_swapped(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                   const Conv2dGeometry& geometry);

}  // namespace capsnet::kernels
