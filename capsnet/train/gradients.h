#pragma once
// Releasing the gradients between optimizer steps.

#include <torch/torch.h>

#include <vector>

namespace capsnet::train {

/// Makes every gradient undefined: what PyTorch 2.x's zero_grad() does by default (set_to_none);
/// LibTorch 1.13's Optimizer::zero_grad() zeroes them in place instead. Why: the next backward then
/// hands its fresh gradient tensors to the parameters rather than adding them into kept ones, so no
/// gradient is held twice during backward nor kept between steps (peak memory, docs/kernels.md).
/// Adam skips a parameter without a gradient: one the loss did not reach is not moved by its moments.
inline void clear_grads(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) p.mutable_grad() = torch::Tensor();
}

/// clear_grads over every parameter group of `optimizer`.
inline void clear_grads(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) clear_grads(group.params());
}

}  // namespace capsnet::train
