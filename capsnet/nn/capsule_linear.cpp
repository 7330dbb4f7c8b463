#include "capsnet/nn/capsule_linear.h"

#include "capsnet/ops/routing.h"

namespace capsnet::nn {

CapsuleLinearImpl::CapsuleLinearImpl(const CapsuleLinearOptions& options_) : options(options_) { reset(); }

void CapsuleLinearImpl::reset() {
  TORCH_CHECK(options.in_caps() > 0 && options.in_dim() > 0 && options.out_caps() > 0 && options.out_dim() > 0,
              "CapsuleLinear: capsule counts and dimensions must be positive");
  options.routing().validate();
  weight = register_parameter(
      "weight", torch::randn({options.in_caps(), options.out_caps(), options.out_dim(), options.in_dim()}) *
                    options.weight_std());
}

void CapsuleLinearImpl::check_input(const torch::Tensor& u) const {
  TORCH_CHECK(u.dim() == 3 && u.size(1) == options.in_caps() && u.size(2) == options.in_dim(),
              "CapsuleLinear: input must be [B, ", options.in_caps(), ", ", options.in_dim(), "], got ", u.sizes());
}

torch::Tensor CapsuleLinearImpl::predictions(const torch::Tensor& u) {
  check_input(u);
  const auto B = u.size(0), I = options.in_caps(), J = options.out_caps(), D = options.out_dim();
  // One small matmul per child capsule i, batched over i: [I, J*D, Din] x [I, Din, B] -> [I, J*D, B].
  auto w = weight.view({I, J * D, options.in_dim()});
  auto u_hat = torch::bmm(w, u.permute({1, 2, 0}));
  return u_hat.permute({2, 0, 1}).view({B, I, J, D});  // [B, I, J, D] (strided view)
}

torch::Tensor CapsuleLinearImpl::forward(const torch::Tensor& u) {
  const auto& routing = options.routing();
  if (routing.fused && u.is_cpu() && weight.is_cpu()) {
    check_input(u);
    return ops::capsule_routing(u, weight, routing.iterations, routing.grad_through_routing);
  }
  return dynamic_routing(predictions(u), routing);
}

}  // namespace capsnet::nn
