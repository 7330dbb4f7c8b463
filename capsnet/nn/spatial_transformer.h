#pragma once
// Spatial transformer (Jaderberg et al., 2015, "Spatial Transformer Networks"): a localization net
// predicts an affine map theta per image (Eq. 1), the grid generator maps every output pixel to a
// source position (Eq. 1: (x_s, y_s) = theta * (x_t, y_t, 1)), and a bilinear sampler reads the input
// there (Eq. 5), reading 0 outside the image. Everything is differentiable w.r.t. the input and theta,
// so the module trains end to end in front of any classifier.
//
// Coordinates (as torch's affine_grid / grid_sample with align_corners = false): x (column) and y (row)
// are normalised to [-1, 1] where -1 and +1 are the OUTER EDGES of the border pixels, so pixel j of a
// W-wide image has its centre at (2j + 1) / W - 1. We pick align_corners = false because it makes theta
// independent of the image resolution (a translation of t moves the image by t * W / 2 pixels whatever
// the size, and an output of a different size covers the same region); with align_corners = true the
// corner pixel centres are pinned to +-1 and theta's meaning changes with W. The identity theta
// reproduces the input exactly under both conventions.

#include <torch/torch.h>

#include <cstdint>

namespace capsnet::nn {

/// Options of SpatialTransformer. The localization net is
/// conv(channels -> loc_channels1, k x k, same) - maxpool 2 - ReLU - conv(-> loc_channels2, k x k, same) -
/// maxpool 2 - ReLU - fc(-> loc_hidden) - ReLU - fc(-> 6) = theta, and needs height, width >= 4.
struct SpatialTransformerOptions {
  SpatialTransformerOptions(int64_t channels, int64_t height, int64_t width)
      : channels_(channels), height_(height), width_(width) {}
  /// Input channels C.
  TORCH_ARG(int64_t, channels);
  /// Input height H and width W (the localization net's first FC layer depends on them).
  TORCH_ARG(int64_t, height);
  TORCH_ARG(int64_t, width);
  /// Output size; 0 means the input's.
  TORCH_ARG(int64_t, output_height) = 0;
  TORCH_ARG(int64_t, output_width) = 0;
  TORCH_ARG(int64_t, loc_channels1) = 8;
  TORCH_ARG(int64_t, loc_channels2) = 16;
  /// Odd kernel size of both localization convolutions ("same" padding k / 2).
  TORCH_ARG(int64_t, loc_kernel) = 5;
  TORCH_ARG(int64_t, loc_hidden) = 32;
};

/// Output of SpatialTransformerImpl::forward_with_theta.
struct SpatialTransformerOutput {
  torch::Tensor output;  // [B, C, H_out, W_out]
  torch::Tensor theta;   // [B, 2, 3], normalised coordinates (see the header comment)
};

/// Spatial transformer: images [B, C, H, W] -> warped images [B, C, H_out, W_out]. The last
/// localization layer starts with zero weights and the identity bias (1, 0, 0, 0, 1, 0), so a fresh
/// module is the identity map (output == input up to rounding) and learns away from it.
class SpatialTransformerImpl : public torch::nn::Cloneable<SpatialTransformerImpl> {
 public:
  explicit SpatialTransformerImpl(const SpatialTransformerOptions& options);
  void reset() override;

  /// theta = loc(images): [B, C, H, W] -> [B, 2, 3].
  torch::Tensor localize(const torch::Tensor& images);
  /// Samples images [B, C, H, W] at theta [B, 2, 3] into [B, C, H_out, W_out] (affine_sample).
  torch::Tensor transform(const torch::Tensor& images, const torch::Tensor& theta) const;
  /// transform(images, localize(images)).
  torch::Tensor forward(const torch::Tensor& images);
  /// forward, also returning theta (for figures and inspection).
  SpatialTransformerOutput forward_with_theta(const torch::Tensor& images);
  /// The localization net's input size; throws std::invalid_argument naming `images` on a mismatch.
  void check_input(const torch::Tensor& images) const;

  SpatialTransformerOptions options;
  torch::nn::Conv2d loc_conv1{nullptr}, loc_conv2{nullptr};
  torch::nn::Linear loc_fc1{nullptr}, loc_fc2{nullptr};
};
TORCH_MODULE(SpatialTransformer);

/// Trainable scalars of a SpatialTransformer built with `options` (localization net weights + biases).
int64_t num_parameters(const SpatialTransformerOptions& options);

/// The identity theta [B, 2, 3] = (1 0 0; 0 1 0) per example, in `options` (dtype/device).
torch::Tensor identity_theta(int64_t batch, const torch::TensorOptions& options = {});

/// Grid generator + bilinear sampler with zero padding (Jaderberg et al. Eq. 1 and 5), the fast path:
/// torch's affine_grid + grid_sample, align_corners = false. input: [B, C, H, W] float;
/// theta: [B, 2, 3] same dtype and device. Returns [B, C, out_h, out_w]. Differentiable in both.
/// Throws std::invalid_argument naming the bad argument (rank, batch, dtype, sizes).
torch::Tensor affine_sample(const torch::Tensor& input, const torch::Tensor& theta, int64_t out_h, int64_t out_w);

namespace detail {

/// Slow, obviously-correct reference of affine_sample, one output pixel at a time: the target pixel
/// centre (x_t, y_t) = ((2j + 1) / W_out - 1, (2i + 1) / H_out - 1), source (x_s, y_s) = theta (x_t, y_t, 1),
/// in pixels ix = ((x_s + 1) W - 1) / 2, iy = ((y_s + 1) H - 1) / 2, then the four neighbours
/// floor/floor+1 weighted by (1 - dx, dx) x (1 - dy, dy), each neighbour outside the image reading 0.
/// Built from autograd scalar ops, so gradients w.r.t. input and theta come from the same formula.
/// Same contract as affine_sample; meant for tiny tensors in tests.
torch::Tensor reference_affine_sample(const torch::Tensor& input, const torch::Tensor& theta, int64_t out_h,
                                      int64_t out_w);

}  // namespace detail

}  // namespace capsnet::nn
