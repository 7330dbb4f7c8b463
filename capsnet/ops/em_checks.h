#pragma once
// Argument checks of the EM operators (em.h), shared by their autograd and device kernels.
// All failures are c10::Error naming the operator and the offending argument.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "capsnet/ops/routing_checks.h"

namespace capsnet::ops::detail {

/// votes: [B, I, J, D], float32/float64.
inline void check_votes(const char* op, const at::Tensor& votes) {
  TORCH_CHECK(votes.defined(), op, ": votes must be a defined tensor");
  TORCH_CHECK(votes.dim() == 4, op, ": votes must be [B, I, J, D] (4 dims), got ", votes.sizes());
  check_dtype(op, "votes", votes);
}

/// t: `shape` with the dtype and device of votes.
inline void check_like_votes(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                             const at::Tensor& votes) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a defined tensor");
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must be ", shape, " for votes ", votes.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == votes.scalar_type(), op, ": ", name, " must have the dtype of votes (",
              votes.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == votes.device(), op, ": ", name, " must be on the device of votes (", votes.device(),
              "), got ", t.device());
}

/// weights: [B, I, J] for votes [B, I, J, D].
inline void check_moments_inputs(const char* op, const at::Tensor& weights, const at::Tensor& votes) {
  check_votes(op, votes);
  check_like_votes(op, "weights", weights, votes.sizes().slice(0, 3), votes);
}

/// mean, variance: [B, J, D] for votes [B, I, J, D].
inline void check_distance_inputs(const char* op, const at::Tensor& votes, const at::Tensor& mean,
                                  const at::Tensor& variance) {
  check_votes(op, votes);
  const std::vector<int64_t> bjd{votes.size(0), votes.size(2), votes.size(3)};
  check_like_votes(op, "mean", mean, bjd, votes);
  check_like_votes(op, "variance", variance, bjd, votes);
}

/// The inputs of em_weighted_moments' backward as every device kernel takes them: checked, contiguous,
/// an undefined gradient (an output that did not reach the loss) as zeros. Shapes: [B, I, J] weights,
/// [B, I, J, D] votes, [B, J, D] mean and both gradients.
struct MomentsGradInputs {
  at::Tensor weights, votes, mean, grad_mean, grad_variance;
};
inline MomentsGradInputs moments_grad_inputs(const char* op, const at::Tensor& grad_mean,
                                             const at::Tensor& grad_variance, const at::Tensor& weights,
                                             const at::Tensor& votes, const at::Tensor& mean) {
  check_moments_inputs(op, weights, votes);
  MomentsGradInputs in{weights.contiguous(), votes.contiguous(), at::Tensor(), at::Tensor(), at::Tensor()};
  const std::vector<int64_t> bjd{votes.size(0), votes.size(2), votes.size(3)};
  check_like_votes(op, "mean", mean, bjd, in.votes);
  in.mean = mean.contiguous();
  in.grad_mean = grad_mean.defined() ? grad_mean.contiguous() : at::zeros(bjd, votes.options());
  in.grad_variance = grad_variance.defined() ? grad_variance.contiguous() : at::zeros(bjd, votes.options());
  check_like_votes(op, "grad_mean", in.grad_mean, bjd, in.votes);
  check_like_votes(op, "grad_variance", in.grad_variance, bjd, in.votes);
  return in;
}

/// The inputs of em_scaled_distance (and, with its gradient [B, I, J], of its backward): checked and
/// contiguous; an undefined gradient as zeros.
struct DistanceInputs {
  at::Tensor votes, mean, variance, grad_distance;
};
inline DistanceInputs distance_inputs(const char* op, const at::Tensor& votes, const at::Tensor& mean,
                                      const at::Tensor& variance, const at::Tensor* grad_distance = nullptr) {
  check_distance_inputs(op, votes, mean, variance);
  DistanceInputs in{votes.contiguous(), mean.contiguous(), variance.contiguous(), at::Tensor()};
  if (grad_distance != nullptr) {
    const std::vector<int64_t> bij{votes.size(0), votes.size(1), votes.size(2)};
    in.grad_distance = grad_distance->defined() ? grad_distance->contiguous() : at::zeros(bij, votes.options());
    check_like_votes(op, "grad_distance", in.grad_distance, bij, in.votes);
  }
  return in;
}

}  // namespace capsnet::ops::detail
