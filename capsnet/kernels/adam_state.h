#pragma once
// Adam's moments allocated before the first step rather than inside it.

#include <torch/torch.h>

#include <memory>
#include <sstream>
#include <string>
#include <type_traits>

namespace capsnet::kernels {

namespace detail {
// The optimizer's state key of a parameter: a string of the TensorImpl's address in LibTorch 1.13,
// the address itself in PyTorch 2.x; written for both so the code builds with either.
template <typename Key>
Key adam_state_key(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // what LibTorch 1.13's c10::guts::to_string(p.unsafeGetTensorImpl()) writes
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

/// The state LibTorch's Adam creates for `p` at its first step: step 0, zero moments (and a zero max moment
/// with amsgrad).
inline std::unique_ptr<torch::optim::AdamParamState> new_adam_state(const torch::Tensor& p, bool amsgrad) {
  auto s = std::make_unique<torch::optim::AdamParamState>();
  s->step(0);
  s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  if (amsgrad) s->max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
  return s;
}
}  // namespace detail

/// Gives every parameter of `optimizer` that has no state yet the state Adam itself would create at its
/// first step (step 0, zero moments; a zero max moment with amsgrad), so the numbers are unchanged.
/// Why: Adam allocates its moments lazily, in the first step, where they land in the middle of the
/// pages that step's activations have just freed; the next forward then cannot reuse those pages and
/// the allocator maps new ones. Allocated before the first forward, the moments sit apart (training
/// peak RSS of the CapsNet 17 MB lower in bf16, 46 MB in fp32, docs/kernels.md). Parameters restored from a checkpoint keep their state. Does
/// nothing for an optimizer other than torch::optim::Adam.
inline void allocate_adam_state(torch::optim::Optimizer& optimizer) {
  auto* adam = dynamic_cast<torch::optim::Adam*>(&optimizer);
  if (!adam) return;
  auto& state = adam->state();
  using Key = typename std::decay_t<decltype(state)>::key_type;
  torch::NoGradGuard no_grad;
  for (auto& group : adam->param_groups()) {
    const bool amsgrad = static_cast<const torch::optim::AdamOptions&>(group.options()).amsgrad();
    for (const auto& p : group.params()) {
      const auto key = detail::adam_state_key<Key>(p);
      if (state.count(key)) continue;
      state[key] = detail::new_adam_state(p, amsgrad);
    }
  }
}

}  // namespace capsnet::kernels
