// Autograd kernels of the routing operators: torch::autograd::Functions that run the device kernels
// below the Autograd key and save only the inputs and s_all: [B, r, J, D] (backward recomputes u_hat).
// Device-agnostic: the internal ops dispatch to CPU (cpu/) or, later, CUDA (cuda/) by the inputs' device.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "capsnet/ops/routing_checks.h"

namespace capsnet::ops::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensor = at::Tensor;

constexpr const char* kFusedOp = "capsnet::capsule_routing";
constexpr const char* kPredOp = "capsnet::routing_from_predictions";

std::tuple<Tensor, Tensor> fused_forward(const Tensor& u, const Tensor& W, int64_t iterations) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::_capsule_routing_forward", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t)>();
  return op.call(u, W, iterations);
}

std::tuple<Tensor, Tensor> fused_backward(const Tensor& grad_v, const Tensor& u, const Tensor& W, const Tensor& s_all,
                                          bool grad_through_routing) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("capsnet::_capsule_routing_backward", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool)>();
  return op.call(grad_v, u, W, s_all, grad_through_routing);
}

std::tuple<Tensor, Tensor> pred_forward(const Tensor& u_hat, int64_t iterations) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::_routing_from_predictions_forward", "")
                             .typed<std::tuple<Tensor, Tensor>(const Tensor&, int64_t)>();
  return op.call(u_hat, iterations);
}

Tensor pred_backward(const Tensor& grad_v, const Tensor& u_hat, const Tensor& s_all, bool grad_through_routing) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::_routing_from_predictions_backward", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, bool)>();
  return op.call(grad_v, u_hat, s_all, grad_through_routing);
}

// The backward kernels run through these Functions so that a double backward (create_graph = true,
// then differentiating again) fails with a clear message instead of silently returning zeros.
class FusedBackwardFunction : public torch::autograd::Function<FusedBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const Tensor& grad_v, const Tensor& u, const Tensor& W,
                               const Tensor& s_all, bool grad_through_routing) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_u, grad_W] = fused_backward(grad_v, u, W, s_all, grad_through_routing);
    return {grad_u, grad_W};
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK(false, kFusedOp, ": double backward (differentiating the gradient) is not implemented");
    return {};
  }
};

class PredBackwardFunction : public torch::autograd::Function<PredBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const Tensor& grad_v, const Tensor& u_hat, const Tensor& s_all,
                               bool grad_through_routing) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return {pred_backward(grad_v, u_hat, s_all, grad_through_routing)};
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grad_outputs*/) {
    TORCH_CHECK(false, kPredOp, ": double backward (differentiating the gradient) is not implemented");
    return {};
  }
};

class FusedRoutingFunction : public torch::autograd::Function<FusedRoutingFunction> {
 public:
  // u: [B, I, Din], W: [I, J, D, Din] -> v: [B, J, D]; saves u, W and s_all: [B, r, J, D].
  static Tensor forward(AutogradContext* ctx, const Tensor& u, const Tensor& W, int64_t iterations,
                        bool grad_through_routing) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [v, s_all] = fused_forward(u, W, iterations);
    ctx->save_for_backward({u, W, s_all});
    ctx->saved_data["grad_through_routing"] = grad_through_routing;
    return v;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const bool full = ctx->saved_data["grad_through_routing"].toBool();
    auto grads = FusedBackwardFunction::apply(grad_outputs[0], saved[0], saved[1], saved[2], full);
    return {grads[0], grads[1], Tensor(), Tensor()};
  }
};

class PredRoutingFunction : public torch::autograd::Function<PredRoutingFunction> {
 public:
  // u_hat: [B, I, J, D] -> v: [B, J, D]; saves u_hat (the caller's tensor, no copy) and s_all.
  static Tensor forward(AutogradContext* ctx, const Tensor& u_hat, int64_t iterations, bool grad_through_routing) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [v, s_all] = pred_forward(u_hat, iterations);
    ctx->save_for_backward({u_hat, s_all});
    ctx->saved_data["grad_through_routing"] = grad_through_routing;
    return v;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const bool full = ctx->saved_data["grad_through_routing"].toBool();
    auto grads = PredBackwardFunction::apply(grad_outputs[0], saved[0], saved[1], full);
    return {grads[0], Tensor(), Tensor()};
  }
};

Tensor capsule_routing_autograd(const Tensor& u, const Tensor& W, int64_t iterations, bool grad_through_routing) {
  detail::check_capsule_routing_inputs(kFusedOp, u, W);
  detail::check_iterations(kFusedOp, iterations);
  return FusedRoutingFunction::apply(u, W, iterations, grad_through_routing);
}

Tensor routing_from_predictions_autograd(const Tensor& u_hat, int64_t iterations, bool grad_through_routing) {
  detail::check_predictions_input(kPredOp, u_hat);
  detail::check_iterations(kPredOp, iterations);
  return PredRoutingFunction::apply(u_hat, iterations, grad_through_routing);
}

std::tuple<Tensor, Tensor> capsule_routing_backward_autograd(const Tensor& grad_v, const Tensor& u, const Tensor& W,
                                                             const Tensor& s_all, bool grad_through_routing) {
  auto grads = FusedBackwardFunction::apply(grad_v, u, W, s_all, grad_through_routing);
  return {grads[0], grads[1]};
}

Tensor routing_from_predictions_backward_autograd(const Tensor& grad_v, const Tensor& u_hat, const Tensor& s_all,
                                                  bool grad_through_routing) {
  return PredBackwardFunction::apply(grad_v, u_hat, s_all, grad_through_routing)[0];
}

}  // namespace
}  // namespace capsnet::ops::autograd

TORCH_LIBRARY_IMPL(capsnet, Autograd, m) {
  using namespace capsnet::ops::autograd;
  m.impl("capsule_routing", &capsule_routing_autograd);
  m.impl("routing_from_predictions", &routing_from_predictions_autograd);
  m.impl("_capsule_routing_backward", &capsule_routing_backward_autograd);
  m.impl("_routing_from_predictions_backward", &routing_from_predictions_backward_autograd);
}
