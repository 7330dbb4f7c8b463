#include "capsnet/ops/em.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace capsnet::ops {

std::tuple<at::Tensor, at::Tensor> em_weighted_moments(const at::Tensor& weights, const at::Tensor& votes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::em_weighted_moments", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>();
  return op.call(weights, votes);
}

at::Tensor em_scaled_distance(const at::Tensor& votes, const at::Tensor& mean, const at::Tensor& variance) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::em_scaled_distance", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(votes, mean, variance);
}

}  // namespace capsnet::ops
