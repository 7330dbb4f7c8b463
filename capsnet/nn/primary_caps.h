#pragma once
#include <torch/torch.h>

#include "capsnet/kernels/conv_dispatch.h"

namespace capsnet::nn {

struct PrimaryCapsOptions {
  PrimaryCapsOptions(int64_t in_channels, int64_t capsule_types, int64_t capsule_dim)
      : in_channels_(in_channels), capsule_types_(capsule_types), capsule_dim_(capsule_dim) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, capsule_types);  // 32 in the paper
  TORCH_ARG(int64_t, capsule_dim);    // 8
  TORCH_ARG(int64_t, kernel_size) = 9;
  TORCH_ARG(int64_t, stride) = 2;
  /// s = output_scale * (W * x + b), then squash. 1 in the paper's text; the authors' code computes the layer as
  /// one routing iteration over the capsule types, which divides the convolution by their number (1/32).
  TORCH_ARG(double, output_scale) = 1.0;
};

/// PrimaryCaps: one convolution with capsule_types * capsule_dim channels, regrouped into
/// capsule_dim-vectors (atoms last, *then* flattened), scaled by output_scale and squashed.
/// x: [B, in_channels, H, W] (dense, or blocked from a previous blocked convolution) -> u: [B, capsule_types * H' * W', capsule_dim], order (type, y, x).
class PrimaryCapsImpl : public torch::nn::Cloneable<PrimaryCapsImpl> {
 public:
  explicit PrimaryCapsImpl(const PrimaryCapsOptions& options);
  void reset() override;
  /// relu_input: squash(conv(relu(x))) (the CapsNet's Conv1 -> ReLU), the ReLU fused into the convolution
  /// where kernels::conv2d_at can (kernels/conv_dispatch.h): less memory held for the backward.
  /// x by value: a moved-in x is let go inside the convolution where it can (kernels::conv2d_at).
  torch::Tensor forward(torch::Tensor x, Precision precision = Precision::kFloat32, bool relu_input = false);
  /// Makes ahead what an inference forward on an x of x_sizes [B, C, H, W] keeps (kernels::prepare_conv2d_at), so
  /// that a caller can make it before x exists.
  void prepare(torch::IntArrayRef x_sizes, Precision precision);

  PrimaryCapsOptions options;
  torch::nn::Conv2d conv{nullptr};
  /// conv's weights in oneDNN's blocked layout, for forward passes without autograd (kernels/blocked_conv.h).
  kernels::BlockedConvWeights blocked_conv;
};
TORCH_MODULE(PrimaryCaps);

}  // namespace capsnet::nn
