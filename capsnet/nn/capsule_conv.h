#pragma once
// Convolutional capsules with locally-constrained dynamic routing (LaLonde & Bagci 2018, "Capsules for
// Object Segmentation", Sec. 3): SegCaps' ConvCaps and DeconvCaps layers.
//
// Layout. A capsule tensor is [B, T, A, H, W]: at every position (y, x) there are T capsule types, each
// an A-dimensional vector of atoms (channel t * A + a of a plain [B, T*A, H, W] feature map).
//
// Math per example and output position p = (y', x') (paper Eq. 1-3, child type i, parent type j):
//   u_hat_{j|i}(p) = sum_{(dy,dx) in k x k} W_{ij}(dy, dx) u_i(q(p, dy, dx)) [+ bias_j]     (A_in -> A_out)
//   i.e. for each child type i one k x k (transposed) convolution from A_in to T_out * A_out channels,
//   weights shared across positions (and, with share_across_types, across child types as well);
//   routing logits b_{ij}(p): [B, T_in, H', W', T_out], c_i(p) = softmax_j b_i(p) (over the parents),
//   s_j(p) = sum_i c_ij(p) u_hat_{j|i}(p),  v_j(p) = squash(s_j(p)) over the atoms,
//   b_ij(p) += u_hat_{j|i}(p) . v_j(p),  r iterations (r = 1: uniform coupling c = 1/T_out).
// Routing is local: children only reach parents at the same output position through the kernel window.
// Per position this is exactly Procedure 1 of Sabour et al. with I = T_in children and J = T_out
// parents, so the layers run the fused operator capsnet::routing_from_predictions on
// u_hat reshaped to [B * H' * W', T_in, T_out, A_out] (or dynamic_routing, the composite ATen path).

#include <torch/torch.h>

#include "capsnet/nn/functional.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::nn {

/// Options of CapsuleConv2d. Defaults: 5x5, stride 1, padding 2 (size-preserving), r = 3 (SegCaps).
struct CapsuleConv2dOptions {
  CapsuleConv2dOptions(int64_t in_types, int64_t in_atoms, int64_t out_types, int64_t out_atoms)
      : in_types_(in_types), in_atoms_(in_atoms), out_types_(out_types), out_atoms_(out_atoms) {}
  TORCH_ARG(int64_t, in_types);   // T_in: child capsule types
  TORCH_ARG(int64_t, in_atoms);   // A_in: atoms per child capsule
  TORCH_ARG(int64_t, out_types);  // T_out: parent capsule types
  TORCH_ARG(int64_t, out_atoms);  // A_out: atoms per parent capsule
  TORCH_ARG(int64_t, kernel_size) = 5;
  TORCH_ARG(int64_t, stride) = 1;
  TORCH_ARG(int64_t, padding) = 2;
  /// Iterations, gradient through routing, fused operator (CPU) or dynamic_routing().
  TORCH_ARG(RoutingOptions, routing) = {};
  /// false (default): one set of k x k transformation matrices per child type (weight [T_in, ...]);
  /// true: one set shared by all child types (weight [1, ...]), as the SegCaps authors' code does.
  TORCH_ARG(bool, share_across_types) = false;
  /// Learnt bias [T_out, A_out] added to every prediction (the SegCaps code has one).
  TORCH_ARG(bool, bias) = true;
  /// Initial weight std; <= 0 means 1 / sqrt(A_in * k * k).
  TORCH_ARG(double, weight_std) = 0;
};

/// Options of CapsuleConvTranspose2d. Defaults: 4x4, stride 2, padding 1: doubles H and W (SegCaps' deconv).
struct CapsuleConvTranspose2dOptions {
  CapsuleConvTranspose2dOptions(int64_t in_types, int64_t in_atoms, int64_t out_types, int64_t out_atoms)
      : in_types_(in_types), in_atoms_(in_atoms), out_types_(out_types), out_atoms_(out_atoms) {}
  TORCH_ARG(int64_t, in_types);
  TORCH_ARG(int64_t, in_atoms);
  TORCH_ARG(int64_t, out_types);
  TORCH_ARG(int64_t, out_atoms);
  TORCH_ARG(int64_t, kernel_size) = 4;
  TORCH_ARG(int64_t, stride) = 2;
  TORCH_ARG(int64_t, padding) = 1;
  /// Extra rows/columns on the bottom/right of the output (must be < stride), as in ConvTranspose2d.
  TORCH_ARG(int64_t, output_padding) = 0;
  TORCH_ARG(RoutingOptions, routing) = {};
  TORCH_ARG(bool, share_across_types) = false;
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(double, weight_std) = 0;
};

namespace detail {
/// Geometry of a (transposed) capsule convolution, as the reference functions take it.
struct CapsuleConvGeometry {
  int64_t stride = 1, padding = 0, output_padding = 0;
  bool transposed = false;
};

/// Output side of a capsule convolution along one axis (may be <= 0 for impossible inputs):
/// conv: (n + 2p - k) / s + 1; transposed: (n - 1) s - 2p + k + output_padding.
int64_t capsule_conv_output_size(int64_t n, int64_t kernel, const CapsuleConvGeometry& g);

/// Slow, obviously-correct predictions with explicit loops over output positions and kernel offsets.
/// u: [B, T_in, A_in, H, W]; weight: [G, T_out, A_out, A_in, k, k] with G = T_in or 1 (shared);
/// bias: [T_out, A_out] or undefined. Returns u_hat: [B, T_in, T_out, A_out, H', W'].
/// conv: u_hat(y', x') = sum_{dy,dx} W(dy,dx) u(y' s - p + dy, x' s - p + dx) (out-of-range = 0);
/// transposed: every input (y, x) adds W(dy,dx) u(y, x) to output (y s - p + dy, x s - p + dx).
torch::Tensor reference_capsule_predictions(const torch::Tensor& u, const torch::Tensor& weight,
                                            const torch::Tensor& bias, const CapsuleConvGeometry& g);

/// Reference layer: reference_capsule_predictions, then detail::reference_routing (explicit logits b)
/// at every output position separately. Returns v: [B, T_out, A_out, H', W'].
torch::Tensor reference_capsule_conv(const torch::Tensor& u, const torch::Tensor& weight, const torch::Tensor& bias,
                                     const CapsuleConvGeometry& g, const RoutingOptions& routing);
}  // namespace detail

/// SegCaps convolutional capsule layer (ConvCaps).
/// forward: u [B, T_in, A_in, H, W] -> v [B, T_out, A_out, H', W'], H' = (H + 2p - k) / s + 1.
/// weight: [G, T_out, A_out, A_in, k, k] (G = T_in, or 1 with share_across_types); bias: [T_out, A_out].
class CapsuleConv2dImpl : public torch::nn::Cloneable<CapsuleConv2dImpl> {
 public:
  explicit CapsuleConv2dImpl(const CapsuleConv2dOptions& options);
  void reset() override;
  /// Prediction vectors (one grouped convolution). u: [B, T_in, A_in, H, W] -> [B, T_in, T_out, A_out, H', W'].
  /// `precision` is the convolution's (bf16: input and weights cast per call); the predictions come back
  /// in the weights' dtype, before the bias, so routing never sees bf16.
  torch::Tensor predictions(const torch::Tensor& u, Precision precision = Precision::kFloat32);
  /// Predictions + locally-constrained dynamic routing. u: [B, T_in, A_in, H, W] -> v: [B, T_out, A_out, H', W'].
  torch::Tensor forward(const torch::Tensor& u, Precision precision = Precision::kFloat32);
  /// Throws std::invalid_argument naming the problem unless u is [B, T_in, A_in, H, W], floating
  /// point and large enough for the kernel.
  void check_input(const torch::Tensor& u) const;
  detail::CapsuleConvGeometry geometry() const;

  CapsuleConv2dOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(CapsuleConv2d);

/// SegCaps transposed convolutional capsule layer (DeconvCaps).
/// forward: u [B, T_in, A_in, H, W] -> v [B, T_out, A_out, H', W'], H' = (H - 1) s - 2p + k + output_padding
/// (2H with the defaults). weight: [G, T_out, A_out, A_in, k, k]; bias: [T_out, A_out].
class CapsuleConvTranspose2dImpl : public torch::nn::Cloneable<CapsuleConvTranspose2dImpl> {
 public:
  explicit CapsuleConvTranspose2dImpl(const CapsuleConvTranspose2dOptions& options);
  void reset() override;
  /// u: [B, T_in, A_in, H, W] -> u_hat: [B, T_in, T_out, A_out, H', W'] (one grouped transposed convolution,
  /// in `precision`; u_hat in the weights' dtype as for CapsuleConv2d).
  torch::Tensor predictions(const torch::Tensor& u, Precision precision = Precision::kFloat32);
  /// u: [B, T_in, A_in, H, W] -> v: [B, T_out, A_out, H', W'].
  torch::Tensor forward(const torch::Tensor& u, Precision precision = Precision::kFloat32);
  /// Throws std::invalid_argument unless u is [B, T_in, A_in, H, W] floating point.
  void check_input(const torch::Tensor& u) const;
  detail::CapsuleConvGeometry geometry() const;

  CapsuleConvTranspose2dOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(CapsuleConvTranspose2d);

/// Locally-constrained routing of predictions at every position.
/// u_hat: [B, T_in, T_out, A_out, H, W] -> v: [B, T_out, A_out, H, W]. routing.fused:
/// capsnet::routing_from_predictions (CPU only; other devices fall back), else dynamic_routing.
torch::Tensor local_routing(const torch::Tensor& u_hat, const RoutingOptions& routing);

}  // namespace capsnet::nn
