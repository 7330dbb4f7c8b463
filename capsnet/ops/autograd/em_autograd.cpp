// Autograd kernels of the EM vote operators (em.h): torch::autograd::Functions that run the device
// kernels below the Autograd key and save only their inputs (and the mean, for the moments).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "capsnet/ops/em_checks.h"

namespace capsnet::ops::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensor = at::Tensor;

constexpr const char* kMomentsOp = "capsnet::em_weighted_moments";
constexpr const char* kDistanceOp = "capsnet::em_scaled_distance";

std::tuple<Tensor, Tensor> moments_forward(const Tensor& weights, const Tensor& votes) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::em_weighted_moments", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&)>();
  return op.call(weights, votes);
}

std::tuple<Tensor, Tensor> moments_backward(const Tensor& grad_mean, const Tensor& grad_variance, const Tensor& weights,
                                            const Tensor& votes, const Tensor& mean) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::_em_weighted_moments_backward", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                               const Tensor&, const Tensor&)>();
  return op.call(grad_mean, grad_variance, weights, votes, mean);
}

Tensor distance_forward(const Tensor& votes, const Tensor& mean, const Tensor& variance) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::em_scaled_distance", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(votes, mean, variance);
}

std::tuple<Tensor, Tensor, Tensor> distance_backward(const Tensor& grad, const Tensor& votes, const Tensor& mean,
                                                     const Tensor& variance) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("capsnet::_em_scaled_distance_backward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&)>();
  return op.call(grad, votes, mean, variance);
}

// The backward kernels run through these Functions so that a double backward fails with a clear
// message instead of silently returning zeros.
class MomentsBackwardFunction : public torch::autograd::Function<MomentsBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const Tensor& grad_mean, const Tensor& grad_variance,
                               const Tensor& weights, const Tensor& votes, const Tensor& mean) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_weights, grad_votes] = moments_backward(grad_mean, grad_variance, weights, votes, mean);
    return {grad_weights, grad_votes};
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK(false, kMomentsOp, ": double backward (differentiating the gradient) is not implemented");
    return {};
  }
};

class DistanceBackwardFunction : public torch::autograd::Function<DistanceBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const Tensor& grad, const Tensor& votes, const Tensor& mean,
                               const Tensor& variance) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_votes, grad_mean, grad_variance] = distance_backward(grad, votes, mean, variance);
    return {grad_votes, grad_mean, grad_variance};
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK(false, kDistanceOp, ": double backward (differentiating the gradient) is not implemented");
    return {};
  }
};

class MomentsFunction : public torch::autograd::Function<MomentsFunction> {
 public:
  // weights: [B, I, J], votes: [B, I, J, D] -> mean, variance: [B, J, D]; saves the inputs and the mean.
  static variable_list forward(AutogradContext* ctx, const Tensor& weights, const Tensor& votes) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [mean, variance] = moments_forward(weights, votes);
    ctx->save_for_backward({weights, votes, mean});
    return {mean, variance};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    return MomentsBackwardFunction::apply(grad_outputs[0], grad_outputs[1], saved[0], saved[1], saved[2]);
  }
};

class DistanceFunction : public torch::autograd::Function<DistanceFunction> {
 public:
  // votes: [B, I, J, D], mean, variance: [B, J, D] -> distance: [B, I, J]; saves the inputs.
  static Tensor forward(AutogradContext* ctx, const Tensor& votes, const Tensor& mean, const Tensor& variance) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto distance = distance_forward(votes, mean, variance);
    ctx->save_for_backward({votes, mean, variance});
    return distance;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    return DistanceBackwardFunction::apply(grad_outputs[0], saved[0], saved[1], saved[2]);
  }
};

std::tuple<Tensor, Tensor> em_weighted_moments_autograd(const Tensor& weights, const Tensor& votes) {
  detail::check_moments_inputs(kMomentsOp, weights, votes);
  auto out = MomentsFunction::apply(weights, votes);
  return {out[0], out[1]};
}

std::tuple<Tensor, Tensor> em_weighted_moments_backward_autograd(const Tensor& grad_mean, const Tensor& grad_variance,
                                                                 const Tensor& weights, const Tensor& votes,
                                                                 const Tensor& mean) {
  auto grads = MomentsBackwardFunction::apply(grad_mean, grad_variance, weights, votes, mean);
  return {grads[0], grads[1]};
}

Tensor em_scaled_distance_autograd(const Tensor& votes, const Tensor& mean, const Tensor& variance) {
  detail::check_distance_inputs(kDistanceOp, votes, mean, variance);
  return DistanceFunction::apply(votes, mean, variance);
}

std::tuple<Tensor, Tensor, Tensor> em_scaled_distance_backward_autograd(const Tensor& grad, const Tensor& votes,
                                                                        const Tensor& mean, const Tensor& variance) {
  auto grads = DistanceBackwardFunction::apply(grad, votes, mean, variance);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace
}  // namespace capsnet::ops::autograd

TORCH_LIBRARY_IMPL(capsnet, Autograd, m) {
  using namespace capsnet::ops::autograd;
  m.impl("em_weighted_moments", &em_weighted_moments_autograd);
  m.impl("_em_weighted_moments_backward", &em_weighted_moments_backward_autograd);
  m.impl("em_scaled_distance", &em_scaled_distance_autograd);
  m.impl("_em_scaled_distance_backward", &em_scaled_distance_backward_autograd);
}
