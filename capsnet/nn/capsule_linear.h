#pragma once
#include <torch/torch.h>

#include "capsnet/nn/functional.h"

namespace capsnet::nn {

struct CapsuleLinearOptions {
  CapsuleLinearOptions(int64_t in_caps, int64_t in_dim, int64_t out_caps, int64_t out_dim)
      : in_caps_(in_caps), in_dim_(in_dim), out_caps_(out_caps), out_dim_(out_dim) {}
  TORCH_ARG(int64_t, in_caps);   // I = 1152 in the paper
  TORCH_ARG(int64_t, in_dim);    // 8
  TORCH_ARG(int64_t, out_caps);  // J = 10
  TORCH_ARG(int64_t, out_dim);   // D = 16
  /// Iterations, gradient through routing, fused operator (capsnet::capsule_routing) or
  /// predictions() + dynamic_routing().
  TORCH_ARG(RoutingOptions, routing) = {};
  TORCH_ARG(double, weight_std) = 0.01;
};

/// DigitCaps: a fully connected capsule layer with dynamic routing.
/// W: [I, J, D, Din] (one d_out x d_in matrix per child/parent pair).
/// forward: u [B, I, Din] -> v [B, J, D].
class CapsuleLinearImpl : public torch::nn::Cloneable<CapsuleLinearImpl> {
 public:
  explicit CapsuleLinearImpl(const CapsuleLinearOptions& options);
  void reset() override;
  /// Prediction vectors u_hat_{j|i} = W_ij u_i. u: [B, I, Din] -> u_hat: [B, I, J, D].
  torch::Tensor predictions(const torch::Tensor& u);
  torch::Tensor forward(const torch::Tensor& u);
  /// Throws c10::Error unless u is [B, in_caps, in_dim].
  void check_input(const torch::Tensor& u) const;

  CapsuleLinearOptions options;
  torch::Tensor weight;
};
TORCH_MODULE(CapsuleLinear);

}  // namespace capsnet::nn
