#pragma once
// Adam in one pass over each parameter: LibTorch's torch::optim::Adam, bit for bit, at a third of the time.
//
// Why: LibTorch's step runs six ATen kernels per parameter (mul_, add_, mul_, addcmul_, sqrt / div /
// add_, addcdiv_), reading and writing the moments several times and allocating `sqrt(v) / c + eps`:
// 8.8-9.0 ms per CapsNet step (8.2M parameters, 2 threads), 6% of a bf16 training step. One pass reads p,
// g, m and v once and writes p, m and v once: 3.3 ms, 2.7-3.0 on both threads (docs/kernels.md,
// "Fused Adam").
//
// The same arithmetic in the same order as the ATen kernels of Debian's LibTorch 1.13 (each rounding where
// they round: m = fma(g, 1 - b1, m b1), v = fma((1 - b2) g, g, v b2) (its addcmul_ is compiled into an
// FMA: measured), p = p + ((-lr / bc1) m) / (sqrt(v) / sqrt(bc2) + eps); fma(p, wd, g) for weight decay;
// max(vmax, v) for amsgrad), so trained weights, checkpoints and resumes are those of torch::optim::Adam
// (tests/unit/kernels/test_fused_adam.cpp holds it to the bit; another ATen build may round addcmul_ apart). It *is* a
// torch::optim::Adam (same options, state and serialisation): a checkpoint written by either loads into
// the other. Float32 CPU parameters with AVX2 or AVX-512 take the
// one pass; others (float64, no AVX2, sparse gradients refused as LibTorch does) LibTorch's formula.

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace capsnet::kernels {

class FusedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// Adam over `params` (or parameter groups) as the training loops use it: a FusedAdam.
std::unique_ptr<torch::optim::Adam> make_adam(std::vector<torch::Tensor> params, const torch::optim::AdamOptions& options);
std::unique_ptr<torch::optim::Adam> make_adam(std::vector<torch::optim::OptimizerParamGroup> groups,
                                              const torch::optim::AdamOptions& options);

}  // namespace capsnet::kernels
