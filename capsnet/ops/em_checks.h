#pragma once
// Argument checks of the EM operators (em.h), shared by their autograd and device kernels.
// All failures are c10::Error naming the operator and the offending argument.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

}  // namespace capsnet::ops::detail
