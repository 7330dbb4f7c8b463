// Consumer of an installed capsnet: one DigitCaps-style routing layer (nn::CapsuleLinear) on random
// capsules. The fused operator, the composite path (predictions + dynamic_routing) and the registered
// op called through the dispatcher must agree; exits 1 on any mismatch.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdio>

#include "capsnet/nn/capsule_linear.h"
#include "capsnet/nn/functional.h"
#include "capsnet/ops/routing.h"

namespace {
int failures = 0;

void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

bool close(const torch::Tensor& a, const torch::Tensor& b) { return torch::allclose(a, b, 1e-4, 1e-6); }
}  // namespace

int main() {
  torch::manual_seed(0);
  const int64_t B = 4, I = 72, Din = 8, J = 10, D = 16;  // u: [B, I, Din] -> v: [B, J, D]

  // The fused operator (routing.fused = true, the default) and the composite ATen path, same weights.
  capsnet::nn::CapsuleLinear fused(capsnet::nn::CapsuleLinearOptions(I, Din, J, D));
  capsnet::nn::CapsuleLinear composite(
      capsnet::nn::CapsuleLinearOptions(I, Din, J, D).routing({/*iterations=*/3, /*grad_through_routing=*/true,
                                                               /*fused=*/false}));
  {
    torch::NoGradGuard no_grad;
    composite->weight.copy_(fused->weight);
  }
  auto u = capsnet::squash(torch::randn({B, I, Din})).set_requires_grad(true);
  auto u2 = u.detach().clone().set_requires_grad(true);

  auto v_fused = fused(u);         // v: [B, J, D]
  auto v_composite = composite(u2);
  check(v_fused.sizes() == torch::IntArrayRef({B, J, D}), "fused output is [B, J, D]");
  check(v_composite.sizes() == torch::IntArrayRef({B, J, D}), "composite output is [B, J, D]");
  check(close(v_fused, v_composite), "fused == composite (values)");

  auto g = torch::randn_like(v_fused);
  (v_fused * g).sum().backward();
  (v_composite * g).sum().backward();
  check(close(u.grad(), u2.grad()), "fused == composite (gradient w.r.t. u)");
  check(close(fused->weight.grad(), composite->weight.grad()), "fused == composite (gradient w.r.t. W)");

  // The registered op through the dispatcher: present only if libcapsnet_ops.so was loaded.
  auto op = c10::Dispatcher::singleton().findSchema({"capsnet::capsule_routing", ""});
  check(op.has_value(), "capsnet::capsule_routing is registered with the dispatcher");
  if (op) {
    torch::NoGradGuard no_grad;
    auto v_op = op->typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool)>().call(
        u.detach(), fused->weight.detach(), 3, true);
    check(close(v_op, v_fused.detach()), "dispatcher call == CapsuleLinear");
    // routing.h's wrapper on precomputed predictions u_hat: [B, I, J, D].
    auto v_pred = capsnet::ops::routing_from_predictions(fused->predictions(u.detach()), 3, true);
    check(close(v_pred, v_fused.detach()), "routing_from_predictions(predictions(u)) == CapsuleLinear");
  }

  std::printf("capsnet consumer: %s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
