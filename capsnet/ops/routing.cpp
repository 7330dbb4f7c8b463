#include "capsnet/ops/routing.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace capsnet::ops {

at::Tensor capsule_routing(const at::Tensor& u, const at::Tensor& W, int64_t iterations, bool grad_through_routing) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::capsule_routing", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>();
  return op.call(u, W, iterations, grad_through_routing);
}

at::Tensor routing_from_predictions(const at::Tensor& u_hat, int64_t iterations, bool grad_through_routing) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsnet::routing_from_predictions", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t, bool)>();
  return op.call(u_hat, iterations, grad_through_routing);
}

}  // namespace capsnet::ops
