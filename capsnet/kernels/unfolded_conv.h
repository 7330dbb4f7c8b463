#pragma once
// Convolution as one matrix product per image over the input's patches (im2col), for training layers with
// little reduction depth: Conv1 of the CapsNet (1 input channel, 9 x 9 kernel: 81 multiply-adds per output).
//
// Why: on such a layer oneDNN's direct kernels run in its blocked layouts, so a training step pays for two
// reorders of the 20 MB (bf16) output beside the convolutions themselves, and its bf16 kernels reach a
// third of the bf16 GEMM rate (docs/kernels.md, "Conv1 as one product per image"). Here the patches are
// gathered by one strided copy (6.6 MB at batch 100), and again, a chunk of images at a time, for the weight
// gradient; the bias is one more column of the weight against a row of ones in the patches, so the bias
// gradient comes out of the weight gradient's product, and the output is written in NCHW directly.

#include <torch/torch.h>

#include <array>

namespace capsnet::kernels {

/// Bytes of patches and per-image weight-gradient products the backward holds at once (a chunk of images).
constexpr int64_t kUnfoldedChunkBytes = 4 << 20;

/// conv2d(x, w, b, stride, padding) (dilation 1, groups 1) with autograd, the products on gemm.h.
/// x: [N, C, H, W] in the compute dtype (bfloat16, float32 or float64); w: [O, C, k0, k1] and b: [O] (or
/// undefined) in their master dtype (float32 for a bf16 x, else x's), cast to x's dtype for the products
/// -> y: [N, O, P, Q] in x's dtype, P = (H + 2 p0 - k0) / s0 + 1. Gradients: dw and db summed in fp32 (in
/// float64 for float64) and returned in the master dtype; dx (only where x needs one) in x's dtype.
/// Double backward is refused.
torch::Tensor conv2d_unfolded(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);

/// x's patches with a row of ones for the bias: [N, K (+ 1), P * Q], K = C k0 k1 ordered (c, i, j) like
/// w's flattening, the patch axis ordered (p, q). The reference the tests check conv2d_unfolded's gather
/// against is at::im2col.
torch::Tensor unfolded_patches(const torch::Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                               std::array<int64_t, 2> padding, bool ones_row);

}  // namespace capsnet::kernels
